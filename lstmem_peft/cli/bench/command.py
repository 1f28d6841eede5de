"""Benchmarks: decode speed vs KV length, end-to-end history + answer, history writing, scans.

Each benchmark times LSTMem against the plain backbone (the same model with the adapter disabled)
in one process, alternating their order, after warm-ups, synchronising CUDA around every timed
region, and records medians and min-max over repetitions in a JSON file with the device, library
versions and date (:mod:`.records`, whose ``report`` renders every JSON record under a folder
into ``RESULTS.md`` and PNG plots). Weights are random: timing needs a model's dimensions, not its
training.

    lstmem bench decode --preset cpu-small          # or --preset qwen3-4b on a GPU
    lstmem bench generate | ops | e2e | write | scan ...
    lstmem bench gpu [--dry-run]                        # the GPU suite (gpu_suite.py): every step, one command
    lstmem bench report benchmarks/results              # RESULTS.md + plots from the JSON records
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from lstmem_peft.tuner.kv_argument import kv_kwargs

from . import settings as bench_settings
from .records import environment, save_record
from .settings import DEFAULTS, progress_bar

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
        (Path(__file__).resolve().parents[2] / "assets" / "configs" / "qwen3-4b.json").read_text()
    ),
}


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


def load_model(model: str, device: torch.device, dtype: torch.dtype, **adapter):
    """A real backbone (``--model``: a short name of ``lstmem models``, a folder or a Hub id) with a
    fresh LSTMem adapter on every layer: its own weights and dimensions instead of a preset's."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from lstmem_peft.tuner.backbones import resolve_model
    from lstmem_peft.tuner.config import LSTMemConfig

    base = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=dtype).to(device)
    torch.manual_seed(0)
    return get_peft_model(base.eval(), LSTMemConfig(**adapter)).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stats(times: list[float]) -> dict:
    return dict(median=statistics.median(times), min=min(times), max=max(times), n=len(times))


def adapter_off(model):
    """For :func:`_alternate`'s ``context``: the plain side runs with the adapter disabled, the
    memory side as it is. PEFT's ``disable_adapter()`` walks the whole model on entry and exit (about
    3 ms for ``cpu-small``, as much as a tenth of its decode step), so it belongs outside the clock."""
    return lambda memory: contextlib.nullcontext() if memory else model.disable_adapter()


def _alternate(
    run, reps: int, warmup: int, device: torch.device, setup=None, context=None, desc: str = "timing"
) -> dict:
    """Time ``run(memory, state)`` for memory in (True, False), alternating order. Untimed:
    ``state = setup(memory)``, and entering and leaving ``context(memory)`` (a context manager that
    encloses the timed call, e.g. :func:`adapter_off`).

    Besides each side's statistics, ``ratio_pairs`` holds those of the ratios within one repetition
    (its two runs are back to back, so a shared machine's slow minutes move both): steadier than the
    ratio of the two medians when the load drifts during the run. ``desc``: the progress bar's label."""
    times = {True: [], False: []}
    with progress_bar(2 * (warmup + reps), desc) as bar:
        for i in range(warmup + reps):
            for memory in (True, False) if i % 2 else (False, True):
                state = setup(memory) if setup else None
                with context(memory) if context else contextlib.nullcontext():
                    _sync(device)
                    start = time.perf_counter()
                    run(memory, state)
                    _sync(device)
                    elapsed = time.perf_counter() - start
                if i >= warmup:
                    times[memory].append(elapsed)
                bar.update()
    pairs = [m / p for m, p in zip(times[True], times[False], strict=True)]
    return {"lstmem": _stats(times[True]), "plain": _stats(times[False]), "ratio_pairs": _stats(pairs)}


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
        model(
            input_ids=prompt,
            **kv_kwargs(model, kv_mem),
            use_cache=True,
            memory_cache=memory,
            logits_to_keep=1,
        )
        with model.disable_adapter():
            model(input_ids=prompt, **kv_kwargs(model, kv_plain), use_cache=True, logits_to_keep=1)

        # Defaults bind this iteration's caches and token (the closures run inside the iteration).
        def setup(with_memory, kv_mem=kv_mem, kv_plain=kv_plain, length=length, memory=memory):
            kv = kv_mem if with_memory else kv_plain
            extra = kv.get_seq_length() - length
            if extra > 0:
                kv.crop(-extra)  # back to the prompt (transformers 5: a negative crop drops tokens)
            return memory.clone() if with_memory else None  # restore the memory

        def run(with_memory, state, token=token, kv_mem=kv_mem, kv_plain=kv_plain):
            if with_memory:
                model(input_ids=token, **kv_kwargs(model, kv_mem), use_cache=True, memory_cache=state)
            else:
                model(input_ids=token, **kv_kwargs(model, kv_plain), use_cache=True)

        result = _alternate(
            run, reps, warmup, device, setup, context=adapter_off(model), desc=f"decode, KV {length}"
        )
        result.update(
            kv_length=length,
            lstmem_tok_s=1 / result["lstmem"]["median"],
            plain_tok_s=1 / result["plain"]["median"],
            ratio=result["lstmem"]["median"] / result["plain"]["median"],
        )
        rows.append(result)
    return rows


def _plain_blocks(model, history: torch.Tensor, block_size: int, kv) -> None:
    """The plain side of a history write: the history's blocks through the backbone, filling the
    KV cache ``kv`` (``None``: independent blocks)."""
    for start in range(0, history.shape[1], block_size):
        model(
            input_ids=history[:, start : start + block_size],
            **kv_kwargs(model, kv),
            use_cache=kv is not None,
            logits_to_keep=1,
        )


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
        _plain_blocks(model, history, block_size, cache)

    label = f"write {tokens} tokens, {'KV kept' if kv else 'memory only'}"
    result = _alternate(run, reps, warmup, device, context=adapter_off(model), desc=label)
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
            model.generate(input_ids=full, **kv_kwargs(model, kv), memory_cache=memory, **gen)
            return
        _plain_blocks(model, history, block_size, kv)
        model.generate(input_ids=full, **kv_kwargs(model, kv), **gen)

    label = f"e2e, history {history_tokens}"
    result = _alternate(run, reps, warmup, device, context=adapter_off(model), desc=label)
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
        model.generate(input_ids=prompt, **gen)

    label = f"generate {new_tokens} after {prompt_tokens}"
    result = _alternate(run, reps, warmup, device, context=adapter_off(model), desc=label)
    result.update(
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        ratio=result["lstmem"]["median"] / result["plain"]["median"],
    )
    return result


#: aten operators that launch no kernel on a GPU: views, aliases and allocations.
NO_KERNEL_OPS = frozenset(
    {
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
)


def count_ops(call) -> Counter:
    """The aten operators the dispatcher runs during ``call()``, by name (views included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count() as counter:
        call()
    return counter.calls


def _generate_ops(model, prompt: torch.Tensor, with_memory: bool, new_tokens: int) -> Counter:
    """Operators of one greedy ``generate`` of exactly ``new_tokens`` tokens from an empty memory."""
    from lstmem_peft.memory.cache import MemoryCache

    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if with_memory:
        return count_ops(lambda: model.generate(input_ids=prompt, memory_cache=MemoryCache(), **gen))
    with adapter_off(model)(with_memory):
        return count_ops(lambda: model.generate(input_ids=prompt, **gen))


def _forward_step_ops(model, prompt: torch.Tensor, with_memory: bool) -> Counter:
    """Operators of one plain ``model(...)`` decode step after the prompt, with a KV cache (and a memory)."""
    from transformers import DynamicCache

    from lstmem_peft.memory.cache import MemoryCache

    kv, cache = DynamicCache(), MemoryCache()
    kw = {"memory_cache": cache} if with_memory else {}
    with torch.no_grad(), adapter_off(model)(with_memory):
        model(input_ids=prompt, **kv_kwargs(model, kv), use_cache=True, **kw)
        return count_ops(lambda: model(input_ids=prompt[:, :1], **kv_kwargs(model, kv), use_cache=True, **kw))


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
    from lstmem_peft.tuner.history import memory_layers

    device = next(model.parameters()).device
    prompt = torch.randint(0, model.get_base_model().config.vocab_size, (1, prompt_tokens), device=device)
    with progress_bar(9, "ops, counting") as bar:
        _forward_step_ops(model, prompt, True)  # warm-up (derives and caches the layers' weights)
        forward_extra = _forward_step_ops(model, prompt, True) - _forward_step_ops(model, prompt, False)
        bar.update(3)
        per_step = {}
        for name, memory in (("lstmem", True), ("plain", False)):
            _generate_ops(model, prompt, memory, 1)  # warm-up
            per_step[name] = _generate_ops(model, prompt, memory, new_tokens + 1) - _generate_ops(
                model, prompt, memory, 1
            )
            bar.update(3)
    layers = len(memory_layers(model))
    extra = per_step["lstmem"] - per_step["plain"]
    return dict(
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        memory_layers=layers,
        lstmem_per_step=sum(per_step["lstmem"].values()) / new_tokens,
        plain_per_step=sum(per_step["plain"].values()) / new_tokens,
        extra_per_layer=sum(extra.values()) / new_tokens / layers,
        extra_non_view_per_layer=sum(v for k, v in extra.items() if k not in NO_KERNEL_OPS)
        / new_tokens
        / layers,
        extra_by_op={k: v / new_tokens / layers for k, v in sorted(extra.items(), key=lambda kv: -kv[1])},
        forward_extra_non_view_per_layer=sum(v for k, v in forward_extra.items() if k not in NO_KERNEL_OPS)
        / layers,
    )


def bench_scan(
    lengths: list[int], batches: list[int], device: torch.device, reps: int = 5, naive_reps: int = 2
) -> list[dict]:
    """Forward and forward+backward time of the naive, vectorised and (CUDA) Triton scans."""
    from lstmem_kernels import lstmem_scan, triton_available

    backends = ["naive", "torch"] + (["triton"] if device.type == "cuda" and triton_available() else [])
    rows = []
    runs = len(lengths) * 2 * sum((naive_reps if b == "naive" else reps) + 1 for b in backends)
    bar = progress_bar(len(batches) * runs, "scan")  # the naive scan's long lengths dominate the estimate
    for B in batches:
        for T in lengths:
            for backend in backends:
                for mode in ("forward", "forward+backward"):
                    bar.set_description(f"scan B={B} T={T} {backend} {mode}")
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
                        bar.update()
                    rows.append(dict(batch=B, T=T, backend=backend, mode=mode, **_stats(times)))
    bar.close()
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


# ---------------------------------------------------------------------- the command
def run(
    kind: str,
    preset: str = "cpu-small",
    device: str | None = None,
    dtype: str = "float32",
    out: str = "benchmarks/results",
    reps: int | None = None,
    model: str | None = None,
    progress: bool = True,
    **sizes,
) -> dict:
    """What ``lstmem bench KIND`` does; returns the record written. ``model``: time that backbone
    (:func:`load_model`) instead of ``preset``'s random weights; the record names it. ``progress``:
    progress bars on stderr (:mod:`.settings`). Sizes not given: :data:`.settings.DEFAULTS`."""
    bench_settings.SHOW_PROGRESS = progress
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    defaults = DEFAULTS["cuda" if dev.type == "cuda" else "cpu"]
    reps = reps or defaults["reps"].get(kind)
    record = dict(
        benchmark=kind,
        preset=None if kind == "scan" or model is not None else preset,
        **({"model": model} if model is not None else {}),
        device_kind=dev.type,
        dtype=dtype,
        **environment(dev),
    )
    if kind == "scan":
        record["rows"] = bench_scan(
            sizes.get("lengths") or defaults["scan_lengths"],
            sizes.get("batches") or defaults["scan_batches"],
            dev,
            reps=reps,
        )
    else:
        if model is not None:
            model = load_model(model, dev, getattr(torch, dtype))
        else:
            model = build_model(preset, dev, getattr(torch, dtype))
        if kind == "decode":
            record["rows"] = bench_decode(model, sizes.get("kv_lengths") or defaults["kv_lengths"], reps=reps)
        elif kind == "write":
            tokens = sizes.get("tokens") or defaults["write_tokens"]
            record["rows"] = [bench_write(model, tokens, reps=reps, kv=kv) for kv in (True, False)]
        elif kind == "generate":
            prompt = sizes.get("prompt_tokens") or defaults["prompt_tokens"]
            new_tokens = sizes.get("answer_tokens") or defaults["generate_tokens"]
            record["rows"] = [bench_generate(model, prompt, new_tokens, reps=reps)]
        elif kind == "ops":
            record["rows"] = [bench_ops(model, new_tokens=sizes.get("answer_tokens") or 8)]
        elif kind == "e2e":
            answer = sizes.get("answer_tokens") or defaults["answer_tokens"]
            record["rows"] = [
                bench_e2e(model, n, answer, reps=reps)
                for n in (sizes.get("histories") or defaults["histories"])
            ]
        else:
            raise ValueError(f"unknown benchmark {kind!r}: decode, generate, ops, e2e, write or scan")
    path = save_record(out, kind, record)
    print(json.dumps(record, indent=2))
    print(f"wrote {path}")
    return record
