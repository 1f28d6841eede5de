"""Public entry points: one signature, three implementations.

``backend="auto"`` picks the Triton kernels for CUDA tensors (when Triton is installed) and the
vectorised PyTorch path otherwise; ``"naive"``, ``"torch"`` and ``"triton"`` force one.
"""

from __future__ import annotations

from typing import Literal

import torch

from .naive import scan_naive, step_naive
from .parallel import scan_parallel, step_torch

Backend = Literal["auto", "naive", "torch", "triton"]
BACKENDS = ("auto", "naive", "torch", "triton")


def triton_available() -> bool:
    """Whether ``lstmem_kernels.triton_scan`` can be imported (Triton installed)."""
    try:
        from . import triton_scan  # noqa: F401  (importable means available)
    except ImportError:
        return False
    return True


def _triton():
    try:
        from . import triton_scan
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "backend='triton' needs the `triton` package: pip install 'lstmem-peft[triton]'"
        ) from err
    return triton_scan


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def lstmem_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    f: torch.Tensor,
    o: torch.Tensor,
    depth: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    initial_cell: torch.Tensor | None = None,
    initial_hidden: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scan the LSTMem cell/hidden recurrence over a block.

    Args:
        q, k, w, f, o: ``(B, T, H, R)`` read query, write key, gated residual ``i*e``, forget and
            output gates.
        depth: ``(B, T, H, R, R)`` depth term ``g * D^{(l-1)}_t``, or ``None`` for zeros.
        valid: ``(B, T)`` bool, ``False`` at padding (state carried over), or ``None``.
        initial_cell, initial_hidden: ``(B, H, R, R)``, or ``None`` for zeros.
        backend: see the module docstring.

    Returns:
        ``read (B, T, H, R)`` (``D_{t-1} q_t``), ``hidden (B, T, H, R, R)`` (``D_t``),
        ``final_cell`` and ``final_hidden`` ``(B, H, R, R)``; all in ``q.dtype``.
    """
    _check_backend(backend)
    if q.dim() != 4:
        raise ValueError(f"q must have shape (B, T, H, R), got {tuple(q.shape)}")
    for name, t in (("k", k), ("w", w), ("f", f), ("o", o)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
    if depth is not None and depth.shape != (*q.shape, q.shape[-1]):
        raise ValueError(f"depth must have shape {(*q.shape, q.shape[-1])}, got {tuple(depth.shape)}")
    if valid is not None and valid.shape != q.shape[:2]:
        raise ValueError(f"valid must have shape {tuple(q.shape[:2])}, got {tuple(valid.shape)}")
    args = (q, k, w, f, o, depth, valid, initial_cell, initial_hidden)
    if backend == "auto":
        backend = "triton" if q.is_cuda and triton_available() else "torch"
    if backend == "naive":
        return scan_naive(*args)
    if backend == "triton":
        return _triton().scan_triton(*args)
    return scan_parallel(*args)


def lstmem_step(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    f: torch.Tensor,
    o: torch.Tensor,
    cell: torch.Tensor,
    hidden: torch.Tensor,
    depth: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    backend: Backend = "auto",
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One decode step of the recurrence, updating ``cell`` and ``hidden`` **in place**, or writing the
    new states into ``out`` (every backend).

    Args:
        q, k, w, f, o: ``(B, H, R)`` read query, write key, gated residual ``i*e``, forget and
            output gates of one token.
        cell, hidden: ``(B, H, R, R)`` states ``C_{t-1}``, ``D_{t-1}``, overwritten with ``C_t``, ``D_t``
            (rows where ``valid`` is ``False`` are left as they are).
        depth: ``(B, H, R, R)`` depth term ``g * D^{(l-1)}_t``, or ``None`` for zeros.
        valid: ``(B,)`` bool, or ``None``.
        backend: see the module docstring (``"auto"``: Triton for CUDA tensors, else PyTorch).
        out: ``(cell_out, hidden_out)``, ``(B, H, R, R)`` float32 (float64 with float64 inputs):
            where ``C_t`` and ``D_t`` go, leaving ``cell`` and ``hidden`` as they are (padded rows
            get the old states); ``None``: in place. The PyTorch member writes them directly; the
            others copy the states there first and step in place.

    Returns:
        ``read`` ``(B, H, R)``: ``D_{t-1} q_t``, from the state before the update.

    Not differentiable (an in-place update): for gradients, scan the token with :func:`lstmem_scan`.
    """
    _check_backend(backend)
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, w, f, o, cell, hidden, depth)
    ):
        raise RuntimeError(
            "lstmem_step updates the states in place and has no gradient; under autograd scan the token with "
            "lstmem_scan (inputs with a time axis of length 1), or call it inside torch.no_grad()"
        )
    if backend == "auto":
        backend = "triton" if q.is_cuda and triton_available() else "torch"
    if backend == "torch":
        return step_torch(q, k, w, f, o, cell, hidden, depth, valid, out=out)
    if out is not None:  # these members step in place: on copies of the states
        out[0].copy_(cell)
        out[1].copy_(hidden)
        cell, hidden = out
    if backend == "triton":
        return _triton().step_triton(q, k, w, f, o, cell, hidden, depth, valid)
    return step_naive(q, k, w, f, o, cell, hidden, depth, valid)
