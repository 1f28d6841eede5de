"""What LSTMem costs on a real backbone: memory on some layers and on every layer against the plain
backbone, on the CPU, in one process, as ratios.

    python benchmarks/real_model_cost.py                                  # smollm2-135m, memory on 12-29 and all
    python benchmarks/real_model_cost.py --model FOLDER --layers 0-3,8 --reps 7 --threads 2

The backbone is loaded twice (float32, CPU) and each copy gets a fresh random-init adapter (n_h 4,
r 8, block 256): one with memory on ``--layers``, one on every layer. ``plain`` is the first copy with
its adapter disabled (``PeftModel.disable_adapter()``, entered and left outside the clock). Timing
does not need trained weights. The variants are interleaved: every repetition times each measurement
for every variant back to back, in an order rotated each repetition, so the machine's load moves them
alike; medians are over ``--reps`` repetitions after ``--warmup`` untimed ones. Measured:

* ``decode``: seconds per token of ``--decode-tokens`` greedy single-token forwards from a KV cache of
  ``--context`` tokens (memory variants: the same context written by ``write_history`` into the KV
  cache and the memory); KV cache and memory are restored before each repetition.
* ``write``: ``write_history`` of a ``--history``-token history (batch 1) into an empty memory, without
  a KV cache (memory-only writing: each block an independent forward that stops after the topmost
  memory layer). Plain: what a user pays without memory, a prefill of the same tokens (one forward,
  ``use_cache=True``, logits of the last position only).
* ``write_kv``: the same ``write_history`` filling a KV cache too (the paper's evaluation protocol),
  against the same plain prefill: the like-for-like row.
* ``train_step``: one training step on ``--batch`` episodes: ``write_history`` of ``--train-history``
  tokens with gradients (train mode), a ``--read``-token read with ``memory_write=False``, mean
  cross-entropy of the read's next tokens, backward, AdamW step on the adapter. Plain (nothing of
  the plain backbone is trainable): forward + backward of the same loss with the history and the
  read as one sequence in context, the gradient taken with respect to the input embeddings (the
  backward runs through every layer, no weight gradient, no optimizer step).
* ``train_step_read_only``: the same memory steps against a plain forward + backward of the read
  alone (no history), also with respect to the input embeddings.

Writes a JSON record (settings, versions, machine, date, every time, medians, ratios to plain) to
``--out`` and prints a Markdown table. The records of ``lstmem bench`` live in
``benchmarks/results/``, whose report reads only those, so this one has a folder of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "real_model" / "real_model_cost.json"
PLAIN = "plain"

#: What each measurement times, for the record and the table.
MEASUREMENTS = {
    "decode": dict(
        label="decode, per token",
        unit="s per token",
        memory="greedy single-token forwards (KV cache + memory of the context), per token",
        plain="greedy single-token forwards (KV cache of the context), adapter disabled, per token",
    ),
    "write": dict(
        label="write",
        unit="s per history",
        memory="write_history of the history, no KV cache (memory-only writing)",
        plain="prefill of the same tokens (one forward, use_cache=True, last logits), adapter disabled",
    ),
    "write_kv": dict(
        label="write + KV",
        unit="s per history",
        memory="write_history of the history filling a KV cache too (the evaluation protocol)",
        plain="prefill of the same tokens (one forward, use_cache=True, last logits), adapter disabled",
    ),
    "train_step": dict(
        label="train step",
        unit="s per step",
        memory=(
            "train mode: write_history with gradients + read with memory_write=False, mean CE of the "
            "read, backward, AdamW step on the adapter"
        ),
        plain=(
            "history + read as one sequence in context, the same CE, backward w.r.t. the input embeddings "
            "(nothing trainable: no weight gradient, no optimizer step), adapter disabled"
        ),
    ),
    "train_step_read_only": dict(
        label="train step (plain: read only)",
        unit="s per step",
        memory="the train_step times (the same runs)",
        plain="the read alone, the same CE, backward w.r.t. the input embeddings, adapter disabled",
    ),
}


def parse_layers(text: str, num_layers: int) -> list[int]:
    """``"12-29"``, ``"0-3,8"`` or ``"all"``: sorted layer indices, each in ``[0, num_layers)``."""
    if text.strip() == "all":
        return list(range(num_layers))
    layers: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty item in layer list {text!r}")
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last) if last else int(first)
        if lo > hi:
            raise ValueError(f"layer range {part!r} runs backwards")
        layers.update(range(lo, hi + 1))
    bad = [i for i in sorted(layers) if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layers {bad} are outside the backbone's {num_layers} layers (0-{num_layers - 1})")
    return sorted(layers)


def layers_label(layers: list[int], num_layers: int) -> str:
    """``"all"`` for every layer, else the compact ``"a-b,c"`` form."""
    if layers == list(range(num_layers)):
        return "all"
    runs, start = [], layers[0]
    for prev, cur in zip(layers, [*layers[1:], None], strict=True):
        if cur != prev + 1:
            runs.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = cur
    return ",".join(runs)


def with_adapter(base, layers: list[int], seed: int = 0):
    """``base`` with a fresh random-init LSTMem adapter (n_h 4, r 8, block 256) on ``layers``, eval mode."""
    from peft import get_peft_model

    from lstmem_peft import LSTMemConfig

    torch.manual_seed(seed)
    config = LSTMemConfig(r=8, num_heads=4, layers_to_transform=layers, block_size=256)
    return get_peft_model(base, config).eval()


# ---------------------------------------------------------------------- one timed call per measurement
def _decode_setup(model, memory: bool, context: torch.Tensor, token: torch.Tensor):
    """KV cache (and memory) holding ``context``, and a ``run`` of ``n`` greedy single-token
    forwards that first restores them (untimed: ``prepare``)."""
    from transformers import DynamicCache

    from lstmem_peft import MemoryCache, write_history
    from lstmem_peft.tuner.kv_argument import kv_kwargs

    length = context.shape[1]
    kv = DynamicCache()
    written = MemoryCache() if memory else None
    with torch.no_grad():
        if memory:
            write_history(model, context, written, past_key_values=kv, progress=False)
        else:
            with model.disable_adapter():
                model(input_ids=context, **kv_kwargs(model, kv), use_cache=True, logits_to_keep=1)
    state = {}

    def prepare():
        extra = kv.get_seq_length() - length
        if extra > 0:
            kv.crop(-extra)  # back to the context (transformers 5: a negative crop drops tokens)
        state["memory"] = written.clone() if memory else None

    def run(n: int):
        step = token
        with torch.no_grad():
            for _ in range(n):
                extra = {"memory_cache": state["memory"]} if memory else {}
                out = model(input_ids=step, **kv_kwargs(model, kv), use_cache=True, **extra)
                step = out.logits[:, -1:].argmax(-1)

    return prepare, run


def _prefill(model, ids: torch.Tensor) -> None:
    from transformers import DynamicCache

    from lstmem_peft.tuner.kv_argument import kv_kwargs

    with torch.no_grad():
        model(input_ids=ids, **kv_kwargs(model, DynamicCache()), use_cache=True, logits_to_keep=1)


def _write(model, ids: torch.Tensor, keep_kv: bool) -> None:
    from transformers import DynamicCache

    from lstmem_peft import MemoryCache, write_history

    with torch.no_grad():
        kv = DynamicCache() if keep_kv else None
        write_history(model, ids, MemoryCache(), past_key_values=kv, progress=False)


def _read_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean CE of each read token's next token: ``logits`` ``(B, R, V)``, ``targets`` ``(B, R)``."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets[:, 1:].flatten())


def _train_memory(model, optimizer, history: torch.Tensor, read: torch.Tensor) -> None:
    from lstmem_peft import MemoryCache, write_history

    model.train()
    try:
        with torch.enable_grad():
            optimizer.zero_grad(set_to_none=True)
            cache = write_history(model, history, MemoryCache(), progress=False)
            out = model(input_ids=read, memory_cache=cache, memory_write=False, use_cache=False)
            _read_loss(out.logits, read).backward()
            optimizer.step()
    finally:
        model.eval()


def _train_plain(model, ids: torch.Tensor, read_tokens: int) -> None:
    """Forward + backward of the read's CE with ``ids`` (history + read, or the read alone) in
    context, the gradient w.r.t. the input embeddings. Called with the adapter disabled."""
    model.train()
    try:
        with torch.enable_grad():
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
            out = model(inputs_embeds=embeds, use_cache=False, logits_to_keep=read_tokens)
            _read_loss(out.logits, ids[:, -read_tokens:]).backward()
    finally:
        model.eval()


# ---------------------------------------------------------------------- the measurement
def measure(
    plain,
    variants: dict,
    *,
    context: int = 512,
    history: int = 2048,
    train_history: int = 256,
    read: int = 32,
    batch: int = 4,
    decode_tokens: int = 16,
    reps: int = 5,
    warmup: int = 1,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Time the plain backbone and each memory variant, interleaved, and return their medians and ratios.

    Args:
        plain: a ``PeftModel`` whose ``disable_adapter()`` is the plain backbone (it may be one of
            ``variants``' models).
        variants: ``{name: PeftModel}``, models with an LSTMem adapter (the same backbone).
        context, history, train_history, read, batch, decode_tokens: sizes (module docstring).
        reps, warmup: timed and untimed repetitions of every measurement of every variant.

    Returns:
        ``{"order", "settings", "measurements", "results"}``: ``results[measurement][variant]`` holds
        ``times_s`` (one per repetition), ``median_s``, ``min_s``, ``max_s``, ``ratio`` (its median
        over plain's median; 1 for plain) and ``ratio_pairs_median`` (the median over repetitions of
        the ratio within one repetition, whose runs were back to back).
    """
    from tqdm.auto import tqdm

    if PLAIN in variants:
        raise ValueError(f"{PLAIN!r} is the name of the plain backbone, not a memory variant")
    if reps < 1 or warmup < 0 or min(context, history, train_history, batch, decode_tokens) < 1 or read < 2:
        raise ValueError("sizes and reps must be positive, read at least 2 tokens")
    vocab = plain.get_base_model().config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = {  # random ids above the usual special tokens: the cost does not depend on the text
        "context": torch.randint(3, vocab, (1, context), generator=g),
        "token": torch.randint(3, vocab, (1, 1), generator=g),
        "history": torch.randint(3, vocab, (1, history), generator=g),
        "train_history": torch.randint(3, vocab, (batch, train_history), generator=g),
        "read": torch.randint(3, vocab, (batch, read), generator=g),
    }
    in_context = torch.cat([ids["train_history"], ids["read"]], dim=1)
    order = [PLAIN, *variants]
    models = {PLAIN: plain, **variants}

    def off(name):  # PEFT's disable_adapter() walks the model on entry and exit: outside the clock
        return plain.disable_adapter() if name == PLAIN else contextlib.nullcontext()

    calls: dict[str, dict[str, tuple]] = {m: {} for m in ("decode", "write", "write_kv", "train_step")}
    calls["train_step_read_only"] = {}
    for name in order:
        model, memory = models[name], name != PLAIN
        prepare, run = _decode_setup(model, memory, ids["context"], ids["token"])
        calls["decode"][name] = (prepare, lambda run=run: run(decode_tokens))
        if memory:
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(trainable, lr=1e-4)
            calls["write"][name] = (None, lambda m=model: _write(m, ids["history"], keep_kv=False))
            calls["write_kv"][name] = (None, lambda m=model: _write(m, ids["history"], keep_kv=True))
            calls["train_step"][name] = (
                None,
                lambda m=model, o=optimizer: _train_memory(m, o, ids["train_history"], ids["read"]),
            )
        else:
            calls["write"][name] = (None, lambda: _prefill(plain, ids["history"]))
            calls["write_kv"][name] = (None, lambda: _prefill(plain, ids["history"]))
            calls["train_step"][name] = (None, lambda: _train_plain(plain, in_context, read))
            calls["train_step_read_only"][name] = (None, lambda: _train_plain(plain, ids["read"], read))

    times = {m: {name: [] for name in named} for m, named in calls.items()}
    total = (warmup + reps) * sum(len(named) for named in calls.values())
    with tqdm(total=total, desc="real_model_cost", unit="run", file=sys.stderr, disable=not progress) as bar:
        for i in range(warmup + reps):
            for measurement, named in calls.items():
                names = list(named)
                shift = i % len(names)  # rotated: no variant always runs first
                for name in names[shift:] + names[:shift]:
                    prepare, run = named[name]
                    bar.set_postfix_str(
                        f"rep {i + 1 - warmup if i >= warmup else 'warm-up'}, {measurement}, {name}"
                    )
                    if prepare:
                        prepare()
                    with off(name):
                        start = time.perf_counter()
                        run()
                        elapsed = time.perf_counter() - start
                    if i >= warmup:
                        times[measurement][name].append(
                            elapsed / (decode_tokens if measurement == "decode" else 1)
                        )
                    bar.update()
    # the read-only row compares the same memory train steps with the other plain baseline
    for name in variants:
        times["train_step_read_only"][name] = times["train_step"][name]

    results = {}
    for measurement, named in times.items():
        base = named[PLAIN]
        row = {}
        for name in order:
            t = named[name]
            row[name] = dict(
                times_s=t,
                median_s=statistics.median(t),
                min_s=min(t),
                max_s=max(t),
                ratio=statistics.median(t) / statistics.median(base),
                ratio_pairs_median=statistics.median(a / b for a, b in zip(t, base, strict=True)),
            )
        results[measurement] = row
    settings = dict(
        context=context,
        history=history,
        train_history=train_history,
        read=read,
        batch=batch,
        decode_tokens=decode_tokens,
        reps=reps,
        warmup=warmup,
        seed=seed,
        threads=torch.get_num_threads(),
    )
    return dict(order=order, settings=settings, measurements=MEASUREMENTS, results=results)


def table(record: dict) -> str:
    """The Markdown table: a row per measurement, plain's median and each variant's median and ratio."""
    order = record["order"]
    head = ["what", "plain s", *(f"{name} s | ratio" for name in order[1:])]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * (1 + 1 + 2 * (len(order) - 1))]
    for measurement, row in record["results"].items():
        cells = [MEASUREMENTS[measurement]["label"], f"{row[PLAIN]['median_s']:.4g}"]
        for name in order[1:]:
            cells += [f"{row[name]['median_s']:.4g}", f"{row[name]['ratio']:.3f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="smollm2-135m", help="a short name of `lstmem models`, a folder or a Hub id"
    )
    ap.add_argument(
        "--layers", default="12-29", help="memory layers of the partial variant, e.g. 12-29 or 0-3,8"
    )
    ap.add_argument("--context", type=int, default=512, help="KV tokens before the timed decode steps")
    ap.add_argument("--decode-tokens", type=int, default=16, help="greedy tokens timed per decode run")
    ap.add_argument("--history", type=int, default=2048, help="tokens written by the write rows")
    ap.add_argument("--train-history", type=int, default=256, help="history tokens of each training episode")
    ap.add_argument("--read", type=int, default=32, help="read tokens of each training episode")
    ap.add_argument("--batch", type=int, default=4, help="episodes per training step")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (medians over them)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="the JSON record")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    import peft
    import transformers

    from lstmem_peft.tuner.backbones import resolve_model
    from lstmem_peft.tuner.loading import load_model_and_adapter

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    bases = [load_model_and_adapter(args.model, None, dtype="float32", device="cpu")[0] for _ in range(2)]
    load_s = time.perf_counter() - start
    num_layers = bases[0].config.num_hidden_layers
    parameters = sum(p.numel() for p in bases[0].parameters())
    partial = parse_layers(args.layers, num_layers)
    name = f"memory {layers_label(partial, num_layers)}"
    if name == "memory all":
        raise SystemExit("--layers names every layer: the all-layers variant is measured anyway")
    variants = {
        name: with_adapter(bases[0], partial, args.seed),
        "memory all": with_adapter(bases[1], list(range(num_layers)), args.seed),
    }
    record = measure(
        variants[name],
        variants,
        context=args.context,
        history=args.history,
        train_history=args.train_history,
        read=args.read,
        batch=args.batch,
        decode_tokens=args.decode_tokens,
        reps=args.reps,
        warmup=args.warmup,
        seed=args.seed,
        progress=not args.no_progress,
    )
    record = dict(
        benchmark="real_model_cost",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=dict(
            platform=platform.platform(),
            machine=platform.machine(),
            processor=platform.processor(),
            node=platform.node(),
            cpu_count=os.cpu_count(),
            threads=torch.get_num_threads(),
            python=platform.python_version(),
        ),
        device="cpu",
        torch=torch.__version__,
        transformers=transformers.__version__,
        peft=peft.__version__,
        model=args.model,
        model_path=str(resolve_model(args.model, progress=False)),
        dtype="float32",
        num_layers=num_layers,
        parameters=parameters,
        adapter=dict(r=8, num_heads=4, block_size=256, weights="random init (timing only)"),
        variants={
            PLAIN: dict(memory_layers=[], how="the first variant's model inside disable_adapter()"),
            name: dict(memory_layers=partial),
            "memory all": dict(memory_layers=list(range(num_layers))),
        },
        load_s=load_s,
        command=" ".join(
            ["python", "benchmarks/real_model_cost.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        **record,
    )
    assert all(math.isfinite(v["median_s"]) for row in record["results"].values() for v in row.values())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"{args.model}: {num_layers} layers, float32, CPU, {record['machine']['threads']} threads; "
        f"context {args.context}, history {args.history}, training episodes {args.batch} x "
        f"({args.train_history} + {args.read}); medians of {args.reps} repetitions"
    )
    print(table(record))
    print(
        "plain: the backbone with the adapter disabled. write: plain is a prefill of the same tokens "
        "(use_cache=True); train step: plain is forward + backward w.r.t. the input embeddings "
        "(history + read in context, or the read only), no optimizer step."
    )
    print(f"record: {out}")
    return record


if __name__ == "__main__":
    main()
