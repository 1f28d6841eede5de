"""Reference implementation of a memory layer's whole decode step: the float64 member of
:func:`lstmem_kernels.lstmem_decode_step`, one line per equation, the specification the PyTorch and
Triton members are tested against. It takes the block maps as they are (``eau``, ``b_eau``,
``read``), with none of the PyTorch member's rearranged maps, and the states row by row where the
op's contract puts them (slots, padding)."""

from __future__ import annotations

import torch

from .decode_torch import DecodeSamples


# Long for its docstring: the equations of the step, one line each, in the order they are stated.
def decode_step_naive(
    x: torch.Tensor,
    w_in: torch.Tensor,
    b_in: torch.Tensor,
    eau: torch.Tensor,
    b_eau: torch.Tensor,
    read: torch.Tensor,
    cell: torch.Tensor,
    hidden: torch.Tensor,
    *,
    num_heads: int,
    out: tuple[torch.Tensor, torch.Tensor],
    depth: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    norm_eps: float,
    slots: torch.Tensor | None = None,
    hidden_seq: torch.Tensor | None = None,
    samples: bool = False,
):
    """The decode step of :func:`lstmem_kernels.lstmem_decode_step` (its contract) in float64::

        proj = x w_in + b_in;  [q; k] = n(proj[:, :2 d_s]) per head;  [v; z] = proj[:, 2 d_s:]
        [e | a | u_dep] = [v; z; D^(l-1) q; D^(l-1) k] eau + b_eau   (head by head for the reads)
        i, f, o, g = sigmoid(a);  C_t = diag(f) C + (i e) k^T;  D_t = diag(o) tanh(C_t) + diag(g) D^(l-1)
        u = u_dep + (D_{t-1} q) read[:d_s]

    ``u`` and the samples come back in the weights' dtype, the states in the ``out`` tensors' dtype.
    """
    f64 = torch.float64
    B = x.shape[0]
    ds = read.shape[1]
    H, R = num_heads, ds // num_heads
    wdtype = w_in.dtype
    w_in, b_in, eau, b_eau, read = (t.to(f64) for t in (w_in, b_in, eau, b_eau, read))
    C_prev, D_prev = _rows(cell, slots), _rows(hidden, slots)  # (B, n_h, r, r), float64
    # eq:projections: q, k through n(.) = tanh, then l2 within each head
    proj = x.to(f64) @ w_in + b_in
    qk = torch.tanh(proj[:, : 2 * ds]).view(B, H, 2, R)
    qk = qk / qk.norm(dim=-1, keepdim=True).clamp_min(norm_eps)
    q, k = qk[:, :, 0], qk[:, :, 1]  # (B, n_h, r)
    v_z = proj[:, 2 * ds :]
    v = v_z[:, :ds].reshape(B, H, R)
    # eq:read (depth) and p^dep of eq:residual: D^(l-1) q, D^(l-1) k, head by head
    if depth is None:
        eau_in, eau_rows = v_z, eau[: 2 * ds]
        dep = torch.zeros(B, H, R, R, dtype=f64, device=x.device)
    else:
        dep = depth.to(f64)
        reads = torch.stack([_matvec(dep, q), _matvec(dep, k)], 2)  # (B, n_h, 2, r)
        eau_in, eau_rows = torch.cat([v_z, reads.reshape(B, 2 * ds)], 1), eau
    # eq:residual, eq:gates and the depth part of eq:read's u
    e, a, u_dep = (eau_in @ eau_rows + b_eau).split([ds, 4 * ds, ds], 1)
    i, f, o, g = torch.sigmoid(a).view(B, 4, H, R).unbind(1)
    e = e.view(B, H, R)
    # eq:read (time), from the state before the write
    r_time = _matvec(D_prev, q)
    # eq:write and eq:hidden
    C_new = f[..., None] * C_prev + (i * e)[..., None] * k[:, :, None, :]
    D_new = o[..., None] * torch.tanh(C_new) + g[..., None] * dep
    # eq:read's u
    u = u_dep + r_time.reshape(B, ds) @ read[:ds]
    # padding (valid False) keeps its states
    if valid is not None:
        keep = valid.view(B, 1, 1, 1)
        C_new, D_new = torch.where(keep, C_new, C_prev), torch.where(keep, D_new, D_prev)
    _write(out[0], C_new, slots)
    _write(out[1], D_new, slots)
    if hidden_seq is not None:
        hidden_seq.copy_(D_new)
    if not samples:
        return u.to(wdtype)
    return u.to(wdtype), DecodeSamples(*(t.to(wdtype) for t in (k, v, o, g)))


def _matvec(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``m v`` per head: ``(B, n_h, r, r)`` times ``(B, n_h, r)`` -> ``(B, n_h, r)``."""
    return (m * v[:, :, None, :]).sum(-1)


def _rows(states: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
    """The states each row steps, in float64: ``states`` itself, or its rows ``slots`` of a table
    (zeros for a negative slot: a padding row)."""
    if slots is None:
        return states.to(torch.float64)
    rows = states.to(torch.float64)[slots.clamp_min(0).long()]
    return torch.where((slots >= 0).view(-1, 1, 1, 1), rows, torch.zeros_like(rows))


def _write(target: torch.Tensor, new: torch.Tensor, slots: torch.Tensor | None) -> None:
    """The new states into ``target``: all of it, or its rows ``slots`` of a table (none for a
    negative slot)."""
    if slots is None:
        target.copy_(new)
        return
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            target[slot] = new[row]
