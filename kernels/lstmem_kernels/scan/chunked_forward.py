"""The forward kernels of the chunked parallel scan (the algorithm, the layouts and the launches:
:mod:`lstmem_kernels.scan.chunked`): ``_fwd_summary_kernel`` composes each chunk's cell maps into
``(A_c, B_c)`` and its last valid position, ``_fwd_replay_kernel`` scans the summaries of the chunks
before its own and replays its chunk, writing the reads, the hidden states, the float32 cells (for the
backward) and, in the last chunk, the final states. Grids ``(B * H, n_c - 1)`` and ``(B * H, n_c)``.

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
