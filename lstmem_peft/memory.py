"""One LSTMem memory layer: projections, reads, gated write and the attention corrections.

Paper Sec. 3.1-3.2 and App. C.2; every name below follows the paper. For one memory layer with
input ``x_t`` (the backbone layer's attention input, after its input norm):

    q_t = n(W_q x_t),  k_t = n(W_k x_t),  v_t = W_v x_t,  z_t = W_x x_t + b_x
    r^time_t = D_{t-1} q_t,   r^dep_t = D^{(l-1)}_t q_t,   p^dep_t = D^{(l-1)}_t k_t      (per head)
    u_t = W_read [r^time_t; r^dep_t] + b_read
    dq_t = (alpha / r) W_dq u_t,   do_t = (alpha / r) W_do u_t
    e_t = v_t - (W~_pred p^dep_t + b_pred)
    [i; f; o; g]_t = sigmoid(W~_gate [z_t; r^dep_t; e_t] + b_gate)
    C_t = diag(f_t) C_{t-1} + diag(i_t) e_t k_t^T,   D_t = diag(o_t) tanh(C_t) + diag(g_t) D^{(l-1)}_t

``n(.)`` is tanh followed by l2 normalisation within each head (denominator >= 1e-6). The stored
parameters are the full matrices ``W_pred^full = [P_time | P_dep]`` and
``W_gate^full = [G_z | G_time | G_dep | G_e]``; the forward applies the effective maps (App. C.2):
``W~_pred = P_dep`` directly, and the gate as ``W_gate^full [z; 0; r_dep; e]``, which equals
``W~_gate [z; r_dep; e]`` with ``W~_gate = [G_z | G_dep | G_e]`` (tested).

The layer holds no state: states come in and go out, so one model serves any number of sessions.

Decoding one token (``T == 1``, writing) and read-only passes take a fast path with few, fused ops
(:class:`DecodePlan`): the same equations, with the affine maps multiplied out once per weight
version (``W~_gate [z; r_dep; e]`` expands into one input-projection block and one block on the
depth reads; ``[W_dq; W_do]`` stacked). It agrees with the general path up to float rounding
(tested against the token-by-token reference, forward and backward).
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F
from torch import nn

from lstmem_kernels import lstmem_scan, lstmem_step

from . import constants as K


def head_normalize(x: torch.Tensor, num_heads: int, eps: float = K.NORM_EPS) -> torch.Tensor:
    """The paper's ``n(.)``: tanh, then l2 normalisation within each head.

    Args:
        x: ``(..., n_h * r)``.
    Returns:
        ``(..., n_h, r)``, each head of unit norm (or zero where the input head is zero).
    """
    x = torch.tanh(x).unflatten(-1, (num_heads, -1))
    # max(||x||, eps) written as sqrt(max(||x||^2, eps^2)): the same value, and a finite
    # derivative for an all-zero head (e.g. a zero padding embedding).
    return x * x.square().sum(dim=-1, keepdim=True).clamp_min(eps * eps).rsqrt()


class LayerOutput:
    """What one memory layer returns for a block of ``T`` tokens (``B`` sequences).

    Attributes:
        delta_q: ``(B, T, d_q)`` correction added to the query projection's output.
        delta_o: ``(B, T, d)`` correction added to the output projection's output.
        cell, hidden: ``(B, n_h, r, r)`` states after the block, in the state dtype.
        hidden_seq: ``(B, T, n_h, r, r)`` ``D_t`` at every position (the next layer's depth input),
            or ``None`` when the layer only read.
        key, value: ``(B, T, n_h, r)`` memory keys and values (the feedback samples), or ``None``.
        out_gate, depth_gate: ``(B, T, n_h, r)`` gates ``o_t`` and ``g_t``, or ``None``.
        next_depth: what the next memory layer takes as its depth input: ``hidden_seq``, or for one
            token its ``(B, n_h, r, r)`` slice (``hidden_seq`` is then formed when first read).
        read: ``(B T, d_s)`` the read ``u`` when the fast paths keep the corrections factored as
            ``delta_q = u C_q``, ``delta_o = u C_o`` (``corr = (C_q, C_o)``, ``(d_s, d_q)`` and
            ``(d_s, d)``, ``alpha / r`` included): the model's projections then accumulate ``u C``
            into their own output, and ``delta_q`` / ``delta_o`` are only formed when read here.
            ``None`` when the corrections are plain tensors.
    """

    __slots__ = (
        "_delta_o", "_delta_q", "_hidden_seq", "_shape", "cell", "corr", "depth_gate", "hidden", "key", "next_depth",
        "out_gate", "read", "value",
    )

    def __init__(
        self,
        delta_q: torch.Tensor | None,
        delta_o: torch.Tensor | None,
        cell: torch.Tensor,
        hidden: torch.Tensor,
        hidden_seq: torch.Tensor | None = None,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        out_gate: torch.Tensor | None = None,
        depth_gate: torch.Tensor | None = None,
        *,
        read: torch.Tensor | None = None,
        corr: tuple[torch.Tensor, torch.Tensor] | None = None,
        shape: tuple | None = None,
        step_hidden: torch.Tensor | None = None,
    ) -> None:
        self._delta_q, self._delta_o = delta_q, delta_o
        self.cell, self.hidden, self._hidden_seq = cell, hidden, hidden_seq
        self.key, self.value, self.out_gate, self.depth_gate = key, value, out_gate, depth_gate
        self.read, self.corr, self._shape = read, corr, shape  # shape: (B, T, dtype) of the corrections
        # what the next memory layer takes as its depth input: (B, n_h, r, r) for one token
        self.next_depth = hidden_seq if step_hidden is None else step_hidden

    def _correction(self, which: int) -> torch.Tensor:
        B, T, dtype = self._shape
        c = self.corr[which]
        return _cast(torch.mm(self.read, c).view(B, T, c.shape[1]), dtype)

    @property
    def hidden_seq(self) -> torch.Tensor | None:
        if self._hidden_seq is None and self.next_depth is not None:
            self._hidden_seq = self.next_depth.unsqueeze(1)  # one token: formed when read
        return self._hidden_seq

    @property
    def delta_q(self) -> torch.Tensor:
        if self._delta_q is None:
            self._delta_q = self._correction(0)
        return self._delta_q

    @property
    def delta_o(self) -> torch.Tensor:
        if self._delta_o is None:
            self._delta_o = self._correction(1)
        return self._delta_o


class DecodePlan:
    """Derived weights of one memory layer for the fast paths (no autograd through the cache).

    With ``P_dep = W~_pred`` and ``W~_gate = [G_z | G_dep | G_e]``, the error ``e``, the gate
    pre-activations ``a`` and the read ``u`` are affine in ``s = [e_0; z]`` (``e_0 = W_v x - b_pred``,
    ``z = W_x x + b_x``) and in the reads ``r_time = D q``, ``r_dep = D^{(l-1)} q``,
    ``p_dep = D^{(l-1)} k``:

        e = e_0 - P_dep p_dep
        a = b_gate + G_e e_0 + G_z z + G_dep r_dep - G_e P_dep p_dep
        u = b_read + W_read [r_time; r_dep]

    so one product ``[s, reads] M + b`` gives all three, then ``dq = (alpha / r) W_dq u`` and
    ``do = (alpha / r) W_do u``, which the model's projections accumulate into their own outputs
    (see :class:`LayerOutput`): the general path's equations, multiplied out in another order.

    Layout: the input projection gives ``q_j`` and ``k_j`` side by side for each head ``j``, a
    ``(2, r)`` block; one batched product of that block with the stacked states ``[D_j; D^{(l-1)}_j]``
    gives every read of head ``j`` at once, ``[[D q, D^{(l-1)} q], [D k, D^{(l-1)} k]]`` (``D k`` is
    unused: zero weights). Matrices are stored transposed (``(in, out)``, contiguous: the fastest
    layout for a single row). The input projection has exactly the rows of ``w_in``: a step reads
    no more weight bytes than the paper's parameters.

    Attributes:
        w_in, b_in: ``(d, 4 d_s)``, ``(4 d_s,)``: ``[W_q, W_k (per head); W_v; W_x]^T`` and
            ``[0; -b_pred; b_x]``, giving ``[q~, k~; e_0; z]``.
        m_depth, m_first: ``(6 d_s, 6 d_s)`` and ``(4 d_s, 6 d_s)``: one token, ``[s, reads] ->
            [e, a, u]`` with a depth input (reads as above) and without (reads ``[D q, D k]``).
        b_eau: ``(6 d_s,)``: ``[0; b_gate; b_read]``.
        m_s, m_pairs, b_ea, w_read_pairs: blocks of tokens, whose ``r_time`` comes from the scan:
            ``[e, a] = s m_s + pairs m_pairs + b_ea`` (``(2 d_s, 5 d_s)`` each; ``pairs`` the depth
            reads ``[D^{(l-1)} q, D^{(l-1)} k]`` per head) and ``u = r_time w_read_t + pairs
            w_read_pairs + b_read``.
        w_corr_q, w_corr_o: ``(d_s, d_q)``, ``(d_s, d)``: ``(alpha / r) W_dq^T``, ``(alpha / r) W_do^T``.
        w_q, w_read_t, w_read_d, b_read: ``W_q^T`` ``(d, d_s)``, the halves of ``W_read^T``
            ``(d_s, d_s)`` and ``b_read``.
    """

    __slots__ = (
        "b_ea", "b_eau", "b_in", "b_read", "m_depth", "m_first", "m_pairs", "m_s", "w_corr_o", "w_corr_q", "w_in",
        "w_q", "w_read_d", "w_read_pairs", "w_read_t",
    )

    def __init__(self, layer: LSTMemLayer) -> None:
        H, R, ds = layer.num_heads, layer.head_dim, layer.state_size
        w_q, w_k, w_v, w_x = layer.w_in.split(ds, dim=0)
        g_z, _, g_dep, g_e = layer.w_gate_full.split(ds, dim=1)  # W_gate^full = [G_z | G_time | G_dep | G_e]
        p_dep = layer.effective_pred()
        w_read_t, w_read_d = (w.t() for w in layer.w_read.split(ds, dim=1))
        eye = torch.eye(ds, dtype=p_dep.dtype, device=p_dep.device)
        zeros = torch.zeros_like(p_dep)
        zero = torch.zeros_like(layer.b_x)

        def per_head(*blocks: torch.Tensor) -> torch.Tensor:
            """Blocks of ``d_s`` rows ordered (head, row) -> ``(H, len(blocks), r, ...)``."""
            return torch.stack([blk.reshape(H, R, -1) for blk in blocks], dim=1)

        self.w_in = torch.cat([per_head(w_q, w_k).reshape(2 * ds, -1), w_v, w_x]).t().contiguous()
        self.b_in = torch.cat([zero, zero, -layer.b_pred, layer.b_x])
        # rows: inputs; columns: [e | a | u]
        rows_s = torch.cat([torch.cat([eye, g_e.t(), zeros], 1), torch.cat([zeros, g_z.t(), zeros], 1)])  # e_0, z
        r_time = torch.cat([zeros, torch.zeros_like(g_dep.t()), w_read_t], 1)
        r_dep = torch.cat([zeros, g_dep.t(), w_read_d], 1)
        p_row = torch.cat([-p_dep.t(), -(g_e @ p_dep).t(), zeros], 1)
        unused = torch.zeros_like(r_time)  # D k
        reads_depth = torch.stack([per_head(r_time, r_dep), per_head(unused, p_row)], dim=1)  # (H, q|k, D|D', r, 6 d_s)
        self.m_depth = torch.cat([rows_s, reads_depth.reshape(4 * ds, -1)]).contiguous()
        self.m_first = torch.cat([rows_s, per_head(r_time, unused).reshape(2 * ds, -1)]).contiguous()
        self.b_eau = torch.cat([zero, layer.b_gate, layer.b_read])
        self.m_s = rows_s[:, : 5 * ds].contiguous()
        self.m_pairs = per_head(r_dep[:, : 5 * ds], p_row[:, : 5 * ds]).reshape(2 * ds, -1).contiguous()
        self.b_ea = self.b_eau[: 5 * ds]
        self.w_read_pairs = per_head(w_read_d, torch.zeros_like(w_read_d)).reshape(2 * ds, -1).contiguous()
        self.w_corr_q = (layer.scale * layer.w_dq).t().contiguous()
        self.w_corr_o = (layer.scale * layer.w_do).t().contiguous()
        self.w_q = w_q.t().contiguous()
        self.w_read_t = w_read_t.contiguous()
        self.w_read_d = w_read_d.contiguous()
        self.b_read = layer.b_read


class LSTMemLayer(nn.Module):
    """The trainable parameters of one LSTMem memory layer and its forward math.

    Args:
        hidden_size: ``d``, width of the backbone layer's attention input and output.
        query_size: ``d_q``, output width of the backbone's query projection.
        num_heads: ``n_h``.
        head_dim: ``r``.
        alpha: ``alpha`` of the correction scale ``alpha / r``.
        layer_idx: index of the backbone decoder layer this memory belongs to (informational).

    Example:
        >>> layer = LSTMemLayer(hidden_size=64, query_size=64)
        >>> x = torch.randn(2, 5, 64)
        >>> cell = hidden = torch.zeros(2, 4, 8, 8)
        >>> out = layer(x, cell, hidden)
        >>> out.delta_q.shape, out.hidden_seq.shape
        (torch.Size([2, 5, 64]), torch.Size([2, 5, 4, 8, 8]))
    """

    def __init__(
        self,
        hidden_size: int,
        query_size: int,
        num_heads: int = K.NUM_HEADS,
        head_dim: int = K.HEAD_DIM,
        alpha: float = K.ALPHA,
        layer_idx: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.query_size = query_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.alpha = alpha
        self.layer_idx = layer_idx
        ds = self.state_size
        kw = {"device": device, "dtype": dtype}
        # [W_q; W_k; W_v; W_x] stacked so one matmul projects the layer input.
        self.w_in = nn.Parameter(torch.empty(4 * ds, hidden_size, **kw))
        self.b_x = nn.Parameter(torch.empty(ds, **kw))
        self.w_read = nn.Parameter(torch.empty(ds, 2 * ds, **kw))
        self.b_read = nn.Parameter(torch.empty(ds, **kw))
        self.w_pred_full = nn.Parameter(torch.empty(ds, 2 * ds, **kw))
        self.b_pred = nn.Parameter(torch.empty(ds, **kw))
        self.w_gate_full = nn.Parameter(torch.empty(4 * ds, 4 * ds, **kw))
        self.b_gate = nn.Parameter(torch.empty(4 * ds, **kw))
        self.w_dq = nn.Parameter(torch.empty(query_size, ds, **kw))
        self.w_do = nn.Parameter(torch.empty(hidden_size, ds, **kw))
        self.reset_parameters()

    @property
    def state_size(self) -> int:
        """``d_s = n_h * r``."""
        return self.num_heads * self.head_dim

    @property
    def scale(self) -> float:
        """``alpha / r``."""
        return self.alpha / self.head_dim

    # ------------------------------------------------------------------ initialisation (App. C.4)
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The paper's initialisation, except ``W_dq``/``W_do`` (zero until :meth:`init_corrections`).

        Kaiming-uniform is PyTorch's ``nn.Linear`` default (``a = sqrt(5)``, i.e. ``U(-1/sqrt(d),
        1/sqrt(d))``), applied to each of ``W_q, W_k, W_v, W_x`` (they share the fan-in ``d``).
        """
        ds = self.state_size
        for block in self.w_in.split(ds, dim=0):
            nn.init.kaiming_uniform_(block, a=math.sqrt(5))
        self.b_x.zero_()
        identity_then_zero = torch.cat([torch.eye(ds), torch.zeros(ds, ds)], dim=1)
        self.w_read.copy_(identity_then_zero)
        self.w_pred_full.copy_(identity_then_zero)
        self.b_read.zero_()
        self.b_pred.zero_()
        self.w_gate_full.zero_()
        self.b_gate.copy_(
            torch.cat([torch.full((ds,), K.GATE_BIAS[name]) for name in ("i", "f", "o", "g")])
        )
        self.w_dq.zero_()
        self.w_do.zero_()

    @torch.no_grad()
    def init_corrections(self, query_weight: torch.Tensor, output_weight: torch.Tensor) -> None:
        """Initialise ``W_dq`` and ``W_do`` from the backbone (App. C.4).

        The first ``min(8, d_s)`` columns of each backbone weight, each column l2-normalised and
        scaled by 0.05; the remaining columns zero.

        Args:
            query_weight: ``(d_q, d)`` weight of the backbone's query projection.
            output_weight: ``(d, d_q)`` weight of the backbone's output projection.
        """
        for target, source, name in ((self.w_dq, query_weight, "query"), (self.w_do, output_weight, "output")):
            if source.shape[0] != target.shape[0]:
                raise ValueError(
                    f"{name} projection weight has {source.shape[0]} output rows but the memory "
                    f"layer expects {target.shape[0]}; build LSTMemLayer with the backbone's sizes"
                )
            n = min(K.CORRECTION_INIT_COLUMNS, self.state_size, source.shape[1])
            cols = source[:, :n].to(device=target.device, dtype=torch.float32)
            cols = cols / cols.norm(dim=0, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
            target.zero_()
            target[:, :n] = (K.CORRECTION_INIT_SCALE * cols).to(target.dtype)

    # ------------------------------------------------------------------ paper view
    def effective_pred(self) -> torch.Tensor:
        """``W~_pred = P_dep``, ``(d_s, d_s)``."""
        return self.w_pred_full[:, self.state_size :]

    def effective_gate(self) -> torch.Tensor:
        """``W~_gate = [G_z | G_dep | G_e]``, ``(4 d_s, 3 d_s)``."""
        ds = self.state_size
        return torch.cat([self.w_gate_full[:, :ds], self.w_gate_full[:, 2 * ds :]], dim=1)

    def paper_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters in paper notation (views of the live parameters).

        Keys and shapes: ``Wq, Wk, Wv, Wx`` ``(d_s, d)``; ``bx`` ``(d_s,)``; ``Wread``
        ``(d_s, 2 d_s)``; ``bread`` ``(d_s,)``; ``Wpred_full`` ``(d_s, 2 d_s)``; ``bpred``
        ``(d_s,)``; ``Wgate_full`` ``(4 d_s, 4 d_s)``; ``bgate`` ``(4 d_s,)``; ``Wdq``
        ``(d_q, d_s)``; ``Wdo`` ``(d, d_s)``.
        """
        wq, wk, wv, wx = self.w_in.split(self.state_size, dim=0)
        return {
            "Wq": wq, "Wk": wk, "Wv": wv, "Wx": wx, "bx": self.b_x,
            "Wread": self.w_read, "bread": self.b_read,
            "Wpred_full": self.w_pred_full, "bpred": self.b_pred,
            "Wgate_full": self.w_gate_full, "bgate": self.b_gate,
            "Wdq": self.w_dq, "Wdo": self.w_do,
        }

    def extra_repr(self) -> str:
        return (
            f"layer_idx={self.layer_idx}, d={self.hidden_size}, d_q={self.query_size}, "
            f"n_h={self.num_heads}, r={self.head_dim}, alpha={self.alpha}"
        )

    # ------------------------------------------------------------------ forward
    #: Use the fused decode/read path (:class:`DecodePlan`) where it applies; ``False`` forces the
    #: general path everywhere (tests compare the two).
    fast_path: bool = True

    def decode_plan(self) -> DecodePlan:
        """The :class:`DecodePlan` of the current weights.

        When no gradient can flow to the parameters (grad mode off, or frozen parameters) the plan is
        cached (:meth:`cached_plan`); otherwise it is built afresh on every call, inside the
        autograd graph.
        """
        plan = self.cached_plan()
        return DecodePlan(self) if plan is None else plan

    def cached_plan(self) -> DecodePlan | None:
        """The cached :class:`DecodePlan`, or ``None`` when a gradient can flow to the parameters.

        The plan is rebuilt when a parameter changes: its ``_version`` counter (any in-place update
        through autograd-visible ops: optimiser steps, ``load_state_dict``, ``copy_`` under
        ``no_grad``) or its storage (``.to``, a new ``.data``). Writes into ``param.data`` bypass the
        version counter; after such a write call :meth:`clear_plan`.
        """
        params = self._parameters.values()
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            return None
        key = [(p._version, p.data_ptr()) for p in params]
        cached = self.__dict__.get("_decode_plan")
        if cached is not None and cached[0] == key:
            return cached[1]
        with torch.inference_mode(False), torch.no_grad():
            plan = DecodePlan(self)
        self.__dict__["_decode_plan"] = (key, plan)
        return plan

    def clear_plan(self) -> None:
        """Drop the cached :class:`DecodePlan` (it is rebuilt on next use)."""
        self.__dict__.pop("_decode_plan", None)

    def _read_vector(self, r_time: torch.Tensor, r_dep: torch.Tensor | None) -> torch.Tensor:
        """``u = W_read [r^time; r^dep] + b_read``, ``(..., d_s)``. Inputs ``(..., n_h, r)``."""
        r_time = r_time.flatten(-2)
        r_dep = torch.zeros_like(r_time) if r_dep is None else r_dep.flatten(-2)
        return F.linear(torch.cat([r_time, r_dep], dim=-1), self.w_read, self.b_read)

    def _corrections(self, r_time: torch.Tensor, r_dep: torch.Tensor | None):
        """``(dq, do)`` from the reads; inputs ``(..., n_h, r)``."""
        u = self._read_vector(r_time, r_dep)
        return self.scale * F.linear(u, self.w_dq), self.scale * F.linear(u, self.w_do)

    def forward(
        self,
        x: torch.Tensor,
        cell: torch.Tensor,
        hidden: torch.Tensor,
        depth: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        write: bool = True,
        backend: str = "auto",
        aux: bool = True,
        plan: DecodePlan | None = None,
    ) -> LayerOutput:
        """Read, then (if ``write``) update the memory for a block of tokens.

        Args:
            x: ``(B, T, d)`` attention input of the backbone layer.
            cell, hidden: ``(B, n_h, r, r)`` states ``C_{t0-1}``, ``D_{t0-1}`` before the block.
            depth: the depth input ``D^{(l-1)}``: ``(B, T, n_h, r, r)`` at every position when
                writing (for one token also ``(B, n_h, r, r)``); ``(B, n_h, r, r)`` (the lower
                layer's fixed state) when only reading; ``None`` for the first memory layer or
                without depth coupling.
            valid: ``(B, T)`` bool, ``False`` at padding, or ``None``.
            write: ``False`` reads the fixed states only (the answer pass of training, read-only
                generation); ``C`` and ``D`` are returned unchanged.
            backend: scan backend, see :func:`lstmem_kernels.lstmem_scan`.
            aux: fill ``key``, ``value``, ``out_gate`` and ``depth_gate`` of the output (block
                feedback needs them); ``False`` lets the one-token path skip them.
            plan: this layer's :meth:`cached_plan`, when the caller has just fetched it (the model
                fetches every layer's plan once at the start of a forward); ``None``: looked up here.

        Returns:
            :class:`LayerOutput`; corrections in ``x.dtype``, states in the dtype of ``cell``.
        """
        if self.fast_path:
            if plan is None:
                plan = self.cached_plan()  # None when a gradient is needed
            if not write:
                if plan is not None:
                    return self._read_fast(plan, x, cell, hidden, depth)
            elif x.shape[1] == 1:  # one token: the fused step (a fresh, differentiable plan under autograd)
                return self._step_fast(DecodePlan(self) if plan is None else plan, x, cell, hidden, depth, valid, backend, aux)
            elif plan is not None:
                return self._block_fast(plan, x, cell, hidden, depth, valid, backend, aux)
        B, T, _ = x.shape
        H = self.num_heads
        ds = self.state_size
        wdtype = self.w_in.dtype
        proj = F.linear(x.to(wdtype), self.w_in)
        if not write:
            q = head_normalize(proj[..., :ds], H)  # (B, T, H, r)
            r_time = _read(hidden.to(wdtype), q)
            r_dep = None if depth is None else _read(depth.to(wdtype), q)
            dq, do = self._corrections(r_time, r_dep)
            return LayerOutput(dq.to(x.dtype), do.to(x.dtype), cell, hidden)

        if depth is not None and depth.dim() == 4:  # one token's depth input without its time axis
            depth = depth.unsqueeze(1)
        q, k = head_normalize(proj[..., : 2 * ds], 2 * H).split(H, dim=-2)  # one pass for both
        v = proj[..., 2 * ds : 3 * ds].unflatten(-1, (H, -1))
        z = proj[..., 3 * ds :] + self.b_x
        if depth is not None:
            depth = depth.to(wdtype)
            pairs = torch.matmul(depth, torch.stack([q, k], dim=-1))  # (B, T, H, r, 2): D q, D k
            r_dep, p_dep = pairs.unbind(-1)
            v_hat = F.linear(p_dep.flatten(-2), self.effective_pred(), self.b_pred)
        else:
            r_dep = None
            v_hat = self.b_pred.expand(B, T, ds)
        e = v.flatten(-2) - v_hat
        # W_gate^full [z; 0; r_dep; e] = W~_gate [z; r_dep; e] (App. C.2): the zero block in the
        # activations costs less than slicing the weight on every call.
        zeros = torch.zeros_like(z)
        gate_in = torch.cat([z, zeros, zeros if r_dep is None else r_dep.flatten(-2), e], dim=-1)
        gates = torch.sigmoid(F.linear(gate_in, self.w_gate_full, self.b_gate))
        i, f, o, g = (t.unflatten(-1, (H, -1)) for t in gates.split(ds, dim=-1))
        w = i * e.unflatten(-1, (H, -1))
        depth_term = None if depth is None else g[..., None] * depth

        if T == 1:  # half-precision states enter the step in float32, so D_t reaches the next layer unrounded
            r_time, new_cell, new_hidden = lstmem_step(
                q[:, 0], k[:, 0], w[:, 0], f[:, 0], o[:, 0], _fresh(cell), _fresh(hidden),
                None if depth_term is None else depth_term[:, 0],
                None if valid is None else valid[:, 0],
                backend=backend,
            )
            r_time = r_time[:, None]
            hidden_seq = new_hidden.to(wdtype)[:, None]
        else:
            r_time, hidden_seq, new_cell, new_hidden = lstmem_scan(
                q, k, w, f, o, depth_term, valid, cell, hidden, backend=backend
            )
        dq, do = self._corrections(r_time.to(wdtype), r_dep)
        return LayerOutput(
            dq.to(x.dtype), do.to(x.dtype), new_cell.to(cell.dtype), new_hidden.to(hidden.dtype), hidden_seq,
            key=k, value=v, out_gate=o, depth_gate=g,
        )

    # ------------------------------------------------------------------ fast paths
    def _read_fast(self, plan: DecodePlan, x, cell, hidden, depth) -> LayerOutput:
        """``write=False`` with the plan: ``q``, the two reads and the stacked corrections."""
        wdtype = plan.w_in.dtype
        q = head_normalize(torch.matmul(_cast(x, wdtype), plan.w_q), self.num_heads)
        u = torch.matmul(_read(_cast(hidden, wdtype), q).flatten(-2), plan.w_read_t) + plan.b_read
        if depth is not None:
            u = u + torch.matmul(_read(_cast(depth, wdtype), q).flatten(-2), plan.w_read_d)
        B, T = x.shape[:2]
        return LayerOutput(
            None, None, cell, hidden, read=u.reshape(B * T, -1), corr=(plan.w_corr_q, plan.w_corr_o), shape=(B, T, x.dtype)
        )

    def _block_fast(self, plan: DecodePlan, x, cell, hidden, depth, valid, backend, aux) -> LayerOutput:
        """A written block (``T > 1``) with the plan, no autograd: the general path's equations with
        the fused maps of :class:`DecodePlan` around the same scan."""
        B, T, _ = x.shape
        H, R, ds = self.num_heads, self.head_dim, self.state_size
        wdtype = plan.w_in.dtype
        x2 = _cast(x.reshape(B * T, -1), wdtype)
        qk, s = torch.addmm(plan.b_in, x2, plan.w_in).split_with_sizes([2 * ds, 2 * ds], 1)  # s = [e_0; z]
        qk = torch.tanh(qk).view(B * T * H, 2, R)  # rows q_j, k_j of head (b, t, j)
        qk = qk / torch.linalg.vector_norm(qk, dim=-1, keepdim=True).clamp_min(K.NORM_EPS)  # n(.)
        ea = torch.addmm(plan.b_ea, s, plan.m_s)
        if depth is not None:
            depth = _cast(depth, wdtype)
            pairs = torch.bmm(qk, depth.reshape(B * T * H, R, R).transpose(1, 2)).view(B * T, 2 * ds)  # D' q, D' k
            ea = torch.addmm(ea, pairs, plan.m_pairs)
        e, a = ea.split_with_sizes([ds, 4 * ds], 1)
        i, f, o, g = torch.sigmoid(a).view(B, T, 4, H, R).unbind(2)
        w = i * e.view(B, T, H, R)
        q, k = qk.view(B, T, H, 2, R).unbind(3)
        depth_term = None if depth is None else g[..., None] * depth
        r_time, hidden_seq, new_cell, new_hidden = lstmem_scan(
            q, k, w, f, o, depth_term, valid, cell, hidden, backend=backend
        )
        u = torch.addmm(plan.b_read, _cast(r_time, wdtype).reshape(B * T, ds), plan.w_read_t)
        if depth is not None:
            u = torch.addmm(u, pairs, plan.w_read_pairs)
        return LayerOutput(
            None, None, _cast(new_cell, cell.dtype), _cast(new_hidden, hidden.dtype), hidden_seq,
            key=k, value=F.linear(x2, self.w_in[2 * ds : 3 * ds]).view(B, T, H, R) if aux else None,
            out_gate=o, depth_gate=g, read=u, corr=(plan.w_corr_q, plan.w_corr_o), shape=(B, T, x.dtype),
        )

    def _step_fast(self, plan: DecodePlan, x, cell, hidden, depth, valid, backend, aux) -> LayerOutput:
        """One written token (``T == 1``) with the plan: the layer's equations in about 30 small ops.

        ``depth`` is ``(B, 1, n_h, r, r)``, its ``(B, n_h, r, r)`` slice or ``None``; ``valid``
        ``(B, 1)`` or ``None``.
        """
        B = x.shape[0]
        H, R, ds = self.num_heads, self.head_dim, self.state_size
        wdtype = plan.w_in.dtype
        x2 = x.reshape(B, -1)
        if x2.dtype != wdtype:
            x2 = x2.to(wdtype)
        qk, s = torch.addmm(plan.b_in, x2, plan.w_in).split_with_sizes([2 * ds, 2 * ds], 1)  # s = [e_0; z]
        qk = torch.tanh(qk).view(B * H, 2, R)  # rows q_j, k_j of head (b, j)
        qk = qk / torch.linalg.vector_norm(qk, dim=-1, keepdim=True).clamp_min(K.NORM_EPS)  # n(.)
        D = hidden if hidden.dtype == wdtype else hidden.to(wdtype)
        if depth is None:
            reads = torch.bmm(qk, D.reshape(B * H, R, R).transpose(1, 2))  # (B H, 2, r): D q, D k
            m = plan.m_first
        else:
            dep = depth if depth.dim() == 4 else depth.reshape(B, H, R, R)
            if dep.dtype != wdtype:
                dep = dep.to(wdtype)
            states = torch.cat([D, dep], dim=2).view(B * H, 2 * R, R).transpose(1, 2)
            reads = torch.bmm(qk, states)  # (B H, 2, 2 r): [q; k] [D; D^(l-1)]^T
            m = plan.m_depth
        e, a, u = torch.addmm(plan.b_eau, torch.cat([s, reads.view(B, -1)], dim=1), m).split_with_sizes([ds, 4 * ds, ds], 1)
        i, f, o, g = torch.sigmoid(a).view(B, 4, H, R, 1).unbind(1)  # (B, H, R, 1)
        w = i * e.view(B, H, R, 1)
        k_row = qk.view(B, H, 2, R).narrow(2, 1, 1)  # (B, H, 1, R)
        if wdtype in (torch.float32, torch.float64) and (backend == "torch" or (backend == "auto" and not x.is_cuda)):
            C = cell if cell.dtype == wdtype else cell.to(wdtype)
            new_c = torch.addcmul(f * C, w, k_row)
            tanh_c = torch.tanh(new_c)
            new_h = o * tanh_c if depth is None else torch.addcmul(g * dep, o, tanh_c)
            if valid is not None:
                keep = valid.reshape(B, 1, 1, 1)
                new_c = torch.where(keep, new_c, C)
                new_h = torch.where(keep, new_h, D)
            step_hidden = new_h
        else:  # Triton (in place, after the reads above), naive, or a half-precision adapter
            _, new_c, new_h = lstmem_step(
                qk.view(B, H, 2, R).select(2, 0), k_row.reshape(B, H, R), w.reshape(B, H, R), f.reshape(B, H, R),
                o.reshape(B, H, R), _fresh(cell), _fresh(hidden), None if depth is None else g * dep,
                None if valid is None else valid.reshape(B), backend=backend,
            )
            step_hidden = _cast(new_h, wdtype)
        out = LayerOutput(
            None, None, _cast(new_c, cell.dtype), _cast(new_h, hidden.dtype),
            read=u, corr=(plan.w_corr_q, plan.w_corr_o), shape=(B, 1, x.dtype), step_hidden=step_hidden,
        )
        if aux:
            out.key = k_row.view(B, 1, H, R)
            out.value = F.linear(x2, self.w_in[2 * ds : 3 * ds]).view(B, 1, H, R)
            out.out_gate = o.view(B, 1, H, R)
            out.depth_gate = g.view(B, 1, H, R)
        return out


def _fresh(state: torch.Tensor) -> torch.Tensor:
    """A float32 (or float64) copy of a state that the step may update in place (the Triton step
    does): the caller's state, which may be a cache's or a checkpoint's, is never written."""
    return state.clone() if state.dtype in (torch.float32, torch.float64) else state.float()


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _read(state: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``state q_t`` per head at every position: state ``(B, H, r, r)``, q ``(B, T, H, r)`` -> ``(B, T, H, r)``."""
    return torch.matmul(q.transpose(1, 2), state.transpose(-1, -2)).transpose(1, 2)
