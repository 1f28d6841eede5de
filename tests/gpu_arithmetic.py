"""The float32 arithmetic of an NVIDIA GPU, emulated inside Triton's interpreter (``TRITON_INTERPRET=1``).

The interpreter evaluates a kernel's operations with numpy: correctly rounded ``exp``, ``/`` and
``sqrt``, a separate rounding for every multiply and add, and a float32 -> bfloat16 cast that truncates.
Compiled for a GPU (Triton 3.9.0, PTX for sm_90; checked on 2026-11-27 by compiling this project's
``_step_kernel`` and ``_decode_step_kernel``, and a small kernel for ``tl.exp2`` and ``tl.rsqrt``, on a
CPU), the same operations become, and are emulated here as:

* ``tl.exp(x)``: ``mul.f32 t, x, 0f3FB8AA3B`` (log2 e rounded to float32), then ``ex2.approx.f32 t``;
  emulated as that float32 product, then ``ex2`` below.
* ``tl.exp2(x)``: ``ex2.approx.ftz.f32``; the IEEE ``2^x`` moved by 2 ulps, subnormals flushed.
* ``x / y`` on float32: ``div.full.f32``; the IEEE quotient moved by 2 ulps.
* ``tl.sqrt(x)``: ``sqrt.approx.ftz.f32``; the exact root times ``1 +- 2^-23``, rounded, subnormals
  flushed. ``tl.rsqrt(x)``: ``rsqrt.approx.ftz.f32``; likewise with ``2^-22.9``.
* ``a * b + c``, ``c - a * b`` (a product used by an add or subtract): ``fma.rn.f32``, since LLVM
  contracts them (Triton 3.9's default ``enable_fp_fusion``); one rounding of the exact result.
* ``x.to(tl.bfloat16)`` and stores of float32 into bfloat16: ``cvt.rn.bf16.f32``; round to nearest,
  ties to even.

What the PTX ISA documents (section 9.7.3, "Floating Point Instructions"; paraphrased):

* 9.7.3.21 ``ex2``: the approximate result is within 2 ulps of the correctly rounded one over the whole
  input range (older editions gave a relative error near 2^-22.5, a tighter figure); the ``.ftz`` form
  flushes subnormal inputs and results to a zero of the same sign.
* 9.7.3.8 ``div``: ``div.full.f32`` scales its operands for accuracy but is not IEEE compliant; its
  error is at most 2 ulps over the full input range.
* 9.7.3.15 ``sqrt``: ``sqrt.approx.f32`` has a relative error of at most 2^-23 over all positive finite
  inputs; 9.7.3.16 ``rsqrt``: at most 2^-22.9.
* 9.7.3.6 ``fma``: ``fma.rn.f32`` computes ``a * b + c`` to infinite precision and rounds once.

Each approximation is applied at its documented worst every time (for ``div`` and ``ex2`` on top of the
correct rounding's half ulp), in a fixed direction chosen so that the errors add up in the kernels'
expressions instead of cancelling: ``ex2`` results are made larger and quotients smaller in magnitude,
so ``1 / (1 + exp(-x))`` and ``2 / (1 + exp(-2x)) - 1`` are both pushed down, and square roots are made
larger, so ``t / sqrt(sum t^2)`` shrinks. ``reverse=True`` flips every direction. A GPU's errors are
mostly smaller and of varying sign; a tolerance that holds in both directions here is expected to hold
there, but this is an emulation of documented bounds, not a run on a GPU.

Not emulated (the interpreter's arithmetic stays): ``tl.sum`` and other reductions (numpy's pairwise
float32 sum; the GPU adds in its own order and fuses products into the additions, both within the
usual ``gamma(n)`` bound), other math functions (``tl.log`` and the like, which this project's kernels
do not use), the correctly rounded ``tl.math.div_rn`` and ``tl.sqrt_rn``, and float16 arithmetic (the
kernels compute in float32). This project's kernels use ``tl.exp``, ``/``, ``tl.sqrt``, multiply-adds,
``tl.sum``, ``tl.minimum``/``tl.maximum``/``tl.where`` (exact) and casts; ``tanh`` and the sigmoid are
written out with ``tl.exp`` and ``/``.

Use :func:`emulated_gpu_arithmetic` as a context manager around kernel launches, or set
``LSTMEM_EMULATE_GPU_ARITH=1`` (``reversed`` flips the directions) to have ``tests/conftest.py`` install
it for a whole pytest session. :class:`ToleranceRatios` is a pytest plugin reporting how close each
test's closeness checks came to their tolerances (``LSTMEM_TOLERANCE_RATIOS=1``, also in conftest).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest

#: what ``tl.exp`` multiplies by before ``ex2`` (the PTX constant ``0f3FB8AA3B``, log2(e) in float32)
LOG2E_F32 = np.float32(math.log2(math.e))
EX2_ULPS = 2  # PTX ISA 9.7.3.21: within 2 ulps of the correctly rounded result
DIV_ULPS = 2  # PTX ISA 9.7.3.8: div.full.f32, at most 2 ulps
SQRT_REL = 2.0**-23  # PTX ISA 9.7.3.15: sqrt.approx.f32, relative error at most 2^-23
RSQRT_REL = 2.0**-22.9  # PTX ISA 9.7.3.16: rsqrt.approx.f32, relative error at most 2^-22.9
SMALLEST_NORMAL = np.finfo(np.float32).tiny

# The builder methods replaced (class attributes of triton.runtime.interpreter.InterpreterBuilder).
_REPLACED = (
    "create_exp",
    "create_exp2",
    "create_fdiv",
    "create_approx_divf",
    "create_sqrt",
    "create_rsqrt",
    "create_fmul",
    "create_fadd",
    "create_fsub",
    "cast_impl",
)
_MARK = "_lstmem_gpu_emulation"  # set on every replacement, so that is_active() can tell


def _builder_class():
    from lstmem_kernels.triton_common import INTERPRETED

    if not INTERPRETED:
        raise RuntimeError(
            "the GPU arithmetic emulation replaces operations of Triton's interpreter, which is not in "
            "use: set TRITON_INTERPRET=1 before triton is imported (tests/conftest.py does so when no "
            "GPU is present); on a GPU the kernels already run with the real instructions"
        )
    from triton.runtime.interpreter import InterpreterBuilder

    return InterpreterBuilder


def is_active() -> bool:
    """Whether the interpreter currently runs with the emulated GPU arithmetic."""
    return getattr(_builder_class().create_exp, _MARK, False)


# ---------------------------------------------------------------------- the emulated instructions
def _f32(x) -> bool:
    return np.asarray(x).dtype == np.float32


def step_ulps(y: np.ndarray, ulps: int, away_from_zero: bool) -> np.ndarray:
    """``y`` (float32) moved by ``ulps`` units in the last place, away from zero or toward it; zeros,
    infinities and NaNs are left as they are."""
    y = np.array(y, dtype=np.float32)
    movable = np.isfinite(y) & (y != 0)
    target = np.copysign(np.float32(np.inf), y) if away_from_zero else np.zeros_like(y)
    for _ in range(ulps):
        y = np.where(movable, np.nextafter(y, target), y)
    return y


def flush_subnormals(x: np.ndarray) -> np.ndarray:
    """Subnormal float32 values replaced by a zero of the same sign (the PTX ``.ftz`` modifier)."""
    x = np.asarray(x, dtype=np.float32)
    return np.where(np.abs(x) < SMALLEST_NORMAL, np.copysign(np.float32(0), x), x)


def ex2_approx(t: np.ndarray, up: bool, ftz: bool = False) -> np.ndarray:
    """``ex2.approx{.ftz}.f32``: ``2^t`` correctly rounded to float32, then moved by ``EX2_ULPS``."""
    if ftz:
        t = flush_subnormals(t)
    exact = np.exp2(np.asarray(t, dtype=np.float64)).astype(np.float32)
    y = step_ulps(exact, EX2_ULPS, away_from_zero=up)
    return flush_subnormals(y) if ftz else y


def exp_approx(x: np.ndarray, up: bool) -> np.ndarray:
    """``tl.exp`` on the GPU: ``ex2.approx.f32(x * log2(e))`` with the product rounded to float32."""
    with np.errstate(over="ignore"):  # |x| > 2.4e38: the product is infinite, as on the GPU
        return ex2_approx(np.asarray(x, dtype=np.float32) * LOG2E_F32, up)


def div_full(a: np.ndarray, b: np.ndarray, larger: bool) -> np.ndarray:
    """``div.full.f32``: the IEEE float32 quotient moved by ``DIV_ULPS``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.divide(a, b, dtype=np.float32)
    return step_ulps(q, DIV_ULPS, away_from_zero=larger)


def sqrt_approx(x: np.ndarray, larger: bool, reciprocal: bool = False) -> np.ndarray:
    """``sqrt.approx.ftz.f32`` (or ``rsqrt``): the exact value times ``1 +- bound``, rounded to
    float32, subnormal inputs and results flushed."""
    x = flush_subnormals(x).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        exact = 1.0 / np.sqrt(x) if reciprocal else np.sqrt(x)
    bound = RSQRT_REL if reciprocal else SQRT_REL
    return flush_subnormals((exact * (1 + bound if larger else 1 - bound)).astype(np.float32))


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 rounded to nearest, ties to even (``cvt.rn.bf16.f32``), as uint16 bits."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet_nan = (bits >> np.uint32(16)) | np.uint32(0x40)
    return np.where(np.isnan(x), quiet_nan, rounded).astype(np.uint16)


# ---------------------------------------------------------------------- the builder methods
def _replacements(original: dict, reverse: bool, counts: Counter) -> dict:
    """Builder methods using the emulations for float32 operands, ``original`` for anything else;
    each emulated operation is counted in ``counts`` (``exp``, ``exp2``, ``div``, ``sqrt``, ``rsqrt``,
    ``fma``, ``bf16``)."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    up = not reverse  # ex2 and sqrt larger, quotients smaller (module docstring); reverse flips all

    def unary(name, fn):
        def method(self, arg):
            if not _f32(arg.data):
                return original[f"create_{name}"](self, arg)
            counts[name] += 1
            return TensorHandle(fn(arg.data), arg.dtype.scalar)

        return method

    def create_fdiv(self, lhs, rhs):
        if not _f32(lhs.data):
            return original["create_fdiv"](self, lhs, rhs)
        counts["div"] += 1
        return TensorHandle(div_full(lhs.data, rhs.data, larger=not up), lhs.dtype.scalar)

    # Contraction: a product remembers its factors; an add or subtract that uses it rounds once.
    def create_fmul(self, lhs, rhs):
        out = original["create_fmul"](self, lhs, rhs)
        if _f32(out.data):
            out.fma_factors = (lhs, rhs)
        return out

    def fused(self, product, sign, other):
        """``sign * (a b) + other`` with one rounding (``fma.rn.f32``)."""
        counts["fma"] += 1
        a, b = product.fma_factors
        if sign < 0:
            a = TensorHandle(np.negative(a.data), a.dtype)
        return self.create_fma(a, b, other)

    def create_fadd(self, lhs, rhs):
        if _f32(lhs.data) and _f32(rhs.data):
            if hasattr(rhs, "fma_factors"):
                return fused(self, rhs, +1, lhs)
            if hasattr(lhs, "fma_factors"):
                return fused(self, lhs, +1, rhs)
        return original["create_fadd"](self, lhs, rhs)

    def create_fsub(self, lhs, rhs):
        if _f32(lhs.data) and _f32(rhs.data):
            if hasattr(rhs, "fma_factors"):
                return fused(self, rhs, -1, lhs)
            if hasattr(lhs, "fma_factors"):
                return fused(self, lhs, +1, TensorHandle(np.negative(rhs.data), rhs.dtype))
        return original["create_fsub"](self, lhs, rhs)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            counts["bf16"] += 1
            return TensorHandle(bfloat16_bits(src.data), tl.bfloat16)
        return original["cast_impl"](self, src, dst_type)

    methods = {
        "create_exp": unary("exp", lambda x: exp_approx(x, up)),
        "create_exp2": unary("exp2", lambda x: ex2_approx(x, up, ftz=True)),
        "create_sqrt": unary("sqrt", lambda x: sqrt_approx(x, larger=up)),
        "create_rsqrt": unary("rsqrt", lambda x: sqrt_approx(x, larger=not up, reciprocal=True)),
        "create_fdiv": create_fdiv,
        "create_approx_divf": create_fdiv,  # div.approx.f32: also within 2 ulps (normal denominators)
        "create_fmul": create_fmul,
        "create_fadd": create_fadd,
        "create_fsub": create_fsub,
        "cast_impl": cast_impl,
    }
    for method in methods.values():
        setattr(method, _MARK, True)
    return methods


@contextlib.contextmanager
def emulated_gpu_arithmetic(reverse: bool = False) -> Iterator[Counter]:
    """Run every Triton kernel launched inside the block with the GPU's float32 arithmetic emulated
    (module docstring). ``reverse``: move every approximation the other way. Yields a ``Counter`` of
    the emulated operations executed (one count per operation on a tile, not per element). Restores
    the interpreter's own methods on exit; nesting is allowed."""
    cls = _builder_class()
    saved = {name: cls.__dict__[name] for name in _REPLACED}
    counts = Counter()
    for name, method in _replacements(saved, reverse, counts).items():
        setattr(cls, name, method)
    try:
        yield counts
    finally:
        for name, method in saved.items():
            setattr(cls, name, method)


def session_mode() -> str | None:
    """The value of ``LSTMEM_EMULATE_GPU_ARITH``: ``None`` (unset, empty or ``0``), ``"documented"``
    (``1``) or ``"reversed"``; anything else raises ``ValueError``."""
    value = os.environ.get("LSTMEM_EMULATE_GPU_ARITH", "").strip().lower()
    if value in ("", "0"):
        return None
    if value in ("1", "reversed"):
        return "documented" if value == "1" else "reversed"
    raise ValueError(
        f"LSTMEM_EMULATE_GPU_ARITH={value!r}: expected 1 (on), reversed (on, errors the other way) or 0"
    )


# ---------------------------------------------------------------------- measuring the tolerances' margin
def _ratio(actual, expected, allowed) -> float:
    """``max |actual - expected| / allowed`` (``inf`` where a difference meets a zero allowance)."""
    import torch

    diff = (actual.detach().double() - expected.detach().double()).abs()
    diff = torch.where(torch.isnan(diff) & actual.isnan() & expected.isnan(), 0.0, diff)
    if diff.numel() == 0:
        return 0.0
    allowed = torch.as_tensor(allowed, dtype=torch.float64).expand_as(diff)
    ratio = torch.where(allowed > 0, diff / allowed.clamp_min(1e-300), torch.where(diff > 0, math.inf, 0.0))
    return ratio.max().item()


class ToleranceRatios:
    """pytest plugin: for every test, the largest ``error / allowed error`` over its closeness checks
    (``torch.testing.assert_close`` with explicit ``atol`` and ``rtol``: ``|a - e| / (atol + rtol |e|)``;
    a test module's ``assert_within(got, want, bound, name, scale)``: ``|got - want| / (scale bound)``),
    printed at the end of the run. A ratio above 1 is a failed check."""

    def __init__(self):
        self.worst: dict[str, float] = {}

    def _note(self, nodeid: str, ratio: float) -> None:
        self.worst[nodeid] = max(self.worst.get(nodeid, 0.0), ratio)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        import torch

        monkey = pytest.MonkeyPatch()
        close = torch.testing.assert_close

        def assert_close(actual, expected, *args, atol=None, rtol=None, **kwargs):
            if atol is not None and rtol is not None and isinstance(actual, torch.Tensor):
                self._note(
                    item.nodeid, _ratio(actual, expected, atol + rtol * expected.detach().double().abs())
                )
            return close(actual, expected, *args, atol=atol, rtol=rtol, **kwargs)

        monkey.setattr(torch.testing, "assert_close", assert_close)
        within = getattr(item.module, "assert_within", None)
        if within is not None:
            signature = inspect.signature(within)

            def assert_within(*args, **kwargs):
                call = signature.bind(*args, **kwargs)
                call.apply_defaults()
                a = call.arguments
                self._note(item.nodeid, _ratio(a["got"], a["want"], a["scale"] * a["bound"].double()))
                return within(*args, **kwargs)

            monkey.setattr(item.module, "assert_within", assert_within)
        try:
            yield
        finally:
            monkey.undo()

    def pytest_terminal_summary(self, terminalreporter):
        write = terminalreporter.write_line
        mode = session_mode() or "off"
        terminalreporter.section(f"worst error / tolerance per test (GPU arithmetic emulation: {mode})")
        for nodeid, ratio in sorted(self.worst.items()):
            write(f"{ratio:10.4g}  {nodeid}")
