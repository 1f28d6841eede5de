"""Benchmarks: decode speed vs KV length, end-to-end history + answer, history writing, scans.

Each benchmark times LSTMem against the plain backbone (the same model with the adapter disabled)
in one process, alternating their order, after warm-ups, synchronising CUDA around every timed
region, and records medians and min-max over repetitions in a JSON file with the device, library
versions and date. ``report`` renders every JSON record under a folder into ``RESULTS.md`` and PNG
plots. Weights are random: timing needs a model's dimensions, not its training.

    lstmem bench decode --preset cpu-small          # or --preset qwen3-4b on a GPU
    lstmem bench generate | ops | e2e | write | scan ...
    lstmem bench gpu [--dry-run]                        # the GPU suite (bench_gpu.py): every step, one command
    lstmem bench report benchmarks/results              # RESULTS.md + plots from the JSON records
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from lstmem_peft.utils.extras import missing_extra

PRESETS = {
    # a few seconds end to end: smoke tests of the benchmark code
    "tiny": dict(
        model_type="qwen3",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    # hidden 1024, 8 layers: the CPU targets of the benchmark issue
    "cpu-small": dict(
        model_type="qwen3",
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
    ),
    # Qwen3-4B's dimensions (the paper's backbone), shipped as a config file
    "qwen3-4b": json.loads(
        (Path(__file__).resolve().parents[1] / "assets" / "configs" / "qwen3-4b.json").read_text()
    ),
}
DEFAULTS = {
    "cpu": dict(
        kv_lengths=[256, 1024, 2048],
        histories=[2048, 4096],
        answer_tokens=32,
        write_tokens=4096,
        prompt_tokens=256,
        generate_tokens=32,
    ),
    "cuda": dict(
        kv_lengths=[8192 * i for i in (1, 2, 4, 8, 16)],
        histories=[8192, 32768, 131072],
        answer_tokens=2048,
        write_tokens=32768,
        prompt_tokens=2048,
        generate_tokens=256,
    ),
}


def environment(device: torch.device) -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else (f"CPU ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)")
    )
    return dict(
        device=name,
        torch=torch.__version__,
        transformers=transformers.__version__,
        triton=triton_version,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def build_model(preset: str, device: torch.device, dtype: torch.dtype, **adapter):
    """A random-init causal LM with a preset's dimensions and LSTMem on every layer."""
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from lstmem_peft.tuner.config import LSTMemConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    spec = dict(PRESETS[preset])
    config = AutoConfig.for_model(
        spec.pop("model_type"), **{k: v for k, v in spec.items() if k != "torch_dtype"}
    )
    torch.manual_seed(0)
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return get_peft_model(base.eval(), LSTMemConfig(**adapter)).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stats(times: list[float]) -> dict:
    return dict(median=statistics.median(times), min=min(times), max=max(times), n=len(times))


def _alternate(run, reps: int, warmup: int, device: torch.device, setup=None) -> dict:
    """Time ``run(memory)`` for memory in (True, False), alternating order; ``setup(memory)`` untimed."""
    times = {True: [], False: []}
    for i in range(warmup + reps):
        for memory in (True, False) if i % 2 else (False, True):
            state = setup(memory) if setup else None
            _sync(device)
            start = time.perf_counter()
            run(memory, state)
            _sync(device)
            if i >= warmup:
                times[memory].append(time.perf_counter() - start)
    return {"lstmem": _stats(times[True]), "plain": _stats(times[False])}


@torch.no_grad()
def bench_decode(model, kv_lengths: list[int], reps: int = 10, warmup: int = 2) -> list[dict]:
    """One synchronised single-token decode forward from restored KV and memory states."""
    from transformers import DynamicCache

    from lstmem_peft.memory.cache import MemoryCache

    device = next(model.parameters()).device
    vocab = model.get_base_model().config.vocab_size
    rows = []
    for length in kv_lengths:
        prompt = torch.randint(0, vocab, (1, length), device=device)
        token = torch.randint(0, vocab, (1, 1), device=device)
        memory, kv_mem, kv_plain = MemoryCache(), DynamicCache(), DynamicCache()
        model(input_ids=prompt, past_key_values=kv_mem, use_cache=True, memory_cache=memory, logits_to_keep=1)
        with model.disable_adapter():
            model(input_ids=prompt, past_key_values=kv_plain, use_cache=True, logits_to_keep=1)

        # Defaults bind this iteration's caches and token (the closures run inside the iteration).
        def setup(with_memory, kv_mem=kv_mem, kv_plain=kv_plain, length=length, memory=memory):
            kv = kv_mem if with_memory else kv_plain
            extra = kv.get_seq_length() - length
            if extra > 0:
                kv.crop(-extra)  # back to the prompt (transformers 5: a negative crop drops tokens)
            return memory.clone() if with_memory else None  # restore the memory

        def run(with_memory, state, token=token, kv_mem=kv_mem, kv_plain=kv_plain):
            if with_memory:
                model(input_ids=token, past_key_values=kv_mem, use_cache=True, memory_cache=state)
            else:
                with model.disable_adapter():
                    model(input_ids=token, past_key_values=kv_plain, use_cache=True)

        result = _alternate(run, reps, warmup, device, setup)
        result.update(
            kv_length=length,
            lstmem_tok_s=1 / result["lstmem"]["median"],
            plain_tok_s=1 / result["plain"]["median"],
            ratio=result["lstmem"]["median"] / result["plain"]["median"],
        )
        rows.append(result)
    return rows


@torch.no_grad()
def bench_write(
    model, tokens: int, block_size: int = 2048, reps: int = 3, warmup: int = 1, kv: bool = True
) -> dict:
    """History writing (blocks + feedback) vs the plain forward of the same blocks.

    ``kv``: both fill a KV cache (the paper's evaluation protocol keeps the history in it); without,
    each block is an independent forward (memory-only writing: training stage 2, ``--memory-only``
    evaluation), where the write stops each block after the topmost memory layer.
    """
    from transformers import DynamicCache

    from lstmem_peft.memory.cache import MemoryCache
    from lstmem_peft.tuner.history import write_history

    device = next(model.parameters()).device
    history = torch.randint(0, model.get_base_model().config.vocab_size, (1, tokens), device=device)

    def run(with_memory, _):
        cache = DynamicCache() if kv else None
        if with_memory:
            write_history(
                model, history, MemoryCache(), block_size=block_size, past_key_values=cache, progress=False
            )
            return
        with model.disable_adapter():
            for start in range(0, tokens, block_size):
                model(
                    input_ids=history[:, start : start + block_size],
                    past_key_values=cache,
                    use_cache=kv,
                    logits_to_keep=1,
                )

    result = _alternate(run, reps, warmup, device)
    result.update(
        tokens=tokens,
        block_size=block_size,
        kv_cache=kv,
        ratio=result["lstmem"]["median"] / result["plain"]["median"],
        lstmem_tok_s=tokens / result["lstmem"]["median"],
        plain_tok_s=tokens / result["plain"]["median"],
    )
    return result


@torch.no_grad()
def bench_e2e(
    model,
    history_tokens: int,
    answer_tokens: int,
    question_tokens: int = 32,
    block_size: int = 2048,
    reps: int = 3,
    warmup: int = 1,
) -> dict:
    """From empty memory: write the history (KV kept), prefill a question, generate ``answer_tokens``."""
    from transformers import DynamicCache

    from lstmem_peft.memory.cache import MemoryCache
    from lstmem_peft.tuner.history import write_history

    device = next(model.parameters()).device
    vocab = model.get_base_model().config.vocab_size
    history = torch.randint(0, vocab, (1, history_tokens), device=device)
    question = torch.randint(0, vocab, (1, question_tokens), device=device)
    full = torch.cat([history, question], dim=1)
    gen = dict(max_new_tokens=answer_tokens, min_new_tokens=answer_tokens, do_sample=False)

    def run(with_memory, _):
        kv = DynamicCache()
        if with_memory:
            memory = MemoryCache()
            write_history(model, history, memory, block_size=block_size, past_key_values=kv, progress=False)
            model.generate(input_ids=full, past_key_values=kv, memory_cache=memory, **gen)
            return
        with model.disable_adapter():
            for start in range(0, history_tokens, block_size):
                model(
                    input_ids=history[:, start : start + block_size],
                    past_key_values=kv,
                    use_cache=True,
                    logits_to_keep=1,
                )
            model.generate(input_ids=full, past_key_values=kv, **gen)

    result = _alternate(run, reps, warmup, device)
    result.update(
        history_tokens=history_tokens,
        answer_tokens=answer_tokens,
        block_size=block_size,
        ratio=result["lstmem"]["median"] / result["plain"]["median"],
    )
    return result


@torch.no_grad()
def bench_generate(model, prompt_tokens: int, new_tokens: int, reps: int = 6, warmup: int = 1) -> dict:
    """``generate`` from an empty memory: prefill a prompt, then ``new_tokens`` greedy tokens (min = max)."""
    from lstmem_peft.memory.cache import MemoryCache

    device = next(model.parameters()).device
    prompt = torch.randint(0, model.get_base_model().config.vocab_size, (1, prompt_tokens), device=device)
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def run(with_memory, _):
        if with_memory:
            model.generate(input_ids=prompt, memory_cache=MemoryCache(), **gen)
            return
        with model.disable_adapter():
            model.generate(input_ids=prompt, **gen)

    result = _alternate(run, reps, warmup, device)
    result.update(
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        ratio=result["lstmem"]["median"] / result["plain"]["median"],
    )
    return result


def bench_ops(model, prompt_tokens: int = 16, new_tokens: int = 8) -> dict:
    """Operator calls per decode step of ``generate``, with memory and plain, and per memory layer.

    Also counts one plain ``model(...)`` decode step with a KV cache (``forward_*``: what a caller
    that decodes by hand, or a serving loop, pays). Counts every aten operator the dispatcher runs
    (views included), between a call of
    ``new_tokens + 1`` and one of ``1`` generated token, so that prefill and set-up cancel. On a GPU
    each operator other than views, aliases and allocations (``extra_non_view_per_layer``) is at
    least one kernel launch, which bounds decode speed at LSTMem's state sizes; the count is
    deterministic, unlike a timing on a shared machine.
    """
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from lstmem_peft.memory.cache import MemoryCache
    from lstmem_peft.tuner.history import memory_layers

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    device = next(model.parameters()).device
    prompt = torch.randint(0, model.get_base_model().config.vocab_size, (1, prompt_tokens), device=device)

    def count(with_memory: bool, n: int) -> Counter:
        gen = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False)
        with torch.no_grad(), Count() as counter:
            if with_memory:
                model.generate(input_ids=prompt, memory_cache=MemoryCache(), **gen)
            else:
                with model.disable_adapter():
                    model.generate(input_ids=prompt, **gen)
        return counter.calls

    def count_forward(with_memory: bool) -> Counter:
        """One plain ``model(...)`` decode step after the prompt, with a KV cache (and a memory)."""
        from transformers import DynamicCache

        kv, cache = DynamicCache(), MemoryCache()
        kw = {"memory_cache": cache} if with_memory else {}
        with torch.no_grad(), contextlib.nullcontext() if with_memory else model.disable_adapter():
            model(input_ids=prompt, past_key_values=kv, use_cache=True, **kw)
            with Count() as counter:
                model(input_ids=prompt[:, :1], past_key_values=kv, use_cache=True, **kw)
        return counter.calls

    count_forward(True)  # warm-up (derives and caches the layers' weights)
    forward_extra = count_forward(True) - count_forward(False)
    per_step = {}
    for name, memory in (("lstmem", True), ("plain", False)):
        count(memory, 1)  # warm-up
        per_step[name] = count(memory, new_tokens + 1) - count(memory, 1)
    layers = len(memory_layers(model))
    extra = per_step["lstmem"] - per_step["plain"]
    views = {
        "view",
        "_unsafe_view",
        "unsqueeze",
        "slice",
        "select",
        "transpose",
        "t",
        "expand",
        "unbind",
        "split",
        "split_with_sizes",
        "narrow",
        "as_strided",
        "squeeze",
        "permute",
        # allocations and aliases launch no kernel either
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "alias",
        "detach",
    }
    return dict(
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        memory_layers=layers,
        lstmem_per_step=sum(per_step["lstmem"].values()) / new_tokens,
        plain_per_step=sum(per_step["plain"].values()) / new_tokens,
        extra_per_layer=sum(extra.values()) / new_tokens / layers,
        extra_non_view_per_layer=sum(v for k, v in extra.items() if k not in views) / new_tokens / layers,
        extra_by_op={k: v / new_tokens / layers for k, v in sorted(extra.items(), key=lambda kv: -kv[1])},
        forward_extra_non_view_per_layer=sum(v for k, v in forward_extra.items() if k not in views) / layers,
    )


def _num(value) -> str:
    """A table cell: one decimal, or a dash for a figure an older record does not have."""
    return "-" if value is None else f"{value:.1f}"


def bench_scan(
    lengths: list[int], batches: list[int], device: torch.device, reps: int = 5, naive_reps: int = 2
) -> list[dict]:
    """Forward and forward+backward time of the naive, vectorised and (CUDA) Triton scans."""
    from lstmem_kernels import lstmem_scan, triton_available

    backends = ["naive", "torch"] + (["triton"] if device.type == "cuda" and triton_available() else [])
    rows = []
    for B in batches:
        for T in lengths:
            for backend in backends:
                for mode in ("forward", "forward+backward"):
                    grad = mode != "forward"
                    g = torch.Generator().manual_seed(0)
                    x = {n: torch.randn(B, T, 4, 8, generator=g) for n in ("q", "k", "w")}
                    x.update({n: torch.rand(B, T, 4, 8, generator=g) for n in ("f", "o")})
                    x["depth"] = torch.randn(B, T, 4, 8, 8, generator=g)
                    x = {n: t.to(device).requires_grad_(grad) for n, t in x.items()}
                    times = []
                    for i in range((naive_reps if backend == "naive" else reps) + 1):
                        _sync(device)
                        start = time.perf_counter()
                        with torch.set_grad_enabled(grad):
                            out = lstmem_scan(**x, backend=backend)
                            if grad:
                                sum(o.float().sum() for o in out).backward()
                        _sync(device)
                        if i:
                            times.append(time.perf_counter() - start)
                    rows.append(dict(batch=B, T=T, backend=backend, mode=mode, **_stats(times)))
    for r in rows:
        naive = next(
            x
            for x in rows
            if (x["batch"], x["T"], x["mode"], x["backend"]) == (r["batch"], r["T"], r["mode"], "naive")
        )
        r["speedup_vs_naive"] = naive["median"] / r["median"]
    return rows


@torch.no_grad()
def bench_step(batches: list[int], device: torch.device, calls: int = 1000, reps: int = 5) -> list[dict]:
    """One token's in-place decode step (``lstmem_step``, n_h 4, r 8) of the naive, PyTorch and (CUDA)
    Triton members: ``calls`` back-to-back calls per timed repetition, after one warm-up repetition;
    ``median`` etc. are seconds per call."""
    from lstmem_kernels import lstmem_step, triton_available

    backends = ["naive", "torch"] + (["triton"] if device.type == "cuda" and triton_available() else [])
    rows = []
    for B in batches:
        g = torch.Generator().manual_seed(0)
        x = {n: torch.randn(B, 4, 8, generator=g) for n in ("q", "k", "w")}
        x.update({n: torch.rand(B, 4, 8, generator=g) for n in ("f", "o")})
        x["depth"] = torch.randn(B, 4, 8, 8, generator=g)
        x = {n: t.to(device) for n, t in x.items()}
        for backend in backends:
            cell, hidden = torch.zeros(B, 4, 8, 8, device=device), torch.zeros(B, 4, 8, 8, device=device)
            times = []
            for i in range(reps + 1):
                _sync(device)
                start = time.perf_counter()
                for _ in range(calls):
                    lstmem_step(**x, cell=cell, hidden=hidden, backend=backend)
                _sync(device)
                if i:
                    times.append((time.perf_counter() - start) / calls)
            rows.append(dict(batch=B, backend=backend, calls=calls, **_stats(times)))
    for r in rows:
        naive = next(x for x in rows if (x["batch"], x["backend"]) == (r["batch"], "naive"))
        r["speedup_vs_naive"] = naive["median"] / r["median"]
    return rows


# ---------------------------------------------------------------------- records, report and plots
def save_record(out_dir: str | os.PathLike, name: str, record: dict) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = record["date"].replace(":", "").replace("-", "")[:15]
    path = out / f"{name}-{record['device_kind']}-{stamp}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def _plot(folder: Path, record: dict, name: str, title: str, draw) -> str:
    """Draw one figure with ``draw(ax)``, save it as PNG in ``folder``; returns the markdown image line."""
    try:
        import matplotlib
    except ModuleNotFoundError as err:
        raise missing_extra(err, "bench", "Benchmark plots (lstmem bench report)") from err

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    draw(ax)
    ax.set_title(f"{title}, {record.get('preset') or ''}, {record['device']}", fontsize=9)
    ax.legend()
    png = folder / f"{name}-{record['device_kind']}-{record.get('preset') or ''}.png"
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return f"![{title}]({png.name})"


RECORD_KEYS = ("benchmark", "device", "device_kind", "date", "torch", "rows")


def read_records(out_dir: str | os.PathLike) -> list[dict]:
    """The JSON records ``lstmem bench`` wrote to ``out_dir``; a folder that is missing or holds none, or a
    record that is not one, raises :class:`~lstmem_peft.utils.errors.DataFormatError` naming it."""
    from lstmem_peft.utils.errors import DataFormatError, MissingDataError, describe

    folder = Path(out_dir)
    expected = "a folder of the JSON records lstmem bench KIND --out FOLDER wrote"
    fix = "Run lstmem bench decode|generate|ops|e2e|write|scan|gpu --out FOLDER first, then report FOLDER"
    if not folder.exists():
        raise MissingDataError(folder, expected, "no such folder", fix)
    if not folder.is_dir():
        raise DataFormatError(folder, expected, "a file, not a folder", fix)
    paths = sorted(folder.glob("*.json"))
    if not paths:
        raise MissingDataError(folder, expected, "no .json record in it", fix)
    records = []
    for path in paths:
        record_expected = "a JSON record of lstmem bench (an object with " + ", ".join(RECORD_KEYS) + ")"
        record_fix = "Remove it from the folder or run that benchmark again"
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DataFormatError(path, record_expected, "not UTF-8 text", record_fix) from None
        if not text.strip():
            raise DataFormatError(path, record_expected, "the file is empty", record_fix)
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            got = f"not JSON ({err.msg} at line {err.lineno} column {err.colno})"
            raise DataFormatError(path, record_expected, got, record_fix) from None
        missing = [k for k in RECORD_KEYS if not isinstance(record, dict) or k not in record]
        if missing or not isinstance(record["rows"], list):
            got = f"the file holds {describe(record)}"
            raise DataFormatError(path, record_expected, got, record_fix)
        records.append(record)
    return records


def report(out_dir: str | os.PathLike, results_md: str | os.PathLike) -> Path:
    """Render every record under ``out_dir`` into ``results_md`` (tables) and PNG plots beside it."""
    records = read_records(out_dir)
    # records of ``lstmem bench gpu --dry-run``: a test of the suite at tiny sizes on CPU, never figures
    dry_runs = [r for r in records if r.get("dry_run")]
    records = [r for r in records if not r.get("dry_run")]
    md = Path(results_md)
    lines = [
        "# Benchmark results",
        "",
        "Generated by `lstmem bench report` from the JSON records in "
        f"`{Path(out_dir).as_posix()}`. Every figure was measured on the device named beside it.",
        "",
    ]
    gpu_seen = any(r["device_kind"] == "cuda" for r in records)
    if not gpu_seen:
        lines += [
            "**GPU: not yet measured.** No GPU was available when these records were made. On a GPU run:",
            "",
            "```bash",
            "lstmem bench gpu --out benchmarks/results   # the paper's decode sweep (HF, vLLM) and the kernels",
            "lstmem bench decode --preset qwen3-4b --dtype bfloat16 --out benchmarks/results",
            "lstmem bench generate --preset qwen3-4b --dtype bfloat16 --out benchmarks/results",
            "lstmem bench e2e --preset qwen3-4b --dtype bfloat16 --out benchmarks/results",
            "lstmem bench write --preset qwen3-4b --dtype bfloat16 --out benchmarks/results",
            "lstmem bench scan --out benchmarks/results",
            "lstmem bench report benchmarks/results",
            "```",
            "",
        ]
    for r in records:
        model = f" — {r['preset']}" if r.get("preset") else ""
        head = f"## {r['benchmark']} — {r['device']}{model} ({r['date']}, torch {r['torch']})"
        lines += [head, ""]
        if r["benchmark"].startswith("gpu-"):
            lines += _gpu_suite_lines(r, md.parent)
        elif r["benchmark"] == "decode":
            lines += [
                "| KV length | LSTMem ms (min-max) | plain ms (min-max) | LSTMem tok/s | plain tok/s | ratio |",
                "| --- | --- | --- | --- | --- | --- |",
            ]
            for row in r["rows"]:
                lm, pl = row["lstmem"], row["plain"]
                lines.append(
                    f"| {row['kv_length']} | {1e3 * lm['median']:.2f} ({1e3 * lm['min']:.2f}-{1e3 * lm['max']:.2f}) | "
                    f"{1e3 * pl['median']:.2f} ({1e3 * pl['min']:.2f}-{1e3 * pl['max']:.2f}) | "
                    f"{row['lstmem_tok_s']:.2f} | {row['plain_tok_s']:.2f} | {row['ratio']:.3f} |"
                )

            def draw(ax, rows=r["rows"]):
                ks = [row["kv_length"] for row in rows]
                ax.plot(ks, [row["lstmem_tok_s"] for row in rows], "o-", label="LSTMem")
                ax.plot(ks, [row["plain_tok_s"] for row in rows], "s--", label="plain backbone")
                ax.set_xlabel("KV cache length (tokens)")
                ax.set_ylabel("equivalent decode speed (tok/s)")

            lines += ["", _plot(md.parent, r, "decode", "decode speed", draw)]
        elif r["benchmark"] == "ops":
            lines += [
                "| aten operators per decode step: LSTMem | plain | extra per memory layer | of which launch kernels |"
                " same, one `model(...)` step | top extra operators per layer |",
                "| --- | --- | --- | --- | --- | --- |",
            ]
            for row in r["rows"]:
                top = ", ".join(f"{k} {v:.1f}" for k, v in list(row["extra_by_op"].items())[:6])
                lines.append(
                    f"| {row['lstmem_per_step']:.1f} | {row['plain_per_step']:.1f} | {row['extra_per_layer']:.1f} | "
                    f"{row['extra_non_view_per_layer']:.1f} | {_num(row.get('forward_extra_non_view_per_layer'))} | "
                    f"{top} |"
                )
        elif r["benchmark"] in ("e2e", "write", "generate"):
            key = {"e2e": "history_tokens", "write": "tokens", "generate": "prompt_tokens"}[r["benchmark"]]
            extra = " new tokens |" if r["benchmark"] == "generate" else ""
            lines += [
                f"| {key.replace('_', ' ')} |{extra} LSTMem s (min-max) | plain s (min-max) | ratio |",
                "| --- |" + " --- |" * (4 if extra else 3),
            ]
            for row in r["rows"]:
                lm, pl = row["lstmem"], row["plain"]
                new_tokens = f" {row['new_tokens']} |" if extra else ""
                label = row[key] if row.get("kv_cache", True) else f"{row[key]}, no KV cache"
                lines.append(
                    f"| {label} |{new_tokens} {lm['median']:.3f} ({lm['min']:.3f}-{lm['max']:.3f}) | "
                    f"{pl['median']:.3f} ({pl['min']:.3f}-{pl['max']:.3f}) | {row['ratio']:.3f} |"
                )
            if r["benchmark"] == "e2e":

                def draw(ax, rows=r["rows"]):
                    xs = range(len(rows))
                    ax.bar(
                        [x - 0.2 for x in xs], [row["lstmem"]["median"] for row in rows], 0.4, label="LSTMem"
                    )
                    ax.bar(
                        [x + 0.2 for x in xs],
                        [row["plain"]["median"] for row in rows],
                        0.4,
                        label="plain backbone",
                    )
                    ax.set_xticks(list(xs), [str(row["history_tokens"]) for row in rows])
                    ax.set_xlabel("history tokens")
                    ax.set_ylabel(f"seconds (history + {rows[0]['answer_tokens']}-token answer)")

                lines += ["", _plot(md.parent, r, "e2e", "end to end", draw)]
        elif r["benchmark"] == "scan":
            lines += [
                "| batch | T | backend | mode | median ms (min-max) | x naive |",
                "| --- | --- | --- | --- | --- | --- |",
            ]
            for row in r["rows"]:
                lines.append(
                    f"| {row['batch']} | {row['T']} | {row['backend']} | {row['mode']} | "
                    f"{1e3 * row['median']:.2f} ({1e3 * row['min']:.2f}-{1e3 * row['max']:.2f}) | "
                    f"{row['speedup_vs_naive']:.1f} |"
                )
        lines.append("")
    if dry_runs:
        lines += [
            "## Dry runs of `lstmem bench gpu` (not measurements)",
            "",
            "Records of `lstmem bench gpu --dry-run`: every step of the GPU suite at tiny sizes on CPU, a "
            "test of the suite itself. Their timings are not figures and are not shown.",
            "",
        ]
        for r in dry_runs:
            lines.append(f"- {r['benchmark']}, {r['date']}, {r['device']}: dry run, {len(r['rows'])} rows")
        lines.append("")
    md.write_text("\n".join(lines))
    return md


def _ms(stats: dict, per: int = 1) -> str:
    """``median (min-max)`` in milliseconds, per ``per`` tokens."""
    return (
        f"{1e3 * stats['median'] / per:.2f} ({1e3 * stats['min'] / per:.2f}-{1e3 * stats['max'] / per:.2f})"
    )


def _gpu_suite_lines(r: dict, folder: Path) -> list[str]:
    """The tables of one ``lstmem bench gpu`` record (gpu-hf-decode, gpu-vllm-decode, gpu-kernels)."""
    git = r.get("git") or {}
    commit = (git.get("commit") or "unknown")[:12] + (" (with local changes)" if git.get("dirty") else "")
    lines = [
        f"CUDA {r.get('cuda')}, driver {r.get('driver')}, transformers {r.get('transformers')}, "
        f"triton {r.get('triton')}, vllm {r.get('vllm')}, {r.get('dtype')}, commit {commit}.",
        "",
    ]
    if r.get("error"):
        return lines + [f"Failed: {r['error']}"]
    if r.get("skipped") and isinstance(r["skipped"], str):
        return lines + [f"Skipped: {r['skipped']}"]
    if r.get("failed"):
        return lines + [f"Failed: {r['failed']}"]
    if r["benchmark"] == "gpu-hf-decode":
        lines += [
            "| KV length | variant | cache | compiled | LSTMem tok/s | plain tok/s | LSTMem / plain speed "
            "| LSTMem ms/token (min-max) | plain ms/token (min-max) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in r["rows"]:
            n = row["tokens_per_call"]
            lines.append(
                f"| {row['kv_length']} | {row['variant']} | {row['cache']} | {'yes' if row['compiled'] else 'no'} | "
                f"{row['lstmem_tok_s']:.2f} | {row['plain_tok_s']:.2f} | {row['speed_retained']:.3f} | "
                f"{_ms(row['lstmem'], n)} | {_ms(row['plain'], n)} |"
            )
        for skip in r.get("skipped_runs") or []:
            lines += ["", f"Skipped: KV {skip['kv_length']}, {skip['variant']}: {skip['reason']}"]
        if r["rows"]:

            def draw(ax, rows=r["rows"]):
                for variant in dict.fromkeys(row["variant"] for row in rows):
                    mine = [row for row in rows if row["variant"] == variant]
                    ks = [row["kv_length"] for row in mine]
                    ax.plot(ks, [row["lstmem_tok_s"] for row in mine], "o-", label=f"LSTMem, {variant}")
                    ax.plot(ks, [row["plain_tok_s"] for row in mine], "s--", label=f"plain, {variant}")
                ax.set_xscale("log", base=2)
                ax.set_xlabel("KV cache length (tokens)")
                ax.set_ylabel("decode speed (tok/s)")

            lines += ["", _plot(folder, r, "gpu-hf-decode", "HF decode sweep", draw)]
    elif r["benchmark"] == "gpu-vllm-decode":
        speeds = r["bench_vllm"]["decode_tokens_per_s"]
        lines += [
            f"vLLM, CUDA graphs {'on' if r.get('cuda_graphs') else 'off'}, {r.get('checkpoint')}.",
            "",
            "| KV length | LSTMem tok/s | plain tok/s | LSTMem / plain speed |",
            "| --- | --- | --- | --- |",
        ]
        for length in r["bench_vllm"]["settings"]["kv"]:
            lm, pl = speeds["lstmem"][str(length)], speeds["plain"][str(length)]
            lines.append(f"| {length} | {lm:.2f} | {pl:.2f} | {lm / pl:.3f} |")
    elif r["benchmark"] == "gpu-kernels":
        lines += [
            "| batch | T | backend | mode | median ms (min-max) | x naive |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for row in (row for row in r["rows"] if row.get("kind") == "scan"):
            lines.append(
                f"| {row['batch']} | {row['T']} | {row['backend']} | {row['mode']} | {_ms(row)} | "
                f"{row['speedup_vs_naive']:.1f} |"
            )
        lines += [
            "",
            "| decode step: batch | backend | median us per call (min-max) | x naive |",
            "| --- | --- | --- | --- |",
        ]
        for row in (row for row in r["rows"] if row.get("kind") == "step"):
            lines.append(
                f"| {row['batch']} | {row['backend']} | {1e6 * row['median']:.1f} "
                f"({1e6 * row['min']:.1f}-{1e6 * row['max']:.1f}) | {row['speedup_vs_naive']:.1f} |"
            )
        for backend, reason in (r.get("skipped_backends") or {}).items():
            lines += ["", f"Skipped: {backend}: {reason}"]
    return lines


def run(
    kind: str,
    preset: str = "cpu-small",
    device: str | None = None,
    dtype: str = "float32",
    out: str = "benchmarks/results",
    reps: int | None = None,
    **sizes,
) -> dict:
    """What ``lstmem bench KIND`` does; returns the record written."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    defaults = DEFAULTS["cuda" if dev.type == "cuda" else "cpu"]
    record = dict(
        benchmark=kind,
        preset=None if kind == "scan" else preset,
        device_kind=dev.type,
        dtype=dtype,
        **environment(dev),
    )
    if kind == "scan":
        record["rows"] = bench_scan(
            sizes.get("lengths") or [63, 2048], sizes.get("batches") or [1, 4], dev, reps=reps or 5
        )
    else:
        model = build_model(preset, dev, getattr(torch, dtype))
        if kind == "decode":
            record["rows"] = bench_decode(
                model, sizes.get("kv_lengths") or defaults["kv_lengths"], reps=reps or 10
            )
        elif kind == "write":
            tokens = sizes.get("tokens") or defaults["write_tokens"]
            record["rows"] = [bench_write(model, tokens, reps=reps or 3, kv=kv) for kv in (True, False)]
        elif kind == "generate":
            prompt = sizes.get("prompt_tokens") or defaults["prompt_tokens"]
            new_tokens = sizes.get("answer_tokens") or defaults["generate_tokens"]
            record["rows"] = [bench_generate(model, prompt, new_tokens, reps=reps or 6)]
        elif kind == "ops":
            record["rows"] = [bench_ops(model, new_tokens=sizes.get("answer_tokens") or 8)]
        elif kind == "e2e":
            answer = sizes.get("answer_tokens") or defaults["answer_tokens"]
            record["rows"] = [
                bench_e2e(model, n, answer, reps=reps or 3)
                for n in (sizes.get("histories") or defaults["histories"])
            ]
        else:
            raise ValueError(f"unknown benchmark {kind!r}: decode, generate, ops, e2e, write or scan")
    path = save_record(out, kind, record)
    print(json.dumps(record, indent=2))
    print(f"wrote {path}")
    return record
