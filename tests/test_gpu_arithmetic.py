"""The GPU arithmetic emulation (``tests/gpu_arithmetic.py``) is active and as bad as documented, and a
representative part of the kernel tests passes under it with the kernel tests' own tolerances.

The whole kernel test files run under the emulation with
``LSTMEM_EMULATE_GPU_ARITH=1 python -m pytest -q tests/test_triton_kernels.py tests/test_decode_step_kernel.py``.
"""

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from lstmem_kernels.triton_common import INTERPRETED  # noqa: E402

if not INTERPRETED:
    pytest.skip(
        "the emulation replaces the Triton interpreter's arithmetic; here kernels run on a GPU",
        allow_module_level=True,
    )

import test_decode_step_kernel as step_tests  # noqa: E402
import test_triton_kernels as kernel_tests  # noqa: E402
import triton.language as tl  # noqa: E402
from gpu_arithmetic import (  # noqa: E402
    DIV_ULPS,
    EX2_ULPS,
    SQRT_REL,
    emulated_gpu_arithmetic,
    is_active,
    session_mode,
)

U32 = 2.0**-24  # float32 unit roundoff


@triton.jit
def _ops_kernel(x_ptr, y_ptr, exp_ptr, div_ptr, sqrt_ptr, fma_ptr, bf16_ptr, N: tl.constexpr):
    """The operations the emulation replaces, elementwise on ``N`` floats ``x`` and ``y > 0``."""
    r = tl.arange(0, N)
    x = tl.load(x_ptr + r)
    y = tl.load(y_ptr + r)
    tl.store(exp_ptr + r, tl.exp(x))
    tl.store(div_ptr + r, x / y)
    tl.store(sqrt_ptr + r, tl.sqrt(y))
    tl.store(fma_ptr + r, x * y - 1.0)
    tl.store(bf16_ptr + r, x.to(tl.bfloat16))


def run_ops(x, y, reverse=None):
    """The kernel's outputs, under the emulation unless ``reverse`` is ``None``."""
    outs = [torch.empty_like(x) for _ in range(4)] + [torch.empty_like(x, dtype=torch.bfloat16)]
    if reverse is None:
        _ops_kernel[(1,)](x, y, *outs, N=x.numel())
    else:
        with emulated_gpu_arithmetic(reverse=reverse):
            assert is_active()
            _ops_kernel[(1,)](x, y, *outs, N=x.numel())
    return dict(zip(("exp", "div", "sqrt", "fma", "bf16"), outs, strict=True))


def ulps(got, exact):
    """``|got - exact|`` in float32 ulps of the exact value."""
    spacing = torch.from_numpy(np.spacing(np.abs(exact.float().numpy())).astype(np.float64))
    return (got.double() - exact).abs() / spacing


def operands(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([1 + 2**-12, -80.0, 80.0, 1e-30])
    x = torch.cat([special, torch.linspace(-0.2, 0.2, 28), 8 * torch.randn(n - 32, generator=g)])
    y = torch.exp(2 * torch.randn(n, generator=g))
    y[0] = 1 + 2**-12  # x * y - 1 rounded twice is 2^-11, the fused one 2^-11 + 2^-24
    return x, y


@pytest.mark.skipif(session_mode() is not None, reason="the session runs under the emulation")
def test_outside_the_emulation_the_interpreter_computes_in_ieee_float32():
    """The baseline the emulation departs from: numpy's correctly rounded float32 operations."""
    x, y = operands()
    plain = run_ops(x, y)
    assert not is_active()
    xd, yd = x.double(), y.double()
    assert ulps(plain["div"], xd / yd).max() <= 0.5
    assert ulps(plain["sqrt"], yd.sqrt()).max() <= 0.5
    assert plain["fma"][0].item() == 2**-11  # the product rounded, then the subtraction


@pytest.mark.parametrize("reverse", [False, True], ids=["documented", "reversed"])
def test_the_emulation_is_as_bad_as_the_ptx_bounds(reverse):
    """Each approximate instruction errs by its documented worst case, in its fixed direction; the
    fused multiply-add rounds once; bfloat16 casts round to nearest even (as torch does)."""
    x, y = operands()
    emu = run_ops(x, y, reverse=reverse)
    xd, yd = x.double(), y.double()
    up = not reverse

    # exp: ex2 of the float32 product t = x * log2(e), 2 ulps off. Rounding t (and log2 e) changes 2^t by
    # at most 2 u |x| relatively, which is at most 2 |x| ulps (an ulp is at least u times the value).
    exact = xd.exp()
    err = ulps(emu["exp"], exact)
    assert (err <= EX2_ULPS + 0.5 + 2 * xd.abs() + 1e-6).all()
    small = x.abs() < 0.25  # there the 2 ulps dominate, and their direction shows
    signed = (emu["exp"].double() - exact)[small] / (exact[small] * 2 * U32)  # at least this many ulps
    assert small.sum() >= 16 and (signed * (1 if up else -1) >= (EX2_ULPS - 1) / 2).all()

    # division: the IEEE quotient moved by exactly DIV_ULPS, toward zero (documented) or away
    ieee = (x / y).numpy()
    target = 0.0 if up else np.copysign(np.inf, ieee)
    moved = ieee.copy()
    for _ in range(DIV_ULPS):
        moved = np.nextafter(moved, target)
    moved[ieee == 0] = 0.0
    assert np.array_equal(emu["div"].numpy(), moved)

    # sqrt: relative error (1 +- 2^-23), then rounding
    rel = (emu["sqrt"].double() - yd.sqrt()) / yd.sqrt()
    assert ((rel * (1 if up else -1)) >= SQRT_REL - U32).all() and (rel.abs() <= SQRT_REL + U32).all()

    # contraction: x * y - 1 rounded once
    assert emu["fma"][0].item() == 2**-11 + 2**-24
    assert torch.equal(emu["fma"], (xd * yd - 1).float())

    # bfloat16: round to nearest even, bit for bit what torch gives (the interpreter truncates)
    assert torch.equal(emu["bf16"], x.to(torch.bfloat16))
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 3 * 2**-9), 1 + 2**-9, 3.0e38, 3.4e38, -1e-40, 0.0])
    assert torch.equal(run_ops(ties, torch.ones(8), reverse=reverse)["bf16"], ties.to(torch.bfloat16))


@triton.jit
def _tanh_sigmoid_kernel(x_ptr, tanh_ptr, sigmoid_ptr, N: tl.constexpr):
    """The kernels' inline tanh and sigmoid, written as in kernels/lstmem_kernels/step/fused.py."""
    r = tl.arange(0, N)
    x = tl.load(x_ptr + r)
    tl.store(tanh_ptr + r, 2.0 / (1.0 + tl.exp(tl.minimum(-2.0 * x, 80.0))) - 1.0)
    tl.store(sigmoid_ptr + r, 1.0 / (1.0 + tl.exp(tl.minimum(-x, 80.0))))


@pytest.mark.parametrize("reverse", [False, True], ids=["documented", "reversed"])
def test_the_inline_tanh_and_sigmoid_stay_within_the_decode_tests_budget(reverse):
    """TANH_ERR and SIGMOID_ERR of tests/test_decode_step_kernel.py (derived there: about 10 u and 5 u
    with the GPU's instructions) hold for the emulated instructions over a dense grid."""
    x = torch.linspace(-12, 12, 1 << 15)
    tanh, sigmoid = torch.empty_like(x), torch.empty_like(x)
    with emulated_gpu_arithmetic(reverse=reverse):
        _tanh_sigmoid_kernel[(1,)](x, tanh, sigmoid, N=x.numel())
    tanh_err = (tanh.double() - x.double().tanh()).abs().max().item()
    sigmoid_err = (sigmoid.double() - x.double().sigmoid()).abs().max().item()
    assert 4 * U32 < tanh_err <= 10.5 * U32 < step_tests.TANH_ERR
    assert 2 * U32 < sigmoid_err <= 5 * U32 < step_tests.SIGMOID_ERR


def test_sqrt_flushes_subnormals_and_the_emulation_is_undone_on_exit():
    tiny = torch.tensor([1e-40, 1e-39, 4.0, 2.0**-126])  # two subnormals, then normal numbers
    emu = run_ops(tiny, tiny, reverse=False)
    assert emu["sqrt"][:2].tolist() == [0.0, 0.0] and emu["sqrt"][2:].gt(0).all()
    assert is_active() == (session_mode() is not None)


def test_the_session_switch():
    """``LSTMEM_EMULATE_GPU_ARITH`` (read by conftest.py) turns the emulation on for every test."""
    assert is_active() == (session_mode() is not None)


# ---------------------------------------------------------------------- the kernel tests, emulated
def assert_emulated(counts, bf16, sqrt=False):
    """The kernels really ran the emulated operations (and not some path around them)."""
    wanted = ["exp", "div", "fma"] + ["bf16"] * bf16 + ["sqrt"] * sqrt
    assert all(counts[op] > 0 for op in wanted), counts


def with_directions(pairs):
    """``(case id, reverse)`` pairs as parameters named ``<id>-documented`` / ``<id>-reversed``."""
    return [pytest.param(c, r, id=f"{c}-{'reversed' if r else 'documented'}") for c, r in pairs]


def _scan_case(case_id):
    (case,) = [c for c in kernel_tests.SCAN_CASES if c[0] == case_id]
    return case[1:]


@pytest.mark.parametrize(
    "case_id, reverse",
    with_directions([("t1-all", False), ("t1-all", True), ("t1-bf16", False), ("t1-bf16", True)])
    + with_directions([("t63-all", False), ("t63-bf16-all", False)]),
)
def test_the_scan_meets_its_tolerances_under_the_emulation(case_id, reverse):
    """``test_scan_matches_naive`` itself (forward and backward against the float64 reference,
    ``TOLERANCES`` of tests/test_triton_kernels.py), every kernel launch emulated. (The long cases run
    with the directions reversed only in the chunked test below, to keep the fast tier fast.)"""
    case = _scan_case(case_id)
    with emulated_gpu_arithmetic(reverse=reverse) as counts:
        kernel_tests.test_scan_matches_naive(*case)
    assert_emulated(counts, bf16=case[4] == torch.bfloat16)


@pytest.mark.parametrize(
    "case_id, reverse",
    with_directions([("t63-c4-all", False), ("t63-c4-all", True), ("t63-c8-bf16-all", False)]),
)
def test_the_chunked_scan_meets_its_tolerances_under_the_emulation(case_id, reverse):
    """``test_chunked_scan_matches_naive``: chunk summaries, their scan and the replays, emulated."""
    (case,) = [c for c in kernel_tests.CHUNKED_CASES if c[0] == case_id]
    with emulated_gpu_arithmetic(reverse=reverse) as counts:
        kernel_tests.test_chunked_scan_matches_naive(*case[1:])
    assert_emulated(counts, bf16=case[5] == torch.bfloat16)


@pytest.mark.parametrize("reverse", [False, True], ids=["documented", "reversed"])
@pytest.mark.parametrize("case_id", ["fp32", "bf16-all"])
def test_the_one_token_step_meets_its_tolerances_under_the_emulation(case_id, reverse):
    (case,) = [c for c in kernel_tests.STEP_CASES if c[0] == case_id]
    with emulated_gpu_arithmetic(reverse=reverse) as counts:
        kernel_tests.test_step_matches_naive(*case[1:], transposed_state=True)
    assert_emulated(counts, bf16=case[4] == torch.bfloat16)


@pytest.mark.parametrize("reverse", [False, True], ids=["documented", "reversed"])
@pytest.mark.parametrize("case_id", ["depth-valid", "no-depth-valid-r6", "bf16-inputs-and-states"])
def test_the_decode_step_meets_its_error_bound_under_the_emulation(case_id, reverse):
    """``test_matches_the_paper_reference`` of tests/test_decode_step_kernel.py (its float32 error
    bound, whose TANH_ERR and SIGMOID_ERR budget the GPU's exp and division), emulated."""
    (case,) = [c for c in step_tests.CASES if c[0] == case_id]
    with emulated_gpu_arithmetic(reverse=reverse) as counts:
        step_tests.test_matches_the_paper_reference(*case[1:])
    assert_emulated(counts, bf16=False, sqrt=True)  # bfloat16 inputs, float32 outputs: no bf16 store
