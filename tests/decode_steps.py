"""The decode-step op (``lstmem_decode_step``) as the tests call it, written once.

* :func:`call_step`: one call of the op without gradients, with the paper's norm epsilon.
* :func:`run_step`: the op on a dict of inputs (``x``, ``cell``, ``hidden``, ``depth``, ``valid``)
  into fresh outputs, or with ``slots`` on copies of the state tables, stepped in place.
* :func:`step`: :func:`run_step` with a layer's derived weights.
* :func:`decode_slots`: the vLLM plugin's decode step: a layer's state tables stepped in place on
  the layer's own member (``LSTMemLayer.decode_member``).
"""

from __future__ import annotations

import torch

from lstmem_kernels import lstmem_decode_step
from lstmem_peft.memory import constants as K


def call_step(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    cell: torch.Tensor,
    hidden: torch.Tensor,
    *,
    num_heads: int,
    out: tuple[torch.Tensor, torch.Tensor],
    backend: str,
    depth: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    hidden_seq: torch.Tensor | None = None,
    samples: bool = False,
):
    """``lstmem_decode_step(x, *weights, cell, hidden, ...)`` under ``torch.no_grad()`` with
    ``norm_eps`` the paper's constant; ``weights``: ``(w_in, b_in, eau, b_eau, read)`` as
    ``LayerWeights.step_weights`` gives them. Returns what the op returns (``u`` ``(B, d_s)``, with
    ``samples`` also the feedback samples)."""
    with torch.no_grad():
        return lstmem_decode_step(
            x,
            *weights,
            cell,
            hidden,
            num_heads=num_heads,
            out=out,
            depth=depth,
            valid=valid,
            norm_eps=K.NORM_EPS,
            slots=slots,
            hidden_seq=hidden_seq,
            samples=samples,
            backend=backend,
        )


def run_step(weights, inputs: dict, backend: str, *, num_heads: int, slots=None, samples=False):
    """One op call on ``inputs`` (``x`` ``(B, d)``, ``cell`` and ``hidden`` ``(B, n_h, r, r)``, or
    ``(S, n_h, r, r)`` tables with ``slots``, ``depth``, ``valid``), which it leaves as they are.

    Returns ``u``, the new states (fresh ``(B, n_h, r, r)`` outputs, float64 for float64 states and
    float32 otherwise; with ``slots`` copies of the tables, stepped in place), ``D_t`` as the
    ``(B, n_h, r, r)`` float32 ``hidden_seq``, and the feedback samples (``None`` without ``samples``).
    """
    x, cell, hidden = inputs["x"], inputs["cell"].clone(), inputs["hidden"].clone()
    if slots is not None:
        out = (cell, hidden)
    else:
        dtype = torch.float64 if cell.dtype == torch.float64 else torch.float32
        out = (torch.empty_like(cell, dtype=dtype), torch.empty_like(hidden, dtype=dtype))
    rows, size = x.shape[0], cell.shape[-1]
    seq = torch.empty(rows, num_heads, size, size, device=x.device)
    result = call_step(
        x,
        weights,
        cell,
        hidden,
        num_heads=num_heads,
        out=out,
        backend=backend,
        depth=inputs["depth"],
        valid=inputs["valid"],
        slots=slots,
        hidden_seq=seq,
        samples=samples,
    )
    u, found = result if samples else (result, None)
    return u, out, seq, found


def step(layer, inputs: dict, backend: str, *, slots=None, samples=False):
    """:func:`run_step` with ``layer``'s derived weights (the depth map when ``inputs["depth"]`` is
    given)."""
    with torch.no_grad():
        weights = layer.weights().step_weights(inputs["depth"] is not None)
    return run_step(weights, inputs, backend, num_heads=layer.num_heads, slots=slots, samples=samples)


def decode_slots(layer, x, cells, hiddens, slots, *, depth=None, valid=None, hidden_seq=None):
    """The vLLM plugin's decode step: the op with ``slots=`` on the layer's member, the tables
    ``cells``, ``hiddens`` ``(S, n_h, r, r)`` their own outputs (stepped in place); ``D_t`` into
    ``hidden_seq`` (a ``(B, n_h, r, r)`` float32 tensor of its own when not given). Returns ``u``
    ``(B, d_s)`` and ``D_t``."""
    w = layer.derived_weights()
    if hidden_seq is None:
        R = layer.head_dim
        hidden_seq = torch.empty(x.shape[0], layer.num_heads, R, R, device=x.device)
    u = call_step(
        x,
        w.step_weights(depth is not None),
        cells,
        hiddens,
        num_heads=layer.num_heads,
        out=(cells, hiddens),
        backend=layer.decode_member(),
        depth=depth,
        valid=valid,
        slots=slots,
        hidden_seq=hidden_seq,
    )
    return u, hidden_seq
