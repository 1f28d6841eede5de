"""The memory layer against the token-by-token transcription of the paper's equations
(:func:`lstmem_peft.reference.memory_layer_ref`)."""

import copy
import math

import pytest
import torch

from lstmem_peft import LSTMemLayer
from lstmem_peft import constants as K
from lstmem_peft.reference import memory_layer_ref

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


def reference(layer, x, depth, cell, hidden, valid=None):
    """The library's float64 transcription of the paper (:mod:`lstmem_peft.reference`)."""
    return memory_layer_ref(
        layer.paper_parameters(), x, cell, hidden, depth, valid, num_heads=layer.num_heads, alpha=layer.alpha
    )


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
    assert_prefill_equals_steps(layer, x, cell, hidden, depth, layer(x, cell, hidden, depth=depth))


def assert_prefill_equals_steps(layer, x, cell, hidden, depth, full):
    """One-token calls from ``(cell, hidden)`` reproduce the block output ``full`` position by position."""
    c, h = cell, hidden
    for t in range(x.shape[1]):
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


# ---------------------------------------------------------------------- fast paths (DecodePlan)
def general(layer):
    """A copy of ``layer`` that always takes the general path."""
    ref = copy.deepcopy(layer)
    ref.fast_path = False
    return ref


def layer_inputs(T, with_depth, with_valid, dtype=torch.float64, B=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D_MODEL, generator=g, dtype=dtype)
    depth = 0.5 * torch.randn(B, T, 4, 8, 8, generator=g, dtype=dtype) if with_depth else None
    cell = torch.randn(B, 4, 8, 8, generator=g, dtype=dtype)
    hidden = torch.randn(B, 4, 8, 8, generator=g, dtype=dtype)
    valid = (torch.rand(B, T, generator=g) > 0.3) if with_valid else None
    if valid is not None:
        valid[0] = True
        valid[1, -1] = False  # the one-token case sees a padded row too
    return x, depth, cell, hidden, valid


def assert_outputs_close(out, ref, aux=True, *, atol, rtol):
    """``out`` and ``ref`` agree within ``atol``/``rtol`` (the error of the computation, in its own
    precision); a result stored in a narrower dtype than it was computed in may additionally differ
    by one unit in the last place of that dtype (two nearly equal float32 values on either side of
    a rounding boundary), i.e. ``finfo(dtype).eps`` relative."""
    for name in ("delta_q", "delta_o", "cell", "hidden", "hidden_seq") + (
        ("key", "value", "out_gate", "depth_gate") if aux else ()
    ):
        a, b = getattr(out, name), getattr(ref, name)
        ulp = torch.finfo(a.dtype).eps if a.dtype in (torch.bfloat16, torch.float16) else 0.0
        torch.testing.assert_close(a, b, msg=name, atol=atol + ulp, rtol=rtol + ulp)


@pytest.mark.parametrize("with_valid", [False, True])
@pytest.mark.parametrize("with_depth", [False, True])
@pytest.mark.parametrize("T", [1, 9, 40])
@pytest.mark.parametrize("grad", [False, True])
def test_fast_paths_match_paper_reference_and_general_path(T, with_depth, with_valid, grad):
    """One token (fused step, cached or fresh plan) and blocks (fused maps around the scan)."""
    layer = make_layer().double()
    x, depth, cell, hidden, valid = layer_inputs(T, with_depth, with_valid)
    with torch.set_grad_enabled(grad):
        out = layer(x, cell, hidden, depth=depth, valid=valid)
        ref_out = general(layer)(x, cell, hidden, depth=depth, valid=valid)
    assert (out.read is not None) == (not grad or T == 1)  # which path ran
    dq, do, C, D, hs = reference(layer, x, depth, cell, hidden, valid)
    torch.testing.assert_close(out.delta_q, dq)
    torch.testing.assert_close(out.delta_o, do)
    torch.testing.assert_close(out.cell, C)
    torch.testing.assert_close(out.hidden, D)
    torch.testing.assert_close(out.hidden_seq, hs)
    assert_outputs_close(out, ref_out, atol=1e-7, rtol=1e-7)  # float64 throughout


@pytest.mark.parametrize("with_valid", [False, True])
@pytest.mark.parametrize("with_depth", [False, True])
def test_fast_step_gradients_match_general_path(with_depth, with_valid):
    """Under autograd the one-token step builds its plan inside the graph: same gradients."""
    layer = make_layer().double()
    ref_layer = general(layer)
    x, depth, cell, hidden, valid = layer_inputs(1, with_depth, with_valid)

    def grads(module):
        module.zero_grad()
        inputs = [t.clone().requires_grad_() for t in (x, cell, hidden)] + (
            [depth.clone().requires_grad_()] if depth is not None else []
        )
        out = module(inputs[0], inputs[1], inputs[2], depth=inputs[3] if depth is not None else None, valid=valid)
        loss = out.delta_q.sin().sum() + out.delta_o.cos().sum() + out.cell.square().sum() + out.hidden.sum()
        loss = loss + (out.key * out.value).sum() + out.out_gate.sum() + out.depth_gate.sum()
        loss.backward()
        params = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        return params, [t.grad for t in inputs]

    ours, ours_in = grads(layer)
    ref, ref_in = grads(ref_layer)
    assert ours.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], msg=name)
    for a, b in zip(ours_in, ref_in):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("with_depth", [False, True])
@pytest.mark.parametrize("T", [1, 6])
def test_fast_read_only_pass_matches_general_path(T, with_depth):
    layer = make_layer().double()
    x, _, cell, hidden, _ = layer_inputs(T, False, False)
    below = torch.randn(3, 4, 8, 8, dtype=torch.float64) if with_depth else None
    with torch.no_grad():
        out = layer(x, cell, hidden, depth=below, write=False)
        ref = general(layer)(x, cell, hidden, depth=below, write=False)
    assert out.read is not None and out.cell is cell and out.hidden is hidden and out.hidden_seq is None
    torch.testing.assert_close(out.delta_q, ref.delta_q)
    torch.testing.assert_close(out.delta_o, ref.delta_o)


@pytest.mark.parametrize("T", [1, 7])
def test_fast_paths_float32_and_bf16_states(T):
    layer = make_layer()
    x, depth, cell, hidden, valid = layer_inputs(T, True, True, dtype=torch.float32)
    with torch.no_grad():
        for states in (torch.float32, torch.bfloat16):
            c, h = cell.to(states), hidden.to(states)
            out = layer(x, c, h, depth=depth, valid=valid)
            ref = general(layer)(x, c, h, depth=depth, valid=valid)
            assert out.cell.dtype == states and out.hidden.dtype == states and out.hidden_seq.dtype == torch.float32
            assert_outputs_close(out, ref, atol=1e-5, rtol=1e-5)
        # a bf16 backbone: corrections in its dtype
        out = layer(x.bfloat16(), cell, hidden, depth=depth, valid=valid)
        ref = general(layer)(x.bfloat16(), cell, hidden, depth=depth, valid=valid)
        assert out.delta_q.dtype == torch.bfloat16
        torch.testing.assert_close(out.delta_q.float(), ref.delta_q.float(), atol=1e-2, rtol=1e-2)


def test_fast_paths_of_a_bf16_adapter_are_as_accurate_as_the_general_path():
    layer32 = make_layer()
    layer = copy.deepcopy(layer32).bfloat16()
    x, depth, cell, hidden, _ = layer_inputs(1, True, False, dtype=torch.bfloat16)
    with torch.no_grad():
        for T in (1, 5):
            xs, deps = x.expand(3, T, -1), depth.expand(3, T, -1, -1, -1)
            exact = layer32(xs.float(), cell.float(), hidden.float(), depth=deps.float())
            out = layer(xs, cell, hidden, depth=deps)
            ref = general(layer)(xs, cell, hidden, depth=deps)
            for name in ("delta_q", "delta_o", "cell", "hidden"):
                target = getattr(exact, name).float()
                err = (getattr(out, name).float() - target).abs().max()
                err_general = (getattr(ref, name).float() - target).abs().max()
                assert err <= 2 * err_general + 1e-2 * target.abs().max(), name


def test_cached_plan_follows_parameter_updates():
    layer = make_layer()
    x, depth, cell, hidden, _ = layer_inputs(1, True, False, dtype=torch.float32)

    def fast_and_general():
        with torch.no_grad():
            return layer(x, cell, hidden, depth=depth).delta_q, general(layer)(x, cell, hidden, depth=depth).delta_q

    assert layer.cached_plan() is None  # grad mode with trainable parameters: no cached plan
    with torch.no_grad():
        plan = layer.cached_plan()
        assert plan is not None and layer.cached_plan() is plan  # reused while nothing changes
    a, b = fast_and_general()
    torch.testing.assert_close(a, b)
    with torch.no_grad():  # an in-place update (an optimiser step does the same)
        layer.w_gate_full.add_(0.1)
        layer.w_dq.mul_(1.5)
    a2, b2 = fast_and_general()
    assert not torch.allclose(a, a2)
    torch.testing.assert_close(a2, b2)
    state = {k: v + 0.05 for k, v in layer.state_dict().items()}
    layer.load_state_dict(state)
    torch.testing.assert_close(*fast_and_general())
    layer.w_read.data = layer.w_read.data.flip(1).contiguous()  # new storage
    torch.testing.assert_close(*fast_and_general())
    layer.w_in.data.mul_(0.5)  # bypasses the version counter: clear_plan() is the documented remedy
    layer.clear_plan()
    torch.testing.assert_close(*fast_and_general())
    layer.double()  # dtype change
    with torch.no_grad():
        out = layer(x.double(), cell.double(), hidden.double(), depth=depth.double())
        ref = general(layer)(x.double(), cell.double(), hidden.double(), depth=depth.double())
    torch.testing.assert_close(out.delta_q, ref.delta_q)


def test_frozen_parameters_use_the_cached_plan_and_keep_input_gradients():
    layer = make_layer().double().requires_grad_(False)
    x, depth, cell, hidden, _ = layer_inputs(4, True, False)
    x.requires_grad_()
    out = layer(x, cell, hidden, depth=depth)
    assert out.read is not None  # cached plan despite grad mode
    out.delta_q.sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    general(layer)(x_ref, cell, hidden, depth=depth).delta_q.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_fast_paths_are_bit_stable_and_prefill_equals_steps():
    layer = make_layer()
    x = torch.randn(2, 12, D_MODEL)
    depth = torch.randn(2, 12, 4, 8, 8) * 0.5
    cell = hidden = torch.zeros(2, 4, 8, 8)
    with torch.no_grad():
        full = layer(x, cell, hidden, depth=depth)
        again = layer(x, cell, hidden, depth=depth)
        assert torch.equal(full.delta_q, again.delta_q) and torch.equal(full.hidden, again.hidden)
        assert_prefill_equals_steps(layer, x, cell, hidden, depth, full)


def test_decode_plan_is_the_paper_map():
    """The plan's fused maps, applied by hand, give the paper's e, gate pre-activations and u."""
    layer = make_layer().double()
    P = {k: v for k, v in layer.paper_parameters().items()}
    plan = layer.decode_plan()
    ds, H, R = layer.state_size, layer.num_heads, layer.head_dim
    x = torch.randn(5, D_MODEL, dtype=torch.float64)
    proj = x @ plan.w_in + plan.b_in
    qk = proj[:, : 2 * ds].view(5, H, 2, R)
    torch.testing.assert_close(qk[:, :, 0].flatten(1), x @ P["Wq"].T)
    torch.testing.assert_close(qk[:, :, 1].flatten(1), x @ P["Wk"].T)
    e0, z = proj[:, 2 * ds :].split(ds, dim=1)
    torch.testing.assert_close(e0, x @ P["Wv"].T - P["bpred"])
    torch.testing.assert_close(z, x @ P["Wx"].T + P["bx"])
    r_dep, p_dep = torch.randn(2, 5, H, R, dtype=torch.float64)
    pairs = torch.stack([r_dep, p_dep], dim=2).flatten(1)  # per head [r_dep_j; p_dep_j]
    ea = torch.cat([e0, z], 1) @ plan.m_s + pairs @ plan.m_pairs + plan.b_ea
    e = e0 - p_dep.flatten(1) @ layer.effective_pred().T
    gates = torch.cat([z, r_dep.flatten(1), e], 1) @ layer.effective_gate().T + P["bgate"]
    torch.testing.assert_close(ea, torch.cat([e, gates], 1))
    r_time = torch.randn(5, ds, dtype=torch.float64)
    u = r_time @ plan.w_read_t + pairs @ plan.w_read_pairs + plan.b_read
    torch.testing.assert_close(u, torch.cat([r_time, r_dep.flatten(1)], 1) @ P["Wread"].T + P["bread"])
    torch.testing.assert_close(u @ plan.w_corr_q, layer.alpha / R * u @ P["Wdq"].T)


@pytest.mark.parametrize("T", [1, 5])
def test_fast_paths_with_the_triton_backend_match_the_general_path(T):
    """The fused paths hand the recurrence to the Triton kernels (in place for one token); on a
    CPU-only machine the kernels run under TRITON_INTERPRET=1."""
    from lstmem_kernels import triton_available

    if not triton_available():
        pytest.skip("triton not installed")
    layer = make_layer()
    x, depth, cell, hidden, valid = layer_inputs(T, True, True, dtype=torch.float32)
    with torch.no_grad():
        for states in (torch.float32, torch.bfloat16):
            c, h = cell.to(states), hidden.to(states)
            ref = general(layer)(x, c, h, depth=depth, valid=valid, backend="torch")
            out = layer(x, c.clone(), h.clone(), depth=depth, valid=valid, backend="triton")
            assert out.read is not None
            assert_outputs_close(out, ref, atol=2e-5, rtol=2e-5)
