"""The memory layer against a token-by-token transcription of the paper's equations."""

import math

import pytest
import torch

from lstmem_peft import LSTMemLayer
from lstmem_peft import constants as K

D_MODEL, D_Q = 48, 64


def make_layer(seed=0, randomize=True, **kw):
    torch.manual_seed(seed)
    layer = LSTMemLayer(D_MODEL, D_Q, **kw)
    layer.init_corrections(torch.randn(D_Q, D_MODEL), torch.randn(D_MODEL, D_Q))
    if randomize:  # move every parameter off its initial value so that each block is exercised
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(0.3 * torch.randn_like(p))
    return layer


def n(x, H):
    x = torch.tanh(x).view(*x.shape[:-1], H, -1)
    return x / torch.clamp(x.norm(dim=-1, keepdim=True), min=1e-6)


def reference(layer, x, depth_seq, cell, hidden, valid=None):
    """Paper Eqs. (projections)-(hidden) with the full matrices and zero blocks, token by token."""
    P = {k: v.double() for k, v in layer.paper_parameters().items()}
    H, r = layer.num_heads, layer.head_dim
    ds = H * r
    x = x.double()
    C, D = cell.double().clone(), hidden.double().clone()
    dqs, dos, hs = [], [], []
    for t in range(x.shape[1]):
        xt = x[:, t]
        q, k = n(xt @ P["Wq"].T, H), n(xt @ P["Wk"].T, H)
        v = (xt @ P["Wv"].T).view(-1, H, r)
        z = xt @ P["Wx"].T + P["bx"]
        Dl = depth_seq[:, t].double() if depth_seq is not None else torch.zeros_like(D)
        r_time = torch.einsum("bjac,bjc->bja", D, q).flatten(1)
        r_dep = torch.einsum("bjac,bjc->bja", Dl, q).flatten(1)
        p_dep = torch.einsum("bjac,bjc->bja", Dl, k).flatten(1)
        u = torch.cat([r_time, r_dep], -1) @ P["Wread"].T + P["bread"]
        dqs.append(layer.alpha / r * u @ P["Wdq"].T)
        dos.append(layer.alpha / r * u @ P["Wdo"].T)
        zeros = torch.zeros_like(p_dep)
        v_hat = torch.cat([zeros, p_dep], -1) @ P["Wpred_full"].T + P["bpred"]  # W_full [0; p_dep]
        e = v.flatten(1) - v_hat
        gates = torch.sigmoid(torch.cat([z, zeros, r_dep, e], -1) @ P["Wgate_full"].T + P["bgate"])
        i, f, o, g = (a.view(-1, H, r) for a in gates.split(ds, -1))
        C_new = f[..., None] * C + (i * e.view(-1, H, r))[..., None] * k[..., None, :]
        D_new = o[..., None] * torch.tanh(C_new) + g[..., None] * Dl
        if valid is not None:
            keep = valid[:, t].view(-1, 1, 1, 1)
            C_new, D_new = torch.where(keep, C_new, C), torch.where(keep, D_new, D)
        C, D = C_new, D_new
        hs.append(D)
    return torch.stack(dqs, 1), torch.stack(dos, 1), C, D, torch.stack(hs, 1)


def test_paper_parameters_keys_and_shapes():
    layer = LSTMemLayer(D_MODEL, D_Q, num_heads=4, head_dim=8)
    ds = 32
    expected = {
        "Wq": (ds, D_MODEL), "Wk": (ds, D_MODEL), "Wv": (ds, D_MODEL), "Wx": (ds, D_MODEL), "bx": (ds,),
        "Wread": (ds, 2 * ds), "bread": (ds,), "Wpred_full": (ds, 2 * ds), "bpred": (ds,),
        "Wgate_full": (4 * ds, 4 * ds), "bgate": (4 * ds,), "Wdq": (D_Q, ds), "Wdo": (D_MODEL, ds),
    }
    got = {k: tuple(v.shape) for k, v in layer.paper_parameters().items()}
    assert got == expected


def test_initialisation_follows_appendix_c4():
    torch.manual_seed(0)
    layer = LSTMemLayer(D_MODEL, D_Q)
    wq_backbone, wo_backbone = torch.randn(D_Q, D_MODEL), torch.randn(D_MODEL, D_Q)
    layer.init_corrections(wq_backbone, wo_backbone)
    P = layer.paper_parameters()
    ds = layer.state_size
    eye_zero = torch.cat([torch.eye(ds), torch.zeros(ds, ds)], 1)
    assert torch.equal(P["Wread"], eye_zero) and torch.equal(P["Wpred_full"], eye_zero)
    assert not P["bread"].any() and not P["bpred"].any() and not P["bx"].any()
    assert not P["Wgate_full"].any()
    bias = P["bgate"].view(4, ds)
    for row, name in enumerate("ifog"):
        assert torch.all(bias[row] == K.GATE_BIAS[name])
    assert tuple(K.GATE_BIAS.values()) == (-1.0, 2.0, 0.0, -1.0)
    bound = 1 / math.sqrt(D_MODEL)  # kaiming_uniform(a=sqrt(5)) on fan_in d
    for name in ("Wq", "Wk", "Wv", "Wx"):
        assert P[name].abs().max() <= bound and P[name].std() > bound / 3
    for target, source in ((P["Wdq"], wq_backbone), (P["Wdo"], wo_backbone)):
        cols = source[:, :8] / source[:, :8].norm(dim=0, keepdim=True)
        torch.testing.assert_close(target[:, :8], 0.05 * cols)
        assert not target[:, 8:].any()
        torch.testing.assert_close(target[:, :8].norm(dim=0), torch.full((8,), 0.05))


def test_effective_blocks_give_the_full_forward_maps():
    layer = make_layer()
    ds = layer.state_size
    p, z, rdep, e = (torch.randn(5, ds) for _ in range(4))
    full_pred = torch.cat([torch.zeros_like(p), p], -1) @ layer.w_pred_full.T
    torch.testing.assert_close(p @ layer.effective_pred().T, full_pred)
    full_gate = torch.cat([z, torch.zeros_like(z), rdep, e], -1) @ layer.w_gate_full.T
    torch.testing.assert_close(torch.cat([z, rdep, e], -1) @ layer.effective_gate().T, full_gate)
    assert layer.effective_gate().shape == (4 * ds, 3 * ds)


def test_initial_layer_reads_only_temporal_memory_and_writes_v():
    """At init W~_pred = 0 so e = v, and W_read selects the temporal read."""
    layer = LSTMemLayer(D_MODEL, D_Q)
    layer.init_corrections(torch.randn(D_Q, D_MODEL), torch.randn(D_MODEL, D_Q))
    x = torch.randn(2, 3, D_MODEL)
    depth = torch.randn(2, 3, 4, 8, 8)
    cell = hidden = torch.zeros(2, 4, 8, 8)
    with_depth = layer(x, cell, hidden, depth=depth)
    without = layer(x, cell, hidden, depth=None)
    # the first token reads D_0 = 0, and W_read = [I | 0] ignores the depth read
    assert not with_depth.delta_q[:, 0].any()
    # e = v and constant gates: the cell does not depend on the depth input at all
    torch.testing.assert_close(with_depth.cell, without.cell)
    assert not torch.allclose(with_depth.hidden, without.hidden)  # D does, through g * D^(l-1)
    torch.testing.assert_close(with_depth.value.flatten(-2), x @ layer.paper_parameters()["Wv"].T)


@pytest.mark.parametrize("with_depth", [False, True])
@pytest.mark.parametrize("backend", ["naive", "torch"])
@pytest.mark.parametrize("T", [1, 7, 40])
def test_layer_matches_paper_reference(with_depth, backend, T):
    layer = make_layer().double()
    B = 3
    x = torch.randn(B, T, D_MODEL, dtype=torch.float64)
    depth = torch.randn(B, T, 4, 8, 8, dtype=torch.float64) * 0.5 if with_depth else None
    cell = torch.randn(B, 4, 8, 8, dtype=torch.float64)
    hidden = torch.randn(B, 4, 8, 8, dtype=torch.float64)
    valid = torch.rand(B, T) > 0.25
    out = layer(x, cell, hidden, depth=depth, valid=valid, backend=backend)
    dq, do, C, D, hs = reference(layer, x, depth, cell, hidden, valid)
    torch.testing.assert_close(out.delta_q, dq)
    torch.testing.assert_close(out.delta_o, do)
    torch.testing.assert_close(out.cell, C)
    torch.testing.assert_close(out.hidden, D)
    torch.testing.assert_close(out.hidden_seq, hs)


def test_gradients_match_reference():
    layer = make_layer().double()
    x = torch.randn(2, 20, D_MODEL, dtype=torch.float64)
    depth = torch.randn(2, 20, 4, 8, 8, dtype=torch.float64) * 0.5
    cell = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    hidden = torch.randn(2, 4, 8, 8, dtype=torch.float64)

    def grads(fn):
        layer.zero_grad()
        dq, do, C, D = fn()
        (dq.sin().sum() + do.cos().sum() + C.square().sum() + D.sum()).backward()
        return {k: p.grad.clone() for k, p in layer.named_parameters()}

    ours = grads(lambda: (lambda o: (o.delta_q, o.delta_o, o.cell, o.hidden))(layer(x, cell, hidden, depth=depth)))
    ref = grads(lambda: reference(layer, x, depth, cell, hidden)[:4])
    for k in ref:
        torch.testing.assert_close(ours[k], ref[k], msg=k)


def test_prefill_equals_token_by_token_steps():
    layer = make_layer()
    x = torch.randn(2, 12, D_MODEL)
    depth = torch.randn(2, 12, 4, 8, 8) * 0.5
    cell = hidden = torch.zeros(2, 4, 8, 8)
    full = layer(x, cell, hidden, depth=depth)
    c, h = cell, hidden
    for t in range(12):
        out = layer(x[:, t : t + 1], c, h, depth=depth[:, t : t + 1])
        torch.testing.assert_close(out.delta_q[:, 0], full.delta_q[:, t], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.delta_o[:, 0], full.delta_o[:, t], atol=1e-5, rtol=1e-5)
        c, h = out.cell, out.hidden
    torch.testing.assert_close(c, full.cell, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, full.hidden, atol=1e-5, rtol=1e-5)


def test_read_only_pass_keeps_states_and_reads_fixed_memory():
    layer = make_layer()
    x = torch.randn(2, 5, D_MODEL)
    cell, hidden = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    below = torch.randn(2, 4, 8, 8)
    out = layer(x, cell, hidden, depth=below, write=False)
    assert out.cell is cell and out.hidden is hidden and out.hidden_seq is None
    # every token reads the same fixed D (and the fixed lower-layer D): equal to a write pass's
    # first-token read, token by token
    for t in range(5):
        ref = layer(x[:, t : t + 1], cell, hidden, depth=below[:, None])
        torch.testing.assert_close(out.delta_q[:, t], ref.delta_q[:, 0], atol=1e-5, rtol=1e-5)


def test_bf16_states_and_backbone_dtype():
    layer = make_layer()
    x = torch.randn(2, 9, D_MODEL, dtype=torch.bfloat16)
    cell = hidden = torch.zeros(2, 4, 8, 8, dtype=torch.bfloat16)
    out = layer(x, cell, hidden)
    assert out.delta_q.dtype == torch.bfloat16 and out.cell.dtype == torch.bfloat16
    ref = layer(x.float(), cell.float(), hidden.float())
    torch.testing.assert_close(out.cell.float(), ref.cell, atol=2e-2, rtol=2e-2)


def test_zero_input_head_has_finite_gradients():
    layer = make_layer()
    x = torch.zeros(1, 3, D_MODEL, requires_grad=True)  # e.g. a zero padding embedding
    out = layer(x, torch.zeros(1, 4, 8, 8), torch.zeros(1, 4, 8, 8))
    (out.delta_q.sum() + out.hidden.sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
