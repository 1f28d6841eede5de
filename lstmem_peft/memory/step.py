"""The decode step of one memory layer: one token per sequence without gradients (generation), on
states the caller holds (:func:`decode_step`, what :meth:`~.layer.LSTMemLayer.forward` returns for
such a token) or on a serving engine's state slots, in place (:func:`decode_slots`).

The paper's equations (Sec. 3.1-3.2; :mod:`.layer` has them in full) at one token ``t``, in the
order a step evaluates them. eq:read reads ``D_{t-1}`` before eq:write changes it, so the temporal
read ``r^time_t = D_{t-1} q_t`` is known together with the depth reads, and one product with the
step's map (:func:`arrange_step_maps`, kept in :class:`~.layer_common.LayerWeights`) gives the
residual, the gate pre-activations and the whole read ``u_t``; ones beside ``e`` make one GLU of it
the gated residual and the gates::

    [q; k] = n([W_q; W_k] x_t),   s = [v; z] = [W_v x_t; W_x x_t + b_x]          eq:projections
    [e | 1 | a | u_t] = [s; D_{t-1} [q; k]; D^(l-1)_t [q; k]] eau_step + b_eau_step
                                                        eq:read, eq:residual, eq:gates
    [i e | f | o | g] = GLU([e | 1 | a])                                          eq:gates
    C_t = diag(f) C_{t-1} + diag(i) e k^T,   D_t = diag(o) tanh(C_t) + diag(g) D^(l-1)_t
                                                        eq:write, eq:hidden

The recurrence (eq:write, eq:hidden) is the kernel op family's decode step
(:func:`lstmem_kernels.lstmem_step`, its member chosen by the layer's ``backend``: the PyTorch one on
a CPU). Where the Triton kernels apply (:func:`fused_decode`) the whole step, from the layer input to
``u_t`` and the new states, is one launch of :func:`lstmem_kernels.lstmem_decode_step`, which takes
the block body's maps (``eau``, ``b_eau``, ``read``) and finishes ``u_t`` itself. Either way the
caller's states are never written (the new ones are fresh tensors, which the caller's cache takes
when its pass commits), except a serving engine's state tables, whose slots are stepped in place.
"""

from __future__ import annotations

import torch
from torch import nn

from lstmem_kernels import fused_decode_step_applies, lstmem_decode_step, lstmem_step

from . import constants as K
from .layer_common import LayerOutput, LayerWeights, cast, needs_grad, unit_heads


def decode_step(
    layer: nn.Module,
    x: torch.Tensor,
    cell: torch.Tensor,
    hidden: torch.Tensor,
    depth: torch.Tensor | None,
    valid: torch.Tensor | None,
    w: LayerWeights,
    aux: bool,
) -> LayerOutput:
    """:meth:`~.layer.LSTMemLayer.forward` for one token without gradients: the step of the module
    docstring, writing the new states into fresh tensors (the caller's change only when its pass
    commits).

    Args:
        layer: the memory layer (:class:`~.layer.LSTMemLayer`: its sizes and ``backend``).
        x: ``(B, 1, d)`` attention input of the backbone layer.
        cell, hidden: ``(B, n_h, r, r)`` states ``C_{t-1}``, ``D_{t-1}``; never written.
        depth: ``(B, 1, n_h, r, r)`` the depth input ``D^(l-1)_t``, or ``None``.
        valid: ``(B, 1)`` bool, ``False`` at padding (those states stay as they are), or ``None``.
        w: the layer's :class:`~.layer_common.LayerWeights`, with the step maps
            (``w.b_eau_step`` not ``None``).
        aux: return the feedback samples (``key``, ``value``, ``out_gate``, ``depth_gate``); without
            them, the step may be the fused Triton launch.

    Returns:
        :class:`~.layer_common.LayerOutput` with ``T = 1``: ``u`` and ``hidden_seq`` in the weight
        dtype (``hidden_seq`` is ``D_t``), the states in the dtype of ``cell``.
    """
    B = x.shape[0]
    H, R, ds = layer.num_heads, layer.head_dim, layer.state_size
    dtype = w.w_in.dtype
    if depth is not None:
        depth = cast(depth, dtype)
    if not aux and fused_decode(layer, x):
        return _fused_step(layer, x, cell, hidden, depth, valid, w)
    # eq:projections, with z_t of eq:gates from the same product
    rows = cast(x, dtype).reshape(B, -1)
    proj = torch.addmm(w.b_in, rows, w.w_in)  # (B, 4 d_s): [W_q x, W_k x (by head); W_v x; W_x x + b_x]
    qk, s = proj.split_with_sizes([2 * ds, 2 * ds], 1)  # s = [v; z]
    qk = unit_heads(torch.tanh(qk).view(B * H, 2, R))  # [q^[j]; k^[j]] per (sequence, head)
    # eq:read (time), before eq:write changes D: [q; k] D_{t-1}^T per head, one product
    parts = [s, cast(_time_reads(qk, hidden), dtype).view(B, 2 * ds)]
    if depth is not None:
        # eq:read (depth) and p^dep of eq:residual: [q; k] D^(l-1)^T per head, one product
        parts.append(torch.bmm(qk, depth.reshape(B * H, R, R).transpose(1, 2)).view(B, 2 * ds))
    # eq:residual, eq:gates and eq:read's u: the step's map sets ones beside e, so one GLU gives
    # [i e | f | o | g] (LayerWeights), as the columns (B, n_h, r, 1) and k as the rows (B, n_h, 1, r)
    # that eq:write multiplies
    eau_map = w.eau_step_first if depth is None else w.eau_step_depth
    gated, u = torch.addmm(w.b_eau_step, torch.cat(parts, 1), eau_map).split_with_sizes([8 * ds, ds], 1)
    i_e, f, o, g = nn.functional.glu(gated).view(B, 4, H, R, 1).unbind(1)
    _, k = qk.view(B, H, 2, 1, R).unbind(2)
    depth_term = None if depth is None else g * depth.view(B, H, R, R)
    # eq:write, eq:hidden: the kernel family's step
    new_cell, new_hidden = _recurrence(layer.backend, k, i_e, f, o, cell, hidden, depth_term, valid)
    out = LayerOutput(
        u.view(B, 1, ds),
        (w.corr_q, w.corr_o),
        cast(new_cell, cell.dtype),
        cast(new_hidden, hidden.dtype),
        cast(new_hidden, dtype).unsqueeze(1),
    )
    if not aux:
        return out
    return out._replace(
        key=k.view(B, 1, H, R),
        value=s[:, :ds].view(B, 1, H, R),
        out_gate=o.view(B, 1, H, R),
        depth_gate=g.view(B, 1, H, R),
    )


def decode_slots(
    layer: nn.Module,
    x: torch.Tensor,
    cells: torch.Tensor,
    hiddens: torch.Tensor,
    slots: torch.Tensor,
    *,
    depth: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    hidden_seq: torch.Tensor | None = None,
    weights: LayerWeights | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of ``layer`` for ``n`` sequences whose states are rows of state tables (a
    serving engine's per-request slots), updating those rows in place. Inference only.

    Args:
        layer: the memory layer (:class:`~.layer.LSTMemLayer`).
        x: ``(n, d)`` the layer input of each sequence's token.
        cells, hiddens: ``(S, n_h, r, r)`` state tables; rows ``slots`` are read, then overwritten
            with ``C_t`` and ``D_t``.
        slots: ``(n,)`` int64, distinct: each sequence's row.
        depth: ``(n, n_h, r, r)`` ``D^(l-1)_t`` of the memory layer below, or ``None``.
        valid: ``(n,)`` bool, ``False`` where a sequence only reads (its states stay as they
            are), or ``None`` (every sequence writes).
        hidden_seq: ``(n, n_h, r, r)`` float32 where ``D_t`` goes (the next layer's depth input),
            or ``None``: ``D_t`` in a float32 tensor of its own.
        weights: the layer's :meth:`~.layer.LSTMemLayer.derived_weights`, when the caller has them.
    Returns:
        ``u`` ``(n, d_s)`` in the weight dtype (the corrections' input), and ``D_t`` (``hidden_seq``).

    With the Triton kernels this is one launch that reads and writes the slots where they are
    (:func:`lstmem_kernels.lstmem_decode_step` with ``slots``); otherwise the rows are gathered,
    stepped by the layer's forward (:func:`decode_step`) and written back: the same math, the
    reference this is tested against (the step's operators, two gathers and two writes, and a copy
    when ``hidden_seq`` is given).
    """
    n = x.shape[0]
    H, R = layer.num_heads, layer.head_dim
    w = layer.derived_weights() if weights is None else weights
    if fused_decode(layer, x) and not needs_grad(x, depth, w.w_in):
        if hidden_seq is None:
            hidden_seq = torch.empty(n, H, R, R, dtype=torch.float32, device=x.device)
        u = _decode_kernel(
            layer,
            x,
            w,
            cells,
            hiddens,
            out=(cells, hiddens),
            depth=depth,
            valid=valid,
            slots=slots,
            hidden_seq=hidden_seq,
        )
        return u, hidden_seq
    out = layer(
        x[:, None],
        cells.index_select(0, slots),
        hiddens.index_select(0, slots),
        depth=None if depth is None else depth[:, None],
        valid=None if valid is None else valid[:, None],
        weights=w,
        aux=False,
    )
    cells.index_copy_(0, slots, cast(out.cell, cells.dtype))
    hiddens.index_copy_(0, slots, cast(out.hidden, hiddens.dtype))
    if hidden_seq is None:
        return out.read[:, 0], cast(out.hidden_seq[:, 0], torch.float32)
    hidden_seq.copy_(out.hidden_seq[:, 0])
    return out.read[:, 0], hidden_seq


def fused_decode(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``layer``'s one-token steps of ``x`` run as one fused launch
    (:func:`lstmem_kernels.lstmem_decode_step`: Triton on this backend and device, weights not
    float64) rather than as PyTorch operators."""
    return fused_decode_step_applies(layer.backend, x, layer.w_in.dtype)


def arrange_step_maps(
    eau_first: torch.Tensor, reads: torch.Tensor, b_eau: torch.Tensor, read: torch.Tensor, num_heads: int
) -> dict[str, torch.Tensor]:
    """The one-token step's maps of :class:`~.layer_common.LayerWeights` (``eau_step_first``,
    ``eau_step_depth``, ``b_eau_step``) from the block body's: ``eau_first`` ``(2 d_s, 6 d_s)``, the
    rows of the depth reads ``reads`` ``(2 d_s, 6 d_s)``, ``b_eau`` ``(6 d_s,)`` and ``read``
    ``(2 d_s, d_s)`` (``W_read^T``). The rows of the temporal reads ``[r^time^[j]; D_{t-1}^[j]
    k^[j]]``, head by head, go after ``[v; z]``: ``W_read^time^T`` to the ``u`` columns, zero for the
    second half (which one batched product over ``[q^[j]; k^[j]]`` also yields)."""
    ds = read.shape[1]
    H, R = num_heads, ds // num_heads
    zeros = read.new_zeros(ds, 5 * ds)  # r^time -> [e | a]: nothing
    t_rows = torch.cat([zeros, read[:ds]], 1)  # r^time -> u
    time_reads = torch.stack([t_rows.view(H, R, -1), torch.zeros_like(t_rows).view(H, R, -1)], 1)
    eau_step_first = torch.cat([eau_first, time_reads.reshape(2 * ds, -1)])
    return dict(
        eau_step_first=_ones_beside_e(eau_step_first, ds),
        eau_step_depth=_ones_beside_e(torch.cat([eau_step_first, reads]), ds),
        b_eau_step=_ones_beside_e(b_eau, ds, bias=True),
    )


def _fused_step(layer: nn.Module, x, cell, hidden, depth, valid, w: LayerWeights) -> LayerOutput:
    """The whole one-token step (projections to ``u`` and the new states) in one kernel launch
    (:func:`lstmem_kernels.lstmem_decode_step`, the Triton member of this layer's math; tested
    against the float64 reference and against the PyTorch step)."""
    B = x.shape[0]
    H, R, ds = layer.num_heads, layer.head_dim, layer.state_size
    new_cell, new_hidden = _step_states(cell, hidden)
    u = _decode_kernel(
        layer,
        x.reshape(B, -1),
        w,
        cell,
        hidden,
        out=(new_cell, new_hidden),
        depth=None if depth is None else depth.view(B, H, R, R),
        valid=None if valid is None else valid.view(B),
    )
    return LayerOutput(
        u.view(B, 1, ds),
        (w.corr_q, w.corr_o),
        cast(new_cell, cell.dtype),
        cast(new_hidden, hidden.dtype),
        cast(new_hidden, w.w_in.dtype).unsqueeze(1),
    )


def _decode_kernel(layer: nn.Module, x, w: LayerWeights, cell, hidden, **kwargs) -> torch.Tensor:
    """:func:`lstmem_kernels.lstmem_decode_step` with ``layer``'s weights (the depth map when
    ``kwargs`` has a depth input) and the paper's norm constant; returns ``u``."""
    eau = w.eau_first if kwargs.get("depth") is None else w.eau_depth
    weights = (w.w_in, w.b_in, eau, w.b_eau, w.read)
    return lstmem_decode_step(
        x, *weights, cell, hidden, num_heads=layer.num_heads, norm_eps=K.NORM_EPS, **kwargs
    )


def _recurrence(backend: str, k, i_e, f, o, cell, hidden, depth_term, valid):
    """eq:write and eq:hidden for one token without gradients (its read ``r^time`` is already
    taken): the kernel family's decode step on ``backend``, writing the new states into fresh tensors
    (the caller's states change only when its pass commits). ``k`` rows ``(B, n_h, 1, r)``, ``i_e, f,
    o`` columns ``(B, n_h, r, 1)``, states and ``depth_term`` ``(B, n_h, r, r)``, ``valid``
    ``(B, 1)`` or ``None``; returns ``(C_t, D_t)``."""
    new_cell, new_hidden = _step_states(cell, hidden)
    valid = None if valid is None else valid.view(-1)
    lstmem_step(
        None,
        k,
        i_e,
        f,
        o,
        cell,
        hidden,
        depth_term,
        valid,
        backend=backend,
        out=(new_cell, new_hidden),
    )
    return new_cell, new_hidden


def _ones_beside_e(m: torch.Tensor, ds: int, bias: bool = False) -> torch.Tensor:
    """A map (or its bias, ``bias=True``) whose columns are ``[e | a | u]`` with ``3 d_s`` columns
    after ``e``: zero weights, or ones in the bias. Its product ``[e | 1 | a | u]`` gives
    ``[i e | f | o | g]`` in one GLU (``first half * sigmoid(second half)``) of its first ``8 d_s``
    columns: ``1 * sigmoid`` is exact, so the gates are those of eq:gates."""
    e, rest = m.split([ds, m.shape[-1] - ds], dim=-1)
    pad = (torch.ones if bias else torch.zeros)(*m.shape[:-1], 3 * ds, dtype=m.dtype, device=m.device)
    return torch.cat([e, pad, rest], dim=-1)


def _time_reads(qk: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``[D_{t-1} q_t; D_{t-1} k_t]`` per head for one token: ``qk`` ``(B n_h, 2, r)``, ``hidden``
    ``(B, n_h, r, r)`` -> ``(B n_h, 2, r)``, computed and returned in float32 (float64 when either
    is), as the recurrence computes its reads."""
    cd = torch.float64 if torch.float64 in (qk.dtype, hidden.dtype) else torch.float32
    R = qk.shape[-1]
    return torch.bmm(cast(qk, cd), cast(hidden, cd).reshape(-1, R, R).transpose(1, 2))


def _step_states(cell: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised float32 (or float64) tensors the decode step writes the new states into: the
    caller's states (a cache's, a checkpoint's) are never written."""
    dtype = cell.dtype if cell.dtype in (torch.float32, torch.float64) else torch.float32
    return torch.empty_like(cell, dtype=dtype), torch.empty_like(hidden, dtype=dtype)
