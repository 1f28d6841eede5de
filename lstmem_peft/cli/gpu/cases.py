"""How the GPU acceptance run (:mod:`.acceptance`) judges a case: the kernel tests' tolerances
(:data:`TOLERANCES`), the largest error between two tensors of one shape, a case judged elementwise
(:func:`close_case`) or against a tolerance the check derived (:func:`bound_case`), and the case
nearest to its tolerance (:func:`worst_case`: the figure a step's row shows).

A case is a dict: ``name``, ``passed``, and where something was measured ``max_error`` and
``tolerance`` (plus what the check adds).
"""

from __future__ import annotations

import math

import torch

#: (atol, rtol) against a float64 reference, atol scaled by the reference's largest magnitude (at
#: least 1): the values of ``TOLERANCES`` in tests/test_triton_kernels.py (tests/test_gpu_acceptance.py
#: checks they stay equal).
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected|`` in float64 (0 for empty tensors; inf where either is not finite)."""
    if expected.numel() == 0:
        return 0.0
    diff = (actual.double() - expected.double()).abs()
    finite = torch.isfinite(actual.double()).all() and torch.isfinite(expected.double()).all()
    return float(diff.max()) if bool(finite) else math.inf


def close_case(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> dict:
    """One case compared as the kernel tests' ``assert_close`` does: ``|a - e| <= atol * max(1, max|e|)
    + rtol |e|`` elementwise, with ``(atol, rtol) = TOLERANCES[dtype]``. The case records the largest
    error, the tolerance at that element, the largest ratio of error to tolerance over all elements, and
    whether every element passed."""
    atol, rtol = TOLERANCES[dtype]
    if actual.shape != expected.shape:
        return dict(name=name, passed=False, reason=f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if expected.numel() == 0:
        return dict(name=name, passed=True, max_error=0.0, tolerance=atol)
    a, e = actual.double(), expected.double()
    allowed = atol * max(1.0, float(e.abs().max())) + rtol * e.abs()
    diff = torch.nan_to_num((a - e).abs(), nan=math.inf)
    largest = int(diff.flatten().argmax())
    return dict(
        name=name,
        passed=bool((diff <= allowed).all()),
        max_error=max_error(a, e),
        tolerance=float(allowed.flatten()[largest]),
        worst_ratio=float((diff / allowed).max()),
    )


def bound_case(name: str, error: float, tolerance: float, **extra) -> dict:
    """A case whose tolerance was derived by the check: passed when ``error <= tolerance``."""
    passed = math.isfinite(error) and error <= tolerance
    return dict(name=name, passed=passed, max_error=error, tolerance=tolerance, **extra)


def worst_case(cases: list[dict]) -> dict:
    """The case nearest to (or furthest past) its tolerance."""
    scored = [c for c in cases if "max_error" in c]
    if not scored:
        return {}

    def ratio(c):
        if not math.isfinite(c["max_error"]):
            return math.inf
        if c["tolerance"] <= 0:
            return math.inf if c["max_error"] > 0 else 0.0
        return c["max_error"] / c["tolerance"]

    return max(scored, key=ratio)
