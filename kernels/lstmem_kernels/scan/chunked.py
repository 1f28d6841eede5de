"""The LSTMem block scan in Triton, forward and backward: the paper's parallel scan over time
(App. C.3), computed in chunks. This module holds the chunk plan (:func:`chunk_length`), the launches,
the autograd Function and :func:`scan_triton`; the kernels are in :mod:`.chunked_forward` and
:mod:`.chunked_backward`. The one-token steps are in :mod:`lstmem_kernels.step.fused`.

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
must be enabled by setting ``TRITON_INTERPRET=1`` before this module (and so its kernels' modules)
is imported.
"""

from __future__ import annotations

import math

import torch
import triton

from ..triton_common import contiguous, device_guard, tile_config, validate
from .chunked_backward import _bwd_replay_kernel, _bwd_summary_kernel
from .chunked_forward import _fwd_replay_kernel, _fwd_summary_kernel

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
