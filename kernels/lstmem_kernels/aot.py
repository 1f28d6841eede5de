"""Compile every Triton launch the host code makes, ahead of time, for NVIDIA GPUs, on a machine
without one, and check each binary's registers, spills, shared memory and occupancy.

How it works (no GPU, no CUDA driver, no change to the kernels or their host code):

1. **Capture.** :func:`capture_launches` installs a stand-in Triton driver whose target is
   ``GPUTarget("cuda", 90, 32)`` (``triton.runtime.driver.driver.set_active``) and a
   ``triton.knobs.runtime.jit_cache_hook`` that records each launch's signature, constexprs,
   attributes and options, then returns ``True`` so that Triton neither compiles nor launches. The
   public entry points (:func:`lstmem_kernels.lstmem_scan` forward and backward,
   :func:`~lstmem_kernels.lstmem_step`, :func:`~lstmem_kernels.lstmem_decode_step`) run their real host
   code on real **CPU tensors**, which stand in for device tensors: they have distinct, aligned
   addresses (Triton's pointer specialisation and the decode step's overlap check see what they
   would see on a GPU: allocations aligned to at least 16 bytes), true shapes and strides, and
   autograd runs the backward. Only one thing in the host code is swapped while capturing: the
   device check ``triton_common.check_runtime`` (which refuses non-CUDA tensors outside the
   interpreter) becomes a no-op in every loaded ``lstmem_kernels`` module that holds it. Tensors on
   the ``meta`` device or torch's ``FakeTensorMode`` were tried and rejected: both report address 0
   for every tensor, so the decode step's overlap check refuses its inputs.
2. **Compile.** Each distinct launch is compiled with
   ``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
   options=...)`` for ``sm_90a`` (Triton names capability 90 so) and ``sm_80``, through TTIR, TTGIR,
   LLIR and PTX to a cubin made by the ``ptxas`` that Triton's wheel ships; Triton runs it with
   ``-v`` and prints its log when ``knobs.nvidia.dump_ptxas_log`` is set (the cache is bypassed
   with ``knobs.compilation.always_compile`` so ptxas always runs). Registers, spill stores and
   loads and static shared memory come from that log, dynamic shared memory (what Triton asks for
   at launch) from the kernel's metadata.
3. **Check** (:func:`problems`): a compile error; a spill at the paper's sizes; shared memory above
   the per-block limit; or fewer than one resident block per SM (:func:`occupancy`).

Distinct launches are keyed by everything that makes a different binary: kernel, signature,
constexprs, attributes (pointer alignment, integer divisibility) and options (``num_warps``,
``num_stages``, ``num_ctas``, FMA fusion); the coarser count by ``(kernel, signature, constexprs,
num_warps)`` is reported beside it.

Which launches are driven (:func:`drive`): the paper's sizes (``n_h = 4``, ``r = 8``, ``d = 2560``
for Qwen3-4B, ``T = 2048`` tokens per block, batch 1 and a few) and the kernel tests' edge sizes
(``r`` 5, 6, 8; ``T`` 1, 63, 2049), over the flags and dtypes each entry point takes. The full
product of flags and dtypes is large (the fused decode step alone takes about 5 s per target to
compile), so the ``full`` set covers every **pair** of factor values (a pairwise covering array,
:func:`~.aot_drive.pairwise`) plus every factor's all-on and all-off extremes; ``--grid product`` runs the whole
product on demand. The ``fast`` set is a representative subset (every kernel, the heaviest flags).

Runs with Triton 3.6.0 to 3.9.0 (the same API; each wheel ships ``ptxas``): the whole set with 3.6.0,
3.7.0 and 3.9.0, the fast set with 3.7.1 and 3.8.0 (2026-11-27). The ``triton`` extra admits 3.6 to
3.9; the fused decode step's tile sizes were chosen by these figures (``docs/benchmarks.md``). Run it
in a process where ``TRITON_INTERPRET`` is unset (the kernels must be real
``JITFunction`` objects)::

    python -m lstmem_kernels.aot --set full --json compile.json

Limits (:data:`LIMITS`) are those of the CUDA C++ Programming Guide, "Technical Specifications per
Compute Capability" (8.0 and 9.0): 64K 32-bit registers per SM and per block, 255 per thread,
allocated per warp in units of 256; at most 2,048 threads and 32 blocks per SM; shared memory
164 KiB per SM / 163 KiB per block (8.0) and 228 KiB per SM / 227 KiB per block (9.0), the
per-block figure being the opt-in maximum that Triton compares a kernel's shared memory with before
loading it (``CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN``), and 1 KiB of each SM's
shared memory reserved per resident block.

The capture is in :mod:`lstmem_kernels.aot_capture`, the calls driven in :mod:`lstmem_kernels.aot_drive`;
this module compiles each launch and checks the binary, runs the whole (:func:`run`) and reports
(``python -m lstmem_kernels.aot``).

No transformers import: these modules need torch and triton only.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import multiprocessing
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from .aot_capture import Launch, capture_launches, defined_kernels
from .aot_drive import drive

__all__ = [
    "LIMITS",
    "Compiled",
    "DeviceLimits",
    "Launch",
    "capture_launches",
    "compile_launch",
    "defined_kernels",
    "drive",
    "occupancy",
    "problems",
    "run",
]

TARGETS = {"sm_90a": 90, "sm_80": 80}


# ---------------------------------------------------------------------- device limits
@dataclass(frozen=True)
class DeviceLimits:
    """What one SM offers a kernel (CUDA C++ Programming Guide, technical specifications)."""

    smem_per_block: int  # bytes, the opt-in maximum per block
    smem_per_sm: int  # bytes
    smem_reserved_per_block: int  # bytes of the SM's shared memory the system keeps per resident block
    smem_unit: int  # shared memory allocation granularity, bytes
    regs_per_sm: int
    regs_per_block: int
    regs_per_thread: int
    reg_unit: int  # registers are allocated per warp in units of this many
    max_threads_per_sm: int
    max_blocks_per_sm: int


KIB = 1024
LIMITS = {
    "sm_90a": DeviceLimits(227 * KIB, 228 * KIB, KIB, 128, 65536, 65536, 255, 256, 2048, 32),
    "sm_80": DeviceLimits(163 * KIB, 164 * KIB, KIB, 128, 65536, 65536, 255, 256, 2048, 32),
}


def occupancy(registers: int, num_warps: int, smem: int, limits: DeviceLimits) -> tuple[int, str]:
    """Resident blocks per SM and what limits them (``"registers"``, ``"shared memory"``,
    ``"threads"`` or ``"blocks"``), for a kernel of ``registers`` per thread, ``num_warps`` warps per
    block and ``smem`` bytes of shared memory per block (static plus dynamic)."""
    regs_per_warp = math.ceil(max(registers, 1) * 32 / limits.reg_unit) * limits.reg_unit
    regs_per_block = regs_per_warp * num_warps
    by_regs = 0 if regs_per_block > limits.regs_per_block else limits.regs_per_sm // regs_per_block
    smem_per_block = math.ceil((smem + limits.smem_reserved_per_block) / limits.smem_unit) * limits.smem_unit
    by_smem = 0 if smem > limits.smem_per_block else limits.smem_per_sm // smem_per_block
    by_threads = limits.max_threads_per_sm // (32 * num_warps)
    bounds = {
        "registers": by_regs,
        "shared memory": by_smem,
        "threads": by_threads,
        "blocks": limits.max_blocks_per_sm,
    }
    limiter = min(bounds, key=bounds.get)
    return bounds[limiter], limiter


# ---------------------------------------------------------------------- compile and check
@dataclass
class Compiled:
    """Resources of one launch's binary for one target (``error`` set when the compile failed)."""

    target: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    smem_static: int = 0
    smem_dynamic: int = 0
    blocks_per_sm: int = 0
    limited_by: str = ""
    cubin_bytes: int = 0
    seconds: float = 0.0
    error: str = ""

    @property
    def smem(self) -> int:
        return self.smem_static + self.smem_dynamic


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spills": re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"),
    "smem": re.compile(r"(\d+) bytes smem"),
    "target": re.compile(r"for '(sm_\w+)'"),
}


def compile_launch(launch: Launch, target: str) -> Compiled:
    """Compile ``launch`` for ``target`` (``"sm_90a"`` or ``"sm_80"``) to a cubin and read ptxas's
    resource report (module docstring)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    result = Compiled(target)
    start = time.perf_counter()
    log = io.StringIO()
    knobs = triton.knobs
    saved = (knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile)
    knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, True
    try:
        source = ASTSource(launch.fn, launch.signature, constexprs=launch.constexprs, attrs=launch.attrs)
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(
                source, target=GPUTarget("cuda", TARGETS[target], 32), options=launch.options
            )
    except Exception as err:  # noqa: BLE001 - any compiler failure is the result
        result.error = f"{type(err).__name__}: {err}"[:2000]
        return result
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved
        result.seconds = time.perf_counter() - start
    text = log.getvalue()
    got = _PTXAS["target"].search(text)
    if not got or not _PTXAS["registers"].search(text):
        result.error = f"no ptxas resource report for {target} in Triton's output: {text[-500:]!r}"
        return result
    if got.group(1) != target:
        result.error = f"ptxas compiled for {got.group(1)}, expected {target}"
        return result
    result.registers = int(_PTXAS["registers"].search(text).group(1))
    spills = _PTXAS["spills"].search(text)
    if spills:
        result.stack, result.spill_stores, result.spill_loads = map(int, spills.groups())
    smem = _PTXAS["smem"].search(text)
    result.smem_static = int(smem.group(1)) if smem else 0
    result.smem_dynamic = int(kernel.metadata.shared)
    result.cubin_bytes = len(kernel.asm["cubin"])
    result.blocks_per_sm, result.limited_by = occupancy(
        result.registers, launch.options["num_warps"], result.smem, LIMITS[target]
    )
    return result


def problems(launch: Launch, compiled: Compiled) -> list[str]:
    """Why this binary would not do: compile error, spill at the paper's sizes, shared memory over the
    per-block limit, or no block resident per SM."""
    where = f"{launch.kernel} [{launch.describe()}] for {compiled.target} (first made by: {launch.label})"
    if compiled.error:
        return [f"{where}: compile error: {compiled.error}"]
    found = []
    limits = LIMITS[compiled.target]
    if launch.paper and (compiled.spill_stores or compiled.spill_loads):
        found.append(
            f"{where}: spills {compiled.spill_stores} bytes stored / {compiled.spill_loads} loaded at the paper's sizes"
        )
    if compiled.smem > limits.smem_per_block:
        found.append(
            f"{where}: {compiled.smem} bytes of shared memory, over {limits.smem_per_block} per block"
        )
    if compiled.blocks_per_sm < 1:
        found.append(
            f"{where}: no block fits on an SM ({compiled.registers} registers x {32 * launch.options['num_warps']} "
            f"threads, {compiled.smem} bytes shared memory; limited by {compiled.limited_by})"
        )
    return found


_WORK: list[Launch] = []  # the launches a forked compile worker reads by index


def _compile_index(task: tuple[int, str]) -> tuple[int, str, Compiled]:
    index, target = task
    return index, target, compile_launch(_WORK[index], target)


def run(which: str = "full", mode: str = "pairwise", targets=tuple(TARGETS), workers: int = 1) -> dict:
    """Capture the launches of the set ``which``, compile each distinct one for every target, and
    return the report (what :func:`main` writes as JSON)."""
    import triton

    started = time.perf_counter()
    with capture_launches() as captured:
        calls = drive(which, mode)
    launches = sorted(captured.values(), key=lambda la: (la.kernel, not la.paper, la.label))
    _WORK[:] = launches
    tasks = [(i, t) for i in range(len(launches)) for t in targets]
    with tempfile.TemporaryDirectory(prefix="lstmem-aot-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # nothing left behind; always_compile bypasses reads anyway
        if workers > 1 and len(tasks) > 1:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                done = pool.map(_compile_index, tasks, chunksize=1)
        else:
            done = [_compile_index(task) for task in tasks]
    results = [{} for _ in launches]
    for index, target, compiled in done:
        results[index][target] = compiled
    found, rows = [], []
    for launch, per_target in zip(launches, results, strict=True):
        for target in targets:
            found += problems(launch, per_target[target])
        rows.append(
            {
                "kernel": launch.kernel,
                "describe": launch.describe(),
                "label": launch.label,
                "paper": launch.paper,
                "count": launch.count,
                "spec": launch.spec(),
                "attrs": {str(k): v for k, v in launch.attrs.items()},
                "options": launch.options,
                "targets": {t: {**asdict(c), "smem": c.smem} for t, c in per_target.items()},
            }
        )
    defined = defined_kernels()
    return {
        "set": which,
        "grid": mode,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs), no GPU",
        "date": datetime.date.today().isoformat(),
        "calls": calls,
        "launches": sum(la.count for la in launches),
        "distinct": len(launches),
        "distinct_coarse": len({la.coarse_key for la in launches}),
        "kernels_defined": defined,
        "kernels_seen": sorted({la.kernel for la in launches}),
        "targets": list(targets),
        "seconds": round(time.perf_counter() - started, 1),
        "problems": found,
        "results": rows,
    }


def kernel_resources(report: dict, kernel: str, target: str) -> tuple[int, dict | None]:
    """``kernel``'s distinct launches in ``report`` (what :func:`run` returns) and, over those that
    compiled for ``target``: the least and most ``registers`` per thread, the largest ``spill`` (bytes
    stored plus loaded per thread), the most ``smem`` per block and the fewest ``blocks_per_sm``
    (``None`` when none compiled)."""
    rows = [r for r in report["results"] if r["kernel"] == kernel]
    compiled = [r["targets"][target] for r in rows if not r["targets"][target]["error"]]
    if not compiled:
        return len(rows), None
    registers = [c["registers"] for c in compiled]
    return len(rows), {
        "registers": (min(registers), max(registers)),
        "spill": max(c["spill_stores"] + c["spill_loads"] for c in compiled),
        "smem": max(c["smem"] for c in compiled),
        "blocks_per_sm": min(c["blocks_per_sm"] for c in compiled),
    }


def _summary(report: dict) -> str:
    lines = [
        f"Triton {report['triton']}, set {report['set']} ({report['grid']}): {report['calls']} calls, "
        f"{report['launches']} launches, {report['distinct']} distinct binaries "
        f"({report['distinct_coarse']} by kernel, signature, constexprs, num_warps), "
        f"{len(report['targets'])} targets, {report['seconds']} s",
        f"{'kernel':<24} {'target':<7} {'n':>4} {'regs':>9} {'spill':>6} {'smem B':>8} {'blocks/SM':>10}",
    ]
    for kernel in report["kernels_seen"]:
        for target in report["targets"]:
            n, k = kernel_resources(report, kernel, target)
            if k is None:
                lines.append(f"{kernel.split(':')[1]:<24} {target:<7} {n:>4} compile errors")
                continue
            lines.append(
                f"{kernel.split(':')[1]:<24} {target:<7} {n:>4} {k['registers'][0]:>4}-{k['registers'][1]:<4}"
                f" {k['spill']:>6} {k['smem']:>8} {k['blocks_per_sm']:>10}"
            )
    lines += [f"PROBLEM: {p}" for p in report["problems"]] or ["no problems"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lstmem_kernels.aot", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--set", dest="which", default="full", choices=("fast", "paper", "edge", "full"))
    parser.add_argument("--grid", default="pairwise", choices=("pairwise", "product"))
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated: sm_90a, sm_80")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--json", help="write the whole report (every distinct launch) here")
    args = parser.parse_args(argv)
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    unknown = set(targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; choose among {sorted(TARGETS)}")
    report = run(args.which, args.grid, targets, args.workers)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1, default=str)
    print(_summary(report))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
