"""Vectorised PyTorch LSTMem scan: the CPU default, autograd-native.

Row ``a`` of the cell follows the affine map ``C_t = diag(f_t) C_{t-1} + B_t`` with
``B_t = w_t k_t^T`` (paper App. C.3). Affine maps compose associatively,
``(A2, B2) o (A1, B1) = (A2 A1, A2 B1 + B2)``, so the block is scanned in two levels:

1. within chunks of ``chunk`` tokens, a Hillis-Steele prefix scan (``log2(chunk)`` vectorised steps);
2. the same scan over the chunk summaries gives every chunk's incoming state.

All cells ``C_t`` are materialised (``D_t`` needs ``tanh(C_t)``), in float32 for half-precision
inputs and in the input dtype otherwise. Multiplying gates directly (no logarithms) keeps the scan
finite for any gate in ``[0, 1]``.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 16  # 8-16 measured fastest on CPU for T = 256 and 2048 (fewer full-size levels)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _last_valid_index(valid: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` index of the last valid position at or before ``t``; ``-1`` if none yet."""
    T = valid.shape[1]
    idx = torch.arange(T, device=valid.device).expand_as(valid)
    return torch.where(valid, idx, torch.full_like(idx, -1)).cummax(dim=1).values


def _inclusive_scan(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hillis-Steele inclusive scan of affine maps along dim 2.

    ``a`` ``(B, N, L, H, R)`` row multipliers, ``b`` ``(B, N, L, H, R, R)`` offsets; returns the
    cumulative maps ``(a_1...a_t, sum_s a_{s+1..t} b_s)`` for every ``t``.
    """
    L = a.shape[2]
    d = 1
    while d < L:
        b = torch.cat([b[:, :, :d], torch.addcmul(b[:, :, d:], a[:, :, d:, ..., None], b[:, :, :-d])], dim=2)
        a = torch.cat([a[:, :, :d], a[:, :, d:] * a[:, :, :-d]], dim=2)
        d *= 2
    return a, b


def scan_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    f: torch.Tensor,
    o: torch.Tensor,
    depth: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    initial_cell: torch.Tensor | None = None,
    initial_hidden: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as :func:`lstmem_kernels.naive.scan_naive`; shapes ``(B, T, H, R)`` in,
    ``read (B, T, H, R)``, ``hidden (B, T, H, R, R)``, finals ``(B, H, R, R)`` out (``q.dtype``)."""
    B, T, H, R = q.shape
    out_dtype = q.dtype
    cd = _compute_dtype(out_dtype)
    q, k, w, f, o = (t.to(cd) for t in (q, k, w, f, o))
    C0 = q.new_zeros(B, H, R, R) if initial_cell is None else initial_cell.to(cd)
    D0 = q.new_zeros(B, H, R, R) if initial_hidden is None else initial_hidden.to(cd)
    if T == 0:
        return (
            q.new_zeros(B, 0, H, R).to(out_dtype),
            q.new_zeros(B, 0, H, R, R).to(out_dtype),
            C0.to(out_dtype),
            D0.to(out_dtype),
        )

    a = f  # (B, T, H, R): row multipliers
    b = w[..., :, None] * k[..., None, :]  # (B, T, H, R, R)
    if valid is not None:
        keep = valid[:, :, None, None]
        a = torch.where(keep, a, torch.ones_like(a))
        b = torch.where(keep[..., None], b, torch.zeros_like(b))

    L = max(1, min(chunk, T))
    n = -(-T // L)
    pad = n * L - T
    if pad:
        a = torch.cat([a, a.new_ones(B, pad, H, R)], dim=1)
        b = torch.cat([b, b.new_zeros(B, pad, H, R, R)], dim=1)
    a = a.view(B, n, L, H, R)
    b = b.view(B, n, L, H, R, R)

    # 1. Cumulative maps inside each chunk.
    a, b = _inclusive_scan(a, b)
    # 2. Cumulative maps over chunk ends give the state entering each chunk.
    a_end, b_end = _inclusive_scan(a[:, None, :, -1], b[:, None, :, -1])
    a_end, b_end = a_end[:, 0, :-1, ..., None], b_end[:, 0, :-1]
    start = torch.cat([C0[:, None], torch.addcmul(b_end, a_end, C0[:, None])], dim=1)  # (B, n, H, R, R)
    C = torch.addcmul(b, a[..., None], start[:, :, None]).view(B, n * L, H, R, R)[:, :T]

    tanh_c = torch.tanh(C)
    D = o[..., None] * tanh_c if depth is None else torch.addcmul(_cast(depth, cd), o[..., None], tanh_c)
    if valid is not None:
        last = _last_valid_index(valid)  # (B, T)
        D_ext = torch.cat([D0[:, None], D], dim=1)
        D = D_ext.gather(1, (last + 1).view(B, T, 1, 1, 1).expand(B, T, H, R, R))
    D_prev = torch.cat([D0[:, None], D[:, :-1]], dim=1)
    read = torch.matmul(D_prev, q[..., None])[..., 0]
    return read.to(out_dtype), D.to(out_dtype), C[:, -1].to(out_dtype), D[:, -1].to(out_dtype)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the dispatch when it already has that dtype (the decode hot path)."""
    return t if t.dtype == dtype else t.to(dtype)


def _column(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A gate ``(B, H, R)`` as columns ``(B, H, R, 1)`` in ``dtype``; columns as they are."""
    t = _cast(t, dtype)
    return t if t.ndim == 4 else t.unsqueeze(-1)


def step_torch(
    q: torch.Tensor | None,
    k: torch.Tensor,
    w: torch.Tensor,
    f: torch.Tensor,
    o: torch.Tensor,
    cell: torch.Tensor,
    hidden: torch.Tensor,
    depth: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One decode step in PyTorch, writing ``C_t``, ``D_t`` into ``out`` (default: ``cell`` and
    ``hidden`` themselves, **in place**); the contract of :func:`lstmem_kernels.naive.step_naive`
    and of the Triton step; not differentiable.

    Args: ``q, k, w, f, o`` ``(B, H, R)``, or ``k`` as rows ``(B, H, 1, R)`` and ``w, f, o`` as columns
    ``(B, H, R, 1)``: the shapes the outer product and the row scalings broadcast, which a memory
    layer's step has as views of its products (no view operator is then spent on them here);
    ``cell, hidden`` ``(B, H, R, R)`` (any float dtype; the
    math runs in float32, or float64 for float64 inputs); ``depth`` ``(B, H, R, R)`` or ``None``;
    ``valid`` ``(B,)`` or ``None``; ``out``: ``(B, H, R, R)`` tensors for the new states (rows where
    ``valid`` is ``False`` get the old ones), or ``None``. Returns ``read`` ``(B, H, R)``
    (``D_{t-1} q_t``) in ``q.dtype``, or ``None`` without ``q``.
    """
    cd = _compute_dtype(k.dtype if k.dtype == torch.float64 else cell.dtype)
    cell_out, hidden_out = (cell, hidden) if out is None else out
    w_col, f_col, o_col = _column(w, cd), _column(f, cd), _column(o, cd)
    k_row = _cast(k, cd) if k.ndim == 4 else _cast(k, cd).unsqueeze(-2)
    C, D = _cast(cell, cd), _cast(hidden, cd)
    depth = None if depth is None else _cast(depth, cd)
    # D_{t-1} q_t, before D changes (R is small: no batched product)
    read = None if q is None else _cast((D * _cast(q, cd)[..., None, :]).sum(-1), q.dtype)
    if valid is None and cell_out.dtype == cd and hidden_out.dtype == cd:
        # the new states go straight where they belong: in place, or into the caller's outputs
        C_new = C.mul_(f_col) if cell_out is C else torch.mul(C, f_col, out=cell_out)
        C_new.addcmul_(w_col, k_row)
        if depth is None:
            torch.tanh(C_new, out=hidden_out).mul_(o_col)
        else:
            torch.addcmul(depth, o_col, torch.tanh(C_new), out=hidden_out)
        return read
    # padding, or states of another dtype: computed aside, then written (padded rows keep theirs)
    C_new = torch.addcmul(f_col * C, w_col, k_row)
    tanh_c = torch.tanh(C_new)
    D_new = o_col * tanh_c if depth is None else torch.addcmul(depth, o_col, tanh_c)
    if valid is None:
        cell_out.copy_(C_new)
        hidden_out.copy_(D_new)
    else:  # padded rows keep their states; one selection per state, written where it belongs
        keep = valid.view(-1, 1, 1, 1)
        for new, old, target in ((C_new, C, cell_out), (D_new, D, hidden_out)):
            if target.dtype == cd:
                torch.where(keep, new, old, out=target)
            else:
                target.copy_(torch.where(keep, new, old))
    return read
