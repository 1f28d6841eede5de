"""The GPU acceptance run's timings (:mod:`.acceptance`): ``time-write``, ``time-scan``,
``time-decode-eager`` and ``time-decode-compiled``, each ``lstmem bench``'s helpers at few repetitions
(the sizes in :data:`.acceptance.SETTINGS`); each returns the rows it measured."""

from __future__ import annotations

import contextlib

import torch

from .model_checks import ModelContext, set_backend


def time_write(s: dict, device: torch.device, ctx: ModelContext, log=print) -> dict:
    """History writing in ``block_size`` blocks (KV cache kept) against the plain prefill of the same blocks."""
    from ..bench import command as bench

    set_backend(ctx.model, "auto")
    row = bench.bench_write(
        ctx.model, s["write_tokens"], block_size=s["block_size"], reps=s["write_reps"], warmup=1, kv=True
    )
    log(
        f"time-write: LSTMem {row['lstmem']['median']:.4g} s, plain {row['plain']['median']:.4g} s "
        f"for {s['write_tokens']} tokens"
    )
    return dict(rows=[row])


def time_scan(s: dict, device: torch.device, log=print) -> dict:
    """Each scan member (naive, torch, and triton on CUDA) at T = ``time_scan_length``, n_h 4, r 8."""
    from lstmem_kernels import triton_available

    from ..bench import command as bench

    rows = bench.bench_scan([s["time_scan_length"]], [1], device, reps=s["time_scan_reps"], naive_reps=1)
    skipped = {}
    if device.type != "cuda":
        skipped["triton"] = f"no CUDA device ({device.type}): bench_scan times Triton on CUDA only"
    elif not triton_available():
        skipped["triton"] = "triton is not importable"
    for r in rows:
        log(f"time-scan: {r['backend']} {r['mode']} T={r['T']}: {r['median'] * 1e3:.3g} ms")
    return dict(rows=rows, skipped_members=skipped)


def _decode_settings(s: dict) -> dict:
    keys = (
        "reps",
        "warmup",
        "new_tokens",
        "generate_reps",
        "generate_warmup",
        "compile_warmup",
        "block_size",
    )
    return {k: s[k] for k in keys}


def time_decode(
    s: dict, device: torch.device, ctx: ModelContext, dry_run: bool, compiled: bool, log=print
) -> dict:
    """Decode at ``kv_lengths`` (``bench_gpu.hf_decode_sweep``): eager (one ``model(...)`` step, and greedy
    ``generate``), or compiled (``generate`` from a static cache, transformers' ``CompileConfig``: inductor
    with ``reduce-overhead``, CUDA graphs) inside ``traceable_memory()`` so that the memory's step can be
    traced into the graph. Each compiled row says whether it was: no graph break, no CUDA-graph skip."""
    from lstmem_peft import traceable_memory

    from ..bench import gpu_suite as bench_gpu

    set_backend(ctx.model, "auto")
    variants = ("generate-static-compile",) if compiled else ("forward", "generate")
    context = traceable_memory() if compiled else contextlib.nullcontext()
    with context:
        rows, skips = bench_gpu.hf_decode_sweep(
            ctx.model, s["kv_lengths"], _decode_settings(s), variants=variants, dry_run=dry_run, log=log
        )
    for r in rows:
        if compiled:
            graphs = device.type == "cuda" and not dry_run
            r["cuda_graphs"] = graphs
            r["memory_in_graph"] = (
                bool(r.get("compiled"))
                and r.get("graph_breaks") == 0
                and (r.get("cudagraph_skips") == 0 or not graphs)
            )
    result = dict(rows=rows, skipped_runs=skips)
    if compiled and dry_run:
        result["note"] = (
            "dry run: the 'eager' compile backend on CPU traces the graph; no CUDA graph is recorded"
        )
    if any(skip.get("failed") for skip in skips):
        result["failed_runs"] = sum(1 for skip in skips if skip.get("failed"))
    return result
