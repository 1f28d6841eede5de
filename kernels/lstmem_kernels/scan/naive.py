"""Reference implementation of the LSTMem block scan: a plain token loop.

This file is the specification the vectorised and Triton paths are tested against. It runs in
whatever float dtype it is given (float64 included) and does no fusion or reordering.

Notation (paper Sec. 3.2 and App. C.3), per sequence ``b``, head ``j`` and time ``t``; a gate vector
multiplies a state row-wise (``diag(g) X``):

    read_t  = D_{t-1} q_t                                   (temporal read r^time_t)
    C_t     = diag(f_t) C_{t-1} + w_t k_t^T                 (w_t = i_t * e_t, the gated residual)
    D_t     = diag(o_t) tanh(C_t) + depth_t                 (depth_t = diag(g_t) D^{(l-1)}_t)

At an invalid (padding) position the read is still produced but ``C`` and ``D`` are carried over
unchanged.
"""

from __future__ import annotations

import torch


def scan_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    f: torch.Tensor,
    o: torch.Tensor,
    depth: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    initial_cell: torch.Tensor | None = None,
    initial_hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the LSTMem cell/hidden recurrence over a block, one token at a time.

    Args:
        q: ``(B, T, H, R)`` read queries (normalised memory queries ``q^mem``).
        k: ``(B, T, H, R)`` write keys (normalised memory keys ``k^mem``).
        w: ``(B, T, H, R)`` gated write residuals ``i_t * e_t``.
        f: ``(B, T, H, R)`` forget gates.
        o: ``(B, T, H, R)`` output gates.
        depth: ``(B, T, H, R, R)`` depth term ``g_t * D^{(l-1)}_t`` or ``None`` (zeros).
        valid: ``(B, T)`` bool, ``False`` where the position is padding; ``None`` means all valid.
        initial_cell, initial_hidden: ``(B, H, R, R)`` states before the block, ``None`` for zeros.

    Returns:
        ``(read, hidden, final_cell, final_hidden)``: ``read`` ``(B, T, H, R)`` is ``D_{t-1} q_t``;
        ``hidden`` ``(B, T, H, R, R)`` is ``D_t`` after each position; the finals are ``(B, H, R, R)``.
    """
    B, T, H, R = q.shape
    C = q.new_zeros(B, H, R, R) if initial_cell is None else initial_cell.to(q.dtype)
    D = q.new_zeros(B, H, R, R) if initial_hidden is None else initial_hidden.to(q.dtype)
    reads, hiddens = [], []
    for t in range(T):
        reads.append(torch.einsum("bhac,bhc->bha", D, q[:, t]))
        C_new = f[:, t, :, :, None] * C + w[:, t, :, :, None] * k[:, t, :, None, :]
        D_new = o[:, t, :, :, None] * torch.tanh(C_new)
        if depth is not None:
            D_new = D_new + depth[:, t]
        if valid is not None:
            keep = valid[:, t].view(B, 1, 1, 1)
            C_new = torch.where(keep, C_new, C)
            D_new = torch.where(keep, D_new, D)
        C, D = C_new, D_new
        hiddens.append(D)
    read = torch.stack(reads, dim=1) if T else q.new_zeros(B, 0, H, R)
    hidden = torch.stack(hiddens, dim=1) if T else q.new_zeros(B, 0, H, R, R)
    return read, hidden, C, D


def scan_naive_pieces(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    f: torch.Tensor,
    o: torch.Tensor,
    depth: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    initial_cell: torch.Tensor | None = None,
    initial_hidden: torch.Tensor | None = None,
    piece: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`scan_naive` over consecutive pieces of at most ``piece`` tokens, carrying the states: the
    reference the kernel tests and the GPU acceptance run compare long blocks with.

    It is the same token loop (resuming from the final states is exact); the pieces only keep
    autograd's per-token slices of a long ``(B, T, ...)`` input (each slice's backward allocates a
    full-size gradient) from costing ``O(T^2)`` in the backward. Arguments and results as
    :func:`scan_naive`'s.
    """
    T = q.shape[1]
    if T <= piece:
        return scan_naive(q, k, w, f, o, depth, valid, initial_cell, initial_hidden)
    reads, hiddens = [], []
    cell, hidden = initial_cell, initial_hidden
    for start in range(0, T, piece):
        part = slice(start, start + piece)
        read, hidden_seq, cell, hidden = scan_naive(
            *(x[:, part] for x in (q, k, w, f, o)),
            None if depth is None else depth[:, part],
            None if valid is None else valid[:, part],
            cell,
            hidden,
        )
        reads.append(read)
        hiddens.append(hidden_seq)
    return torch.cat(reads, dim=1), torch.cat(hiddens, dim=1), cell, hidden
