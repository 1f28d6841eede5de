"""Triton kernels for one token: the whole decode step of one memory layer (one launch per layer and
token, :func:`decode_step_triton`), and the recurrence's step alone (:func:`step_triton`: one
program per ``(batch, head)`` reads the states, produces the read from the old hidden state and
writes the new states back in place, in the states' dtype). As in :mod:`lstmem_kernels.scan.chunked`, each kernel's
body stays whole: one kernel is one launch.

For one token per sequence, a memory layer (:func:`lstmem_kernels.lstmem_decode_step`) projects its
input row, normalises the query and key per head, reads the depth input, forms the write residual,
the gates and the depth part of the read with one affine map, runs one step of the recurrence and
finishes the read. With the layer's derived weights (``LayerWeights``: ``w_in``, ``b_in``, ``eau``,
``b_eau``, ``read``), per sequence and with ``d_s = n_h r``::

    proj   = x w_in + b_in                     [q^[j]; k^[j]] head by head (2 d_s), then s = [v; z]
    q, k   = n(proj[:2 d_s])                   tanh, then l2 within each head (denominator >= 1e-6)
    reads  = [D^(l-1) q; D^(l-1) k] per head    [r^dep^[j]; p^dep^[j]] head by head (with depth only)
    eau    = [s, reads] eau + b_eau             [e | i | f | o | g | u_dep] (gates pre-sigmoid)
    r_time = D_{t-1} q                          per head, from the state before the update
    C_t    = diag(f) C_{t-1} + (i * e) k^T
    D_t    = diag(o) tanh(C_t) + diag(g) D^(l-1)
    u      = u_dep + r_time read[:d_s]

and at a padded row (``valid`` false) ``C`` and ``D`` keep their values (the read ``u`` is still
produced). Without a depth input ``reads`` is zero and only the first ``2 d_s`` rows of ``eau`` act.

Kernel design
-------------
One program per batch row (grid ``B``): the affine map ``eau`` mixes heads, so a row's heads cannot
be split across programs without a second pass. Every per-head quantity lives in a register tile
indexed ``(head, lane)``, ``BLOCK_H x BLOCK_R`` (``n_h`` and ``r`` rounded up to powers of two); a
pair of such quantities (``[q; k]``, ``[v; z]``, ``[r^dep; p^dep]``) is a ``(2, BLOCK_H, BLOCK_R)``
tile, the six outputs of ``eau`` one ``(8, BLOCK_H, BLOCK_R)`` tile (two pieces of padding), and the
states ``(BLOCK_H, BLOCK_R, BLOCK_R)`` tiles. Padding lanes are masked on every load and store and
stay exactly zero, so ``r`` and ``n_h`` need not be powers of two. Each weight is addressed where it
lies (through its strides), so the tiles come straight out of the ``LayerWeights`` layout and no
input is copied or converted before the launch. All arithmetic is float32; inputs may be float32,
bfloat16 or float16, states any float dtype (stored back in the dtype of the output tensors).

1. Projection: a loop over ``d`` in chunks of ``BLOCK_D`` accumulates ``x w_in`` for the
   ``[q; k]`` and ``[v; z]`` tiles (``(BLOCK_D, 2, BLOCK_H, BLOCK_R)`` weight tiles, summed over the
   chunk), so ``d`` may be any size; ``BLOCK_D`` keeps the two tiles near ``_TILE`` elements.
2. ``n(.)`` on the ``[q; k]`` tile: tanh, then a sum of squares over the lane axis per head.
3. Depth reads: the ``(BLOCK_H, BLOCK_R, BLOCK_R)`` depth tile times the ``[q; k]`` tile, summed
   over the last lane axis (kept for the ``g D^(l-1)`` term of step 5).
4. ``eau``: a loop over the input heads. Head ``j``'s inputs are picked out of the tiles with a
   masked sum over the head axis; for each of the six output pieces a
   ``(2, BLOCK_R, BLOCK_H, BLOCK_R)`` weight tile (head ``j``'s rows, every output column of the
   piece) is multiplied and summed, and the result added into its piece of the output tile. A tile
   is at most ``2 r d_s`` elements (16,384 at ``r = 32``, ``d_s = 256``), never ``d_s^2``.
5. Gates (sigmoid), the read of the old hidden state and the recurrence on the state tiles; padded
   rows select the loaded states, so they are written back bit for bit.
6. ``u``: ``u_dep`` plus a loop over heads of ``r_time^[j]`` times its rows of ``read``.

No product uses ``tl.dot``: every dimension is small (``r`` may be below 16) and broadcast products
reduced with ``tl.sum`` also run well under the interpreter. ``triton.language`` has no ``tanh``;
as in :mod:`lstmem_kernels.scan.chunked` it is written inline (``2 / (1 + exp(-2x)) - 1``, exponent clamped to 80),
and so is the sigmoid (``1 / (1 + exp(-x))``, same clamp), rather than called as jit helpers: the
interpreter re-patches ``triton.language`` on every nested jit call.

On a machine without a GPU the kernel runs on CPU tensors under the Triton interpreter, which
must be enabled by setting ``TRITON_INTERPRET=1`` before this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import FLOAT_DTYPES, check_runtime, contiguous, device_guard, tile_config, validate

__all__ = ["decode_step_triton", "step_triton"]

#: target number of elements of one weight tile (one program's registers on a GPU)
_TILE = 4096


# Long on purpose: one kernel is one launch, and its body stays whole (module docstring).
@triton.jit
def _decode_step_kernel(
    x_ptr,
    w_in_ptr,
    b_in_ptr,
    eau_ptr,
    b_eau_ptr,
    read_ptr,
    cell_ptr,
    hidden_ptr,
    depth_ptr,
    valid_ptr,
    cell_out_ptr,
    hidden_out_ptr,
    u_ptr,
    slots_ptr,
    seq_ptr,
    d,
    H,
    R,
    sx_b,
    sx_d,
    sw_r,
    sw_c,
    sb_in,
    se_r,
    se_c,
    sb_eau,
    sr_r,
    sr_c,
    sc_b,
    sc_h,
    sc_r,
    sc_c,
    sh_b,
    sh_h,
    sh_r,
    sh_c,
    sd_b,
    sd_h,
    sd_r,
    sd_c,
    sco_b,
    sco_h,
    sco_r,
    sco_c,
    sho_b,
    sho_h,
    sho_r,
    sho_c,
    ss_b,
    ss_h,
    ss_r,
    ss_c,
    eps,
    HAS_DEPTH: tl.constexpr,
    HAS_VALID: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The decode step of one batch row (see the module docstring for the math and the tiles).

    Every tensor is addressed through its strides (``s<name>_<axis>``); ``valid`` is ``(B,)`` uint8;
    ``u`` is a contiguous ``(B, d_s)`` output. With ``HAS_SLOTS`` row ``b``'s states are row
    ``slots[b]`` of the state tables (read, then written: in place when the outputs are the tables;
    a negative slot, vLLM's padding of a CUDA graph's batch, reads zero states and writes none);
    with ``HAS_SEQ`` ``D_t`` also goes to row ``b`` of ``seq``.
    """
    b = tl.program_id(0).to(tl.int64)
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + b).to(tl.int64)  # negative: a serving engine's padding row
        row = tl.maximum(slot, 0)
    else:
        row = b
    DS = H * R
    # (head, lane) index tiles, alone and under a leading piece axis of 2 or 8
    h2 = tl.arange(0, BLOCK_H)[:, None]
    r2 = tl.arange(0, BLOCK_R)[None, :]
    m2 = (h2 < H) & (r2 < R)
    p3 = tl.arange(0, 2)[:, None, None]
    h3 = h2[None]
    r3 = r2[None]
    m3 = m2[None]
    o3 = tl.arange(0, 8)[:, None, None]

    # 1. proj = x w_in + b_in, as the [q; k] and [v; z] tiles. Columns: head j's q then k (2 r each),
    #    then v and z (d_s each).
    col_qk = h3 * (2 * R) + p3 * R + r3
    col_s = 2 * DS + p3 * DS + h3 * R + r3
    acc_qk = tl.load(b_in_ptr + col_qk * sb_in, mask=m3, other=0.0).to(tl.float32)
    acc_s = tl.load(b_in_ptr + col_s * sb_in, mask=m3, other=0.0).to(tl.float32)
    dd = tl.arange(0, BLOCK_D)
    for d0 in range(0, d, BLOCK_D):
        di = d0 + dd
        d_mask = di < d
        xv = tl.load(x_ptr + b * sx_b + di * sx_d, mask=d_mask, other=0.0).to(tl.float32)
        xv = xv[:, None, None, None]
        w_rows = w_in_ptr + di[:, None, None, None] * sw_r
        chunk_mask = d_mask[:, None, None, None] & m3[None]
        w_qk = tl.load(w_rows + col_qk[None] * sw_c, mask=chunk_mask, other=0.0).to(tl.float32)
        acc_qk += tl.sum(xv * w_qk, axis=0)
        w_s = tl.load(w_rows + col_s[None] * sw_c, mask=chunk_mask, other=0.0).to(tl.float32)
        acc_s += tl.sum(xv * w_s, axis=0)

    # 2. n(.): tanh, then l2 within each head (padding heads are zero and stay zero)
    t = 2.0 / (1.0 + tl.exp(tl.minimum(-2.0 * acc_qk, 80.0))) - 1.0
    norm = tl.sqrt(tl.sum(t * t, axis=2))
    qk = t / tl.maximum(norm, eps)[:, :, None]
    q = tl.sum(tl.where(p3 == 0, qk, 0.0), axis=0)
    k = tl.sum(tl.where(p3 == 1, qk, 0.0), axis=0)

    # 3. reads[p, j, a] = sum_c D^(l-1)[j, a, c] [q; k][p, j, c]
    st_h = h2[:, :, None]  # (head, row, column) index tiles of a state
    st_r = r2[:, :, None]
    st_c = r2[:, None, :]
    st_mask = (st_h < H) & (st_r < R) & (st_c < R)
    if HAS_DEPTH:
        dep = tl.load(
            depth_ptr + b * sd_b + st_h * sd_h + st_r * sd_r + st_c * sd_c, mask=st_mask, other=0.0
        ).to(tl.float32)
        reads = tl.sum(dep[None] * qk[:, :, None, :], axis=3)

    # 4. eau = [s, reads] eau + b_eau as the (8, head, lane) tile [e | i | f | o | g | u_dep | pad]
    eau = tl.load(b_eau_ptr + (o3 * DS + h3 * R + r3) * sb_eau, mask=(o3 < 6) & m3, other=0.0).to(tl.float32)
    p_in = tl.arange(0, 2)[:, None]  # input piece: v or z (r^dep or p^dep)
    lane_in = tl.arange(0, BLOCK_R)[None, :]
    eau_mask = (lane_in < R)[:, :, None, None] & m2[None, None]
    for j in range(H):
        head = h3 == j
        s_j = tl.sum(tl.where(head, acc_s, 0.0), axis=1)[:, :, None, None]
        rows_sj = eau_ptr + (p_in * DS + j * R + lane_in)[:, :, None, None] * se_r
        if HAS_DEPTH:
            reads_j = tl.sum(tl.where(head, reads, 0.0), axis=1)[:, :, None, None]
            rows_rj = eau_ptr + (2 * DS + j * (2 * R) + p_in * R + lane_in)[:, :, None, None] * se_r
        for piece in tl.static_range(6):
            cols = ((piece * DS + h2 * R + r2) * se_c)[None, None]
            w_sj = tl.load(rows_sj + cols, mask=eau_mask, other=0.0).to(tl.float32)
            part = tl.sum(tl.sum(s_j * w_sj, axis=0), axis=0)
            if HAS_DEPTH:
                w_rj = tl.load(rows_rj + cols, mask=eau_mask, other=0.0).to(tl.float32)
                part += tl.sum(tl.sum(reads_j * w_rj, axis=0), axis=0)
            eau = tl.where(o3 == piece, eau + part[None], eau)

    # 5. gates, the read of D_{t-1} and the recurrence
    gates = 1.0 / (1.0 + tl.exp(tl.minimum(-eau, 80.0)))
    e = tl.sum(tl.where(o3 == 0, eau, 0.0), axis=0)
    i = tl.sum(tl.where(o3 == 1, gates, 0.0), axis=0)
    f = tl.sum(tl.where(o3 == 2, gates, 0.0), axis=0)
    o = tl.sum(tl.where(o3 == 3, gates, 0.0), axis=0)
    u = tl.sum(tl.where(o3 == 5, eau, 0.0), axis=0)
    if HAS_SLOTS:  # a padding row reads and writes no state (the slot is compared tile-wide: the
        # interpreter cannot combine a scalar predicate with a tile mask)
        state_mask = st_mask & ((st_h * 0 + slot) >= 0)
    else:
        state_mask = st_mask
    C_old = tl.load(
        cell_ptr + row * sc_b + st_h * sc_h + st_r * sc_r + st_c * sc_c, mask=state_mask, other=0.0
    )
    D_old = tl.load(
        hidden_ptr + row * sh_b + st_h * sh_h + st_r * sh_r + st_c * sh_c, mask=state_mask, other=0.0
    )
    C = C_old.to(tl.float32)
    D = D_old.to(tl.float32)
    r_time = tl.sum(D * q[:, None, :], axis=2)
    C_new = f[:, :, None] * C + (i * e)[:, :, None] * k[:, None, :]
    D_new = o[:, :, None] * (2.0 / (1.0 + tl.exp(tl.minimum(-2.0 * C_new, 80.0))) - 1.0)
    if HAS_DEPTH:
        g = tl.sum(tl.where(o3 == 4, gates, 0.0), axis=0)
        D_new += g[:, :, None] * dep
    C_new = C_new.to(cell_out_ptr.dtype.element_ty)
    D_new = D_new.to(hidden_out_ptr.dtype.element_ty)
    if HAS_VALID:
        keep = tl.load(valid_ptr + b) != 0
        C_new = tl.where(keep, C_new, C_old.to(cell_out_ptr.dtype.element_ty))
        D_new = tl.where(keep, D_new, D_old.to(hidden_out_ptr.dtype.element_ty))
    tl.store(cell_out_ptr + row * sco_b + st_h * sco_h + st_r * sco_r + st_c * sco_c, C_new, mask=state_mask)
    tl.store(
        hidden_out_ptr + row * sho_b + st_h * sho_h + st_r * sho_r + st_c * sho_c, D_new, mask=state_mask
    )
    if HAS_SEQ:
        tl.store(
            seq_ptr + b * ss_b + st_h * ss_h + st_r * ss_r + st_c * ss_c,
            D_new.to(seq_ptr.dtype.element_ty),
            mask=st_mask,
        )

    # 6. u = u_dep + r_time read[:d_s]
    lane = tl.arange(0, BLOCK_R)
    r_mask = (lane < R)[:, None, None] & m2[None]
    cols_u = (h2 * R + r2)[None] * sr_c
    for j in range(H):
        r_j = tl.sum(tl.where(h2 == j, r_time, 0.0), axis=0)[:, None, None]
        w_j = tl.load(read_ptr + (j * R + lane)[:, None, None] * sr_r + cols_u, mask=r_mask, other=0.0)
        u += tl.sum(r_j * w_j.to(tl.float32), axis=0)
    tl.store(u_ptr + b * DS + h2 * R + r2, u.to(u_ptr.dtype.element_ty), mask=m2)


def _fused_config(d: int, H: int, R: int) -> dict:
    """Block sizes and ``num_warps`` for one program's tiles: the projection loads two
    ``BLOCK_D x 2 d_s`` weight tiles per chunk, about ``_TILE`` elements together; a warp per 256
    elements of the largest tile, 16 at most.

    Chosen by compiling ahead of time (``lstmem_kernels.aot``; docs/benchmarks.md, 2026-11-27): at the
    paper's ``r = 8``, ``d_s = 32``, tiles of 8,192 elements with 8 warps spilled 40-52 B/thread on
    sm_80 with Triton 3.6, and with 16 warps 16 B/thread on sm_80 with Triton 3.9; tiles of 4,096
    with 16 warps spill with neither, on sm_90a or sm_80. At ``r = 32``, ``d_s = 256`` (16,384-element
    ``eau`` and depth-read tiles) 16 warps still spill on sm_90a with Triton 3.9 (48 B/thread; 160
    with 8)."""
    block_h, block_r = triton.next_power_of_2(H), triton.next_power_of_2(R)
    width = 2 * block_h * block_r  # columns of one projection weight tile
    block_d = max(1, min(triton.next_power_of_2(max(d, 1)), _TILE // (2 * width)))
    largest = max(2 * block_d * width, 2 * block_r * block_h * block_r, 2 * block_h * block_r * block_r)
    return {
        "BLOCK_D": block_d,
        "BLOCK_H": block_h,
        "BLOCK_R": block_r,
        "num_warps": max(1, min(16, largest // 256)),
    }


def _check(name: str, x: torch.Tensor, device: torch.device, dtypes: tuple[torch.dtype, ...]) -> None:
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} (the device of x); move it there")
    if x.dtype not in dtypes:
        names = ", ".join(str(t).removeprefix("torch.") for t in dtypes)
        raise ValueError(f"{name} has dtype {x.dtype}; the Triton decode step takes {names}")


# Long for its checks and the launch's argument list (every tensor is passed with its strides).
def decode_step_triton(
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
) -> torch.Tensor:
    """The Triton member of :func:`lstmem_kernels.lstmem_decode_step` (its contract): the decode
    step of one memory layer in one kernel launch (see the module docstring); ``norm_eps``: the
    lower bound of the l2 normalisation's denominator in ``n(.)``; ``slots``, the state rows of each
    batch row, and ``hidden_seq``, where ``D_t`` goes besides. It returns no feedback samples
    (``samples=True`` is refused: a step that needs them runs on the PyTorch member).

    Shapes are checked by :func:`lstmem_kernels.lstmem_decode_step`; this checks what the kernel
    needs besides: float32, bfloat16 or float16 for ``x``, the weights (one dtype) and ``depth``, any
    float dtype for the states, one device, and CUDA tensors unless the interpreter runs.

    Returns:
        ``u`` ``(B, d_s)`` in the dtype of the weights; ``C_t`` and ``D_t`` go into ``out``.
    """
    if samples:
        raise ValueError(
            "the Triton decode step returns no feedback samples; a step that needs them (block-end "
            "feedback) runs on the PyTorch member (backend='torch')"
        )
    device = x.device
    wdtype = w_in.dtype
    if (
        wdtype == torch.float64
        or x.dtype == torch.float64
        or (depth is not None and depth.dtype == torch.float64)
    ):
        raise ValueError(
            "the Triton decode step computes in float32 and takes float32, bfloat16 or float16 inputs and "
            "weights, got float64; a float64 adapter decodes in PyTorch (the layer's forward with backend 'torch')"
        )
    check_runtime(device)
    floats = (torch.float64, *FLOAT_DTYPES)
    _check("x", x, device, FLOAT_DTYPES)
    if wdtype not in FLOAT_DTYPES:
        raise ValueError(f"w_in has dtype {wdtype}; the weights must be float32, bfloat16 or float16")
    for name, t in (("b_in", b_in), ("eau", eau), ("b_eau", b_eau), ("read", read)):
        if t.dtype != wdtype:
            raise ValueError(
                f"{name} has dtype {t.dtype} but w_in has {wdtype}; pass the weights in one dtype "
                "(the layer's derived weights are)"
            )
        _check(name, t, device, (wdtype,))
    for name, t in (("cell", cell), ("hidden", hidden), ("cell_out", out[0]), ("hidden_out", out[1])):
        _check(name, t, device, floats)
    if depth is not None:
        _check("depth", depth, device, FLOAT_DTYPES)
    if valid is not None:
        _check("valid", valid, device, (torch.bool,))
    if slots is not None:
        _check("slots", slots, device, (torch.int64, torch.int32))
    if hidden_seq is not None:
        _check("hidden_seq", hidden_seq, device, floats)

    B, d = x.shape
    ds = read.shape[1]
    H = num_heads
    R = ds // H
    u = torch.empty((B, ds), dtype=wdtype, device=device)
    if B == 0:
        return u
    cell_out, hidden_out = out
    # strides of an absent depth input are never read (HAS_DEPTH is false)
    depth_strides = depth.stride() if depth is not None else (0, 0, 0, 0)
    seq_strides = hidden_seq.stride() if hidden_seq is not None else (0, 0, 0, 0)
    with device_guard(device):
        _decode_step_kernel[(B,)](
            x,
            w_in,
            b_in,
            eau,
            b_eau,
            read,
            cell,
            hidden,
            depth,
            None if valid is None else valid.view(torch.uint8),  # a view: no copy, no kernel
            cell_out,
            hidden_out,
            u,
            slots,
            hidden_seq,
            d,
            H,
            R,
            *x.stride(),
            *w_in.stride(),
            *b_in.stride(),
            *eau.stride(),
            *b_eau.stride(),
            *read.stride(),
            *cell.stride(),
            *hidden.stride(),
            *depth_strides,
            *cell_out.stride(),
            *hidden_out.stride(),
            *seq_strides,
            norm_eps,
            HAS_DEPTH=depth is not None,
            HAS_VALID=valid is not None,
            HAS_SLOTS=slots is not None,
            HAS_SEQ=hidden_seq is not None,
            **_fused_config(d, H, R),
        )
    return u


# ---------------------------------------------------------------------- the recurrence's step alone
@triton.jit
def _step_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    f_ptr,
    o_ptr,
    depth_ptr,
    valid_ptr,
    cell_ptr,
    hidden_ptr,
    read_ptr,
    H,
    R,
    cell_sb,
    cell_sh,
    cell_sr,
    cell_sc,
    hidden_sb,
    hidden_sh,
    hidden_sr,
    hidden_sc,
    HAS_DEPTH: tl.constexpr,
    HAS_VALID: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One decode step for one ``(b, h)`` pair.

    ``q, k, w, f, o, read`` are contiguous ``(B, H, R)``, ``depth`` contiguous ``(B, H, R, R)``,
    ``valid`` ``(B,)`` int8; ``cell`` and ``hidden`` ``(B, H, R, R)`` are addressed through their
    strides and updated in place.
    """
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    tile_mask = r_mask[:, None] & r_mask[None, :]
    vec = pid * R + r
    cell_tile = cell_ptr + b * cell_sb + h * cell_sh + r[:, None] * cell_sr + r[None, :] * cell_sc
    hidden_tile = hidden_ptr + b * hidden_sb + h * hidden_sh + r[:, None] * hidden_sr + r[None, :] * hidden_sc

    C = tl.load(cell_tile, mask=tile_mask, other=0.0).to(tl.float32)
    D = tl.load(hidden_tile, mask=tile_mask, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)
    f = tl.load(f_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)

    read = tl.sum(D * q[None, :], axis=1)
    tl.store(read_ptr + vec, read.to(read_ptr.dtype.element_ty), mask=r_mask)

    C_new = f[:, None] * C + w[:, None] * k[None, :]
    D_new = o[:, None] * (2.0 / (1.0 + tl.exp(tl.minimum(-2.0 * C_new, 80.0))) - 1.0)
    if HAS_DEPTH:
        D_new += tl.load(depth_ptr + pid * R * R + r[:, None] * R + r[None, :], mask=tile_mask, other=0.0).to(
            tl.float32
        )
    if HAS_VALID:
        keep = tl.load(valid_ptr + b) != 0
        C_new = tl.where(keep, C_new, C)
        D_new = tl.where(keep, D_new, D)
    tl.store(cell_tile, C_new.to(cell_ptr.dtype.element_ty), mask=tile_mask)
    tl.store(hidden_tile, D_new.to(hidden_ptr.dtype.element_ty), mask=tile_mask)


def step_triton(
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
    """One decode step (a single kernel launch), updating ``cell`` and ``hidden`` **in place**.

    Same semantics as :func:`~lstmem_kernels.step.naive.step_naive`; not differentiable.

    Args:
        q, k, w, f, o: ``(B, H, R)`` per-token inputs, one dtype among float32, bfloat16, float16.
        cell, hidden: ``(B, H, R, R)`` states of any floating dtype and any strides, overwritten
            with ``C_t`` and ``D_t`` (computed in float32, stored in their own dtype).
        depth: ``(B, H, R, R)`` depth term (dtype of ``q``) or ``None``.
        valid: ``(B,)`` bool or ``None``; where ``False`` the states are left unchanged.

    Returns:
        ``read`` ``(B, H, R)`` in ``q.dtype``: ``D_{t-1} q_t`` from the state before the update.

    Raises:
        ValueError: on inconsistent shapes, dtypes or devices.
        RuntimeError: if grad mode is enabled and an input requires grad.
    """
    if q.dim() != 3:
        raise ValueError(f"q must have shape (B, H, R), got {tuple(q.shape)}")
    B, H, R = q.shape
    inputs = {
        "q": q,
        "k": k,
        "w": w,
        "f": f,
        "o": o,
        "depth": depth,
        "valid": valid,
        "cell": cell,
        "hidden": hidden,
    }
    validate(
        inputs,
        vec_shape=(B, H, R),
        mat_shape=(B, H, R, R),
        state_shape=(B, H, R, R),
        valid_shape=(B,),
        state_names=("cell", "hidden"),
    )
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs.values()):
        raise RuntimeError(
            "step_triton is not differentiable and updates its states in place; call it under "
            "torch.no_grad() or with inputs that do not require grad"
        )
    q, k, w, f, o, depth = map(contiguous, (q, k, w, f, o, depth))
    read = torch.empty_like(q)
    if B * H > 0:
        with device_guard(q.device):
            _step_kernel[(B * H,)](
                q,
                k,
                w,
                f,
                o,
                depth,
                None if valid is None else valid.to(torch.int8).contiguous(),
                cell,
                hidden,
                read,
                H,
                R,
                *cell.stride(),
                *hidden.stride(),
                HAS_DEPTH=depth is not None,
                HAS_VALID=valid is not None,
                **tile_config(R),
            )
    return read
