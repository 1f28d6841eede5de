"""A memory layer's whole decode step in PyTorch operators: the PyTorch member of
:func:`lstmem_kernels.lstmem_decode_step` (:func:`decode_step_torch`), with the step's own maps
(:class:`StepMaps`, derived from the block maps the op takes and kept while those do not change).

The step reads ``D_{t-1}`` before it writes (eq:read before eq:write), so the temporal read
``r^time = D_{t-1} q`` is known together with the depth reads, and one product with the step's map
gives the residual, the gate pre-activations and the whole read ``u``; ones beside ``e`` make one GLU
of it the gated residual and the gates::

    proj = x w_in + b_in;   [q; k] = n(proj[:, :2 d_s]) per head;   s = [v; z] = proj[:, 2 d_s:]
    [e | 1 | a | u] = [s; D_{t-1} [q; k]; D^(l-1) [q; k]] StepMaps.depth + StepMaps.bias
    [i e | f | o | g] = GLU([e | 1 | a])
    C_t = diag(f) C_{t-1} + (i e) k^T,   D_t = diag(o) tanh(C_t) + diag(g) D^(l-1)

(without a depth input the rows of ``D^(l-1) [q; k]`` are left out: ``StepMaps.first``). The
recurrence is :func:`~lstmem_kernels.step.pytorch.step_torch`. Eager PyTorch runs each operator as
its own kernel: 13 per step, 15 with a depth input.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from ..precision import cast
from .pytorch import step_torch


class StepMaps(NamedTuple):
    """The one-token step's affine maps, from the block maps ``eau`` ``(2 d_s or 4 d_s, 6 d_s)``
    (rows ``[v; z]``, then ``[r^dep^[j]; p^dep^[j]]`` head by head; columns ``[e | a | u_dep]``),
    ``b_eau`` ``(6 d_s,)`` and ``read`` ``(2 d_s, d_s)`` (``W_read^T``).

    The rows of the temporal reads ``[r^time^[j]; D_{t-1}^[j] k^[j]]``, head by head, go after
    ``[v; z]``: ``W_read^time^T`` to the ``u`` columns and zeros for the second half (which the one
    batched product over ``[q^[j]; k^[j]]`` also yields). ``3 d_s`` columns go after ``e``: zero
    weights, ones in the bias, so that the product is ``[e | 1 | a | u]`` and one GLU (``first half *
    sigmoid(second half)``) of its first ``8 d_s`` columns is ``[i e | f | o | g]`` exactly.

    Attributes:
        first: ``(4 d_s, 9 d_s)`` ``[v; z; time reads] -> [e | 1 | a | u]`` (no depth input; the
            first rows of ``depth`` when that exists: a view).
        depth: ``(6 d_s, 9 d_s)`` ``[v; z; time reads; depth reads] -> [e | 1 | a | u]``, or ``None``
            when ``eau`` has no depth rows.
        bias: ``(9 d_s,)`` ``[-b_pred; 1; b_gate - G_e b_pred; b_read]``.
    """

    first: torch.Tensor
    depth: torch.Tensor | None
    bias: torch.Tensor


def arrange_step_maps(eau: torch.Tensor, b_eau: torch.Tensor, read: torch.Tensor, num_heads: int) -> StepMaps:
    """:class:`StepMaps` from the block maps (see there); differentiable, no cache."""
    ds = read.shape[1]
    H, R = num_heads, ds // num_heads
    zeros = read.new_zeros(ds, 5 * ds)  # r^time -> [e | a]: nothing
    t_rows = torch.cat([zeros, read[:ds]], 1)  # r^time -> u
    time_reads = torch.stack([t_rows.view(H, R, -1), torch.zeros_like(t_rows).view(H, R, -1)], 1)
    rows = torch.cat([eau[: 2 * ds], time_reads.reshape(2 * ds, -1), eau[2 * ds :]])
    full = _ones_beside_e(rows, ds)
    bias = _ones_beside_e(b_eau, ds, bias=True)
    if eau.shape[0] == 2 * ds:
        return StepMaps(full, None, bias)
    return StepMaps(full[: 4 * ds], full, bias)


#: id(eau) -> (weak references to eau, b_eau, read; their versions; num_heads; the maps)
_MAPS: dict[int, tuple] = {}


def step_maps(eau: torch.Tensor, b_eau: torch.Tensor, read: torch.Tensor, num_heads: int) -> StepMaps:
    """:func:`arrange_step_maps`, kept while the same three tensors are passed unchanged: built
    again when one of them is another tensor or was written in place (its version counter moved;
    inference tensors have none, so an in-place write to one is not seen), and forgotten when
    ``eau`` is freed. A layer that passes its cached derived weights builds the
    maps once, not per token.

    Inside a ``torch.compile`` graph the kept maps are used without the version check (a version
    counter is not part of a graph; the caller's cached weights are not checked there either), and
    maps that were never built are built in the graph."""
    entry = _MAPS.get(id(eau))
    if entry is not None:
        refs, versions, heads, maps = entry
        same = all(r() is t for r, t in zip(refs, (eau, b_eau, read), strict=True)) and heads == num_heads
        if same and (torch.compiler.is_compiling() or versions == _versions(eau, b_eau, read)):
            return maps
    with torch.no_grad():
        maps = arrange_step_maps(eau, b_eau, read, num_heads)
    if not torch.compiler.is_compiling():
        key = id(eau)
        refs = (
            weakref.ref(eau, lambda _, key=key: _MAPS.pop(key, None)),
            weakref.ref(b_eau),
            weakref.ref(read),
        )
        _MAPS[key] = (refs, _versions(eau, b_eau, read), num_heads, maps)
    return maps


def _versions(*tensors: torch.Tensor) -> tuple:
    """The tensors' version counters (``None`` for an inference tensor, which has none: such
    weights are told apart by identity alone)."""
    return tuple(None if t.is_inference() else t._version for t in tensors)


class DecodeSamples(NamedTuple):
    """The feedback samples of one step (``samples=True``): ``(B, n_h, r)`` each, in the weights'
    dtype: the key ``k_t``, the value ``v_t``, and the gates ``o_t`` and ``g_t``."""

    key: torch.Tensor
    value: torch.Tensor
    out_gate: torch.Tensor
    depth_gate: torch.Tensor


# Long for its signature (the op's) and the slots' gather and write-back around the step.
def decode_step_torch(
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
    """The PyTorch member of :func:`lstmem_kernels.lstmem_decode_step` (its contract; the math in
    the module docstring), computing in the weights' dtype and the recurrence in float32 (float64
    for float64 weights or states).

    With ``slots`` the rows are gathered from the tables (``index_select``), stepped, and written
    back into the ``out`` tables (``index_copy_``); ``D_t`` is made in ``hidden_seq`` when that is a
    float32 (or, for float64 states, float64) tensor, so that giving it costs nothing. Slots must be
    non-negative here: a padding slot ``-1`` (only a full CUDA graph pads, and that needs the Triton
    member) is the naive and Triton members'.
    """
    weights = (w_in, b_in, eau, b_eau, read)
    if slots is None:
        u, found = _step(x, weights, cell, hidden, num_heads, out, depth, valid, norm_eps, samples)
        if hidden_seq is not None:
            hidden_seq.copy_(out[1])
        return (u, found) if samples else u
    # state tables: the rows gathered, stepped into fresh tensors (D_t straight into hidden_seq where
    # its dtype allows), and written back into the out tables
    rows = cell.index_select(0, slots), hidden.index_select(0, slots)
    new_cell, new_hidden = fresh_states(*rows)
    if hidden_seq is not None and hidden_seq.dtype == new_hidden.dtype:
        new_hidden = hidden_seq
    u, found = _step(x, weights, *rows, num_heads, (new_cell, new_hidden), depth, valid, norm_eps, samples)
    out[0].index_copy_(0, slots, cast(new_cell, out[0].dtype))
    out[1].index_copy_(0, slots, cast(new_hidden, out[1].dtype))
    if hidden_seq is not None and hidden_seq is not new_hidden:
        hidden_seq.copy_(new_hidden)
    return (u, found) if samples else u


def _step(x, weights, cell, hidden, num_heads, out, depth, valid, norm_eps, samples):
    """The step of the module docstring on ``B`` rows, the new states into ``out``; returns ``u``
    and the feedback samples (``None`` unless ``samples``)."""
    w_in, b_in, eau, b_eau, read = weights
    B = x.shape[0]
    ds = read.shape[1]
    H, R = num_heads, ds // num_heads
    dtype = w_in.dtype
    maps = step_maps(eau, b_eau, read, H)
    # eq:projections, with z of eq:gates from the same product
    proj = torch.addmm(b_in, cast(x, dtype), w_in)  # (B, 4 d_s): [W_q x, W_k x (by head); W_v x; W_x x + b_x]
    qk, s = proj.split_with_sizes([2 * ds, 2 * ds], 1)  # s = [v; z]
    qk = torch.tanh(qk).view(B * H, 2, R)
    qk = qk / torch.linalg.vector_norm(qk, dim=-1, keepdim=True).clamp_min(norm_eps)  # [q^[j]; k^[j]]
    # eq:read (time), before eq:write changes D: [q; k] D_{t-1}^T per head, one product
    parts = [s, cast(_time_reads(qk, hidden), dtype).view(B, 2 * ds)]
    if depth is not None:
        depth = cast(depth, dtype)
        # eq:read (depth) and p^dep of eq:residual: [q; k] D^(l-1)^T per head, one product
        parts.append(torch.bmm(qk, depth.reshape(B * H, R, R).transpose(1, 2)).view(B, 2 * ds))
    # eq:residual, eq:gates and eq:read's u; one GLU gives [i e | f | o | g] as the columns
    # (B, n_h, r, 1) and k as the rows (B, n_h, 1, r) that eq:write multiplies
    step_map = maps.first if depth is None else maps.depth
    gated, u = torch.addmm(maps.bias, torch.cat(parts, 1), step_map).split_with_sizes([8 * ds, ds], 1)
    i_e, f, o, g = torch.nn.functional.glu(gated).view(B, 4, H, R, 1).unbind(1)
    _, k = qk.view(B, H, 2, 1, R).unbind(2)
    depth_term = None if depth is None else g * depth.view(B, H, R, R)
    # eq:write, eq:hidden: the recurrence's PyTorch step (its read r^time is already taken)
    step_torch(None, k, i_e, f, o, cell, hidden, depth_term, valid, out=out)
    if not samples:
        return u, None
    found = DecodeSamples(k.view(B, H, R), s[:, :ds].view(B, H, R), o.view(B, H, R), g.view(B, H, R))
    return u, found


def fresh_states(cell: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised float32 (float64 for float64 states) tensors for a step's new states, so that
    the states it read are never written."""
    dtype = cell.dtype if cell.dtype in (torch.float32, torch.float64) else torch.float32
    return torch.empty_like(cell, dtype=dtype), torch.empty_like(hidden, dtype=dtype)


def _ones_beside_e(m: torch.Tensor, ds: int, bias: bool = False) -> torch.Tensor:
    """A map (or its bias, ``bias=True``) whose columns are ``[e | a | u]`` with ``3 d_s`` columns
    after ``e``: zero weights, or ones in the bias (``1 * sigmoid`` is exact, so the GLU's gates are
    those of eq:gates)."""
    e, rest = m.split([ds, m.shape[-1] - ds], dim=-1)
    pad = (torch.ones if bias else torch.zeros)(*m.shape[:-1], 3 * ds, dtype=m.dtype, device=m.device)
    return torch.cat([e, pad, rest], dim=-1)


def _time_reads(qk: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``[D_{t-1} q; D_{t-1} k]`` per head: ``qk`` ``(B n_h, 2, r)``, ``hidden`` ``(B, n_h, r, r)`` ->
    ``(B n_h, 2, r)``, computed and returned in float32 (float64 when either is), as the recurrence
    computes its reads."""
    cd = torch.float64 if torch.float64 in (qk.dtype, hidden.dtype) else torch.float32
    R = qk.shape[-1]
    return torch.bmm(cast(qk, cd), cast(hidden, cd).reshape(-1, R, R).transpose(1, 2))
