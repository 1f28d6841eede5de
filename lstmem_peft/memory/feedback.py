"""Block-end cross-layer feedback (paper Sec. 3.3 and App. C.4), exactly as specified.

At the end of a history block, every memory layer ``l = 1..L`` has terminal states
``C_b^(l),bef`` and ``D_b^(l),bef`` and cached terminal gates ``o_b^(l)``, ``g_b^(l)``. All layers share
a set ``I_b`` of sampled positions, where each layer's own memory keys and values give the
reconstruction loss

    L^(l) = 1 / (2 |I_b| n_h r) * sum_{t in I_b} sum_j || D^(l),[j] k_t^[j] - v_t^[j] ||^2 .

The correction of layer ``l`` follows ``G^(l) = d/dC^(l) sum_{m>l} L^(m)`` along the depth recurrence
only (keys, values, gates and the other cells fixed), in closed form:

    R^(l) = dL^(l)/dD^(l),   U^(L) = 0,   U^(l) = g^(l+1) * (R^(l+1) + U^(l+1)),
    G^(l) = o^(l) * (1 - tanh^2(C^(l))) * U^(l).

Each head then takes a normalised step ``-eta * s * G / RMS(G)`` with ``s = max(1, RMS(C))``, bounded
to relative RMS ``rho`` and accepted only if the cast candidate moves at most ``rho + 1e-7``; ``D`` is
rebuilt shallow to deep with the cached gates. Everything is plain tensor algebra (no host
synchronisation, no detach), so when gradients are enabled the step stays in the outer training
graph, as the paper requires.

Choices where the paper is silent (documented in docs/design-choices.md):

* Rows of a batch are independent sequences: a nonfinite loss, gradient or state aborts the step of
  that sequence only (its states are kept), so a batch gives what each sequence gives alone.
* Without depth coupling (``D^(l-1) := 0``) no higher layer depends on a lower cell, so every
  ``G`` is zero and feedback leaves the states unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import constants as K


def sample_feedback_positions(
    valid: torch.Tensor, num_positions: int = K.FEEDBACK_POSITIONS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose the shared feedback positions ``I_b`` of one block, per sequence.

    With ``n`` valid positions, all of them when ``n <= num_positions``, otherwise the valid
    positions of ranks ``round(linspace(0, n - 1, num_positions))`` (distinct, evenly spaced, first
    and last included). Padding is never sampled.

    Args:
        valid: ``(B, T)`` bool.
        num_positions: the bound ``|I_b|`` (32 in the paper).

    Returns:
        ``positions`` ``(B, P)`` long and ``mask`` ``(B, P)`` bool with ``P = min(T, num_positions)``;
        ``mask`` is ``False`` in slots beyond a row's count (their position is 0).
    """
    B, T = valid.shape
    P = min(T, num_positions)
    n = valid.sum(dim=1, keepdim=True)  # (B, 1)
    slots = torch.arange(P, device=valid.device).expand(B, P)
    spread = torch.round(slots.to(torch.float64) * (n - 1).clamp_min(0) / max(P - 1, 1)).long()
    rank = torch.where(n > P, spread, slots)
    mask = slots < n
    cum = valid.long().cumsum(dim=1)  # rank r (0-based) sits where cum first reaches r + 1
    positions = torch.searchsorted(cum, (rank + 1).contiguous()).clamp_max(max(T - 1, 0))
    return torch.where(mask, positions, torch.zeros_like(positions)), mask


@dataclass
class LayerTerminal:
    """What feedback needs from one memory layer at the end of a block.

    Attributes:
        cell, hidden: ``(B, n_h, r, r)`` pre-feedback terminal states, in the state dtype.
        out_gate, depth_gate: ``(B, n_h, r)`` terminal gates ``o_b``, ``g_b``.
        key, value: ``(B, P, n_h, r)`` the layer's memory keys and values at the sampled positions.
    """

    cell: torch.Tensor
    hidden: torch.Tensor
    out_gate: torch.Tensor
    depth_gate: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


_TINY = torch.finfo(torch.float32).tiny


def _rms(x: torch.Tensor) -> torch.Tensor:
    """RMS over the last two (``r x r``) dims.

    The mean square is bounded below by the smallest normal float32 before the square root, so the
    derivative stays finite at zero (an exactly zero ``G`` or ``C`` is common: the top layer, a fresh
    memory). Values change only below ``1e-19``, far under ``epsilon``.
    """
    return x.square().mean(dim=(-2, -1)).clamp_min(_TINY).sqrt()


def reconstruction_terms(
    hidden: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss ``L^(l)`` per sequence and its gradient ``R^(l) = dL/dD``.

    Args:
        hidden: ``(B, H, r, r)`` terminal ``D`` (float32).
        key, value: ``(B, P, H, r)``.
        mask: ``(B, P)`` bool, the sampled slots.

    Returns:
        ``loss`` ``(B,)`` and ``grad`` ``(B, H, r, r)`` (zero for rows without samples).
    """
    H, r = hidden.shape[1], hidden.shape[-1]
    m = mask.to(hidden.dtype)[:, :, None, None]
    count = mask.sum(dim=1).clamp_min(1).to(hidden.dtype)  # |I_b|
    err = (torch.einsum("bhac,bphc->bpha", hidden, key) - value) * m  # (B, P, H, r)
    norm = (count * H * r)[:, None, None, None]
    loss = err.square().sum(dim=(1, 2, 3)) / (2 * count * H * r)
    grad = torch.einsum("bpha,bphc->bhac", err, key) / norm
    return loss, grad


def feedback_gradients(
    terminals: list[LayerTerminal], mask: torch.Tensor, depth_coupling: bool = True
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``G^(l)`` for every layer by the closed-form recurrence of App. C.4 (float32).

    Returns:
        ``(grads, losses)``: ``grads[l]`` ``(B, H, r, r)``; ``losses`` ``(L, B)`` the ``L^(l)``.
    """
    L = len(terminals)
    losses, residual_grads = [], []
    for t in terminals:
        loss, grad = reconstruction_terms(
            t.hidden.float(), t.key.float(), t.value.float(), mask.to(t.hidden.device)
        )
        losses.append(loss.to(mask.device))
        residual_grads.append(grad)
    grads: list[torch.Tensor] = [None] * L  # type: ignore[list-item]
    U = torch.zeros_like(residual_grads[-1])
    for l in range(L - 1, -1, -1):  # noqa: E741 (the paper's layer index l)
        if l < L - 1:
            U = terminals[l + 1].depth_gate.float()[..., None] * (residual_grads[l + 1] + U)
            if not depth_coupling:
                U = torch.zeros_like(U)
        C = terminals[l].cell.float()
        U = U.to(C.device)  # layer l's device (a sharded backbone)
        grads[l] = terminals[l].out_gate.float()[..., None] * (1 - torch.tanh(C).square()) * U
    return grads, torch.stack(losses)


@dataclass
class FeedbackResult:
    """Corrected states and diagnostics of one feedback step.

    Attributes:
        cells, hiddens: per layer ``(B, H, r, r)`` states after feedback, in the state dtype.
        accepted: ``(L, B, H)`` bool, heads whose cell correction was committed.
        aborted: ``(B,)`` bool, sequences whose step was aborted (nonfinite values).
        losses: ``(L, B)`` reconstruction losses ``L^(l)`` at the pre-feedback states.
    """

    cells: list[torch.Tensor]
    hiddens: list[torch.Tensor]
    accepted: torch.Tensor
    aborted: torch.Tensor
    losses: torch.Tensor


def block_feedback(
    terminals: list[LayerTerminal],
    mask: torch.Tensor,
    depth_coupling: bool = True,
    eta: float = K.ETA,
    rho: float = K.RHO,
    epsilon: float = K.EPSILON,
) -> FeedbackResult:
    """Apply block-end feedback to all memory layers at once.

    Args:
        terminals: one :class:`LayerTerminal` per memory layer, shallow to deep.
        mask: ``(B, P)`` bool, the sampled slots (a row with none is an empty block: unchanged).
        depth_coupling: whether ``D^(l)`` depends on ``D^(l-1)`` (see the module docstring).
        eta, rho, epsilon: the paper's constants.

    Returns:
        :class:`FeedbackResult`.
    """
    grads, losses = feedback_gradients(terminals, mask, depth_coupling)
    has_samples = mask.any(dim=1)  # (B,)
    finite = torch.isfinite(losses.detach()).all(dim=0)
    candidates, steps = [], []
    for t, G in zip(terminals, grads, strict=True):
        C_bef = t.cell.float()
        a = _rms(G)  # (B, H)
        s = _rms(C_bef).clamp_min(1.0)
        active = a >= epsilon
        step = -eta * s[..., None, None] * G / a.clamp_min(epsilon)[..., None, None]
        step = torch.where(active[..., None, None], step, torch.zeros_like(step))
        relative = _rms(step) / s
        step = (
            step
            * torch.where(relative > rho, rho / relative.clamp_min(epsilon), torch.ones_like(relative))[
                ..., None, None
            ]
        )
        C_cand = (C_bef + step).to(t.cell.dtype)
        with torch.no_grad():  # acceptance and finiteness are decisions, not differentiable maps
            moved = _rms(C_cand.float() - C_bef) / s
            accept = active & (moved <= rho + K.ACCEPT_TOLERANCE)
            finite_g = torch.isfinite(G).flatten(1).all(dim=1)
            finite_c = torch.isfinite(C_cand.float()).flatten(1).all(dim=1)
            finite = finite & (finite_g & finite_c).to(finite.device)
        candidates.append(C_cand)
        steps.append(accept.to(mask.device))
    commit_row = finite & has_samples  # (B,)
    accepted = torch.stack(steps) & commit_row[None, :, None]

    cells, hiddens = [], []
    prev_delta = None  # D^(l-1),aft - D^(l-1),bef; zero for the first layer
    for t, C_cand, acc in zip(terminals, candidates, accepted, strict=True):
        device = t.cell.device  # this layer's device; the rest sit on the mask's (a sharded backbone)
        C_aft = torch.where(acc.to(device)[..., None, None], C_cand, t.cell)
        delta = t.out_gate.float()[..., None] * (torch.tanh(C_aft.float()) - torch.tanh(t.cell.float()))
        if depth_coupling and prev_delta is not None:
            delta = delta + t.depth_gate.float()[..., None] * prev_delta.to(device)
        D_aft = (t.hidden.float() + delta).to(t.hidden.dtype)
        D_aft = torch.where(commit_row.to(device)[:, None, None, None], D_aft, t.hidden)
        prev_delta = D_aft.float() - t.hidden.float()
        cells.append(C_aft)
        hiddens.append(D_aft)
    return FeedbackResult(cells, hiddens, accepted, has_samples & ~finite, losses)


def layer_terminal(
    out, last: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor | None = None
) -> LayerTerminal:
    """One memory layer's :class:`LayerTerminal` from its output over a block.

    Args:
        out: the layer's :class:`~lstmem_peft.memory.layer_common.LayerOutput` over ``(B, T)`` tokens
            (with its feedback samples: ``aux=True``).
        last: ``(k,)`` long, the time index of each block's last token (``T_b``).
        key, value: ``(k, P, n_h, r)`` the layer's keys and values at the block's samples ``I_b``.
        rows: ``(k,)`` long, the batch rows whose blocks end, or ``None``: every row (``k = B``).
    """
    if rows is None:
        rows = torch.arange(out.cell.shape[0], device=last.device)
        cell, hidden = out.cell, out.hidden
    else:
        cell, hidden = out.cell[rows], out.hidden[rows]
    return LayerTerminal(
        cell=cell,
        hidden=hidden,
        out_gate=out.out_gate[rows, last],
        depth_gate=out.depth_gate[rows, last],
        key=key,
        value=value,
    )


class BlockEnds:
    """The blocks that end in one forward of the memory stack, and their feedback in one batch.

    Each memory layer adds its :class:`LayerTerminal` of a group of blocks as it runs (shallow to
    deep); after the last layer, :meth:`apply` runs :func:`block_feedback` once over every group that
    every layer added to, and writes the corrected states into a storage
    (:mod:`~lstmem_peft.memory.storage`: staged into dense rows, in place into slot tables). A group is
    the rows of one batch (a history block of the library's pass) or one request's slot of a serving
    engine, whose samples were gathered over the block's chunks; groups with fewer samples are padded
    with zeros that the mask leaves out.

    Args:
        num_layers: the memory layers ``L``.
        depth_coupling: as :func:`block_feedback`'s.
    """

    def __init__(self, num_layers: int, depth_coupling: bool = True) -> None:
        self.num_layers = num_layers
        self.depth_coupling = depth_coupling
        self.groups: dict[object, tuple[int | None, torch.Tensor, list[LayerTerminal]]] = {}

    def __bool__(self) -> bool:
        return bool(self.groups)

    def add(self, group, terminal: LayerTerminal, mask: torch.Tensor, index: int | None = None) -> None:
        """Add the next memory layer's terminal of ``group`` (any key): ``mask`` ``(k, P)`` bool, its
        sampled slots; ``index`` where its states are stored (a slot; ``None``: every dense row)."""
        entry = self.groups.setdefault(group, (index, mask, []))
        entry[2].append(terminal)

    def discard(self, group) -> None:
        """Forget ``group``'s terminals (its request left or started over)."""
        self.groups.pop(group, None)

    def clear(self) -> None:
        self.groups.clear()

    def apply(self, storage) -> FeedbackResult | None:
        """Block-end feedback over every complete group, written into ``storage`` by
        ``storage.write(depth, cell, hidden, index)``; forgets every group. Returns the
        :class:`FeedbackResult` (``None``: no group was complete)."""
        groups = [g for g in self.groups.values() if len(g[2]) == self.num_layers]
        self.groups.clear()
        if not groups:
            return None
        if len(groups) == 1:
            index, mask, terminals = groups[0]
        else:
            index, mask, terminals = _batch_groups(groups)
        result = block_feedback(terminals, mask, self.depth_coupling)
        if index is not None:
            index = torch.tensor(index, device=terminals[0].cell.device).reshape(-1)
        for depth, (cell, hidden) in enumerate(zip(result.cells, result.hiddens, strict=True)):
            storage.write(depth, cell, hidden, index)
        return result


def _batch_groups(groups: list) -> tuple[list[int], torch.Tensor, list[LayerTerminal]]:
    """Groups of slot-stored blocks as one batch: their slots, the ``(G, P)`` mask padded to the
    widest sample set, and per layer the terminals concatenated (samples padded with zeros)."""
    width = max(mask.shape[1] for _, mask, _ in groups)

    def pad(x: torch.Tensor, value=0) -> torch.Tensor:  # (k, P, ...) -> (k, width, ...)
        return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, width - x.shape[1]), value=value)

    terminals = []
    for depth in range(len(groups[0][2])):
        layer = [g[2][depth] for g in groups]
        terminals.append(
            LayerTerminal(
                cell=torch.cat([t.cell for t in layer]),
                hidden=torch.cat([t.hidden for t in layer]),
                out_gate=torch.cat([t.out_gate for t in layer]),
                depth_gate=torch.cat([t.depth_gate for t in layer]),
                key=torch.cat([pad(t.key) for t in layer]),
                value=torch.cat([pad(t.value) for t in layer]),
            )
        )
    mask = torch.cat([pad(m, False) for _, m, _ in groups])
    return [g[0] for g in groups], mask, terminals
