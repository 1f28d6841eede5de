"""What one memory layer's block body (:mod:`.layer`) and its decode step share: the
parameters arranged as both multiply by them (:class:`LayerWeights`), what both return
(:class:`LayerOutput`), and the small tensor helpers of their math (the normalisation of the paper's
``n(.)``, casts, whether a gradient can flow). Every name follows the paper (Sec. 3.1-3.2, App. C.2;
see :mod:`.layer`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import constants as K


class LayerOutput(NamedTuple):
    """What one memory layer returns for a block of ``T`` tokens (``B`` sequences).

    The corrections stay factored: ``Δq = read corr[0]`` and ``Δo = read corr[1]`` (eq:injection with
    ``corr = ((alpha / r) W_dq^T, (alpha / r) W_do^T)``, the scale folded into the maps), so a
    projection adds its correction in one product (:meth:`add_to`) and nothing ``(B, T, d)``-sized is
    formed unless asked for (:meth:`correction`).

    Attributes:
        read: ``(B, T, d_s)`` the read ``u_t`` of eq:read, in the layer's weight dtype.
        corr: ``((d_s, d_q), (d_s, d))`` the correction maps of :class:`LayerWeights`.
        cell, hidden: ``(B, n_h, r, r)`` states after the block, in the state dtype.
        hidden_seq: ``(B, T, n_h, r, r)`` ``D_t`` at every position, unrounded (the next layer's
            depth input), or ``None`` when the layer only read.
        key, value: ``(B, T, n_h, r)`` memory keys ``k_t`` and values ``v_t`` (feedback samples).
        out_gate, depth_gate: ``(B, T, n_h, r)`` gates ``o_t`` and ``g_t``.
    """

    read: torch.Tensor
    corr: tuple[torch.Tensor, torch.Tensor]
    cell: torch.Tensor | None
    hidden: torch.Tensor | None
    hidden_seq: torch.Tensor | None = None
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    out_gate: torch.Tensor | None = None
    depth_gate: torch.Tensor | None = None

    def correction(self, which: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``Δq`` (``which`` 0) ``(B, T, d_q)`` or ``Δo`` (1) ``(B, T, d)``, formed, in ``dtype``
        (default: the layer's weight dtype)."""
        delta = torch.matmul(self.read, self.corr[which])
        return delta if dtype is None else cast(delta, dtype)

    def add_to(self, result: torch.Tensor, which: int) -> torch.Tensor:
        """``result + Δ`` for the projection output ``result`` ``(B, T, n)`` (``which``: 0 for
        ``Δq``, 1 for ``Δo``): one fused product where the dtypes agree, else ``Δ`` is formed in the
        layer's dtype and rounded once to ``result``'s."""
        corr = self.corr[which]
        if self.read.dtype != result.dtype:
            return result + self.correction(which, result.dtype)
        n = corr.shape[1]
        return torch.addmm(result.reshape(-1, n), self.read.reshape(-1, corr.shape[0]), corr).view(
            result.shape
        )


class LayerWeights(NamedTuple):
    """The parameters arranged as the forward multiplies by them (``(in, out)``, contiguous: the
    fastest layout for a few rows). Derived by :meth:`.layer.LSTMemLayer.weights` (differentiably, in
    every forward that trains) and kept by :meth:`.layer.LSTMemLayer.derived_weights` until a parameter
    changes.

    With ``W~_gate = [G_z | G_dep | G_e]``, ``W~_pred = P_dep`` (App. C.2) and
    ``W_read = [W_read^time | W_read^dep]``, the residual, the gate pre-activations and the depth
    part of the read are affine in ``s = [v; z]`` and the depth reads ``r^dep = D^(l-1) q``,
    ``p^dep = D^(l-1) k``, all known before the write (eq:residual, eq:gates, eq:read)::

        e     = v - b_pred - W~_pred p^dep
        a     = (b_gate - G_e b_pred) + G_e v + G_z z + G_dep r^dep - G_e W~_pred p^dep
        u_dep = b_read + W_read^dep r^dep

    so one product ``[s, reads] eau + b_eau`` gives ``[e | a | u_dep]`` for any number of tokens,
    and ``u = u_dep + W_read^time r^time`` once the recurrence has produced ``r^time``. A one-token
    step (:func:`lstmem_kernels.lstmem_decode_step`) takes these maps as they are; its PyTorch member
    arranges its own from them (``lstmem_kernels.step.decode_torch.StepMaps``).

    Attributes:
        w_in, b_in: ``(d, 4 d_s)``, ``(4 d_s,)``: ``[W_q, W_k (head by head); W_v; W_x]^T`` and
            ``[0; 0; 0; b_x]``. The first ``2 d_s`` columns hold head ``j``'s rows of ``W_q`` and then of
            ``W_k``, so that one product's ``(n_h, 2, r)`` view gives ``[q^[j]; k^[j]]`` per head.
        eau_depth: ``(4 d_s, 6 d_s)``: ``[v; z; reads] -> [e | a | u_dep]``, the reads
            ``[r^dep^[j]; p^dep^[j]]`` head by head (the order one batched product over
            ``[q^[j]; k^[j]]`` yields them).
        eau_first: ``(2 d_s, 6 d_s)``: ``[v; z] -> [e | a | u_dep]`` for a layer without depth input.
        b_eau: ``(6 d_s,)`` ``[-b_pred; b_gate - G_e b_pred; b_read]``.
        read: ``(2 d_s, d_s)`` ``W_read^T``; ``read_time``: its first ``d_s`` rows, ``W_read^time^T``
            (a view).
        corr: ``(d_s, d_q + d)``: ``(alpha / r) [W_dq; W_do]^T`` (eq:injection, with its scale
            folded into the map): ``u corr = [Δq | Δo]`` in one product (a serving engine's).
        corr_q, corr_o: ``(d_s, d_q)``, ``(d_s, d)``: its two parts (views), ``Δq = u corr_q``,
            ``Δo = u corr_o``.
    """

    w_in: torch.Tensor
    b_in: torch.Tensor
    eau_depth: torch.Tensor
    eau_first: torch.Tensor
    b_eau: torch.Tensor
    read: torch.Tensor
    read_time: torch.Tensor
    corr: torch.Tensor
    corr_q: torch.Tensor
    corr_o: torch.Tensor

    def step_weights(self, depth: bool) -> tuple[torch.Tensor, ...]:
        """The weight arguments of :func:`lstmem_kernels.lstmem_decode_step`, ``(w_in, b_in, eau,
        b_eau, read)``, for a step with a depth input (``eau_depth``) or without (``eau_first``)."""
        return (self.w_in, self.b_in, self.eau_depth if depth else self.eau_first, self.b_eau, self.read)


def unit_heads(x: torch.Tensor) -> torch.Tensor:
    """The l2 normalisation of ``n(.)`` along the last axis (denominator at least 1e-6)."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(K.NORM_EPS)


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether a gradient can reach any of ``tensors`` (gradients enabled and one requires them)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the dispatch when it already has that dtype."""
    return t if t.dtype == dtype else t.to(dtype)
