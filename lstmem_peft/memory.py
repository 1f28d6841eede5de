"""One LSTMem memory layer: projections, reads, gated write and the attention corrections.

Paper Sec. 3.1-3.2 and App. C.2; every name below follows the paper. For one memory layer with
input ``x_t`` (the backbone layer's attention input, after its input norm):

    q_t = n(W_q x_t),  k_t = n(W_k x_t),  v_t = W_v x_t,  z_t = W_x x_t + b_x        eq:projections
    r^time_t = D_{t-1} q_t,   r^dep_t = D^{(l-1)}_t q_t   (per head)                  eq:read
    u_t = W_read [r^time_t; r^dep_t] + b_read
    dq_t = (alpha / r) W_dq u_t,   do_t = (alpha / r) W_do u_t                        eq:injection
    p^dep_t = D^{(l-1)}_t k_t,   e_t = v_t - (W~_pred p^dep_t + b_pred)                eq:residual
    [i; f; o; g]_t = sigmoid(W~_gate [z_t; r^dep_t; e_t] + b_gate)                     eq:gates
    C_t = diag(f_t) C_{t-1} + diag(i_t) e_t k_t^T                                      eq:write
    D_t = diag(o_t) tanh(C_t) + diag(g_t) D^{(l-1)}_t                                  eq:hidden

``n(.)`` is tanh followed by l2 normalisation within each head (denominator >= 1e-6). The stored
parameters are the full matrices ``W_pred^full = [P_time | P_dep]`` and
``W_gate^full = [G_z | G_time | G_dep | G_e]``; the forward uses the effective maps of App. C.2,
``W~_pred = P_dep`` and ``W~_gate = [G_z | G_dep | G_e]`` (:class:`LayerWeights`).

:meth:`LSTMemLayer.forward` is the body of this math, in the paper's order, for every token count,
with or without a depth input, writing or read-only, with or without gradients. The recurrence
(eq:write, eq:hidden and the temporal read) is the kernel op family of ``lstmem_kernels``:
``lstmem_step`` for one token, ``lstmem_scan`` for a block, each with naive, vectorised-PyTorch and
Triton members chosen by ``backend``. One exception, for speed: the one-token steps of a
``generate`` call use :class:`StepPlan`, the same affine maps multiplied out (decoding is bound by
the number of small operations: about 35 per layer instead of about 60, measured in
``benchmarks/``). :func:`lstmem_peft.reference.memory_layer_ref` is the float64 token-loop
transcription every path is tested against.

The layer holds no state: states come in and go out, so one model serves any number of sessions.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from lstmem_kernels import lstmem_scan, lstmem_step, step_shaped

from . import constants as K


def head_normalize(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The paper's ``n(.)``: tanh, then l2 normalisation within each head.

    Args:
        x: ``(..., n_h * r)``.
    Returns:
        ``(..., n_h, r)``, each head of unit norm (or zero where the input head is zero).
    """
    return _unit_heads(torch.tanh(x).unflatten(-1, (num_heads, -1)))


class LayerOutput(NamedTuple):
    """What one memory layer returns for a block of ``T`` tokens (``B`` sequences).

    Attributes:
        delta_q: ``(B, T, d_q)`` correction added to the query projection's output (``x.dtype``).
        delta_o: ``(B, T, d)`` correction added to the output projection's output (``x.dtype``).
        cell, hidden: ``(B, n_h, r, r)`` states after the block, in the state dtype.
        hidden_seq: ``(B, T, n_h, r, r)`` ``D_t`` at every position, unrounded (the next layer's
            depth input), or ``None`` when the layer only read.
        key, value: ``(B, T, n_h, r)`` memory keys ``k_t`` and values ``v_t`` (feedback samples).
        out_gate, depth_gate: ``(B, T, n_h, r)`` gates ``o_t`` and ``g_t``.
        read: ``(B, d_s)`` the read ``u`` of a fused one-token step, whose corrections stay factored:
            ``Δq = u corr[:, :d_q]`` and ``Δo = u corr[:, d_q:]`` (``corr``: :attr:`LayerWeights.corr`);
            the model's projections accumulate them into their own output (``delta_q``/``delta_o``
            are then ``None``; :meth:`correction` forms them).
    """

    delta_q: torch.Tensor | None
    delta_o: torch.Tensor | None
    cell: torch.Tensor
    hidden: torch.Tensor
    hidden_seq: torch.Tensor | None = None
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    out_gate: torch.Tensor | None = None
    depth_gate: torch.Tensor | None = None
    read: torch.Tensor | None = None
    corr: tuple[torch.Tensor, torch.Tensor] | None = None

    def correction(self, which: int) -> torch.Tensor:
        """``Δq`` (``which`` 0) or ``Δo`` (1) as a ``(B, 1, n)`` tensor, formed if factored."""
        if self.read is None:
            return self.delta_q if which == 0 else self.delta_o
        return torch.mm(self.read, self.corr[which]).unsqueeze(1)


class LayerWeights(NamedTuple):
    """The parameters in the layout the forward multiplies by: slices, stacks and transposes of the
    stored parameters (``(in, out)``, contiguous: the fastest layout for a few rows), no other math.

    Derive once per forward (:meth:`LSTMemLayer.weights`), or once per ``generate`` call, where
    the parameters cannot change.

    Attributes:
        w_in, b_in: ``(d, 4 d_s)``, ``(4 d_s,)``: ``[W_q, W_k (head by head); W_v; W_x]^T`` and
            ``[0; 0; 0; b_x]``. The first ``2 d_s`` columns hold head ``j``'s rows of ``W_q`` and then of
            ``W_k``, so that one product's ``(n_h, 2, r)`` view gives ``[q^[j]; k^[j]]`` per head.
        pred: ``(d_s, d_s)`` ``W~_pred^T = P_dep^T``.
        gate: ``(3 d_s, 4 d_s)`` ``W~_gate^T = [G_z | G_dep | G_e]^T``; gate_first: ``(2 d_s, 4 d_s)``
            ``[G_z | G_e]^T``, for a layer without depth input (``r^dep = 0``).
        read: ``(2 d_s, d_s)`` ``W_read^T``.
        corr: ``(d_s, d_q + d)`` ``(alpha / r) [W_dq; W_do]^T``: both corrections in one product.
        step: the :class:`StepPlan` of the fused one-token step, or ``None`` (derived only where
            many one-token steps share the weights: a ``generate`` call).
    """

    w_in: torch.Tensor
    b_in: torch.Tensor
    pred: torch.Tensor
    gate: torch.Tensor
    gate_first: torch.Tensor
    read: torch.Tensor
    corr: torch.Tensor
    step: StepPlan | None = None


class StepPlan:
    """The affine maps of one written token, multiplied out for the fused decode step.

    Decoding spends its time in the number of small operations, not in arithmetic. With
    ``W~_gate = [G_z | G_dep | G_e]``, the residual ``e``, the gate pre-activations ``a`` and the
    read ``u`` of one token are affine in ``s = [e_0; z]`` (``e_0 = W_v x - b_pred``,
    ``z = W_x x + b_x``) and in the reads ``r^time = D q``, ``r^dep = D^(l-1) q``,
    ``p^dep = D^(l-1) k``, all of which exist before the write:

        e = e_0 - W~_pred p^dep
        a = b_gate + G_e e_0 + G_z z + G_dep r^dep - G_e W~_pred p^dep
        u = b_read + W_read [r^time; r^dep]

    so one product ``[s, reads] M + b`` gives all three (``M`` built here, once per ``generate``
    call). :meth:`LSTMemLayer._step_fused` uses it; tests hold it to the reference.

    Attributes:
        m_depth, m_first: ``(6 d_s, 6 d_s)`` and ``(4 d_s, 6 d_s)``: ``[s, reads] -> [e, a, u]``
            with a depth input (reads ``[D q, D^(l-1) q, D k, D^(l-1) k]`` per head) and without
            (reads ``[D q, D k]``; ``D k`` is unused: zero rows).
        b_in: ``(4 d_s,)`` ``[0; -b_pred; b_x]``, the bias of ``x -> [q~, k~; e_0; z]``.
        b_eau: ``(6 d_s,)`` ``[0; b_gate; b_read]``.
    """

    __slots__ = ("b_eau", "b_in", "m_depth", "m_first")

    def __init__(self, layer: LSTMemLayer) -> None:
        H, R, ds = layer.num_heads, layer.head_dim, layer.state_size
        g_z, _, g_dep, g_e = layer.w_gate_full.split(ds, dim=1)  # W_gate^full = [G_z | G_time | G_dep | G_e]
        p_dep = layer.effective_pred()
        w_read_t, w_read_d = (w.t() for w in layer.w_read.split(ds, dim=1))
        eye = torch.eye(ds, dtype=p_dep.dtype, device=p_dep.device)
        zeros = torch.zeros_like(p_dep)
        zero = torch.zeros_like(layer.b_x)

        def per_head(*blocks: torch.Tensor) -> torch.Tensor:
            """Blocks of ``d_s`` rows ordered (head, row) -> ``(H, len(blocks), r, ...)``."""
            return torch.stack([blk.reshape(H, R, -1) for blk in blocks], dim=1)

        self.b_in = torch.cat([zero, zero, -layer.b_pred, layer.b_x])
        # rows: inputs; columns: [e | a | u]
        rows_s = torch.cat(
            [torch.cat([eye, g_e.t(), zeros], 1), torch.cat([zeros, g_z.t(), zeros], 1)]
        )  # e_0, z
        r_time = torch.cat([zeros, torch.zeros_like(g_dep.t()), w_read_t], 1)
        r_dep = torch.cat([zeros, g_dep.t(), w_read_d], 1)
        p_row = torch.cat([-p_dep.t(), -(g_e @ p_dep).t(), zeros], 1)
        unused = torch.zeros_like(r_time)  # D k
        reads_depth = torch.stack(
            [per_head(r_time, r_dep), per_head(unused, p_row)], dim=1
        )  # (H, q|k, D|D', r, 6 d_s)
        self.m_depth = torch.cat([rows_s, reads_depth.reshape(4 * ds, -1)]).contiguous()
        self.m_first = torch.cat([rows_s, per_head(r_time, unused).reshape(2 * ds, -1)]).contiguous()
        self.b_eau = torch.cat([zero, layer.b_gate, layer.b_read])


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
        # whether a depth input D^(l-1) reaches this layer (set at injection: not for the first
        # memory layer, nor without depth coupling); without one, P_dep can never get a gradient
        self.depth_input = True
        self.reset_parameters()
        self.register_load_state_dict_post_hook(_refuse_nonfinite_weights)

    @property
    def state_size(self) -> int:
        """``d_s = n_h * r``."""
        return self.num_heads * self.head_dim

    @property
    def scale(self) -> float:
        """``alpha / r``."""
        return self.alpha / self.head_dim

    def set_depth_input(self, receives: bool) -> None:
        """Declare whether a depth input reaches this layer. Without one, ``W_pred^full`` (whose
        ``P_dep`` only ever multiplies the depth input) is frozen, so that every trainable
        parameter receives a gradient (DDP's and PEFT's invariant); it stays in the adapter file.
        The query wrapper re-freezes it whenever PEFT marks adapter weights trainable."""
        self.depth_input = bool(receives)
        if not self.depth_input:
            self.w_pred_full.requires_grad_(False)

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
        self.b_gate.copy_(torch.cat([torch.full((ds,), K.GATE_BIAS[name]) for name in ("i", "f", "o", "g")]))
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
        for target, source, name in (
            (self.w_dq, query_weight, "query"),
            (self.w_do, output_weight, "output"),
        ):
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
            "Wq": wq,
            "Wk": wk,
            "Wv": wv,
            "Wx": wx,
            "bx": self.b_x,
            "Wread": self.w_read,
            "bread": self.b_read,
            "Wpred_full": self.w_pred_full,
            "bpred": self.b_pred,
            "Wgate_full": self.w_gate_full,
            "bgate": self.b_gate,
            "Wdq": self.w_dq,
            "Wdo": self.w_do,
        }

    def extra_repr(self) -> str:
        return (
            f"layer_idx={self.layer_idx}, d={self.hidden_size}, d_q={self.query_size}, "
            f"n_h={self.num_heads}, r={self.head_dim}, alpha={self.alpha}"
        )

    # ------------------------------------------------------------------ forward
    def weights(self, step: bool = False) -> LayerWeights:
        """The :class:`LayerWeights` of the current parameters (differentiable); ``step``: with
        the :class:`StepPlan` of the fused one-token step."""
        ds = self.state_size
        g = self.w_gate_full  # [G_z | G_time | G_dep | G_e]
        w_q, w_k, w_v, w_x = self.w_in.split(ds)
        qk_by_head = torch.stack(
            [w_q.view(self.num_heads, self.head_dim, -1), w_k.view(self.num_heads, self.head_dim, -1)], 1
        )
        return LayerWeights(
            w_in=torch.cat([qk_by_head.reshape(2 * ds, -1), w_v, w_x]).t().contiguous(),
            b_in=torch.cat([torch.zeros_like(self.b_x).repeat(3), self.b_x]),
            pred=self.effective_pred().t().contiguous(),
            gate=self.effective_gate().t().contiguous(),
            gate_first=torch.cat([g[:, :ds], g[:, 3 * ds :]], dim=1).t().contiguous(),
            read=self.w_read.t().contiguous(),
            corr=(self.scale * torch.cat([self.w_dq, self.w_do])).t().contiguous(),
            step=StepPlan(self) if step else None,
        )

    def forward(
        self,
        x: torch.Tensor,
        cell: torch.Tensor,
        hidden: torch.Tensor,
        depth: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        write: bool = True,
        backend: str = "auto",
        weights: LayerWeights | None = None,
        aux: bool = True,
    ) -> LayerOutput:
        """Read, then (if ``write``) update the memory for a block of tokens, in the paper's order.

        Every token is a row of 2-D products (``B T`` rows), so one token costs few operations.

        Args:
            x: ``(B, T, d)`` attention input of the backbone layer.
            cell, hidden: ``(B, n_h, r, r)`` states ``C_{t0-1}``, ``D_{t0-1}`` before the block.
            depth: the depth input ``D^{(l-1)}``: ``(B, T, n_h, r, r)`` at every position when
                writing; ``(B, n_h, r, r)`` (the lower layer's fixed state) when only reading;
                ``None`` for the first memory layer or without depth coupling.
            valid: ``(B, T)`` bool, ``False`` at padding, or ``None``.
            write: ``False`` reads the fixed states only (the answer pass of training, read-only
                generation); ``C`` and ``D`` are returned unchanged.
            backend: the recurrence's kernel, see :func:`lstmem_kernels.lstmem_scan`.
            weights: this layer's :meth:`weights`, when the caller derived them already.
            aux: return the feedback samples (``key``, ``value``, ``out_gate``, ``depth_gate``);
                ``False`` lets the fused one-token step skip them.

        Returns:
            :class:`LayerOutput`; corrections in ``x.dtype``, states in the dtype of ``cell``.
        """
        w = self.weights() if weights is None else weights
        B, T, _ = x.shape
        H, R, ds = self.num_heads, self.head_dim, self.state_size
        dtype = w.w_in.dtype
        rows = _cast(x, dtype).reshape(B * T, -1)
        if not write:
            # eq:projections (q only) and eq:read against the fixed states
            q = head_normalize(torch.mm(rows, self.w_in[:ds].t()), H).view(B, T, H, R)
            r_time = _read(_cast(hidden, dtype), q).reshape(B * T, ds)
            if depth is None:
                u = torch.addmm(self.b_read, r_time, w.read[:ds])
            else:
                r_dep = _read(_cast(depth, dtype), q).reshape(B * T, ds)
                u = torch.addmm(self.b_read, torch.cat([r_time, r_dep], 1), w.read)
            delta_q, delta_o = self._inject(u, w, B, T, x.dtype)
            return LayerOutput(delta_q, delta_o, cell, hidden)

        if T == 1 and w.step is not None:
            return self._step_fused(w, rows, cell, hidden, depth, valid, backend, aux)
        # eq:projections, with z_t of eq:gates from the same product
        proj = torch.addmm(w.b_in, rows, w.w_in)  # (B T, 4 d_s): [W_q x, W_k x (by head); W_v x; W_x x + b_x]
        qk = _unit_heads(
            torch.tanh(proj[:, : 2 * ds]).view(B * T * H, 2, R)
        )  # [q^[j]; k^[j]] per (token, head)
        v, z = proj[:, 2 * ds : 3 * ds], proj[:, 3 * ds :]
        if depth is None:  # D^(l-1) = 0: r^dep = p^dep = 0
            # eq:residual
            e = v - self.b_pred
            # eq:gates
            a = torch.addmm(self.b_gate, torch.cat([z, e], 1), w.gate_first)
        else:
            depth = _cast(depth, dtype)
            # eq:read (depth) and p^dep of eq:residual: [q; k] D^(l-1)^T per (token, head), one product
            reads = torch.bmm(qk, depth.reshape(B * T * H, R, R).transpose(1, 2))
            r_dep, p_dep = reads.view(B * T, H, 2, R).transpose(1, 2).reshape(B * T, 2, ds).unbind(1)
            # eq:residual
            e = v - torch.addmm(self.b_pred, p_dep, w.pred)
            # eq:gates
            a = torch.addmm(self.b_gate, torch.cat([z, r_dep, e], 1), w.gate)
        lead = (B,) if T == 1 else (B, T)  # one token: the step's shapes, no time axis
        i, f, o, g = torch.sigmoid(a).view(*lead, 4, H, R).unbind(-3)
        i_e = i * e.view(*lead, H, R)
        q, k = qk.view(*lead, H, 2, R).unbind(-2)
        depth_term = None if depth is None else g[..., None] * depth.view(*lead, H, R, R)
        # eq:write, eq:hidden and r^time of eq:read: the recurrence, one kernel op
        if T == 1:
            r_time, new_cell, new_hidden = lstmem_step(
                q,
                k,
                i_e,
                f,
                o,
                *_step_states(cell, hidden, backend),
                depth_term,
                None if valid is None else valid.view(B),
                backend=backend,
            )
            hidden_seq = _cast(new_hidden, dtype).unsqueeze(1)
            k, o, g = k.unsqueeze(1), o.unsqueeze(1), g.unsqueeze(1)
        else:
            r_time, hidden_seq, new_cell, new_hidden = lstmem_scan(
                q, k, i_e, f, o, depth_term, valid, cell, hidden, backend=backend
            )
        # eq:read (u) and eq:injection
        r_time = _cast(r_time, dtype).reshape(B * T, ds)
        if depth is None:
            u = torch.addmm(self.b_read, r_time, w.read[:ds])
        else:
            u = torch.addmm(self.b_read, torch.cat([r_time, r_dep], 1), w.read)
        delta_q, delta_o = self._inject(u, w, B, T, x.dtype)
        return LayerOutput(
            delta_q,
            delta_o,
            _cast(new_cell, cell.dtype),
            _cast(new_hidden, hidden.dtype),
            hidden_seq,
            key=k,
            value=v.view(B, T, H, R),
            out_gate=o,
            depth_gate=g,
        )

    def _inject(self, u: torch.Tensor, w: LayerWeights, B: int, T: int, dtype: torch.dtype):
        """eq:injection: ``(alpha / r) W_dq u`` and ``(alpha / r) W_do u`` in one product; ``u``
        ``(B T, d_s)`` -> ``(B, T, d_q)``, ``(B, T, d)`` in ``dtype``."""
        delta_q, delta_o = (
            torch.mm(u, w.corr).view(B, T, -1).split([self.query_size, self.hidden_size], dim=-1)
        )
        return _cast(delta_q, dtype), _cast(delta_o, dtype)

    def _step_fused(self, w: LayerWeights, x, cell, hidden, depth, valid, backend, aux) -> LayerOutput:
        """One written token with the :class:`StepPlan`: :meth:`forward`'s equations with the affine
        maps multiplied out, in about 35 operations. ``x`` ``(B, d)`` rows; ``depth`` ``(B, 1, n_h, r, r)``
        or ``None``; ``valid`` ``(B, 1)`` or ``None``."""
        plan = w.step
        B = x.shape[0]
        H, R, ds = self.num_heads, self.head_dim, self.state_size
        dtype = w.w_in.dtype
        qk, s = torch.addmm(plan.b_in, x, w.w_in).split_with_sizes([2 * ds, 2 * ds], 1)  # s = [e_0; z]
        qk = _unit_heads(torch.tanh(qk).view(B * H, 2, R))  # n(.): rows q^[j], k^[j] of head (b, j)
        D = _cast(hidden, dtype)
        if depth is None:
            reads = torch.bmm(qk, D.reshape(B * H, R, R).transpose(1, 2))  # (B H, 2, r): D q, D k
            m = plan.m_first
        else:
            below = _cast(depth, dtype).view(B, H, R, R)
            states = torch.cat([D, below], dim=2).view(B * H, 2 * R, R).transpose(1, 2)
            reads = torch.bmm(qk, states)  # (B H, 2, 2 r): [q; k] [D; D^(l-1)]^T
            m = plan.m_depth
        e, a, u = torch.addmm(plan.b_eau, torch.cat([s, reads.view(B, -1)], dim=1), m).split_with_sizes(
            [ds, 4 * ds, ds], 1
        )
        i, f, o, g = torch.sigmoid(a).view(B, 4, H, R, 1).unbind(1)  # (B, H, r, 1)
        i_e = i * e.view(B, H, R, 1)
        k_row = qk.view(B, H, 2, R).narrow(2, 1, 1)  # (B, H, 1, r); r^time = D q is in `reads` already
        depth_term = None if depth is None else g * below
        if backend == "torch" or (
            backend == "auto" and not x.is_cuda and dtype in (torch.float32, torch.float64)
        ):
            # the kernel family's PyTorch step, in the column shapes the plan produces
            C = _cast(cell, dtype) if dtype in (torch.float32, torch.float64) else cell.float()
            keep = None if valid is None else valid.view(B, 1, 1, 1)
            _, new_cell, new_hidden = step_shaped(None, k_row, i_e, f, o, C, D, depth_term, keep)
        else:  # Triton (in place, on copies), naive, or a half-precision adapter
            _, new_cell, new_hidden = lstmem_step(
                qk.view(B, H, 2, R)[:, :, 0],
                k_row[:, :, 0],
                i_e[..., 0],
                f[..., 0],
                o[..., 0],
                *_step_states(cell, hidden, backend),
                depth_term,
                None if valid is None else valid.view(B),
                backend=backend,
            )
        out = LayerOutput(  # corrections factored: the projections add u corr to their own products
            None,
            None,
            _cast(new_cell, cell.dtype),
            _cast(new_hidden, hidden.dtype),
            _cast(new_hidden, dtype)[:, None],
            read=u,
            corr=w.corr.split([self.query_size, self.hidden_size], dim=1),
        )
        if not aux:
            return out
        return out._replace(
            key=k_row.view(B, 1, H, R),
            value=(s[:, :ds] + self.b_pred).view(B, 1, H, R),
            out_gate=o.view(B, 1, H, R),
            depth_gate=g.view(B, 1, H, R),
        )


def _refuse_nonfinite_weights(layer: LSTMemLayer, incompatible_keys) -> None:
    """After a state dict is loaded into ``layer`` (an adapter file, a checkpoint): every weight finite."""
    bad = [name for name, p in layer.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise ValueError(
            f"the LSTMem weights loaded for decoder layer {layer.layer_idx} hold NaN or inf in {bad}: the adapter "
            "file is damaged or was saved from a diverged run; load another checkpoint"
        )


def _unit_heads(x: torch.Tensor) -> torch.Tensor:
    """The l2 normalisation of ``n(.)`` along the last axis (denominator at least 1e-6)."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(K.NORM_EPS)


def _step_states(cell: torch.Tensor, hidden: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The states as the one-token step takes them: float32 (or float64) tensors it may update in
    place (the Triton step does): copies then, so that the caller's states (a cache's, a
    checkpoint's) are never written; the PyTorch steps are functional and take them as they are."""
    in_place = backend == "triton" or (backend == "auto" and cell.is_cuda)
    states = []
    for state in (cell, hidden):
        if state.dtype not in (torch.float32, torch.float64):
            state = state.float()  # a copy
        elif in_place:
            state = state.clone()
        states.append(state)
    return states[0], states[1]


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _read(state: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``state q_t`` per head at every position: state ``(B, H, r, r)``, q ``(B, T, H, r)`` -> ``(B, T, H, r)``."""
    return torch.matmul(q.transpose(1, 2), state.transpose(-1, -2)).transpose(1, 2)
