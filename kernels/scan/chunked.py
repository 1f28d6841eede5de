"""Triton kernels for the LSTMem block scan, forward and backward: the paper's parallel scan over
time (App. C.3), computed in chunks. The one-token steps are in :mod:`lstmem_kernels.step.fused`.

The recurrence (see :mod:`lstmem_kernels.scan.naive`, the specification) is, per sequence ``b``, head ``h`` and
time ``t``, with ``R x R`` states ``C`` (cell) and ``D`` (hidden) and gates acting row-wise::

    read_t = D_{t-1} q_t
    C_t    = diag(f_t) C_{t-1} + w_t k_t^T
    D_t    = diag(o_t) tanh(C_t) + depth_t

and at a padding position (``valid[b, t]`` false) the read is produced but ``C`` and ``D`` are
carried over unchanged.

The parallel scan
-----------------
The cell update is the affine map ``C_t = A_t C_{t-1} + B_t`` with ``A_t = diag(f_t)`` and
``B_t = w_t k_t^T`` (a padding position is the identity map, ``A = I``, ``B = 0``), and affine maps
compose associatively, ``(A2, B2) o (A1, B1) = (A2 A1, A2 B1 + B2)``. The block of ``T`` tokens is
cut into ``n_c = ceil(T / L)`` chunks of ``L`` tokens (:func:`chunk_length`), and the forward runs
in two launches:

1. **Summaries** (``_fwd_summary_kernel``, grid ``(B * H, n_c - 1)``): each program composes the maps
   of one chunk into ``(A_c, B_c)`` (``A_c`` diagonal: a length-``R`` vector) and records the chunk's
   last valid position. It walks ``L`` tokens.
2. **Replay** (``_fwd_replay_kernel``, grid ``(B * H, n_c)``): each program first applies the
   summaries of the chunks before its own to the block's initial state (at most ``n_c - 1``
   steps of one vector-times-tile and one add: the scan over the chunks, done by every program for
   itself, so that no launch waits on another program), which gives ``C`` entering its chunk. ``D``
   entering the chunk is ``D`` at the last valid position before it, ``o_s tanh(C) + depth_s``: a
   padding position changes neither state, so ``C`` at that position is ``C`` entering the chunk.
   Then it replays its ``L`` tokens as the recurrence above, writing the reads and hidden states
   (and the float32 cells, for the backward). The last chunk's program writes the final states.

No program walks more than ``n_c - 1 + L`` dependent steps, and each launch runs ``B * H * n_c``
(or ``B * H * (n_c - 1)``) programs: at batch 1, ``n_h = 4`` and ``T = 2,048`` that is ``L = 32``,
256 programs (252 for the summaries) of at most 95 steps, where a sequential scan runs 4 programs of
2,048 steps. With a
single chunk (``T`` up to :data:`SINGLE_CHUNK_MAX`, or ``chunk >= T``) the replay alone runs, from
the initial states: one launch of ``B * H`` programs walking the block, the sequential scan.

The backward is the same scan in reverse time. The adjoints carried from later positions,
``dC`` (of ``C_t``) and ``dD`` (of ``D_t``), follow a map that is affine in the pair: per element,
``dC <- F dC + Q dD + P`` and ``dD <- E dD + N`` (``F`` and ``E`` row vectors, ``Q, P, N`` tiles; ``E``
is 1 when the chunk is all padding and 0 otherwise, since ``D_t`` at a valid position does not depend on
``D_{t-1}``). ``_bwd_summary_kernel`` composes each chunk's map from the right (grid
``(B * H, n_c - 1)``, chunk 0 needs none); ``_bwd_replay_kernel`` (grid ``(B * H, n_c)``) applies the
summaries of the chunks after its own to the final-state gradients, then walks its chunk backwards
writing every input gradient; chunk 0 writes the initial states' gradients.

Kernel design
-------------
A program keeps its pair's ``R x R`` states as ``BLOCK_R x BLOCK_R`` float32 register tiles
(``BLOCK_R`` is ``R`` rounded up to a power of two; the padding lanes are masked on every load and
store and stay exactly zero). All arithmetic is float32 whatever the storage dtype; the summaries
are float32 buffers of ``B * H * n_c`` tiles. What the backward needs is saved by the forward: the
inputs, the ``hidden`` output (in the input dtype: with bfloat16 inputs the ``q`` gradient sees the
rounded ``D_{t-1}``) and the float32 cell sequence; nothing is recomputed by a second forward pass.
The backward is not differentiable.

``triton.language`` has no ``tanh``; it is written inline as ``2 / (1 + exp(-2x)) - 1`` with the
exponent clamped to 80 (no overflow; absolute error of a few float32 ulps). It is inlined rather
than a ``@triton.jit`` helper because the interpreter re-patches ``triton.language`` on every
nested jit call, which would dominate its per-step cost. For the same reason, and because one kernel
is one launch, each kernel's body stays whole, however long.

On a machine without a GPU the kernels run on CPU tensors under the Triton interpreter, which
must be enabled by setting ``TRITON_INTERPRET=1`` before this module is imported.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..triton_common import contiguous, device_guard, tile_config, validate

__all__ = ["SINGLE_CHUNK_MAX", "chunk_length", "scan_triton"]

#: blocks of at most this many tokens are scanned as one chunk (one launch, one walk per pair)
SINGLE_CHUNK_MAX = 64


def chunk_length(T: int) -> int:
    """The chunk length ``L`` the scan uses for a block of ``T`` tokens.

    Up to :data:`SINGLE_CHUNK_MAX` tokens, one chunk (``L = T``). Longer blocks take the power of two
    nearest above ``sqrt(T / 2)``, within ``[16, 1024]``: a replay program walks ``n_c - 1 + L``
    steps (the chunks before its own, then its tokens) and a summary program ``L``, so the longest
    walk ``2 L + T / L`` is least near ``L = sqrt(T / 2)``. ``T = 2,048`` gives ``L = 32``,
    ``n_c = 64``; ``T = 131,072`` (one 128K block) ``L = 256``, ``n_c = 512``.
    """
    if T <= SINGLE_CHUNK_MAX:
        return max(T, 1)
    return min(1024, max(16, triton.next_power_of_2(math.ceil(math.sqrt(T / 2)))))


# Long on purpose: one kernel is one launch, and its body stays whole (module docstring).
@triton.jit
def _fwd_summary_kernel(
    k_ptr,
    w_ptr,
    f_ptr,
    valid_ptr,
    a_ptr,
    b_ptr,
    last_ptr,
    T,
    H,
    R,
    L,
    NC,
    HAS_VALID: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Compose the cell maps of chunk ``c`` (``program_id(1)``) of one ``(b, h)`` pair.

    Writes ``A_c`` (the product of the chunk's forget gates, valid positions only) into ``a``
    ``(B * H, NC, R)``, ``B_c = sum_s (prod_{u > s} f_u) w_s k_s^T`` into ``b`` ``(B * H, NC, R, R)``
    (both float32) and the chunk's last valid position (``-1``: none) into ``last`` ``(B * H, NC)``
    int32. Vectors are contiguous ``(B, T, H, R)``; ``valid`` is ``(B, T)`` int8.
    """
    pid = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    b = pid // H
    h = pid % H
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    tile = r[:, None] * R + r[None, :]
    tile_mask = r_mask[:, None] & r_mask[None, :]
    vec_step = H * R
    start = c * L
    end = tl.minimum(start + L, T)
    vec_off = (b * T + start) * vec_step + h * R

    A = tl.full([BLOCK_R], 1.0, tl.float32)
    Bc = tl.zeros([BLOCK_R, BLOCK_R], dtype=tl.float32)
    last = end - 1
    if HAS_VALID:
        last = start - 1 - start  # -1, as a tensor the loop can carry
    for t in range(start, end):
        vec = vec_off + r
        k = tl.load(k_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)
        f = tl.load(f_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)
        B_new = f[:, None] * Bc + w[:, None] * k[None, :]
        if HAS_VALID:
            keep = tl.load(valid_ptr + b * T + t) != 0
            A = tl.where(keep, f * A, A)
            Bc = tl.where(keep, B_new, Bc)
            last = tl.where(keep, t, last)
        else:
            A = f * A
            Bc = B_new
        vec_off += vec_step

    summary = pid * NC + c
    tl.store(a_ptr + summary * R + r, A, mask=r_mask)
    tl.store(b_ptr + summary * R * R + tile, Bc, mask=tile_mask)
    tl.store(last_ptr + summary, last.to(tl.int32))


# Long on purpose: one kernel is one launch, and its body stays whole (module docstring).
@triton.jit
def _fwd_replay_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    f_ptr,
    o_ptr,
    depth_ptr,
    valid_ptr,
    c0_ptr,
    d0_ptr,
    a_ptr,
    b_ptr,
    last_ptr,
    read_ptr,
    hidden_ptr,
    cells_ptr,
    final_cell_ptr,
    final_hidden_ptr,
    T,
    H,
    R,
    L,
    NC,
    CHUNKED: tl.constexpr,
    HAS_DEPTH: tl.constexpr,
    HAS_VALID: tl.constexpr,
    HAS_C0: tl.constexpr,
    HAS_D0: tl.constexpr,
    SAVE_CELLS: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Forward scan of chunk ``c`` (``program_id(1)``) of one ``(b, h)`` pair.

    Vectors are contiguous ``(B, T, H, R)``, matrices ``(B, T, H, R, R)``, states ``(B, H, R, R)``,
    ``valid`` is ``(B, T)`` int8, the summaries those of ``_fwd_summary_kernel`` (read only when
    ``CHUNKED``). ``cells`` (float32, ``C_t`` after step ``t``, same layout as ``hidden``) is only
    written when ``SAVE_CELLS``; the final states only by the last chunk's program.
    """
    pid = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    b = pid // H
    h = pid % H
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    tile = r[:, None] * R + r[None, :]
    tile_mask = r_mask[:, None] & r_mask[None, :]
    vec_step = H * R
    mat_step = H * R * R
    state = pid * R * R + tile

    if HAS_C0:
        C = tl.load(c0_ptr + state, mask=tile_mask, other=0.0).to(tl.float32)
    else:
        C = tl.zeros([BLOCK_R, BLOCK_R], dtype=tl.float32)
    if HAS_D0:
        D = tl.load(d0_ptr + state, mask=tile_mask, other=0.0).to(tl.float32)
    else:
        D = tl.zeros([BLOCK_R, BLOCK_R], dtype=tl.float32)

    if CHUNKED:
        # The scan over the chunks before this one: C <- A_j C + B_j; D is D at the chunk's last
        # valid position s, where C equals C after the chunk (padding changes no state).
        for j in range(0, c):
            summary = pid * NC + j
            A = tl.load(a_ptr + summary * R + r, mask=r_mask, other=0.0)
            C = A[:, None] * C + tl.load(b_ptr + summary * R * R + tile, mask=tile_mask, other=0.0)
            s = tl.load(last_ptr + summary).to(tl.int64)
            has = s >= 0
            at_s = b * T + s
            o = tl.load(o_ptr + at_s * vec_step + h * R + r, mask=tl.where(has, r_mask, False), other=0.0).to(
                tl.float32
            )
            D_s = o[:, None] * (2.0 / (1.0 + tl.exp(tl.minimum(-2.0 * C, 80.0))) - 1.0)
            if HAS_DEPTH:
                D_s += tl.load(
                    depth_ptr + at_s * mat_step + h * R * R + tile,
                    mask=tl.where(has, tile_mask, False),
                    other=0.0,
                ).to(tl.float32)
            D = tl.where(has, D_s, D)

    start = c * L
    end = tl.minimum(start + L, T)
    vec_off = (b * T + start) * vec_step + h * R
    mat_off = (b * T + start) * mat_step + h * R * R
    for t in range(start, end):
        vec = vec_off + r
        mat = mat_off + tile
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
            D_new += tl.load(depth_ptr + mat, mask=tile_mask, other=0.0).to(tl.float32)
        if HAS_VALID:
            keep = tl.load(valid_ptr + b * T + t) != 0
            C = tl.where(keep, C_new, C)
            D = tl.where(keep, D_new, D)
        else:
            C = C_new
            D = D_new

        tl.store(hidden_ptr + mat, D.to(hidden_ptr.dtype.element_ty), mask=tile_mask)
        if SAVE_CELLS:
            tl.store(cells_ptr + mat, C, mask=tile_mask)
        vec_off += vec_step
        mat_off += mat_step

    at_last = tl.where(c == NC - 1, tile_mask, False)  # only the last chunk's program ends the block
    tl.store(final_cell_ptr + state, C.to(final_cell_ptr.dtype.element_ty), mask=at_last)
    tl.store(final_hidden_ptr + state, D.to(final_hidden_ptr.dtype.element_ty), mask=at_last)


# Long on purpose: one kernel is one launch, and its body stays whole (module docstring).
@triton.jit
def _bwd_summary_kernel(
    q_ptr,
    f_ptr,
    o_ptr,
    valid_ptr,
    cells_ptr,
    g_read_ptr,
    g_hidden_ptr,
    fs_ptr,
    qs_ptr,
    ps_ptr,
    es_ptr,
    ns_ptr,
    T,
    H,
    R,
    L,
    NC,
    HAS_VALID: tl.constexpr,
    HAS_G_READ: tl.constexpr,
    HAS_G_HIDDEN: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Compose the adjoint map of chunk ``c = program_id(1) + 1`` of one ``(b, h)`` pair.

    Walking the chunk backwards from the adjoints ``(dC, dD)`` entering it from the right, the
    adjoints leaving it on the left are ``dC' = F dC + Q dD + P`` and ``dD' = E dD + N`` (elementwise;
    ``F`` and ``E`` broadcast along rows). Writes ``F``, ``E`` ``(B * H, NC, R)`` and ``Q``, ``P``,
    ``N`` ``(B * H, NC, R, R)``, float32. One step of the walk, for the coefficients of the pair
    entering the chunk (``S_t = o_t (1 - tanh(C_t)^2)``, ``G_t`` the gradient of ``hidden[t]``)::

        valid:   F <- f F,  Q <- f (Q + E S_t),  P <- f (P + (N + G_t) S_t),  E <- 0,  N <- 0
        padding: N <- N + G_t                                    (dD passes through, dC is kept)
        then:    N <- N + g_read[t] q_t^T                         (the read of D_{t-1})
    """
    pid = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) + 1
    b = pid // H
    h = pid % H
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    tile = r[:, None] * R + r[None, :]
    tile_mask = r_mask[:, None] & r_mask[None, :]
    vec_step = H * R
    mat_step = H * R * R
    start = c * L
    end = tl.minimum(start + L, T)
    vec_off = (b * T + end - 1) * vec_step + h * R
    mat_off = (b * T + end - 1) * mat_step + h * R * R

    F = tl.full([BLOCK_R], 1.0, tl.float32)
    E = tl.full([BLOCK_R], 1.0, tl.float32)
    Q = tl.zeros([BLOCK_R, BLOCK_R], dtype=tl.float32)
    P = tl.zeros([BLOCK_R, BLOCK_R], dtype=tl.float32)
    N = tl.zeros([BLOCK_R, BLOCK_R], dtype=tl.float32)
    for i in range(0, end - start):
        t = end - 1 - i
        vec = vec_off + r
        mat = mat_off + tile
        f = tl.load(f_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)
        th = (
            2.0 / (1.0 + tl.exp(tl.minimum(-2.0 * tl.load(cells_ptr + mat, mask=tile_mask, other=0.0), 80.0)))
            - 1.0
        )
        S = o[:, None] * (1.0 - th * th)
        N_tot = N
        if HAS_G_HIDDEN:
            N_tot += tl.load(g_hidden_ptr + mat, mask=tile_mask, other=0.0).to(tl.float32)
        F_new = f * F
        Q_new = f[:, None] * (Q + E[:, None] * S)
        P_new = f[:, None] * (P + N_tot * S)
        if HAS_VALID:
            keep = tl.load(valid_ptr + b * T + t) != 0
            F = tl.where(keep, F_new, F)
            Q = tl.where(keep, Q_new, Q)
            P = tl.where(keep, P_new, P)
            E = tl.where(keep, 0.0, E)
            N = tl.where(keep, 0.0, N_tot)
        else:
            F = F_new
            Q = Q_new
            P = P_new
            E = tl.zeros([BLOCK_R], dtype=tl.float32)
            N = tl.zeros([BLOCK_R, BLOCK_R], dtype=tl.float32)
        if HAS_G_READ:
            q = tl.load(q_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)
            g_read = tl.load(g_read_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)
            N += g_read[:, None] * q[None, :]
        vec_off -= vec_step
        mat_off -= mat_step

    summary = pid * NC + c
    tl.store(fs_ptr + summary * R + r, F, mask=r_mask)
    tl.store(es_ptr + summary * R + r, E, mask=r_mask)
    tl.store(qs_ptr + summary * R * R + tile, Q, mask=tile_mask)
    tl.store(ps_ptr + summary * R * R + tile, P, mask=tile_mask)
    tl.store(ns_ptr + summary * R * R + tile, N, mask=tile_mask)


# Long on purpose: one kernel is one launch, and its body stays whole (module docstring).
@triton.jit
def _bwd_replay_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    f_ptr,
    o_ptr,
    valid_ptr,
    c0_ptr,
    d0_ptr,
    cells_ptr,
    hidden_ptr,
    g_read_ptr,
    g_hidden_ptr,
    g_final_cell_ptr,
    g_final_hidden_ptr,
    fs_ptr,
    qs_ptr,
    ps_ptr,
    es_ptr,
    ns_ptr,
    dq_ptr,
    dk_ptr,
    dw_ptr,
    df_ptr,
    do_ptr,
    d_depth_ptr,
    d_c0_ptr,
    d_d0_ptr,
    T,
    H,
    R,
    L,
    NC,
    CHUNKED: tl.constexpr,
    HAS_VALID: tl.constexpr,
    HAS_C0: tl.constexpr,
    HAS_D0: tl.constexpr,
    HAS_G_READ: tl.constexpr,
    HAS_G_HIDDEN: tl.constexpr,
    HAS_G_FINAL_CELL: tl.constexpr,
    HAS_G_FINAL_HIDDEN: tl.constexpr,
    WRITE_D_DEPTH: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Reverse-time adjoint scan of chunk ``c`` (``program_id(1)``) of one ``(b, h)`` pair (layouts
    as in the forward kernels; the summaries those of ``_bwd_summary_kernel``, read when ``CHUNKED``).

    The adjoints entering the chunk from the right are the final states' gradients taken through
    the summaries of the chunks after it. Then, per step, with ``dD``/``dC`` the adjoints of
    ``D_t``/``C_t`` coming from later steps::

        dD_tot = dD + g_hidden[t]
        dC_tot = dC + dD_tot * o_t[:, None] * (1 - tanh(C_t)^2)      (valid positions only)
        do = rowsum(dD_tot * tanh(C_t)), d_depth = dD_tot, df = rowsum(dC_tot * C_{t-1}),
        dw = dC_tot @ k_t, dk = dC_tot^T @ w_t, dC <- f_t[:, None] * dC_tot, dD <- 0
        (padding: all of these are zero, dC is kept and dD <- dD_tot), then the read adds
        dD <- dD + outer(g_read[t], q_t) and dq = D_{t-1}^T g_read[t].

    Writes ``dk, dw, df, do`` ``(B, T, H, R)``, ``dq`` (same shape) when ``HAS_G_READ`` (``q``
    only reaches the reads), ``d_depth`` ``(B, T, H, R, R)`` when ``WRITE_D_DEPTH``, and (chunk 0's
    program) the float32 initial-state gradients ``d_c0, d_d0`` ``(B, H, R, R)``.
    """
    pid = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    b = pid // H
    h = pid % H
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    tile = r[:, None] * R + r[None, :]
    tile_mask = r_mask[:, None] & r_mask[None, :]
    vec_step = H * R
    mat_step = H * R * R
    state = pid * R * R + tile

    if HAS_C0:
        C0 = tl.load(c0_ptr + state, mask=tile_mask, other=0.0).to(tl.float32)
    if HAS_D0:
        D0 = tl.load(d0_ptr + state, mask=tile_mask, other=0.0).to(tl.float32)
    if HAS_G_FINAL_CELL:
        dC = tl.load(g_final_cell_ptr + state, mask=tile_mask, other=0.0).to(tl.float32)
    else:
        dC = tl.zeros([BLOCK_R, BLOCK_R], dtype=tl.float32)
    if HAS_G_FINAL_HIDDEN:
        dD = tl.load(g_final_hidden_ptr + state, mask=tile_mask, other=0.0).to(tl.float32)
    else:
        dD = tl.zeros([BLOCK_R, BLOCK_R], dtype=tl.float32)

    if CHUNKED:
        # The reverse scan over the chunks after this one, last chunk first.
        for i in range(0, NC - 1 - c):
            summary = pid * NC + NC - 1 - i
            F = tl.load(fs_ptr + summary * R + r, mask=r_mask, other=0.0)
            E = tl.load(es_ptr + summary * R + r, mask=r_mask, other=0.0)
            Q = tl.load(qs_ptr + summary * R * R + tile, mask=tile_mask, other=0.0)
            P = tl.load(ps_ptr + summary * R * R + tile, mask=tile_mask, other=0.0)
            N = tl.load(ns_ptr + summary * R * R + tile, mask=tile_mask, other=0.0)
            dC = F[:, None] * dC + Q * dD + P
            dD = E[:, None] * dD + N

    start = c * L
    end = tl.minimum(start + L, T)
    vec_off = (b * T + end - 1) * vec_step + h * R
    mat_start = b * T * mat_step + h * R * R
    mat_off = mat_start + (end - 1) * mat_step
    C_cur = tl.load(cells_ptr + mat_off + tile, mask=tile_mask, other=0.0)
    for i in range(0, end - start):
        t = end - 1 - i
        vec = vec_off + r
        mat = mat_off + tile
        mat_prev = mat - mat_step
        has_prev = mat_off > mat_start
        prev_mask = tl.where(has_prev, tile_mask, False)
        C_prev = tl.load(cells_ptr + mat_prev, mask=prev_mask, other=0.0)
        if HAS_C0:
            C_prev = tl.where(has_prev, C_prev, C0)
        k = tl.load(k_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)
        f = tl.load(f_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)

        dD_tot = dD
        if HAS_G_HIDDEN:
            dD_tot += tl.load(g_hidden_ptr + mat, mask=tile_mask, other=0.0).to(tl.float32)
        th = 2.0 / (1.0 + tl.exp(tl.minimum(-2.0 * C_cur, 80.0))) - 1.0
        dC_tot = dC + dD_tot * o[:, None] * (1.0 - th * th)
        if HAS_VALID:
            keep = tl.load(valid_ptr + b * T + t) != 0
            dD_used = tl.where(keep, dD_tot, 0.0)
            dC_used = tl.where(keep, dC_tot, 0.0)
            dC = tl.where(keep, f[:, None] * dC_tot, dC)
            dD = tl.where(keep, 0.0, dD_tot)
        else:
            dD_used = dD_tot
            dC_used = dC_tot
            dC = f[:, None] * dC_tot
            dD = tl.zeros([BLOCK_R, BLOCK_R], dtype=tl.float32)

        if WRITE_D_DEPTH:
            tl.store(d_depth_ptr + mat, dD_used.to(d_depth_ptr.dtype.element_ty), mask=tile_mask)
        tl.store(do_ptr + vec, tl.sum(dD_used * th, axis=1).to(do_ptr.dtype.element_ty), mask=r_mask)
        tl.store(df_ptr + vec, tl.sum(dC_used * C_prev, axis=1).to(df_ptr.dtype.element_ty), mask=r_mask)
        tl.store(dw_ptr + vec, tl.sum(dC_used * k[None, :], axis=1).to(dw_ptr.dtype.element_ty), mask=r_mask)
        tl.store(dk_ptr + vec, tl.sum(dC_used * w[:, None], axis=0).to(dk_ptr.dtype.element_ty), mask=r_mask)

        if HAS_G_READ:
            q = tl.load(q_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)
            g_read = tl.load(g_read_ptr + vec, mask=r_mask, other=0.0).to(tl.float32)
            D_prev = tl.load(hidden_ptr + mat_prev, mask=prev_mask, other=0.0).to(tl.float32)
            if HAS_D0:
                D_prev = tl.where(has_prev, D_prev, D0)
            dD += g_read[:, None] * q[None, :]
            d_q = tl.sum(g_read[:, None] * D_prev, axis=0)
            tl.store(dq_ptr + vec, d_q.to(dq_ptr.dtype.element_ty), mask=r_mask)

        C_cur = C_prev
        vec_off -= vec_step
        mat_off -= mat_step

    at_first = tl.where(c == 0, tile_mask, False)  # only the first chunk's program reaches the block's start
    tl.store(d_c0_ptr + state, dC, mask=at_first)
    tl.store(d_d0_ptr + state, dD, mask=at_first)


def _plan(T: int, chunk: int | None) -> tuple[int, int]:
    """``(L, n_c)``: the chunk length (``chunk``, else :func:`chunk_length`) and the number of chunks."""
    L = chunk_length(T) if chunk is None else min(chunk, max(T, 1))
    return L, triton.cdiv(T, L)


def _scan_forward(q, k, w, f, o, depth, valid, initial_cell, initial_hidden, save_cells, chunk):
    """Launch the forward kernels on contiguous inputs; ``valid`` is int8 or ``None``.

    Returns ``(read, hidden, final_cell, final_hidden, cells)``, ``cells`` being the float32
    ``(B, T, H, R, R)`` cell sequence when ``save_cells`` and ``None`` otherwise.
    """
    B, T, H, R = q.shape
    read = torch.empty_like(q)
    hidden = q.new_empty(B, T, H, R, R)
    final_cell = q.new_empty(B, H, R, R)
    final_hidden = q.new_empty(B, H, R, R)
    cells = q.new_empty(B, T, H, R, R, dtype=torch.float32) if save_cells else None
    if B * H == 0:
        return read, hidden, final_cell, final_hidden, cells
    L, NC = _plan(T, chunk)
    a = b = last = None
    config = tile_config(R)
    with device_guard(q.device):
        if NC > 1:
            a = q.new_empty(B * H, NC, R, dtype=torch.float32)
            b = q.new_empty(B * H, NC, R, R, dtype=torch.float32)
            last = q.new_empty(B * H, NC, dtype=torch.int32)
            _fwd_summary_kernel[(B * H, NC - 1)](
                k, w, f, valid, a, b, last, T, H, R, L, NC, HAS_VALID=valid is not None, **config
            )
        _fwd_replay_kernel[(B * H, NC)](
            q,
            k,
            w,
            f,
            o,
            depth,
            valid,
            initial_cell,
            initial_hidden,
            a,
            b,
            last,
            read,
            hidden,
            cells,
            final_cell,
            final_hidden,
            T,
            H,
            R,
            L,
            NC,
            CHUNKED=NC > 1,
            HAS_DEPTH=depth is not None,
            HAS_VALID=valid is not None,
            HAS_C0=initial_cell is not None,
            HAS_D0=initial_hidden is not None,
            SAVE_CELLS=save_cells,
            **config,
        )
    return read, hidden, final_cell, final_hidden, cells


def _bwd_summaries(q, f, o, valid, cells, g_read, g_hidden, L, NC, config):
    """The adjoint maps of chunks ``1 .. NC - 1`` (``_bwd_summary_kernel``): ``(F, Q, P, E, N)``
    float32 buffers ``(B * H, NC, R)`` / ``(B * H, NC, R, R)``, or ``None`` five times for one chunk."""
    if NC == 1:
        return (None,) * 5
    B, T, H, R = q.shape
    F, E = (q.new_empty(B * H, NC, R, dtype=torch.float32) for _ in range(2))
    Q, P, N = (q.new_empty(B * H, NC, R, R, dtype=torch.float32) for _ in range(3))
    _bwd_summary_kernel[(B * H, NC - 1)](
        q,
        f,
        o,
        valid,
        cells,
        g_read,
        g_hidden,
        F,
        Q,
        P,
        E,
        N,
        T,
        H,
        R,
        L,
        NC,
        HAS_VALID=valid is not None,
        HAS_G_READ=g_read is not None,
        HAS_G_HIDDEN=g_hidden is not None,
        **config,
    )
    return F, Q, P, E, N


def _scan_backward(saved, has_depth, need, chunk, g_read, g_hidden, g_final_cell, g_final_hidden):
    """Launch the backward kernels; returns the gradients of ``(q, k, w, f, o, depth, valid,
    initial_cell, initial_hidden)`` as :meth:`torch.autograd.Function.backward` does."""
    q, k, w, f, o, valid, initial_cell, initial_hidden, cells, hidden = saved
    B, T, H, R = q.shape
    dk, dw, df, do = (torch.empty_like(x) for x in (k, w, f, o))
    dq = torch.empty_like(q) if g_read is not None else None
    write_d_depth = has_depth and need[5]
    d_depth = q.new_empty(B, T, H, R, R) if write_d_depth else None
    d_c0 = q.new_empty(B, H, R, R, dtype=torch.float32)
    d_d0 = q.new_empty(B, H, R, R, dtype=torch.float32)
    g_read, g_hidden, g_final_cell, g_final_hidden = map(
        contiguous, (g_read, g_hidden, g_final_cell, g_final_hidden)
    )
    L, NC = _plan(T, chunk)
    config = tile_config(R)
    if B * H > 0:
        with device_guard(q.device):
            summaries = _bwd_summaries(q, f, o, valid, cells, g_read, g_hidden, L, NC, config)
            _bwd_replay_kernel[(B * H, NC)](
                q,
                k,
                w,
                f,
                o,
                valid,
                initial_cell,
                initial_hidden,
                cells,
                hidden,
                g_read,
                g_hidden,
                g_final_cell,
                g_final_hidden,
                *summaries,
                dq,
                dk,
                dw,
                df,
                do,
                d_depth,
                d_c0,
                d_d0,
                T,
                H,
                R,
                L,
                NC,
                CHUNKED=NC > 1,
                HAS_VALID=valid is not None,
                HAS_C0=initial_cell is not None,
                HAS_D0=initial_hidden is not None,
                HAS_G_READ=g_read is not None,
                HAS_G_HIDDEN=g_hidden is not None,
                HAS_G_FINAL_CELL=g_final_cell is not None,
                HAS_G_FINAL_HIDDEN=g_final_hidden is not None,
                WRITE_D_DEPTH=write_d_depth,
                **config,
            )
    grad_c0 = d_c0.to(initial_cell.dtype) if need[7] else None
    grad_d0 = d_d0.to(initial_hidden.dtype) if need[8] else None
    grads = (dq, dk, dw, df, do)
    return (
        *(g if n else None for g, n in zip(grads, need[:5], strict=True)),
        d_depth,
        None,
        grad_c0,
        grad_d0,
    )


class _ScanFunction(torch.autograd.Function):
    """Autograd wrapper: the Triton forward scan saving the float32 cell sequence, the Triton backward."""

    @staticmethod
    def forward(ctx, q, k, w, f, o, depth, valid, initial_cell, initial_hidden, chunk):
        q, k, w, f, o, depth, initial_cell, initial_hidden = map(
            contiguous, (q, k, w, f, o, depth, initial_cell, initial_hidden)
        )
        valid_i8 = None if valid is None else valid.to(torch.int8).contiguous()
        read, hidden, final_cell, final_hidden, cells = _scan_forward(
            q, k, w, f, o, depth, valid_i8, initial_cell, initial_hidden, save_cells=True, chunk=chunk
        )
        ctx.save_for_backward(q, k, w, f, o, valid_i8, initial_cell, initial_hidden, cells, hidden)
        ctx.has_depth = depth is not None
        ctx.chunk = chunk
        ctx.set_materialize_grads(False)
        return read, hidden, final_cell, final_hidden

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_read, g_hidden, g_final_cell, g_final_hidden):
        grads = _scan_backward(
            ctx.saved_tensors,
            ctx.has_depth,
            ctx.needs_input_grad,
            ctx.chunk,
            g_read,
            g_hidden,
            g_final_cell,
            g_final_hidden,
        )
        return (*grads, None)


def scan_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    f: torch.Tensor,
    o: torch.Tensor,
    depth: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    initial_cell: torch.Tensor | None = None,
    initial_hidden: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton implementation of :func:`~lstmem_kernels.scan.naive.scan_naive` (the chunked parallel scan of the module
    docstring), differentiable in every float input.

    Args:
        q, k, w, f, o: ``(B, T, H, R)`` read queries, write keys, gated write residuals, forget
            and output gates; one dtype among float32, bfloat16 and float16.
        depth: ``(B, T, H, R, R)`` depth term (dtype of ``q``) or ``None`` (zeros).
        valid: ``(B, T)`` bool, ``False`` at padding positions, or ``None`` (all valid).
        initial_cell, initial_hidden: ``(B, H, R, R)`` floating states before the block, or
            ``None`` (zeros).
        chunk: the chunk length ``L`` (``>= T``: one chunk, the sequential scan), or ``None`` for
            :func:`chunk_length`'s choice. The result does not depend on it beyond float32 rounding.

    Returns:
        ``(read, hidden, final_cell, final_hidden)`` in ``q.dtype``: ``read`` ``(B, T, H, R)``,
        ``hidden`` ``(B, T, H, R, R)`` (``D_t`` after each position), and the final states
        ``(B, H, R, R)``. Computation is float32 internally.

    Raises:
        ValueError: on inconsistent shapes, dtypes or devices, or a chunk length below 1.
    """
    if q.dim() != 4:
        raise ValueError(f"q must have shape (B, T, H, R), got {tuple(q.shape)}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive int (tokens per chunk) or None, got {chunk!r}")
    B, T, H, R = q.shape
    validate(
        {
            "q": q,
            "k": k,
            "w": w,
            "f": f,
            "o": o,
            "depth": depth,
            "valid": valid,
            "initial_cell": initial_cell,
            "initial_hidden": initial_hidden,
        },
        vec_shape=(B, T, H, R),
        mat_shape=(B, T, H, R, R),
        state_shape=(B, H, R, R),
        valid_shape=(B, T),
        state_names=("initial_cell", "initial_hidden"),
    )
    if T == 0:
        cell = q.new_zeros(B, H, R, R) if initial_cell is None else initial_cell.to(q.dtype, copy=True)
        hidden = q.new_zeros(B, H, R, R) if initial_hidden is None else initial_hidden.to(q.dtype, copy=True)
        return q.new_zeros(B, 0, H, R), q.new_zeros(B, 0, H, R, R), cell, hidden

    differentiable = (q, k, w, f, o, depth, initial_cell, initial_hidden)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in differentiable):
        return _ScanFunction.apply(q, k, w, f, o, depth, valid, initial_cell, initial_hidden, chunk)
    read, hidden, final_cell, final_hidden, _ = _scan_forward(
        *map(contiguous, (q, k, w, f, o, depth)),
        None if valid is None else valid.to(torch.int8).contiguous(),
        contiguous(initial_cell),
        contiguous(initial_hidden),
        save_cells=False,
        chunk=chunk,
    )
    return read, hidden, final_cell, final_hidden
