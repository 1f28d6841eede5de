"""The LSTMem memory layer exactly as the paper writes it: the oracle for every other path.

A token-by-token loop over paper Sec. 3.1-3.2 in float64, with the paper's names and the full
stored matrices ``W_pred^full`` and ``W_gate^full`` applied to zero-padded inputs (App. C.2), so that
nothing here depends on how :class:`~lstmem_peft.memory.layer.LSTMemLayer` arranges its parameters or on
any algebra the fast paths use. It is slow on purpose; use it to check, never to run.

>>> import torch
>>> from lstmem_peft import LSTMemLayer
>>> layer = LSTMemLayer(hidden_size=16, query_size=16)
>>> x, C0 = torch.randn(2, 3, 16), torch.zeros(2, 4, 8, 8)
>>> ref = memory_layer_ref(layer.paper_parameters(), x, C0, C0, num_heads=4, alpha=layer.alpha)
>>> ref.delta_q.shape, ref.hidden_seq.shape, ref.delta_q.dtype
(torch.Size([2, 3, 16]), torch.Size([2, 3, 4, 8, 8]), torch.float64)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import constants as K


class ReferenceOutput(NamedTuple):
    """Float64 results for a block of ``T`` tokens of ``B`` sequences.

    Attributes:
        delta_q: ``(B, T, d_q)``; delta_o: ``(B, T, d)``.
        cell, hidden: ``(B, n_h, r, r)`` ``C`` and ``D`` after the block.
        hidden_seq: ``(B, T, n_h, r, r)`` ``D_t`` at every position.
    """

    delta_q: torch.Tensor
    delta_o: torch.Tensor
    cell: torch.Tensor
    hidden: torch.Tensor
    hidden_seq: torch.Tensor


def n(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``n(.)``: tanh, then l2 normalisation within each head (denominator at least 1e-6).
    ``(..., d_s) -> (..., n_h, r)``."""
    x = torch.tanh(x).unflatten(-1, (num_heads, -1))
    return x / torch.clamp(x.norm(dim=-1, keepdim=True), min=K.NORM_EPS)


def per_head(state: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """``concat_j(state^[j] vector^[j])``: ``(B, n_h, r, r)`` x ``(B, n_h, r)`` -> ``(B, d_s)``."""
    return torch.einsum("bjac,bjc->bja", state, vector).flatten(1)


def memory_layer_ref(
    params: dict[str, torch.Tensor],
    x: torch.Tensor,
    cell: torch.Tensor,
    hidden: torch.Tensor,
    depth: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    *,
    num_heads: int,
    alpha: float,
) -> ReferenceOutput:
    """One memory layer over a block, read-then-write at every token, in float64.

    Args:
        params: :meth:`LSTMemLayer.paper_parameters` (``Wq, Wk, Wv, Wx, bx, Wread, bread,
            Wpred, bpred, Wgate, bgate, Wdq, Wdo``: the effective maps ``W~_pred``, ``W~_gate``;
            this function applies them as the paper's full matrices to zero-padded inputs).
        x: ``(B, T, d)`` the layer's attention inputs ``x_t``.
        cell, hidden: ``(B, n_h, r, r)`` ``C_{t0-1}``, ``D_{t0-1}``.
        depth: ``(B, T, n_h, r, r)`` ``D^{(l-1)}_t`` of the memory layer below, or ``None``
            (the first memory layer, or no depth coupling: ``D^{(0)} = 0``).
        valid: ``(B, T)`` bool, ``False`` at padding (states carried over unchanged), or ``None``.
        num_heads: ``n_h``; alpha: the correction scale's ``alpha``.
    """
    P = {name: p.double() for name, p in params.items()}  # differentiable: gradients are checked too
    r = P["Wq"].shape[0] // num_heads
    x = x.double()
    C, D = cell.double().clone(), hidden.double().clone()
    # App. C.2: W_pred^full = [P_time | P_dep] and W_gate^full = [G_z | G_time | G_dep | G_e] act on
    # inputs whose temporal block is zero, so P_time and G_time never matter (taken as zero here)
    ds = P["Wpred"].shape[0]
    Wpred_full = torch.cat([torch.zeros_like(P["Wpred"]), P["Wpred"]], 1)
    g_z, g_dep, g_e = P["Wgate"].split(ds, 1)
    Wgate_full = torch.cat([g_z, torch.zeros_like(g_z), g_dep, g_e], 1)
    delta_q, delta_o, hidden_seq = [], [], []
    for t in range(x.shape[1]):
        x_t = x[:, t]
        # eq:projections
        q_t, k_t = n(x_t @ P["Wq"].T, num_heads), n(x_t @ P["Wk"].T, num_heads)
        v_t = x_t @ P["Wv"].T
        D_below = torch.zeros_like(D) if depth is None else depth[:, t].double()
        # eq:read
        r_time = per_head(D, q_t)
        r_dep = per_head(D_below, q_t)
        u_t = torch.cat([r_time, r_dep], -1) @ P["Wread"].T + P["bread"]
        # eq:injection
        delta_q.append(alpha / r * u_t @ P["Wdq"].T)
        delta_o.append(alpha / r * u_t @ P["Wdo"].T)
        # eq:residual, with W~_pred p = W_pred^full [0; p] (App. C.2)
        p_dep = per_head(D_below, k_t)
        zeros = torch.zeros_like(p_dep)
        v_hat = torch.cat([zeros, p_dep], -1) @ Wpred_full.T + P["bpred"]
        e_t = v_t - v_hat
        # eq:gates, with W~_gate [z; r_dep; e] = W_gate^full [z; 0; r_dep; e] (App. C.2)
        z_t = x_t @ P["Wx"].T + P["bx"]
        gates = torch.sigmoid(torch.cat([z_t, zeros, r_dep, e_t], -1) @ Wgate_full.T + P["bgate"])
        i_t, f_t, o_t, g_t = (a.unflatten(-1, (num_heads, r)) for a in gates.chunk(4, -1))
        # eq:write
        C_t = f_t[..., None] * C + (i_t * e_t.unflatten(-1, (num_heads, r)))[..., None] * k_t[..., None, :]
        # eq:hidden
        D_t = o_t[..., None] * torch.tanh(C_t) + g_t[..., None] * D_below
        if valid is not None:  # padding leaves both states as they were
            keep = valid[:, t].view(-1, 1, 1, 1)
            C_t, D_t = torch.where(keep, C_t, C), torch.where(keep, D_t, D)
        C, D = C_t, D_t
        hidden_seq.append(D)
    return ReferenceOutput(torch.stack(delta_q, 1), torch.stack(delta_o, 1), C, D, torch.stack(hidden_seq, 1))
