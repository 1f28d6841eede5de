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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass
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
    """

    delta_q: torch.Tensor
    delta_o: torch.Tensor
    cell: torch.Tensor
    hidden: torch.Tensor
    hidden_seq: torch.Tensor | None = None
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    out_gate: torch.Tensor | None = None
    depth_gate: torch.Tensor | None = None


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
    def _corrections(self, r_time: torch.Tensor, r_dep: torch.Tensor | None):
        """``u = W_read [r^time; r^dep] + b_read``; returns ``(dq, do)``. Inputs ``(..., n_h, r)``."""
        r_time = r_time.flatten(-2)
        r_dep = torch.zeros_like(r_time) if r_dep is None else r_dep.flatten(-2)
        u = F.linear(torch.cat([r_time, r_dep], dim=-1), self.w_read, self.b_read)
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
    ) -> LayerOutput:
        """Read, then (if ``write``) update the memory for a block of tokens.

        Args:
            x: ``(B, T, d)`` attention input of the backbone layer.
            cell, hidden: ``(B, n_h, r, r)`` states ``C_{t0-1}``, ``D_{t0-1}`` before the block.
            depth: the depth input ``D^{(l-1)}``: ``(B, T, n_h, r, r)`` at every position when
                writing; ``(B, n_h, r, r)`` (the lower layer's fixed state) when only reading;
                ``None`` for the first memory layer or without depth coupling.
            valid: ``(B, T)`` bool, ``False`` at padding, or ``None``.
            write: ``False`` reads the fixed states only (the answer pass of training, read-only
                generation); ``C`` and ``D`` are returned unchanged.
            backend: scan backend, see :func:`lstmem_kernels.lstmem_scan`.

        Returns:
            :class:`LayerOutput`; corrections in ``x.dtype``, states in the dtype of ``cell``.
        """
        B, T, _ = x.shape
        H = self.num_heads
        ds = self.state_size
        wdtype = self.w_in.dtype
        proj = F.linear(x.to(wdtype), self.w_in)
        if not write:
            q = head_normalize(proj[..., :ds], H)  # (B, T, H, r)
            D = hidden.to(wdtype)
            r_time = torch.einsum("bhac,bthc->btha", D, q)
            r_dep = None if depth is None else torch.einsum("bhac,bthc->btha", depth.to(wdtype), q)
            dq, do = self._corrections(r_time, r_dep)
            return LayerOutput(dq.to(x.dtype), do.to(x.dtype), cell, hidden)

        q, k = head_normalize(proj[..., : 2 * ds], 2 * H).split(H, dim=-2)  # one pass for both
        v = proj[..., 2 * ds : 3 * ds].unflatten(-1, (H, -1))
        z = proj[..., 3 * ds :] + self.b_x
        if depth is not None:
            depth = depth.to(wdtype)
            r_dep = torch.einsum("bthac,bthc->btha", depth, q)
            p_dep = torch.einsum("bthac,bthc->btha", depth, k)
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

        if T == 1:
            r_time, new_cell, new_hidden = lstmem_step(
                q[:, 0], k[:, 0], w[:, 0], f[:, 0], o[:, 0], cell, hidden,
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
            delta_q=dq.to(x.dtype),
            delta_o=do.to(x.dtype),
            cell=new_cell.to(cell.dtype),
            hidden=new_hidden.to(hidden.dtype),
            hidden_seq=hidden_seq,
            key=k,
            value=v,
            out_gate=o,
            depth_gate=g,
        )
