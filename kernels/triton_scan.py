"""Triton kernels for the LSTMem block scan, forward and backward (the one-token steps:
:mod:`triton_step`).

The recurrence (see :mod:`naive`, the specification) is, per sequence ``b``, head ``h`` and
time ``t``, with ``R x R`` states ``C`` (cell) and ``D`` (hidden) and gates acting row-wise::

    read_t = D_{t-1} q_t
    C_t    = diag(f_t) C_{t-1} + w_t k_t^T
    D_t    = diag(o_t) tanh(C_t) + depth_t

and at a padding position (``valid[b, t]`` false) the read is produced but ``C`` and ``D`` are
carried over unchanged.

Kernel design
-------------
Every kernel runs one program per ``(batch, head)`` pair (grid ``B * H``). The program keeps the
whole ``R x R`` cell and hidden states of its pair as ``BLOCK_R x BLOCK_R`` float32 register
tiles (``BLOCK_R`` is ``R`` rounded up to a power of two; the padding lanes are masked on every
load and store and stay exactly zero) and walks the time axis sequentially, so each step only
reads its length-``R`` gate vectors, the optional depth tile and the valid flag, and writes the
read vector and the new hidden tile. All arithmetic is float32 whatever the storage dtype.

* Forward (``_scan_fwd_kernel``): loops ``t = 0 .. T-1``. When a gradient is required it also
  writes the cell sequence ``C_t`` as a float32 ``(B, T, H, R, R)`` tensor; otherwise nothing
  besides the outputs is written.
* Backward (``_scan_bwd_kernel``): loops ``t = T-1 .. 0`` carrying the adjoints ``dC`` and ``dD``
  (seeded with the gradients of the final states) as register tiles. It needs ``C_t`` and
  ``C_{t-1}`` (the saved float32 cell sequence, or the initial cell at ``t = 0``) and ``D_{t-1}``
  (the ``hidden`` output, or the initial hidden at ``t = 0``); nothing is recomputed by a second
  forward pass. What is saved for backward is therefore the inputs, the ``hidden`` output (in the
  input dtype: with bfloat16 inputs the ``q`` gradient sees the rounded ``D_{t-1}``) and the
  float32 cell sequence; ``depth`` itself is not needed. The backward is not differentiable.

``triton.language`` has no ``tanh``; it is written inline as ``2 / (1 + exp(-2x)) - 1`` with the
exponent clamped to 80 (no overflow; absolute error of a few float32 ulps). It is inlined rather
than a ``@triton.jit`` helper because the interpreter re-patches ``triton.language`` on every
nested jit call, which would dominate its per-step cost. For the same reason, and because one kernel
is one launch, each kernel's body stays whole, however long.

On a machine without a GPU the kernels run on CPU tensors under the Triton interpreter, which
must be enabled by setting ``TRITON_INTERPRET=1`` before this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import contiguous, device_guard, tile_config, validate

__all__ = ["scan_triton"]


# Long on purpose: one kernel is one launch, and its body stays whole (module docstring).
@triton.jit
def _scan_fwd_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    f_ptr,
    o_ptr,
    depth_ptr,
    valid_ptr,
    c0_ptr,
    d0_ptr,
    read_ptr,
    hidden_ptr,
    cells_ptr,
    final_cell_ptr,
    final_hidden_ptr,
    T,
    H,
    R,
    HAS_DEPTH: tl.constexpr,
    HAS_VALID: tl.constexpr,
    HAS_C0: tl.constexpr,
    HAS_D0: tl.constexpr,
    SAVE_CELLS: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Forward scan for one ``(b, h)`` pair.

    Vectors are contiguous ``(B, T, H, R)``, matrices ``(B, T, H, R, R)``, states ``(B, H, R, R)``,
    ``valid`` is ``(B, T)`` int8. ``cells`` (float32, ``C_t`` after step ``t``, same layout as
    ``hidden``) is only written when ``SAVE_CELLS``.
    """
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    tile = r[:, None] * R + r[None, :]
    tile_mask = r_mask[:, None] & r_mask[None, :]
    vec_step = H * R
    mat_step = H * R * R
    vec_off = b * T * vec_step + h * R
    mat_off = b * T * mat_step + h * R * R
    state = pid * R * R + tile
    if HAS_VALID:
        valid_row = valid_ptr + b * T

    if HAS_C0:
        C = tl.load(c0_ptr + state, mask=tile_mask, other=0.0).to(tl.float32)
    else:
        C = tl.zeros([BLOCK_R, BLOCK_R], dtype=tl.float32)
    if HAS_D0:
        D = tl.load(d0_ptr + state, mask=tile_mask, other=0.0).to(tl.float32)
    else:
        D = tl.zeros([BLOCK_R, BLOCK_R], dtype=tl.float32)

    for t in range(T):
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
            keep = tl.load(valid_row + t) != 0
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

    tl.store(final_cell_ptr + state, C.to(final_cell_ptr.dtype.element_ty), mask=tile_mask)
    tl.store(final_hidden_ptr + state, D.to(final_hidden_ptr.dtype.element_ty), mask=tile_mask)


# Long on purpose: one kernel is one launch, and its body stays whole (module docstring).
@triton.jit
def _scan_bwd_kernel(
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
    """Reverse-time adjoint scan for one ``(b, h)`` pair (layouts as in the forward kernel).

    Per step, with ``dD``/``dC`` the adjoints of ``D_t``/``C_t`` coming from later steps::

        dD_tot = dD + g_hidden[t]
        dC_tot = dC + dD_tot * o_t[:, None] * (1 - tanh(C_t)^2)      (valid positions only)
        do = rowsum(dD_tot * tanh(C_t)), d_depth = dD_tot, df = rowsum(dC_tot * C_{t-1}),
        dw = dC_tot @ k_t, dk = dC_tot^T @ w_t, dC <- f_t[:, None] * dC_tot, dD <- 0
        (padding: all of these are zero, dC is kept and dD <- dD_tot), then the read adds
        dD <- dD + outer(g_read[t], q_t) and dq = D_{t-1}^T g_read[t].

    Writes ``dk, dw, df, do`` ``(B, T, H, R)``, ``dq`` (same shape) when ``HAS_G_READ`` (``q``
    only reaches the reads), ``d_depth`` ``(B, T, H, R, R)`` when ``WRITE_D_DEPTH``, and the
    float32 initial-state gradients ``d_c0, d_d0`` ``(B, H, R, R)``.
    """
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    tile = r[:, None] * R + r[None, :]
    tile_mask = r_mask[:, None] & r_mask[None, :]
    vec_step = H * R
    mat_step = H * R * R
    vec_off = (b * T + T - 1) * vec_step + h * R
    mat_start = b * T * mat_step + h * R * R
    mat_off = mat_start + (T - 1) * mat_step
    state = pid * R * R + tile
    if HAS_VALID:
        valid_row = valid_ptr + b * T

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

    C_cur = tl.load(cells_ptr + mat_off + tile, mask=tile_mask, other=0.0)
    for i in range(T):
        t = T - 1 - i
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
            keep = tl.load(valid_row + t) != 0
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

    tl.store(d_c0_ptr + state, dC, mask=tile_mask)
    tl.store(d_d0_ptr + state, dD, mask=tile_mask)


def _scan_forward(q, k, w, f, o, depth, valid, initial_cell, initial_hidden, save_cells):
    """Launch the forward kernel on contiguous inputs; ``valid`` is int8 or ``None``.

    Returns ``(read, hidden, final_cell, final_hidden, cells)``, ``cells`` being the float32
    ``(B, T, H, R, R)`` cell sequence when ``save_cells`` and ``None`` otherwise.
    """
    B, T, H, R = q.shape
    read = torch.empty_like(q)
    hidden = q.new_empty(B, T, H, R, R)
    final_cell = q.new_empty(B, H, R, R)
    final_hidden = q.new_empty(B, H, R, R)
    cells = q.new_empty(B, T, H, R, R, dtype=torch.float32) if save_cells else None
    if B * H > 0:
        with device_guard(q.device):
            _scan_fwd_kernel[(B * H,)](
                q,
                k,
                w,
                f,
                o,
                depth,
                valid,
                initial_cell,
                initial_hidden,
                read,
                hidden,
                cells,
                final_cell,
                final_hidden,
                T,
                H,
                R,
                HAS_DEPTH=depth is not None,
                HAS_VALID=valid is not None,
                HAS_C0=initial_cell is not None,
                HAS_D0=initial_hidden is not None,
                SAVE_CELLS=save_cells,
                **tile_config(R),
            )
    return read, hidden, final_cell, final_hidden, cells


class _ScanFunction(torch.autograd.Function):
    """Autograd wrapper: Triton forward scan saving the float32 cell sequence, Triton backward."""

    @staticmethod
    def forward(ctx, q, k, w, f, o, depth, valid, initial_cell, initial_hidden):
        q, k, w, f, o, depth, initial_cell, initial_hidden = map(
            contiguous, (q, k, w, f, o, depth, initial_cell, initial_hidden)
        )
        valid_i8 = None if valid is None else valid.to(torch.int8).contiguous()
        read, hidden, final_cell, final_hidden, cells = _scan_forward(
            q, k, w, f, o, depth, valid_i8, initial_cell, initial_hidden, save_cells=True
        )
        ctx.save_for_backward(q, k, w, f, o, valid_i8, initial_cell, initial_hidden, cells, hidden)
        ctx.has_depth = depth is not None
        ctx.set_materialize_grads(False)
        return read, hidden, final_cell, final_hidden

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_read, g_hidden, g_final_cell, g_final_hidden):
        q, k, w, f, o, valid_i8, initial_cell, initial_hidden, cells, hidden = ctx.saved_tensors
        B, T, H, R = q.shape
        dk, dw, df, do = (torch.empty_like(x) for x in (k, w, f, o))
        dq = torch.empty_like(q) if g_read is not None else None
        write_d_depth = ctx.has_depth and ctx.needs_input_grad[5]
        d_depth = q.new_empty(B, T, H, R, R) if write_d_depth else None
        d_c0 = q.new_empty(B, H, R, R, dtype=torch.float32)
        d_d0 = q.new_empty(B, H, R, R, dtype=torch.float32)
        g_read, g_hidden, g_final_cell, g_final_hidden = map(
            contiguous, (g_read, g_hidden, g_final_cell, g_final_hidden)
        )
        if B * H > 0:
            with device_guard(q.device):
                _scan_bwd_kernel[(B * H,)](
                    q,
                    k,
                    w,
                    f,
                    o,
                    valid_i8,
                    initial_cell,
                    initial_hidden,
                    cells,
                    hidden,
                    g_read,
                    g_hidden,
                    g_final_cell,
                    g_final_hidden,
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
                    HAS_VALID=valid_i8 is not None,
                    HAS_C0=initial_cell is not None,
                    HAS_D0=initial_hidden is not None,
                    HAS_G_READ=g_read is not None,
                    HAS_G_HIDDEN=g_hidden is not None,
                    HAS_G_FINAL_CELL=g_final_cell is not None,
                    HAS_G_FINAL_HIDDEN=g_final_hidden is not None,
                    WRITE_D_DEPTH=write_d_depth,
                    **tile_config(R),
                )
        need = ctx.needs_input_grad
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton implementation of :func:`naive.scan_naive`, differentiable in every float input.

    Args:
        q, k, w, f, o: ``(B, T, H, R)`` read queries, write keys, gated write residuals, forget
            and output gates; one dtype among float32, bfloat16 and float16.
        depth: ``(B, T, H, R, R)`` depth term (dtype of ``q``) or ``None`` (zeros).
        valid: ``(B, T)`` bool, ``False`` at padding positions, or ``None`` (all valid).
        initial_cell, initial_hidden: ``(B, H, R, R)`` floating states before the block, or
            ``None`` (zeros).

    Returns:
        ``(read, hidden, final_cell, final_hidden)`` in ``q.dtype``: ``read`` ``(B, T, H, R)``,
        ``hidden`` ``(B, T, H, R, R)`` (``D_t`` after each position), and the final states
        ``(B, H, R, R)``. Computation is float32 internally.

    Raises:
        ValueError: on inconsistent shapes, dtypes or devices.
    """
    if q.dim() != 4:
        raise ValueError(f"q must have shape (B, T, H, R), got {tuple(q.shape)}")
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
        return _ScanFunction.apply(q, k, w, f, o, depth, valid, initial_cell, initial_hidden)
    read, hidden, final_cell, final_hidden, _ = _scan_forward(
        *map(contiguous, (q, k, w, f, o, depth)),
        None if valid is None else valid.to(torch.int8).contiguous(),
        contiguous(initial_cell),
        contiguous(initial_hidden),
        save_cells=False,
    )
    return read, hidden, final_cell, final_hidden
