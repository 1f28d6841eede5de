"""The backward kernels of the chunked parallel scan (the algorithm, the layouts and the launches:
:mod:`lstmem_kernels.scan.chunked`), the same scan in reverse time: ``_bwd_summary_kernel`` composes
each chunk's adjoint map (``dC <- F dC + Q dD + P``, ``dD <- E dD + N``) from the right,
``_bwd_replay_kernel`` applies the summaries of the chunks after its own to the final states'
gradients, then walks its chunk backwards writing every input's gradient (chunk 0: the initial
states'). Grids ``(B * H, n_c - 1)`` and ``(B * H, n_c)``.

Each kernel's body stays whole, however long: one kernel is one launch, and ``tanh`` is written
inline (``2 / (1 + exp(-2x)) - 1``, exponent clamped to 80) rather than as a ``@triton.jit`` helper,
because the interpreter re-patches ``triton.language`` on every nested jit call (kernel design:
:mod:`lstmem_kernels.scan.chunked`). Under the Triton interpreter (no GPU: CPU tensors), set
``TRITON_INTERPRET=1`` before this module is imported.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
