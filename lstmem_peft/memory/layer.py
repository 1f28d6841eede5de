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

``n(.)`` is tanh followed by l2 normalisation within each head (denominator >= 1e-6). The paper stores
the full matrices ``W_pred^full = [P_time | P_dep]`` and ``W_gate^full = [G_z | G_time | G_dep | G_e]``
and feeds them zero-padded inputs, so ``P_time`` and ``G_time`` only ever multiply zeros (App. C.2).
This layer registers exactly the effective maps, ``w_pred = W~_pred = P_dep`` (only in a layer that
receives a depth input: elsewhere ``p^dep`` is zero and ``W~_pred`` could never get a gradient) and
``w_gate = W~_gate = [G_z | G_dep | G_e]``: the same function, and every registered parameter can
learn. Adapter files that carry the full matrices still load (:mod:`.adapter_files`).

:meth:`LSTMemLayer.forward` derives the weights, returns the decode step for one token without
gradients (generation: one call of the op :func:`lstmem_kernels.lstmem_decode_step`, the whole step
from the layer input to ``u`` and the new states), and is otherwise the one body of this math, in
the paper's order, for every token count, with or without a depth input, writing or read-only, with
or without gradients. Its affine maps are arranged once (:class:`LayerWeights`, in
:mod:`.layer_common` with :class:`LayerOutput`): ``e``, the gate pre-activations ``a`` and the depth
part of the read ``u`` come from one product of ``[v; z; r^dep; p^dep]``, whatever the token count.
The recurrence (eq:write, eq:hidden and the temporal read) is the kernel op family of
``lstmem_kernels``, its member chosen there from the layer's ``backend``: ``lstmem_scan`` for a
block or anything that needs gradients, and ``lstmem_decode_step`` (the same op also steps a
serving engine's state slots) for one token without gradients.
:func:`lstmem_peft.memory.reference.memory_layer_ref` is the float64
token-loop transcription every path is tested against.

The layer holds no state: states come in and go out, so one model serves any number of sessions.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from lstmem_kernels import decode_backend, lstmem_decode_step, lstmem_scan
from lstmem_kernels.step.decode_torch import fresh_states, step_maps

from . import constants as K
from .adapter_files import refuse_nonfinite_weights
from .layer_common import LayerOutput, LayerWeights, cast, needs_grad, unit_heads


def head_normalize(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The paper's ``n(.)``: tanh, then l2 normalisation within each head.

    Args:
        x: ``(..., n_h * r)``.
    Returns:
        ``(..., n_h, r)``, each head of unit norm (or zero where the input head is zero).
    """
    return unit_heads(torch.tanh(x).unflatten(-1, (num_heads, -1)))


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
        >>> out.correction(0).shape, out.hidden_seq.shape
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
        # W~_pred = P_dep (removed by set_depth_input(False)) and W~_gate = [G_z | G_dep | G_e] (App. C.2)
        self.w_pred = nn.Parameter(torch.empty(ds, ds, **kw))
        self.b_pred = nn.Parameter(torch.empty(ds, **kw))
        self.w_gate = nn.Parameter(torch.empty(4 * ds, 3 * ds, **kw))
        self.b_gate = nn.Parameter(torch.empty(4 * ds, **kw))
        self.w_dq = nn.Parameter(torch.empty(query_size, ds, **kw))
        self.w_do = nn.Parameter(torch.empty(hidden_size, ds, **kw))
        # whether a depth input D^(l-1) reaches this layer (set at injection: not for the first
        # memory layer, nor without depth coupling); without one there is no W~_pred
        self.depth_input = True
        #: the kernels' member (the scan's and the decode step's, :func:`lstmem_kernels.decode_backend`):
        #: ``"auto"`` (Triton for CUDA tensors when installed, else PyTorch),
        #: ``"torch"``, ``"triton"`` or ``"naive"`` (:mod:`lstmem_kernels.backend`); set at injection from
        #: ``LSTMemConfig.scan_backend``
        self.backend = "auto"
        self.decode_member()  # the decode step's member, chosen now and again when the layer moves
        self.reset_parameters()
        self.register_load_state_dict_post_hook(refuse_nonfinite_weights)
        self.register_load_state_dict_post_hook(_forget_derived)

    @property
    def state_size(self) -> int:
        """``d_s = n_h * r``."""
        return self.num_heads * self.head_dim

    @property
    def scale(self) -> float:
        """``alpha / r``."""
        return self.alpha / self.head_dim

    def set_depth_input(self, receives: bool) -> None:
        """Declare whether a depth input ``D^(l-1)`` reaches this layer (injection sets it: not for
        the first memory layer, nor without depth coupling).

        Without one, ``p^dep = 0`` and ``W~_pred`` could never get a gradient, so the parameter is
        removed (it is neither trained nor saved); with one, it is registered at its initial value
        (zero) if absent. Every registered parameter can then learn (DDP's and PEFT's invariant).
        """
        self.depth_input = bool(receives)
        self._derived = None
        has = self._parameters.get("w_pred") is not None
        if not self.depth_input and has:
            del self._parameters["w_pred"]
            self.w_pred = None
        elif self.depth_input and not has:
            like = self.b_pred
            self.w_pred = nn.Parameter(
                torch.zeros(self.state_size, self.state_size, device=like.device, dtype=like.dtype),
                requires_grad=like.requires_grad,
            )

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
        # W_pred^full = [I | 0] and W_gate^full = 0 (App. C.4) are W~_pred = 0 and W~_gate = 0
        if self.w_pred is not None:
            self.w_pred.zero_()
        self.b_read.zero_()
        self.b_pred.zero_()
        self.w_gate.zero_()
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
        """``W~_pred = P_dep``, ``(d_s, d_s)``: the parameter, or zeros in a layer without depth input
        (where it only ever multiplies ``p^dep = 0``)."""
        if self.w_pred is not None:
            return self.w_pred
        return torch.zeros(
            self.state_size, self.state_size, device=self.b_pred.device, dtype=self.b_pred.dtype
        )

    def effective_gate(self) -> torch.Tensor:
        """``W~_gate = [G_z | G_dep | G_e]``, ``(4 d_s, 3 d_s)``."""
        return self.w_gate

    def paper_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters in paper notation (views of the live parameters).

        Keys and shapes: ``Wq, Wk, Wv, Wx`` ``(d_s, d)``; ``bx`` ``(d_s,)``; ``Wread``
        ``(d_s, 2 d_s)``; ``bread`` ``(d_s,)``; ``Wpred`` (``W~_pred``, :meth:`effective_pred`)
        ``(d_s, d_s)``; ``bpred`` ``(d_s,)``; ``Wgate`` (``W~_gate``) ``(4 d_s, 3 d_s)``; ``bgate``
        ``(4 d_s,)``; ``Wdq`` ``(d_q, d_s)``; ``Wdo`` ``(d, d_s)``.
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
            "Wpred": self.effective_pred(),
            "bpred": self.b_pred,
            "Wgate": self.w_gate,
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
    def train(self, mode: bool = True) -> LSTMemLayer:
        self._derived = None  # a mode switch is a natural point to forget derived weights
        return super().train(mode)

    def _apply(self, fn, recurse=True):
        self._derived = None  # .to(), .half(), .cuda(): the parameters are new tensors
        return super()._apply(fn, recurse)

    def derived_weights(self) -> LayerWeights:
        """:meth:`weights` for a forward that passes none: derived again only when a parameter
        changed, while no gradient can reach the parameters (decoding, evaluation, memory writes
        without training). With gradients they are derived differentiably in every forward.

        A parameter changes (and the weights are derived again) when its version counter moves (an
        optimizer step, ``load_state_dict``, any in-place write), when its storage moves (``.to()``,
        ``.data = ...``), or when it is replaced or removed (``set_depth_input``); ``train()``/
        ``eval()`` also drop the cache.

        Inside a ``torch.compile`` graph (``traceable_memory()``) the cached weights are graph inputs,
        so a compiled step derives nothing: the cache cannot be checked there (a version counter is
        not part of a graph), so it is kept current where parameters change: after every optimizer
        step (a global optimizer hook, registered when the first layer caches, derives the cached
        layers' weights again), on ``load_state_dict``, ``.to()`` and ``set_depth_input`` (dropped),
        and by any eager forward. A parameter written by hand between compiled steps is seen after
        one eager forward or :meth:`refresh_derived`.

        A write through ``p.data`` (``p.data.copy_(...)``) moves neither the version counter nor the
        storage, so nothing sees it: write parameters in place under ``torch.no_grad()`` instead,
        or call ``model.eval()`` (or ``train()``) after such a write, which drops every cache.
        """
        params = self._parameters
        if torch.is_grad_enabled() and any(p.requires_grad for p in params.values() if p is not None):
            return self.weights()  # derived differentiably in every forward that trains
        cached = self.__dict__.get("_derived")
        if torch.compiler.is_compiling():
            return self.weights() if cached is None else cached[1]
        key = self._weights_key()
        if cached is not None and cached[0] == key:
            return cached[1]
        with torch.no_grad():
            weights = self.weights()
            # the PyTorch decode step's own maps, kept with these weights: built now, so that the first
            # token costs what every token does
            eau = weights.eau_depth if self.depth_input else weights.eau_first
            step_maps(eau, weights.b_eau, weights.read, self.num_heads)
        self.__dict__["_derived"] = (key, weights)
        _cache(self)
        return weights

    def refresh_derived(self) -> None:
        """Derive the cached weights again if a parameter changed since (what an eager forward does;
        for compiled steps after a parameter was written by hand). No cache: nothing to do."""
        cached = self.__dict__.get("_derived")
        key = self._weights_key()
        if cached is not None and cached[0] != key:
            with torch.no_grad():
                self.__dict__["_derived"] = (key, self.weights())

    def _weights_key(self) -> tuple:
        """What identifies the parameters' current values (inference tensors stay in inference mode):
        each parameter's identity, storage and version counter. A new dtype or device is a new
        storage (``.to()`` also drops the cache)."""
        key = [torch.is_inference_mode_enabled()]
        for p in self._parameters.values():
            key += (None, None, None) if p is None else (id(p), p.data_ptr(), p._version)
        return tuple(key)

    def weights(self) -> LayerWeights:
        """The :class:`LayerWeights` of the current parameters (differentiable)."""
        H, R, ds = self.num_heads, self.head_dim, self.state_size
        w_q, w_k, w_v, w_x = self.w_in.split(ds)
        qk_by_head = torch.stack([w_q.view(H, R, -1), w_k.view(H, R, -1)], 1).reshape(2 * ds, -1)
        g_z, g_dep, g_e = self.w_gate.split(ds, dim=1)  # W~_gate = [G_z | G_dep | G_e]
        p_dep = self.effective_pred()
        w_read_dep = self.w_read[:, ds:]
        zeros = torch.zeros_like(p_dep)
        eye = torch.eye(ds, dtype=p_dep.dtype, device=p_dep.device)
        eau_first = torch.cat(  # rows v, z; columns [e | a | u_dep]
            [torch.cat([eye, g_e.t(), zeros], 1), torch.cat([zeros, g_z.t(), zeros], 1)]
        )
        r_rows = torch.cat([zeros, g_dep.t(), w_read_dep.t()], 1)  # r^dep
        p_rows = torch.cat([-p_dep.t(), -(g_e @ p_dep).t(), zeros], 1)  # p^dep
        reads = torch.stack([r_rows.view(H, R, -1), p_rows.view(H, R, -1)], 1).reshape(2 * ds, -1)
        read = self.w_read.t().contiguous()
        b_eau = torch.cat([-self.b_pred, self.b_gate - g_e @ self.b_pred, self.b_read])
        corr = (self.scale * torch.cat([self.w_dq, self.w_do])).t()
        return LayerWeights(
            w_in=torch.cat([qk_by_head, w_v, w_x]).t().contiguous(),
            b_in=torch.cat([torch.zeros_like(self.b_x).repeat(3), self.b_x]),
            eau_depth=torch.cat([eau_first, reads]),
            eau_first=eau_first,
            b_eau=b_eau,
            read=read,
            read_time=read[:ds],
            corr=corr,
            corr_q=corr[:, : self.query_size],
            corr_o=corr[:, self.query_size :],
        )

    # Long on purpose: the paper's equations in their order, one body for every token count (see the
    # module docstring); the read-only pass and the one-token step are the helpers below.
    def forward(
        self,
        x: torch.Tensor,
        cell: torch.Tensor,
        hidden: torch.Tensor,
        *,
        depth: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        write: bool = True,
        weights: LayerWeights | None = None,
        aux: bool = True,
    ) -> LayerOutput:
        """Read, then (if ``write``) update the memory for a block of tokens, in the paper's order.

        Every token is a row of 2-D products (``B T`` rows), so one token costs few operations. One
        token without gradients is the decode step (:meth:`_decode_step`).

        Args:
            x: ``(B, T, d)`` attention input of the backbone layer.
            cell, hidden: ``(B, n_h, r, r)`` states ``C_{t0-1}``, ``D_{t0-1}`` before the block.
            depth: the depth input ``D^{(l-1)}``: ``(B, T, n_h, r, r)`` at every position when
                writing; ``(B, n_h, r, r)`` (the lower layer's fixed state) when only reading;
                ``None`` for the first memory layer or without depth coupling.
            valid: ``(B, T)`` bool, ``False`` at padding, or ``None``.
            write: ``False`` reads the fixed states only (the answer pass of training, read-only
                generation); ``C`` and ``D`` are returned unchanged.
            weights: this layer's :meth:`weights`, when the caller derived them already.
            aux: return the feedback samples (``key``, ``value``, ``out_gate``, ``depth_gate``);
                ``False`` leaves them ``None`` (block feedback reads them; decoding does not).

        Returns:
            :class:`LayerOutput`: the read ``u`` and the correction maps in the weight dtype (the
            projections add ``Δq``, ``Δo`` in their own dtype), states in the dtype of ``cell``.
        """
        w = self.derived_weights() if weights is None else weights
        # one token without gradients: the decode step (new states in fresh tensors; the caller's
        # change only when its pass commits); under autograd the token is scanned
        if write and x.shape[1] == 1 and not needs_grad(x, cell, hidden, depth, w.w_in):
            return self._decode_step(x, cell, hidden, depth, valid, w, aux)
        B, T, _ = x.shape
        H, R, ds = self.num_heads, self.head_dim, self.state_size
        dtype = w.w_in.dtype
        rows = cast(x, dtype).reshape(B * T, -1)
        if depth is not None:
            depth = cast(depth, dtype)
        if not write:
            return self._read_fixed(rows, cell, hidden, depth, w, B, T)
        # eq:projections, with z_t of eq:gates from the same product
        proj = torch.addmm(w.b_in, rows, w.w_in)  # (B T, 4 d_s): [W_q x, W_k x (by head); W_v x; W_x x + b_x]
        qk, s = proj.split_with_sizes([2 * ds, 2 * ds], 1)  # s = [v; z]
        qk = unit_heads(torch.tanh(qk).view(B * T * H, 2, R))  # [q^[j]; k^[j]] per (token, head)
        eau_in = s
        if depth is not None:
            # eq:read (depth) and p^dep of eq:residual: [q; k] D^(l-1)^T per (token, head), one product
            reads = torch.bmm(qk, depth.reshape(B * T * H, R, R).transpose(1, 2)).view(B * T, 2 * ds)
            eau_in = torch.cat([s, reads], 1)
        # eq:residual, eq:gates and the depth part of eq:read's u
        eau_map = w.eau_first if depth is None else w.eau_depth
        e, a, u = torch.addmm(w.b_eau, eau_in, eau_map).split_with_sizes([ds, 4 * ds, ds], 1)
        i, f, o, g = torch.sigmoid(a).view(B, T, 4, H, R).unbind(2)
        i_e = i * e.view(B, T, H, R)
        q, k = qk.view(B, T, H, 2, R).unbind(-2)
        g = g.unsqueeze(-1)
        depth_term = None if depth is None else g * depth.view(B, T, H, R, R)
        # eq:write, eq:hidden and r^time of eq:read: the recurrence, one kernel op (the scan:
        # autograd-native, for a block or one token under autograd)
        r_time, hidden_seq, new_cell, new_hidden = lstmem_scan(
            q, k, i_e, f, o, depth_term, valid, cell, hidden, backend=self.backend
        )
        # the final states on their own (not views of the block's states: the cache would keep
        # those alive, and the next step reads them as (B n_h, r, r) matrices)
        new_cell, new_hidden = new_cell.contiguous(), new_hidden.contiguous()
        u = torch.addmm(u, cast(r_time, dtype).reshape(B * T, ds), w.read_time)  # eq:read (u)
        out = LayerOutput(
            u.view(B, T, ds),
            (w.corr_q, w.corr_o),
            cast(new_cell, cell.dtype),
            cast(new_hidden, hidden.dtype),
            hidden_seq,
        )
        if not aux:
            return out
        return out._replace(
            key=k.view(B, T, H, R),
            value=s[:, :ds].view(B, T, H, R),
            out_gate=o.view(B, T, H, R),
            depth_gate=g.view(B, T, H, R),
        )

    def decode_member(self, samples: bool = False, weight: torch.Tensor | None = None) -> str:
        """The member of :func:`lstmem_kernels.lstmem_decode_step` this layer steps on
        (:func:`lstmem_kernels.decode_backend` of :attr:`backend` on its weights' device and dtype;
        with ``samples``, the one that returns the feedback samples). ``weight``: the derived
        ``w_in`` a step runs with (default: the parameter ``w_in``, of the same device and dtype
        unless a caller passes weights of its own).

        Chosen once, and chosen again only when what it depends on changes: :attr:`backend`, or the
        device or dtype of the weights (``.to()``, ``.double()``, or parameters replaced on another
        device, as accelerate does for a model laid out on the meta device). So a token pays a
        comparison of three values, not the choice."""
        weight = self._parameters["w_in"] if weight is None else weight
        key = (self.backend, weight.device, weight.dtype)
        chosen = self.__dict__.get("_members")
        if chosen is None or chosen[0] != key:
            members = tuple(
                decode_backend(self.backend, weight, weight.dtype, samples=s) for s in (False, True)
            )
            chosen = self.__dict__["_members"] = (key, members)
        return chosen[1][samples]

    def _decode_step(self, x, cell, hidden, depth, valid, w: LayerWeights, aux: bool) -> LayerOutput:
        """The forward for one token without gradients: the step op family's
        (:func:`lstmem_kernels.lstmem_decode_step`) on this layer's weights, on its member
        (:meth:`decode_member`: the PyTorch one when the feedback samples are wanted, ``aux``). The
        new states go into fresh tensors: the caller's states change only when its pass commits."""
        B = x.shape[0]
        H, R, ds = self.num_heads, self.head_dim, self.state_size
        dtype = w.w_in.dtype
        new_cell, new_hidden = fresh_states(cell, hidden)
        result = lstmem_decode_step(
            x.reshape(B, -1),
            *w.step_weights(depth is not None),
            cell,
            hidden,
            num_heads=H,
            out=(new_cell, new_hidden),
            depth=None if depth is None else cast(depth, dtype).reshape(B, H, R, R),
            valid=None if valid is None else valid.reshape(B),
            norm_eps=K.NORM_EPS,
            samples=aux,
            backend=self.decode_member(aux, w.w_in),
            fresh_out=True,  # the new states' tensors were made just above
        )
        u, found = result if aux else (result, None)
        out = LayerOutput(
            u.view(B, 1, ds),
            (w.corr_q, w.corr_o),
            cast(new_cell, cell.dtype),
            cast(new_hidden, hidden.dtype),
            cast(new_hidden, dtype).unsqueeze(1),
        )
        if found is None:
            return out
        key, value, out_gate, depth_gate = (t.unsqueeze(1) for t in found)
        return out._replace(key=key, value=value, out_gate=out_gate, depth_gate=depth_gate)

    def _read_fixed(self, rows, cell, hidden, depth, w: LayerWeights, B: int, T: int) -> LayerOutput:
        """The read-only forward: eq:projections (``q`` only) and eq:read against the fixed states
        ``hidden`` and ``depth`` (the lower layer's fixed ``D``, or ``None``); the states come back as
        they are."""
        H, R, ds = self.num_heads, self.head_dim, self.state_size
        q = head_normalize(torch.mm(rows, self.w_in[:ds].t()), H).view(B, T, H, R)
        r_time = _read(cast(hidden, rows.dtype), q).reshape(B * T, ds)
        if depth is None:
            u = torch.addmm(self.b_read, r_time, w.read_time)
        else:
            r_dep = _read(depth, q).reshape(B * T, ds)
            u = torch.addmm(self.b_read, torch.cat([r_time, r_dep], 1), w.read)
        return LayerOutput(u.view(B, T, ds), (w.corr_q, w.corr_o), cell, hidden)


#: layers whose derived weights are cached (kept current after optimizer steps)
_CACHED_LAYERS: weakref.WeakSet[LSTMemLayer] = weakref.WeakSet()
_optimizer_hook = None  # torch's handle, once a layer has cached its weights


def _refresh_after_optimizer_step(optimizer, args, kwargs) -> None:
    """Global optimizer step hook: the cached derived weights follow the new parameters (a compiled
    graph reads them without checking; see :meth:`LSTMemLayer.derived_weights`)."""
    for layer in list(_CACHED_LAYERS):
        layer.refresh_derived()


def _cache(layer: LSTMemLayer) -> None:
    """Keep ``layer``'s cached weights current after every optimizer step. The process-wide hook
    this needs is registered here, when the first layer caches its weights (decoding or evaluating
    without gradients), not when this module is imported: a process that never caches never has it."""
    global _optimizer_hook
    _CACHED_LAYERS.add(layer)
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_post_hook(_refresh_after_optimizer_step)


def _forget_derived(module: LSTMemLayer, incompatible_keys) -> None:
    """``load_state_dict`` post hook: the loaded parameters are derived again when next used."""
    module._derived = None


def _read(state: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``state q_t`` per head at every position: state ``(B, H, r, r)``, q ``(B, T, H, r)`` -> ``(B, T, H, r)``."""
    return torch.matmul(q.transpose(1, 2), state.transpose(-1, -2)).transpose(1, 2)
