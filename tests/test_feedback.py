"""Block-end feedback: sampling, the closed-form gradient, the step rule and the rebuild."""

import pytest
import torch

from lstmem_peft.memory import constants as K
from lstmem_peft.memory.feedback import (
    LayerTerminal,
    block_feedback,
    feedback_gradients,
    reconstruction_terms,
    sample_feedback_positions,
)

B, H, R, P = 2, 4, 8, 6


def make_terminals(L=4, dtype=torch.float32, seed=0, consistent=True):
    """Random terminals whose D is consistent with the depth recurrence D = o tanh(C) + g D_below."""
    g = torch.Generator().manual_seed(seed)
    terms, below = [], torch.zeros(B, H, R, R)
    for _ in range(L):
        C = torch.randn(B, H, R, R, generator=g) * 1.5
        o, gd = torch.rand(B, H, R, generator=g), torch.rand(B, H, R, generator=g)
        D = o[..., None] * torch.tanh(C) + gd[..., None] * below
        if not consistent:
            D = torch.randn(B, H, R, R, generator=g)
        k = torch.nn.functional.normalize(torch.randn(B, P, H, R, generator=g), dim=-1)
        v = torch.randn(B, P, H, R, generator=g)
        terms.append(LayerTerminal(C.to(dtype), D.to(dtype), o, gd, k, v))
        below = D
    return terms


@pytest.mark.parametrize(
    "valid_row, expected",
    [
        ([1] * 5, [0, 1, 2, 3, 4]),
        ([0, 0, 1, 1, 1], [2, 3, 4]),
        ([0, 0, 0], []),
    ],
)
def test_all_valid_positions_when_few(valid_row, expected):
    valid = torch.tensor([valid_row], dtype=torch.bool)
    pos, mask = sample_feedback_positions(valid, 32)
    assert pos[0][mask[0]].tolist() == expected


def test_evenly_spaced_distinct_valid_positions():
    T = 1000
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, :300] = False  # left padding
    valid[1, 500:520] = False  # a gap
    pos, mask = sample_feedback_positions(valid, 32)
    assert mask.all() and pos.shape == (2, 32)
    for b in range(2):
        row = pos[b].tolist()
        assert len(set(row)) == 32 and row == sorted(row)
        assert all(valid[b, p] for p in row)
        idx = valid[b].nonzero().flatten()
        assert row[0] == idx[0] and row[-1] == idx[-1]
        ranks = torch.searchsorted(idx, pos[b])
        gaps = ranks.diff().float()
        assert gaps.max() - gaps.min() <= 1  # evenly spaced over the valid ranks
    assert pos[0].tolist() == torch.linspace(0, 999, 32).round().long().tolist()


def test_reconstruction_loss_and_its_gradient():
    t = make_terminals(1)[0]
    mask = torch.tensor([[True] * P, [True] * 3 + [False] * (P - 3)])
    Dv = t.hidden.clone().requires_grad_(True)
    loss, grad = reconstruction_terms(Dv, t.key, t.value, mask)
    for b, n in ((0, P), (1, 3)):
        err = torch.einsum("hac,phc->pha", t.hidden[b], t.key[b, :n]) - t.value[b, :n]
        torch.testing.assert_close(loss[b], err.square().sum() / (2 * n * H * R))
    loss.sum().backward()
    torch.testing.assert_close(grad, Dv.grad)


@pytest.mark.parametrize("coupling", [True, False])
def test_closed_form_G_equals_autograd_of_higher_layer_losses(coupling):
    """G^(l) = d/dC^(l) sum_{m>l} L^(m), following only D = o tanh(C) + g D_below."""
    L = 4
    terms = make_terminals(L)
    mask = torch.ones(B, P, dtype=torch.bool)
    mask[1, 4:] = False
    G, _ = feedback_gradients(terms, mask, depth_coupling=coupling)
    cells = [t.cell.clone().double().requires_grad_(True) for t in terms]
    below = torch.zeros(B, H, R, R, dtype=torch.float64)
    losses = []
    for t, C in zip(terms, cells, strict=True):
        D = t.out_gate.double()[..., None] * torch.tanh(C)
        if coupling:
            D = D + t.depth_gate.double()[..., None] * below
        losses.append(reconstruction_terms(D, t.key.double(), t.value.double(), mask)[0].sum())
        below = D
    for l in range(L):  # noqa: E741 (the paper's layer index l)
        higher = sum(losses[l + 1 :]) if l < L - 1 else None
        grad = (
            None
            if higher is None
            else torch.autograd.grad(higher, cells[l], retain_graph=True, allow_unused=True)[0]
        )
        expected = torch.zeros_like(cells[l]) if grad is None else grad
        torch.testing.assert_close(G[l].double(), expected, atol=1e-6, rtol=1e-5)
    assert not G[-1].any()


def test_step_rule_and_top_cell_unchanged():
    terms = make_terminals(3)
    mask = torch.ones(B, P, dtype=torch.bool)
    res = block_feedback(terms, mask)
    G, _ = feedback_gradients(terms, mask)
    for l, (t, C_aft) in enumerate(zip(terms, res.cells, strict=True)):  # noqa: E741
        delta = C_aft - t.cell
        if l == len(terms) - 1:
            assert torch.equal(C_aft, t.cell)
            continue
        s = t.cell.square().mean((-2, -1)).sqrt().clamp_min(1)
        rms = delta.square().mean((-2, -1)).sqrt()
        torch.testing.assert_close(rms / s, torch.full_like(s, K.ETA), atol=1e-6, rtol=1e-4)
        cos = torch.nn.functional.cosine_similarity(delta.flatten(2), -G[l].flatten(2), dim=-1)
        torch.testing.assert_close(cos, torch.ones_like(cos))
    assert res.accepted[:-1].all() and not res.accepted[-1].any()


def test_rebuild_recomputes_hidden_from_corrected_cells():
    terms = make_terminals(3)
    res = block_feedback(terms, torch.ones(B, P, dtype=torch.bool))
    below = torch.zeros(B, H, R, R)
    for t, C, D in zip(terms, res.cells, res.hiddens, strict=True):
        expected = t.out_gate[..., None] * torch.tanh(C) + t.depth_gate[..., None] * below
        torch.testing.assert_close(D, expected, atol=1e-6, rtol=1e-5)
        below = D
    assert not torch.equal(res.hiddens[-1], terms[-1].hidden)  # top D moves through the layers below


def test_no_coupling_means_no_correction():
    terms = make_terminals(3)
    res = block_feedback(terms, torch.ones(B, P, dtype=torch.bool), depth_coupling=False)
    for t, C, D in zip(terms, res.cells, res.hiddens, strict=True):
        assert torch.equal(C, t.cell) and torch.equal(D, t.hidden)


def test_empty_block_rows_are_untouched():
    terms = make_terminals(3)
    mask = torch.ones(B, P, dtype=torch.bool)
    mask[1] = False
    res = block_feedback(terms, mask)
    for t, C, D in zip(terms, res.cells, res.hiddens, strict=True):
        assert torch.equal(C[1], t.cell[1]) and torch.equal(D[1], t.hidden[1])
    assert not torch.equal(res.cells[0][0], terms[0].cell[0])


def test_nonfinite_values_abort_that_sequence_and_keep_its_states():
    terms = make_terminals(3)
    terms[2].value[0, 0, 0, 0] = float("nan")
    res = block_feedback(terms, torch.ones(B, P, dtype=torch.bool))
    assert res.aborted.tolist() == [True, False]
    for t, C, D in zip(terms, res.cells, res.hiddens, strict=True):
        assert torch.equal(C[0], t.cell[0]) and torch.equal(D[0], t.hidden[0])
    assert not torch.equal(res.cells[0][1], terms[0].cell[1])


def test_bf16_states_are_cast_and_accepted():
    terms = make_terminals(3, dtype=torch.bfloat16)
    res = block_feedback(terms, torch.ones(B, P, dtype=torch.bool))
    assert all(
        C.dtype == torch.bfloat16 and D.dtype == torch.bfloat16
        for C, D in zip(res.cells, res.hiddens, strict=True)
    )
    for t, C in zip(terms[:-1], res.cells[:-1], strict=True):
        s = t.cell.float().square().mean((-2, -1)).sqrt().clamp_min(1)
        moved = (C.float() - t.cell.float()).square().mean((-2, -1)).sqrt() / s
        assert (moved <= K.RHO + K.ACCEPT_TOLERANCE).all()


def test_feedback_stays_in_the_outer_graph():
    terms = make_terminals(3)
    keys = [t.key.clone().requires_grad_(True) for t in terms]
    gates = [t.depth_gate.clone().requires_grad_(True) for t in terms]
    terms = [
        LayerTerminal(t.cell, t.hidden, t.out_gate, gd, k, t.value)
        for t, k, gd in zip(terms, keys, gates, strict=True)
    ]
    res = block_feedback(terms, torch.ones(B, P, dtype=torch.bool))
    res.cells[0].sum().backward()
    assert keys[1].grad is not None and keys[1].grad.abs().sum() > 0
    assert gates[1].grad is not None and gates[1].grad.abs().sum() > 0


def test_gradients_are_finite_with_zero_states():
    """sqrt at zero (top-layer G = 0, fresh cells) must not turn into NaN gradients."""
    terms = make_terminals(3)
    zero = torch.zeros(B, H, R, R, requires_grad=True)
    terms[0] = LayerTerminal(zero, zero, terms[0].out_gate, terms[0].depth_gate, terms[0].key, terms[0].value)
    keys = [t.key.clone().requires_grad_(True) for t in terms]
    terms = [
        LayerTerminal(t.cell, t.hidden, t.out_gate, t.depth_gate, k, t.value)
        for t, k in zip(terms, keys, strict=True)
    ]
    res = block_feedback(terms, torch.ones(B, P, dtype=torch.bool))
    (sum(c.sum() for c in res.cells) + sum(d.sum() for d in res.hiddens)).backward()
    assert torch.isfinite(zero.grad).all()
    assert keys[0].grad is None  # the lowest layer's own loss never drives a correction
    assert all(torch.isfinite(k.grad).all() for k in keys[1:])
