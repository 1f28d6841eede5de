"""One LSTMem decode step in PyTorch: the CPU default of the step family, in place or into given
tensors (:func:`step_torch`)."""

from __future__ import annotations

import torch

from ..precision import cast, compute_dtype


def _column(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A gate ``(B, H, R)`` as columns ``(B, H, R, 1)`` in ``dtype``; columns as they are."""
    t = cast(t, dtype)
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
    ``hidden`` themselves, **in place**); the contract of :func:`lstmem_kernels.step.naive.step_naive`
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
    cd = compute_dtype(k.dtype if k.dtype == torch.float64 else cell.dtype)
    cell_out, hidden_out = (cell, hidden) if out is None else out
    w_col, f_col, o_col = _column(w, cd), _column(f, cd), _column(o, cd)
    k_row = cast(k, cd) if k.ndim == 4 else cast(k, cd).unsqueeze(-2)
    C, D = cast(cell, cd), cast(hidden, cd)
    depth = None if depth is None else cast(depth, cd)
    # D_{t-1} q_t, before D changes (R is small: no batched product)
    read = None if q is None else cast((D * cast(q, cd)[..., None, :]).sum(-1), q.dtype)
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
