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
:func:`pairwise`) plus every factor's all-on and all-off extremes; ``--grid product`` runs the whole
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

No transformers import: this module needs torch and triton only.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import io
import itertools
import json
import math
import multiprocessing
import os
import pkgutil
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

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
    "pairwise",
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


# ---------------------------------------------------------------------- capture
@dataclass
class Launch:
    """One distinct kernel launch as Triton would compile it (``fn`` the ``JITFunction``)."""

    kernel: str  # "module:qualname"
    signature: dict  # parameter name -> Triton type ("*fp32", "i32", "constexpr", ...)
    constexprs: dict  # parameter index path (tuple) -> value
    attrs: dict  # parameter index path (tuple) -> [[attribute, value], ...]
    options: dict  # num_warps, num_stages, num_ctas, enable_fp_fusion
    fn: object = field(repr=False, compare=False)
    label: str = ""  # the first call (scenario) that made it
    paper: bool = False  # made at the paper's sizes
    count: int = 0  # how many launches had this key

    @property
    def key(self) -> str:
        """Everything that selects a binary."""
        return repr((self.kernel, self.spec(), sorted(self.attrs.items()), sorted(self.options.items())))

    @property
    def coarse_key(self) -> str:
        return repr((self.kernel, self.spec(), self.options["num_warps"]))

    def spec(self) -> dict:
        """Signature and constexprs by parameter name (``{"T": "i32", "HAS_DEPTH": True, ...}``)."""
        names = list(self.signature)
        out = {}
        for name, ty in self.signature.items():
            out[name] = ty
        for path, value in self.constexprs.items():
            name = ".".join([names[path[0]], *map(str, path[1:])])
            out[name] = value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
        return out

    def describe(self) -> str:
        """A short, version-independent description: pointer dtypes, true flags, other constexprs."""
        spec = self.spec()
        dtypes = sorted({ty[1:] for ty in spec.values() if isinstance(ty, str) and ty.startswith("*")})
        flags = [n for n, v in spec.items() if v is True]
        values = [f"{n}={v}" for n, v in spec.items() if n in _constexpr_names(self) and type(v) is int]
        parts = ["/".join(dtypes), *flags, *values, f"warps={self.options['num_warps']}"]
        return " ".join(p for p in parts if p)


def _constexpr_names(launch: Launch) -> set[str]:
    return {n for n, ty in launch.signature.items() if ty == "constexpr"}


class _StandInDriver:
    """The parts of Triton's driver interface that the JIT launch path asks for before it compiles
    (the launch itself never happens: the cache hook stops it)."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    @classmethod
    def is_active(cls):
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_capability(self, device=None):
        return divmod(self.target.arch, 10)

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_benchmarker(self):
        raise RuntimeError("lstmem_kernels.aot's stand-in driver launches nothing and benchmarks nothing")


# the scenario being driven, and whether it is at the paper's sizes
_LABEL: list[tuple[str, bool]] = [("", False)]


@contextlib.contextmanager
def scenario(label: str, paper: bool) -> Iterator[None]:
    """Label the launches captured inside (``paper``: at the paper's sizes)."""
    _LABEL.append((label, paper))
    try:
        yield
    finally:
        _LABEL.pop()


def _kernel_modules() -> list:
    """Every module of ``lstmem_kernels`` (imported, subpackages included; this one aside): the
    Triton members of the op families and their shared helpers are among them."""
    import lstmem_kernels

    names = [m.name for m in pkgutil.walk_packages(lstmem_kernels.__path__, "lstmem_kernels.")]
    return [importlib.import_module(name) for name in names if name != __name__]


def defined_kernels() -> list[str]:
    """Every ``@triton.jit`` function defined (not imported) in a module of ``lstmem_kernels``, as
    ``"module:qualname"``."""
    import triton

    found = []
    for module in _kernel_modules():
        for value in vars(module).values():
            if isinstance(value, triton.runtime.jit.JITFunction) and value.fn.__module__ == module.__name__:
                found.append(f"{module.__name__}:{value.fn.__qualname__}")
    return sorted(set(found))


@contextlib.contextmanager
def capture_launches(arch: int = 90) -> Iterator[dict[str, Launch]]:
    """Within the block, Triton launches of this process are recorded (deduplicated, in the yielded
    dict keyed by :attr:`Launch.key`) instead of compiled and run, and the kernels' host code accepts
    CPU tensors as stand-ins for device tensors (module docstring).

    Raises:
        RuntimeError: when the kernels were imported under the interpreter (``TRITON_INTERPRET=1``).
    """
    import triton
    from triton.runtime.driver import driver

    from . import triton_common

    if triton_common.INTERPRETED:
        raise RuntimeError(
            "lstmem_kernels was imported under the Triton interpreter (TRITON_INTERPRET=1), so its kernels "
            "are not compilable JITFunctions; run the ahead-of-time compile in a process without "
            "TRITON_INTERPRET (python -m lstmem_kernels.aot)"
        )
    _kernel_modules()  # every kernel module loaded, so every reference to the device check is found
    launches: dict[str, Launch] = {}

    def hook(*, fn, compile, **_):
        label, paper = _LABEL[-1]
        launch = Launch(
            kernel=f"{fn.jit_function.fn.__module__}:{fn.jit_function.fn.__qualname__}",
            signature=dict(compile["signature"]),
            constexprs=dict(compile["constants"]),
            attrs=dict(compile["configs"][0]),
            options={
                "num_warps": compile["num_warps"],
                "num_stages": compile["num_stages"],
                "num_ctas": compile["num_ctas"],
                "enable_fp_fusion": compile["enable_fp_fusion"],
            },
            fn=fn.jit_function,
            label=label,
        )
        launch = launches.setdefault(launch.key, launch)
        launch.count += 1
        launch.paper |= paper
        return True  # skip the compile and the launch

    original_check = triton_common.check_runtime
    patched = [
        (module, name)
        for module in list(sys.modules.values())
        if getattr(module, "__name__", "").startswith("lstmem_kernels")
        for name, value in list(vars(module).items())
        if value is original_check
    ]
    previous_hook = triton.knobs.runtime.jit_cache_hook
    previous_driver = driver._active  # None until a driver was asked for (none can be made without a GPU)
    driver.set_active(_StandInDriver(arch))
    triton.knobs.runtime.jit_cache_hook = hook
    for module, name in patched:
        setattr(module, name, _accept_any_device)
    try:
        yield launches
    finally:
        for module, name in patched:
            setattr(module, name, original_check)
        triton.knobs.runtime.jit_cache_hook = previous_hook
        driver.set_active(previous_driver)


def _accept_any_device(device: torch.device) -> None:
    """The capture's stand-in for ``triton_common.check_runtime``: CPU tensors stand for device ones."""


# ---------------------------------------------------------------------- covering the flags
def pairwise(factors: dict[str, list]) -> list[dict]:
    """Rows (one value per factor) in which every pair of values of two factors appears at least once,
    plus the row of every factor's first value and the row of every last value (the factors below list
    their lightest value first and their heaviest last: flags off, then on); greedy, deterministic.

    >>> rows = pairwise({"a": [0, 1], "b": [0, 1], "c": [0, 1, 2]})
    >>> all(any(r["a"] == x and r["c"] == z for r in rows) for x in (0, 1) for z in (0, 1, 2))
    True
    """
    names = list(factors)
    rows = [{n: factors[n][0] for n in names}, {n: factors[n][-1] for n in names}]
    uncovered = {
        (a, i, b, j)
        for a, b in itertools.combinations(range(len(names)), 2)
        for i in range(len(factors[names[a]]))
        for j in range(len(factors[names[b]]))
    }

    def cover(row_idx: list[int]) -> None:
        for a, b in itertools.combinations(range(len(names)), 2):
            uncovered.discard((a, row_idx[a], b, row_idx[b]))

    for row in rows:
        cover([factors[n].index(row[n]) for n in names])
    while uncovered:
        a, i, b, j = min(uncovered)
        choice = {a: i, b: j}
        for c in range(len(names)):
            if c in choice:
                continue

            best, best_gain = 0, -1
            for v in range(len(factors[names[c]])):
                g = sum(((c, v, d, e) if c < d else (d, e, c, v)) in uncovered for d, e in choice.items())
                if g > best_gain:
                    best, best_gain = v, g
            choice[c] = best
        idx = [choice[c] for c in range(len(names))]
        cover(idx)
        rows.append({n: factors[n][k] for n, k in zip(names, idx, strict=True)})
    unique = {repr(sorted(r.items(), key=lambda kv: kv[0])): r for r in rows}
    return list(unique.values())


def extremes(factors: dict[str, list]) -> list[dict]:
    """The row of every factor's first (lightest) value and the row of every last (heaviest) one."""
    return [{n: v[0] for n, v in factors.items()}, {n: v[-1] for n, v in factors.items()}]


def _grid(factors: dict[str, list], mode: str) -> list[dict]:
    if mode == "product":
        return [dict(zip(factors, values, strict=True)) for values in itertools.product(*factors.values())]
    return pairwise(factors)


# ---------------------------------------------------------------------- driving the public entry points
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
PAPER = {"H": 4, "R": 8, "d": 2560, "T": 2048}


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def _scan(B, T, H, R, dtype, depth, valid, initial, grad, label, paper) -> None:
    """One ``lstmem_scan(..., backend="triton")`` call, and its backward when ``grad`` names a loss:
    ``"all"`` (every output, every input with a gradient), ``"read"`` (the reads; depth without a
    gradient) or ``"finals"`` (the final states only)."""
    from . import lstmem_scan

    dt = DTYPES[dtype]
    vecs = [_rand(B, T, H, R, dtype=dt) for _ in range(5)]
    dep = _rand(B, T, H, R, R, dtype=dt) if depth else None
    keep = (torch.rand(B, T) > 0.25) if valid else None
    c0 = d0 = None
    if initial:
        c0, d0 = (_rand(B, H, R, R, dtype=DTYPES[initial]) for _ in range(2))
    with scenario(label, paper):
        if grad == "none":
            with torch.no_grad():
                lstmem_scan(*vecs, dep, keep, c0, d0, backend="triton")
            return
        for t in vecs:
            t.requires_grad_()
        if dep is not None and grad == "all":
            dep.requires_grad_()
        for t in (c0, d0):
            if t is not None and grad != "read":
                t.requires_grad_()
        read, hidden, cell_T, hidden_T = lstmem_scan(*vecs, dep, keep, c0, d0, backend="triton")
        terms = {"all": (read, hidden, cell_T, hidden_T), "read": (read,), "finals": (cell_T, hidden_T)}[grad]
        sum(t.float().sum() for t in terms).backward()


def _step(B, H, R, dtype, state, depth, valid, strided, query, out, label, paper) -> None:
    """One ``lstmem_step(..., backend="triton")`` call (in place, or into ``out``)."""
    from . import lstmem_step

    dt = DTYPES[dtype]
    q, k, w, f, o = (_rand(B, H, R, dtype=dt) for _ in range(5))
    cell, hidden = (_rand(B, H, R, R, dtype=DTYPES[state]) for _ in range(2))
    if strided:  # states as the transposes of contiguous tensors
        cell, hidden = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (cell, hidden))
    dep = _rand(B, H, R, R, dtype=dt) if depth else None
    keep = torch.arange(B) % 2 == 0 if valid else None
    target = (torch.empty(B, H, R, R), torch.empty(B, H, R, R)) if out else None
    with scenario(label, paper), torch.no_grad():
        lstmem_step(q if query else None, k, w, f, o, cell, hidden, dep, keep, backend="triton", out=target)


def _decode(B, d, H, R, dtype, weights, state, depth, valid, slots, seq, label, paper) -> None:
    """One ``lstmem_decode_step`` call with the layer's weight shapes; ``slots`` ``"int64"`` or
    ``"int32"``: state tables of ``2 B + 3`` rows stepped in place."""
    from . import lstmem_decode_step

    ds = H * R
    wdt = DTYPES[dtype if weights == "like-x" else weights]
    x = _rand(B, d, dtype=DTYPES[dtype])
    w_in, b_in = _rand(d, 4 * ds, dtype=wdt), _rand(4 * ds, dtype=wdt)
    eau = _rand((4 if depth else 2) * ds, 6 * ds, dtype=wdt)
    b_eau, read = _rand(6 * ds, dtype=wdt), _rand(2 * ds, ds, dtype=wdt)
    rows = 2 * B + 3 if slots else B
    cell, hidden = (_rand(rows, H, R, R, dtype=DTYPES[state]) for _ in range(2))
    index = None
    if slots:
        index = torch.randperm(rows)[:B].to(getattr(torch, slots))
        target = (cell, hidden)  # the serving engine's in-place slot step
    else:
        target = (torch.empty_like(cell), torch.empty_like(hidden))
    dep = _rand(B, H, R, R, dtype=DTYPES[dtype]) if depth else None
    keep = torch.arange(B) % 2 == 0 if valid else None
    hidden_seq = torch.empty(B, H, R, R) if seq else None
    with scenario(label, paper), torch.no_grad():
        lstmem_decode_step(
            x,
            w_in,
            b_in,
            eau,
            b_eau,
            read,
            cell,
            hidden,
            num_heads=H,
            out=target,
            depth=dep,
            valid=keep,
            norm_eps=1e-6,
            slots=index,
            hidden_seq=hidden_seq,
        )


FLAGS = [False, True]
SCAN_FLAGS = {
    "dtype": ["f32", "bf16", "f16"],
    "depth": FLAGS,
    "valid": FLAGS,
    "initial": [None, "bf16", "f32"],
    "grad": ["none", "read", "finals", "all"],
}
STEP_FLAGS = {
    "dtype": ["f32", "bf16", "f16"],
    "state": ["f32", "bf16"],
    "depth": FLAGS,
    "valid": FLAGS,
    "strided": FLAGS,
    "query": [False, True],
    "out": FLAGS,
}
DECODE_FLAGS = {
    "dtype": ["f32", "bf16", "f16"],
    "weights": ["like-x", "f32"],
    "state": ["f32", "bf16"],
    "depth": FLAGS,
    "valid": FLAGS,
    "slots": [None, "int32", "int64"],
    "seq": FLAGS,
}


def _label(entry: str, sizes: dict, row: dict) -> str:
    parts = [f"{k}={v}" for k, v in sizes.items()]
    parts += [k if v is True else f"{k}={v}" for k, v in row.items() if v not in (False, None)]
    return f"{entry} " + " ".join(parts)


def _calls(which: str, mode: str) -> list[tuple[Callable, dict]]:
    """``(function, kwargs)`` for every call of the set ``which`` (``fast``, ``paper``, ``edge``, ``full``)."""
    calls = []

    def add(fn, entry, sizes, rows, paper):
        for row in rows:
            calls.append((fn, {**sizes, **row, "label": _label(entry, sizes, row), "paper": paper}))

    H, R, d, T = PAPER["H"], PAPER["R"], PAPER["d"], PAPER["T"]
    if which == "fast":
        heavy_scan = {"depth": True, "valid": True, "initial": "f32", "grad": "all"}
        for dtype in ("f32", "bf16"):
            add(_scan, "scan", {"B": 1, "T": T, "H": H, "R": R}, [{"dtype": dtype, **heavy_scan}], True)
        add(_scan, "scan", {"B": 2, "T": 1, "H": 2, "R": 5}, [{"dtype": "f32", **heavy_scan}], False)
        add(
            _step,
            "step",
            {"B": 4, "H": H, "R": R},
            [dict(dtype="bf16", state="f32", depth=True, valid=True, strided=False, query=True, out=False)],
            True,
        )
        add(
            _decode,
            "decode",
            {"B": 8, "d": d, "H": H, "R": R},
            [{**extremes(DECODE_FLAGS)[1], "dtype": "bf16", "weights": "like-x", "state": "f32"}],
            True,
        )
        return calls
    if which in ("paper", "full"):
        for B in (1, 4):
            add(_scan, "scan", {"B": B, "T": T, "H": H, "R": R}, _grid(SCAN_FLAGS, mode), True)
        for B in (1, 8):
            add(_step, "step", {"B": B, "H": H, "R": R}, _grid(STEP_FLAGS, mode), True)
            add(_decode, "decode", {"B": B, "d": d, "H": H, "R": R}, _grid(DECODE_FLAGS, mode), True)
    if which in ("edge", "full"):  # shapes, not flags: every factor's lightest and heaviest values
        for T_edge, R_edge, H_edge in ((1, 5, 2), (63, 6, 1), (2049, 8, 1), (63, 8, 3)):
            sizes = {"B": 2, "T": T_edge, "H": H_edge, "R": R_edge}
            add(_scan, "scan", sizes, extremes(SCAN_FLAGS), False)
        for R_edge in (5, 6):
            add(_step, "step", {"B": 3, "H": 2, "R": R_edge}, extremes(STEP_FLAGS), False)
            add(_decode, "decode", {"B": 3, "d": 300, "H": 3, "R": R_edge}, extremes(DECODE_FLAGS), False)
    return calls


def drive(which: str = "full", mode: str = "pairwise") -> int:
    """Call the public entry points for the set ``which`` (inside :func:`capture_launches`); returns
    the number of calls."""
    calls = _calls(which, mode)
    torch.manual_seed(0)
    for fn, kwargs in calls:
        fn(**kwargs)
    return len(calls)


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
