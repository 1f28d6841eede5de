"""Reference implementation of one LSTMem decode step (the recurrence at one token), the
specification the PyTorch and Triton members of the step family are tested against; the notation is
the scan reference's (:mod:`lstmem_kernels.scan.naive`)."""

from __future__ import annotations

import torch

from ..scan.naive import scan_naive


def step_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    f: torch.Tensor,
    o: torch.Tensor,
    cell: torch.Tensor,
    hidden: torch.Tensor,
    depth: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of the recurrence, updating ``cell`` and ``hidden`` **in place**.

    Args:
        q, k, w, f, o: ``(B, H, R)`` per-token inputs (see :func:`scan_naive`).
        cell, hidden: ``(B, H, R, R)`` states, overwritten with ``C_t`` and ``D_t``.
        depth: ``(B, H, R, R)`` depth term or ``None``.
        valid: ``(B,)`` bool or ``None``.

    Returns:
        ``read`` ``(B, H, R)``: ``D_{t-1} q_t``, computed before the update.
    """
    read, _, C, D = scan_naive(
        q[:, None],
        k[:, None],
        w[:, None],
        f[:, None],
        o[:, None],
        None if depth is None else depth[:, None],
        None if valid is None else valid[:, None],
        cell,
        hidden,
    )
    cell.copy_(C)
    hidden.copy_(D)
    return read[:, 0]
