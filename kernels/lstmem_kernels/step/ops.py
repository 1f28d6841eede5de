"""The step family's public ops: :func:`lstmem_step` (one token of the recurrence, on the member
:mod:`lstmem_kernels.backend` picks: :mod:`.naive`, :mod:`.pytorch` or the Triton step of
:mod:`.fused`), :func:`lstmem_decode_step` (a memory layer's whole decode step, also on a serving
engine's state slots: :mod:`.decode_naive`, :mod:`.decode_torch` or the Triton launch of
:mod:`.fused`) with the check of its inputs, and :func:`decode_backend` (the member a layer steps
on)."""

from __future__ import annotations

import torch

from ..backend import Backend, check_backend, resolve_backend
from .decode_naive import decode_step_naive
from .decode_torch import decode_step_torch
from .naive import step_naive
from .pytorch import step_torch


def _fused():
    try:
        from . import fused
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "backend='triton' needs the `triton` package: pip install 'lstmem-peft[triton]'"
        ) from err
    return fused


def lstmem_step(
    q: torch.Tensor | None,
    k: torch.Tensor,
    w: torch.Tensor,
    f: torch.Tensor,
    o: torch.Tensor,
    cell: torch.Tensor,
    hidden: torch.Tensor,
    depth: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    backend: Backend = "auto",
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One decode step of the recurrence, updating ``cell`` and ``hidden`` **in place**, or writing the
    new states into ``out`` (every backend).

    Args:
        q, k, w, f, o: ``(B, H, R)`` read query, write key, gated residual ``i*e``, forget and
            output gates of one token (or ``k`` as rows ``(B, H, 1, R)`` and ``w, f, o`` as columns
            ``(B, H, R, 1)``, the shapes the PyTorch member multiplies); ``q`` may be ``None`` when
            the caller took the read ``D_{t-1} q_t`` itself (a memory layer's decode step does, in
            one product with its depth reads): then nothing is read and ``None`` is returned.
        cell, hidden: ``(B, H, R, R)`` states ``C_{t-1}``, ``D_{t-1}``, overwritten with ``C_t``, ``D_t``
            (rows where ``valid`` is ``False`` are left as they are).
        depth: ``(B, H, R, R)`` depth term ``g * D^{(l-1)}_t``, or ``None`` for zeros.
        valid: ``(B,)`` bool, or ``None``.
        backend: the member (:mod:`lstmem_kernels.backend`; ``"auto"``: Triton for CUDA tensors,
            else PyTorch).
        out: ``(cell_out, hidden_out)``, ``(B, H, R, R)`` float32 (float64 with float64 inputs):
            where ``C_t`` and ``D_t`` go, leaving ``cell`` and ``hidden`` as they are (padded rows
            get the old states); ``None``: in place. The PyTorch member writes them directly; the
            others copy the states there first and step in place.

    Returns:
        ``read`` ``(B, H, R)``: ``D_{t-1} q_t``, from the state before the update (``None`` without
        ``q``).

    Not differentiable (an in-place update): for gradients, scan the token with :func:`lstmem_scan`.
    """
    check_backend(backend)
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, w, f, o, cell, hidden, depth)
    ):
        raise RuntimeError(
            "lstmem_step updates the states in place and has no gradient; under autograd scan the token with "
            "lstmem_scan (inputs with a time axis of length 1), or call it inside torch.no_grad()"
        )
    backend = resolve_backend(backend, k)
    if backend == "torch":
        return step_torch(q, k, w, f, o, cell, hidden, depth, valid, out=out)
    if out is not None:  # these members step in place: on copies of the states
        out[0].copy_(cell)
        out[1].copy_(hidden)
        cell, hidden = out
    k, w, f, o = (t.flatten(-2) if t.ndim == 4 else t for t in (k, w, f, o))  # rows, columns -> (B, H, R)
    query = torch.zeros_like(k) if q is None else q  # these members always read; a read of zeros is free
    if backend == "triton":
        read = _fused().step_triton(query, k, w, f, o, cell, hidden, depth, valid)
    else:
        read = step_naive(query, k, w, f, o, cell, hidden, depth, valid)
    return None if q is None else read


def decode_backend(
    backend: Backend, x: torch.Tensor, weight_dtype: torch.dtype, samples: bool = False
) -> str:
    """The member of :func:`lstmem_decode_step` that a memory layer whose kernels are ``backend``
    (its ``scan_backend``) steps ``x`` on: :func:`~lstmem_kernels.backend.resolve_backend`'s, except
    that the Triton member, which computes in float32 and returns no feedback samples, gives way to
    the PyTorch one for float64 weights and when ``samples`` are wanted. The one place that rule is
    written."""
    member = resolve_backend(backend, x)
    if member == "triton" and (weight_dtype == torch.float64 or samples):
        return "torch"
    return member


# Long for its docstring: the op's whole contract (the math, every argument's shape, the slots).
def lstmem_decode_step(
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
    backend: Backend = "auto",
    fresh_out: bool = False,
):
    """The whole decode step of one memory layer for one token per sequence, from the layer input to
    the read ``u`` and the new states.

    Three members with this signature, picked once from ``backend``
    (:func:`~lstmem_kernels.backend.resolve_backend`): ``"naive"`` (:mod:`.decode_naive`, float64,
    one line per equation: the specification), ``"torch"`` (:mod:`.decode_torch`, PyTorch operators)
    and ``"triton"`` (:mod:`.fused`, one kernel launch). A memory layer picks its member with
    :func:`decode_backend`.

    With ``d_s = n_h r`` and the weights arranged as the layer's ``LayerWeights`` (``lstmem_peft``)::

        proj = x w_in + b_in;  [q; k] = n(proj[:, :2 d_s]) per head;  s = proj[:, 2 d_s:] = [v; z]
        [e | a | u_dep] = [s, D^(l-1) q, D^(l-1) k] eau + b_eau   (without depth: s eau[:2 d_s] + b_eau)
        i, f, o, g = sigmoid(a);  C_t = diag(f) C + (i e) k^T;  D_t = diag(o) tanh(C_t) + diag(g) D^(l-1)
        u = u_dep + (D_{t-1} q) read[:d_s]

    where ``n(.)`` is tanh then l2 normalisation within each head (denominator at least ``norm_eps``;
    the layer passes the paper's constant).

    Args:
        x: ``(B, d)`` the layer input of the token (the backbone layer's normed attention input).
        w_in, b_in: ``(d, 4 d_s)``, ``(4 d_s,)``: the input map; columns ``[q^[j]; k^[j]]`` head by
            head (``2 d_s``), then ``v`` and ``z`` (``d_s`` each).
        eau, b_eau: ``(4 d_s, 6 d_s)`` (rows ``[v; z]`` then ``[r^dep^[j]; p^dep^[j]]`` head by head)
            and ``(6 d_s,)``: the map to ``[e | i | f | o | g | u_dep]``. Without ``depth`` a
            ``(2 d_s, 6 d_s)`` map (the rows of ``[v; z]``) is enough; a ``(4 d_s, 6 d_s)`` one also
            works (its depth rows are not used).
        read: ``(2 d_s, d_s)`` ``W_read^T``; only its first ``d_s`` rows (the temporal read) act here.
        cell, hidden: ``(B, n_h, r, r)`` states ``C_{t-1}``, ``D_{t-1}``, any float dtype; never written.
        num_heads: ``n_h`` (``d_s``, the width of ``read``, must be a multiple of it).
        out: ``(cell_out, hidden_out)``, ``(B, n_h, r, r)`` float tensors where ``C_t`` and ``D_t`` go
            (rows where ``valid`` is ``False`` get the old states), in their own dtype (float32, or
            float64 to keep float64 states). Their memory must not overlap any input's.
        depth: ``(B, n_h, r, r)`` ``D^(l-1)_t``, the new hidden state of the memory layer below at this
            token (un-gated), or ``None`` for the first memory layer or without depth coupling.
        valid: ``(B,)`` bool, ``False`` at padding, or ``None``.
        slots: ``(B,)`` int64 (or int32), or ``None``. Given, ``cell``, ``hidden`` and the two ``out``
            tensors are state tables ``(S, n_h, r, r)`` (a serving engine's per-request slots) and
            row ``b`` steps the states in row ``slots[b]`` of them, so ``out`` may be ``(cell,
            hidden)`` themselves: the step updates the slots **in place** (the Triton member with
            no copy out and none back; rows where ``valid`` is ``False`` keep theirs). The slots of
            one call must differ (one row of each table per sequence; not checked, it would read the
            device), except negative ones (the naive and Triton members): a negative slot (vLLM pads
            a CUDA graph's batch with ``-1``) marks a padding row, which steps zero states and
            writes no table row (its ``u`` and ``hidden_seq`` row are made, and mean nothing).
        hidden_seq: ``(B, n_h, r, r)`` float tensor that also receives ``D_t`` of each row (the depth
            input of the memory layer above), or ``None``.
        samples: also return the feedback samples (:class:`~.decode_torch.DecodeSamples`: ``k``,
            ``v``, ``o``, ``g``), which block-end feedback writes with; not the Triton member's.
        backend: the member (``"auto"``: Triton for CUDA tensors when installed, else PyTorch).
        fresh_out: ``True`` says that ``out`` was allocated for this call (``torch.empty_like``, as a
            memory layer's step does), so no input can share its memory and the overlap check, most
            of what checking a call costs, is skipped; the shapes and dtypes are checked all the
            same. A caller that passes tensors it holds must leave it ``False``.
    Returns:
        ``u`` ``(B, d_s)`` in the weights' dtype: the read ``u_dep + W_read^time r^time`` that the
        layer's corrections are made from (``Δq = u corr_q``, ``Δo = u corr_o``); with ``samples``,
        ``(u, DecodeSamples)``.

    Not differentiable (a decode step): under autograd run the layer's forward, which scans the token.
    """
    _check_decode_shapes(
        x, w_in, b_in, eau, b_eau, read, cell, hidden, num_heads, out, depth, valid, slots, hidden_seq
    )
    if not fresh_out and not torch.compiler.is_compiling():  # a traced graph has no addresses to compare
        _check_decode_overlaps(x, cell, hidden, out, depth, slots, hidden_seq)
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, w_in, b_in, eau, b_eau, read, cell, hidden, depth)
    ):
        raise RuntimeError(
            "lstmem_decode_step has no gradient; call it inside torch.no_grad(), or under autograd run "
            "the memory layer's forward (which scans the token with lstmem_scan)"
        )
    member = resolve_backend(backend, x)
    if member == "triton":
        step = _fused().decode_step_triton
    else:
        step = decode_step_torch if member == "torch" else decode_step_naive
    return step(
        x,
        w_in,
        b_in,
        eau,
        b_eau,
        read,
        cell,
        hidden,
        num_heads=num_heads,
        out=out,
        depth=depth,
        valid=valid,
        norm_eps=norm_eps,
        slots=slots,
        hidden_seq=hidden_seq,
        samples=samples,
    )


def _check_decode_shapes(
    x, w_in, b_in, eau, b_eau, read, cell, hidden, num_heads, out, depth, valid, slots, hidden_seq
) -> None:
    """The shapes and dtypes of :func:`lstmem_decode_step`'s inputs, with ``ValueError`` saying what
    was expected."""
    if x.dim() != 2:
        raise ValueError(
            f"x must have shape (B, d), one token per sequence, got {tuple(x.shape)}; for a block of tokens "
            "run the memory layer's forward"
        )
    if read.dim() != 2 or read.shape[0] != 2 * read.shape[1]:
        raise ValueError(f"read must have shape (2 d_s, d_s) (W_read^T), got {tuple(read.shape)}")
    ds = read.shape[1]
    if not isinstance(num_heads, int) or num_heads < 1 or ds % num_heads:
        raise ValueError(
            f"num_heads must be a positive int dividing d_s = {ds} (the width of read), got {num_heads!r}"
        )
    B, d = x.shape
    H, R = num_heads, ds // num_heads
    per_row = (B, H, R, R)
    # with slots the states are tables of any number of rows
    state = per_row if slots is None else (cell.shape[0], H, R, R)
    eau_rows = (4 * ds,) if depth is not None else (2 * ds, 4 * ds)
    expected = [
        ("w_in", w_in, (d, 4 * ds)),
        ("b_in", b_in, (4 * ds,)),
        ("b_eau", b_eau, (6 * ds,)),
        ("cell", cell, state),
        ("hidden", hidden, state),
        ("depth", depth, per_row),
        ("valid", valid, (B,)),
        ("slots", slots, (B,)),
        ("hidden_seq", hidden_seq, per_row),
    ]
    for name, t, shape in expected:
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected {shape} (B = {B}, d = {d}, n_h = {H}, r = {R})"
            )
    if eau.dim() != 2 or eau.shape[0] not in eau_rows or eau.shape[1] != 6 * ds:
        need = " or ".join(str((n, 6 * ds)) for n in eau_rows)
        raise ValueError(
            f"eau has shape {tuple(eau.shape)}, expected {need}"
            + (" (with a depth input: the map eau_depth)" if depth is not None else "")
        )
    if valid is not None and valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor, got {valid.dtype}")
    if slots is not None and slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slots must be an int64 or int32 tensor of state rows, got {slots.dtype}")
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError(
            "out must be a pair (cell_out, hidden_out) of (B, n_h, r, r) tensors for C_t and D_t"
        )
    for name, t in zip(("cell_out", "hidden_out"), out, strict=True):
        if tuple(t.shape) != state or not t.is_floating_point():
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} and dtype {t.dtype}, expected a float tensor of shape {state}"
            )


def _check_decode_overlaps(x, cell, hidden, out, depth, slots, hidden_seq) -> None:
    """``ValueError`` where an ``out`` tensor shares memory with an input, except a state table that
    is its own output with ``slots``."""
    inputs = {"x": x, "cell": cell, "hidden": hidden, "depth": depth, "hidden_seq": hidden_seq}
    # state tables that are their own outputs: each row reads its own slot before it writes it, and the
    # two tables may share one buffer (a serving engine's interleave their rows)
    tables = slots is not None and all(_same_view(t, own) for t, own in zip(out, (cell, hidden), strict=True))
    for name, t, own in zip(("cell_out", "hidden_out"), out, (cell, hidden), strict=True):
        for other, u in inputs.items():
            # with slots each row reads its own slot before it writes it: a table may be its own output
            in_place = (slots is not None and u is own and _same_view(t, own)) or (
                tables and (u is cell or u is hidden)
            )
            if u is not None and not in_place and _overlap(t, u):
                raise ValueError(
                    f"{name} overlaps the memory of {other}: the step reads its inputs while it writes, so "
                    "write the new states into separate tensors (e.g. torch.empty_like(cell, dtype=torch.float32)); "
                    "only with slots= may a state table be its own output"
                )


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements in the same layout (one tensor, or views of it)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of ``a`` and ``b`` (first to last element) intersect. Meta tensors
    (a model laid out before its weights load) have no memory: every one's address is 0."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.is_meta:
        return False
    if a.is_contiguous() and b.is_contiguous():  # one block of memory each: no strides to walk
        a0, b0 = a.data_ptr(), b.data_ptr()
        return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()

    def span(t: torch.Tensor) -> tuple[int, int]:
        extents = [(n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)]
        low = t.data_ptr() + sum(e for e in extents if e < 0) * t.element_size()
        high = t.data_ptr() + (sum(e for e in extents if e > 0) + 1) * t.element_size()
        return low, high

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1
