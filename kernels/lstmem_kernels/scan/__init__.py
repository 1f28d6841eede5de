"""The scan family: the LSTMem cell/hidden recurrence over a block, one signature
(:func:`lstmem_scan`), three members: :mod:`.naive` (the token loop, the specification),
:mod:`.pytorch` (vectorised, autograd-native: the CPU default) and :mod:`.chunked` (the paper's
parallel scan over time in Triton, App. C.3: the GPU default). Its rule for short blocks lives
there (:func:`.chunked.chunk_length`): a block of up to 64 tokens is one chunk, one program per
``(batch, head)`` walking the block, which is the sequential scan."""

from __future__ import annotations

import torch

from ..backend import Backend, check_backend, resolve_backend
from .naive import scan_naive
from .pytorch import scan_parallel


def _chunked():
    try:
        from . import chunked
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "backend='triton' needs the `triton` package: pip install 'lstmem-peft[triton]'"
        ) from err
    return chunked


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
    check_backend(backend)
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
    backend = resolve_backend(backend, q)
    if backend == "naive":
        return scan_naive(*args)
    if backend == "triton":
        return _chunked().scan_triton(*args)
    return scan_parallel(*args)
