"""The memory layer against the token-by-token transcription of the paper's equations
(:func:`lstmem_peft.memory.reference.memory_layer_ref`)."""

import math

import pytest
import torch
from decode_steps import decode_slots

from lstmem_kernels.step.decode_torch import arrange_step_maps
from lstmem_peft import LSTMemLayer
from lstmem_peft.memory import layer as layer_module
from lstmem_peft.memory.reference import memory_layer_ref

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
    """The library's float64 transcription of the paper (:mod:`lstmem_peft.memory.reference`)."""
    return memory_layer_ref(
        layer.paper_parameters(), x, cell, hidden, depth, valid, num_heads=layer.num_heads, alpha=layer.alpha
    )


def test_paper_parameters_keys_and_shapes():
    layer = LSTMemLayer(D_MODEL, D_Q, num_heads=4, head_dim=8)
    ds = 32
    expected = {
        "Wq": (ds, D_MODEL),
        "Wk": (ds, D_MODEL),
        "Wv": (ds, D_MODEL),
        "Wx": (ds, D_MODEL),
        "bx": (ds,),
        "Wread": (ds, 2 * ds),
        "bread": (ds,),
        "Wpred": (ds, ds),
        "bpred": (ds,),
        "Wgate": (4 * ds, 3 * ds),
        "bgate": (4 * ds,),
        "Wdq": (D_Q, ds),
        "Wdo": (D_MODEL, ds),
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
    assert torch.equal(P["Wread"], eye_zero)
    # W_pred^full = [I | 0] and W_gate^full = 0: their effective maps W~_pred = P_dep and W~_gate are 0
    assert not P["Wpred"].any() and not P["Wgate"].any()
    assert not P["bread"].any() and not P["bpred"].any() and not P["bx"].any()
    bias = P["bgate"].view(4, ds)
    for row, value in enumerate((-1.0, 2.0, 0.0, -1.0)):  # the paper's b_i, b_f, b_o, b_g (App. C.4)
        assert torch.all(bias[row] == value)
    bound = 1 / math.sqrt(D_MODEL)  # kaiming_uniform(a=sqrt(5)) on fan_in d
    for name in ("Wq", "Wk", "Wv", "Wx"):
        assert P[name].abs().max() <= bound and P[name].std() > bound / 3
    for target, source in ((P["Wdq"], wq_backbone), (P["Wdo"], wo_backbone)):
        cols = source[:, :8] / source[:, :8].norm(dim=0, keepdim=True)
        torch.testing.assert_close(target[:, :8], 0.05 * cols)
        assert not target[:, 8:].any()
        torch.testing.assert_close(target[:, :8].norm(dim=0), torch.full((8,), 0.05))


def test_a_layer_without_depth_input_registers_no_prediction_map():
    layer = make_layer()
    names = lambda: {n for n, _ in layer.named_parameters()}  # noqa: E731
    assert "w_pred" in names()
    layer.set_depth_input(False)
    assert "w_pred" not in names() and "w_pred" not in layer.state_dict()
    layer.set_depth_input(True)  # registered again at its initial value, W~_pred = 0
    assert "w_pred" in names() and not layer.w_pred.any()


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
    assert not with_depth.correction(0)[:, 0].any()
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
    layer.backend = backend
    out = layer(x, cell, hidden, depth=depth, valid=valid)
    dq, do, C, D, hs = reference(layer, x, depth, cell, hidden, valid)
    torch.testing.assert_close(out.correction(0), dq)
    torch.testing.assert_close(out.correction(1), do)
    torch.testing.assert_close(out.cell, C)
    torch.testing.assert_close(out.hidden, D)
    torch.testing.assert_close(out.hidden_seq, hs)


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
        torch.testing.assert_close(out.correction(0)[:, 0], full.correction(0)[:, t], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.correction(1)[:, 0], full.correction(1)[:, t], atol=1e-5, rtol=1e-5)
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
        torch.testing.assert_close(out.correction(0)[:, t], ref.correction(0)[:, 0], atol=1e-5, rtol=1e-5)


def test_bf16_states_and_backbone_dtype():
    layer = make_layer()
    x = torch.randn(2, 9, D_MODEL, dtype=torch.bfloat16)
    cell = hidden = torch.zeros(2, 4, 8, 8, dtype=torch.bfloat16)
    out = layer(x, cell, hidden)
    assert out.read.dtype == torch.float32 and out.cell.dtype == torch.bfloat16  # u in the adapter's dtype
    assert out.add_to(torch.zeros(2, 9, layer.query_size, dtype=torch.bfloat16), 0).dtype == torch.bfloat16
    ref = layer(x.float(), cell.float(), hidden.float())
    torch.testing.assert_close(out.cell.float(), ref.cell, atol=2e-2, rtol=2e-2)


def test_zero_input_head_has_finite_gradients():
    layer = make_layer()
    x = torch.zeros(1, 3, D_MODEL, requires_grad=True)  # e.g. a zero padding embedding
    out = layer(x, torch.zeros(1, 4, 8, 8), torch.zeros(1, 4, 8, 8))
    (out.correction(0).sum() + out.hidden.sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


# ---------------------------------------------------------------------- every path against the reference
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


def assert_close_to_reference(out, ref, *, atol, rtol):
    """``out`` agrees with the float64 reference within the error of its own computation
    (``atol``/``rtol``); a state stored in a narrower dtype than it was computed in may differ by
    one more unit in the last place of that dtype (``finfo(dtype).eps`` relative)."""
    for name in ("delta_q", "delta_o", "cell", "hidden", "hidden_seq"):
        a = (
            out.correction(("delta_q", "delta_o").index(name))
            if name.startswith("delta")
            else getattr(out, name)
        )
        b = getattr(ref, name)
        ulp = torch.finfo(a.dtype).eps if a.dtype in (torch.bfloat16, torch.float16) else 0.0
        torch.testing.assert_close(a.double(), b.double(), msg=name, atol=atol + ulp, rtol=rtol + ulp)


# (tokens, grad mode): a block scans; one token scans under autograd and takes the in-place decode step without
PATHS = {"block": (9, True), "one token under autograd": (1, True), "one-token decode step": (1, False)}
GRAD_PATHS = sorted(name for name, (_, grad) in PATHS.items() if grad)


@pytest.mark.parametrize("with_valid", [False, True])
@pytest.mark.parametrize("with_depth", [False, True])
@pytest.mark.parametrize("path", GRAD_PATHS)
def test_every_path_and_its_gradients_match_the_reference(path, with_depth, with_valid):
    """Forward and every gradient (parameters and inputs) of the paths that run under autograd."""
    T, _ = PATHS[path]
    layer = make_layer().double()
    x, depth, cell, hidden, valid = layer_inputs(T, with_depth, with_valid)

    def grads(fn):
        layer.zero_grad()
        inputs = [t.clone().requires_grad_() for t in (x, cell, hidden)] + (
            [depth.clone().requires_grad_()] if depth is not None else []
        )
        dq, do, C, D = fn(*inputs)[:4]
        (dq.sin().sum() + do.cos().sum() + C.square().sum() + D.sum()).backward()
        params = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        return params, [t.grad for t in inputs]

    def ours(x, cell, hidden, depth=None):
        out = layer(x, cell, hidden, depth=depth, valid=valid)
        ref = reference(layer, x, depth, cell, hidden, valid)
        torch.testing.assert_close(out.hidden_seq, ref.hidden_seq)
        for name in ("key", "out_gate", "depth_gate"):  # the feedback samples, same in every path
            assert getattr(out, name).shape == (3, T, 4, 8)
        return out.correction(0), out.correction(1), out.cell, out.hidden

    def ref(x, cell, hidden, depth=None):
        return reference(layer, x, depth, cell, hidden, valid)

    got, got_in = grads(ours)
    want, want_in = grads(ref)
    for name, p in layer.named_parameters():  # a parameter a path does not use has a zero gradient
        zero = torch.zeros_like(p)
        torch.testing.assert_close(got.get(name, zero), want.get(name, zero), msg=name)
    for a, b in zip(got_in, want_in, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", ["naive", "torch"])
@pytest.mark.parametrize("with_valid", [False, True])
@pytest.mark.parametrize("with_depth", [False, True])
def test_the_decode_step_matches_the_reference_and_leaves_the_callers_states(with_depth, with_valid, backend):
    """One token without gradients: the kernel family's in-place step, run on copies of the states."""
    layer = make_layer().double()
    x, depth, cell, hidden, valid = layer_inputs(1, with_depth, with_valid)
    c0, h0 = cell.clone(), hidden.clone()
    with torch.no_grad():
        layer.backend = backend
        out = layer(x, cell, hidden, depth=depth, valid=valid)
    assert torch.equal(cell, c0) and torch.equal(hidden, h0)
    assert_close_to_reference(out, reference(layer, x, depth, cell, hidden, valid), atol=1e-12, rtol=1e-12)
    for name in ("key", "value", "out_gate", "depth_gate"):
        assert getattr(out, name).shape == (3, 1, 4, 8)


# (layer dtype, state-table dtype, tolerance against the float64 reference): the vLLM plugin keeps a
# float32 layer and its tables in the adapter's state dtype
SLOT_DTYPES = {
    "float64": (torch.float64, torch.float64, 1e-12),
    "float32 layer, bf16 tables": (torch.float32, torch.bfloat16, 1e-5),
}


@pytest.mark.parametrize("dtypes", sorted(SLOT_DTYPES))
@pytest.mark.parametrize("read_only", [False, True], ids=["all-write", "one-reads-only"])
@pytest.mark.parametrize("with_depth", [False, True])
def test_decode_slots_steps_the_table_rows_like_the_gathered_rows(with_depth, read_only, dtypes):
    """``lstmem_decode_step`` with ``slots=`` (the vLLM plugin's decode; here its PyTorch member)
    on rows 5, 0 and 3 of 7-row state tables: ``u``, ``D_t`` and the stepped rows are the
    layer's forward on the gathered rows bit for bit and the paper reference's; a read-only row
    (``valid`` False) and the rows of no sequence are unchanged bit for bit; ``D_t`` lands in a
    given tensor, or in a float32 one of its own."""
    layer_dtype, table_dtype, tol = SLOT_DTYPES[dtypes]
    layer = make_layer(seed=4).to(layer_dtype)
    layer.backend = "torch"
    g = torch.Generator().manual_seed(5)
    cells, hiddens = (0.5 * torch.randn(7, 4, 8, 8, generator=g).to(table_dtype) for _ in range(2))
    slots = torch.tensor([5, 0, 3])
    x = torch.randn(3, D_MODEL, generator=g, dtype=layer_dtype)
    depth = 0.5 * torch.randn(3, 4, 8, 8, generator=g, dtype=layer_dtype) if with_depth else None
    valid = torch.tensor([True, False, True]) if read_only else None
    gathered = (cells[slots], hiddens[slots])
    with torch.no_grad():
        want = layer(
            x[:, None],
            *gathered,
            depth=None if depth is None else depth[:, None],
            valid=None if valid is None else valid[:, None],
            aux=False,
        )
        c, h = cells.clone(), hiddens.clone()
        u, seq = decode_slots(layer, x, c, h, slots, depth=depth, valid=valid)
        c2, h2 = cells.clone(), hiddens.clone()
        given = torch.empty(3, 4, 8, 8)
        u2, seq2 = decode_slots(layer, x, c2, h2, slots, depth=depth, valid=valid, hidden_seq=given)
    assert seq.dtype == torch.float32 and seq2 is given
    assert torch.equal(u, want.read[:, 0]) and torch.equal(u2, u)
    assert torch.equal(seq, want.hidden_seq[:, 0].float()) and torch.equal(seq2, seq)
    assert torch.equal(c[slots], want.cell) and torch.equal(h[slots], want.hidden)
    assert torch.equal(c2, c) and torch.equal(h2, h)
    untouched = [1, 2, 4, 6] + ([0] if read_only else [])
    assert torch.equal(c[untouched], cells[untouched]) and torch.equal(h[untouched], hiddens[untouched])
    ref = reference(
        layer,
        x[:, None],
        None if depth is None else depth[:, None],
        *gathered,
        None if valid is None else valid[:, None],
    )
    # the tables' rows against the paper (D_t is want's, rounded to float32 above)
    assert_close_to_reference(want._replace(cell=c[slots], hidden=h[slots]), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("with_depth", [False, True])
@pytest.mark.parametrize("T", [1, 6])
def test_read_only_pass_matches_the_reference_token_by_token(T, with_depth):
    """Read-only: every token reads the same fixed states, i.e. the reference's first-token
    corrections from those states, token by token."""
    layer = make_layer().double()
    x, _, cell, hidden, _ = layer_inputs(T, False, False)
    below = torch.randn(3, 4, 8, 8, dtype=torch.float64) if with_depth else None
    out = layer(x, cell, hidden, depth=below, write=False)
    assert out.cell is cell and out.hidden is hidden and out.hidden_seq is None
    for t in range(T):
        ref = reference(layer, x[:, t : t + 1], None if below is None else below[:, None], cell, hidden)
        torch.testing.assert_close(out.correction(0)[:, t], ref.delta_q[:, 0])
        torch.testing.assert_close(out.correction(1)[:, t], ref.delta_o[:, 0])


@pytest.mark.parametrize("states", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_float32_layer_with_float32_and_bf16_states(path, states):
    """A float32 layer against the float64 reference: float32 rounding over a few tokens (1e-5),
    plus one bf16 unit where the states are stored in bf16."""
    T, grad = PATHS[path]
    layer = make_layer()
    x, depth, cell, hidden, valid = layer_inputs(T, True, True, dtype=torch.float32)
    c, h = cell.to(states), hidden.to(states)
    with torch.set_grad_enabled(grad):
        out = layer(x, c, h, depth=depth, valid=valid)
    ref = reference(layer, x, depth, c, h, valid)
    assert out.cell.dtype == states and out.hidden.dtype == states and out.hidden_seq.dtype == torch.float32
    assert_close_to_reference(out, ref, atol=1e-5, rtol=1e-5)
    # a bf16 backbone: the projections add the corrections in their own dtype
    out = layer(x.bfloat16(), c, h, depth=depth, valid=valid)
    on_q, on_o = (torch.zeros(3, T, n, dtype=torch.bfloat16) for n in (layer.query_size, layer.hidden_size))
    assert out.add_to(on_q, 0).dtype == out.add_to(on_o, 1).dtype == torch.bfloat16


def test_a_bf16_adapter_is_within_bf16_precision_of_the_reference():
    layer = make_layer().bfloat16()
    x, depth, cell, hidden, _ = layer_inputs(5, True, False, dtype=torch.bfloat16)
    with torch.no_grad():
        out = layer(x, cell, hidden, depth=depth)
    ref = reference(layer, x, depth, cell, hidden)
    for name in ("delta_q", "delta_o", "cell", "hidden"):
        got = (
            out.correction(("delta_q", "delta_o").index(name))
            if name.startswith("delta")
            else getattr(out, name)
        )
        got, want = got.double(), getattr(ref, name)
        # every input, weight and product rounded to bf16 (2^-8 relative) a few dozen times
        assert (got - want).abs().max() <= 0.1 * want.abs().max() + 1e-2, name


def test_blocks_are_bit_stable_and_prefill_equals_steps():
    layer = make_layer()
    x = torch.randn(2, 12, D_MODEL)
    depth = torch.randn(2, 12, 4, 8, 8) * 0.5
    cell = hidden = torch.zeros(2, 4, 8, 8)
    with torch.no_grad():
        full = layer(x, cell, hidden, depth=depth)
        again = layer(x, cell, hidden, depth=depth)
        assert torch.equal(full.correction(0), again.correction(0)) and torch.equal(full.hidden, again.hidden)
        assert_prefill_equals_steps(layer, x, cell, hidden, depth, full)


def test_weights_arrange_the_paper_maps():
    """LayerWeights: W_q/W_k by head; ``[v; z; reads] eau + b_eau`` is ``[e | a | u_dep]`` of eq:residual,
    eq:gates and eq:read, written with the effective maps of App. C.2; a step's map with the temporal
    reads gives ``u``."""
    layer = make_layer().double()
    w, P = layer.weights(), layer.paper_parameters()
    ds, H, R = layer.state_size, layer.num_heads, layer.head_dim
    v, z, r_dep, p_dep = (torch.randn(5, ds, dtype=torch.float64) for _ in range(4))
    by_head = torch.stack([r_dep.view(5, H, R), p_dep.view(5, H, R)], 2).reshape(5, 2 * ds)
    e = v - P["bpred"] - p_dep @ layer.effective_pred().T
    a = torch.cat([z, r_dep, e], 1) @ layer.effective_gate().T + P["bgate"]
    u_dep = r_dep @ P["Wread"][:, ds:].T + P["bread"]
    torch.testing.assert_close(
        torch.cat([v, z, by_head], 1) @ w.eau_depth + w.b_eau, torch.cat([e, a, u_dep], 1)
    )
    e0 = v - P["bpred"]
    a0 = torch.cat([z, torch.zeros_like(z), e0], 1) @ layer.effective_gate().T + P["bgate"]
    u0 = P["bread"].expand(5, ds)
    torch.testing.assert_close(torch.cat([v, z], 1) @ w.eau_first + w.b_eau, torch.cat([e0, a0, u0], 1))
    # a one-token step's maps also take the temporal reads [r^time; D_{t-1} k] head by head and give u
    # whole (eq:read); D_{t-1} k, which the same product yields, plays no part. They set exact ones
    # beside e, so that one GLU of the first 8 d_s columns gives [i e | f | o | g] (eq:gates)
    r_time, d_k = torch.randn(5, ds, dtype=torch.float64), torch.randn(5, ds, dtype=torch.float64)
    time_reads = torch.stack([r_time.view(5, H, R), d_k.view(5, H, R)], 2).reshape(5, 2 * ds)
    u_time = r_time @ P["Wread"][:, :ds].T
    ones = torch.ones(5, 3 * ds, dtype=torch.float64)
    maps = arrange_step_maps(w.eau_depth, w.b_eau, w.read, H)  # the PyTorch decode step's
    for inputs, map_, (e_, a_, u_) in (
        (torch.cat([v, z, time_reads, by_head], 1), maps.depth, (e, a, u_dep + u_time)),
        (torch.cat([v, z, time_reads], 1), maps.first, (e0, a0, u0 + u_time)),
    ):
        step = inputs @ map_ + maps.bias
        torch.testing.assert_close(step, torch.cat([e_, ones, a_, u_], 1))
        assert torch.equal(step[:, ds : 4 * ds], ones)
        i, f, o, g = torch.sigmoid(a_).split(ds, 1)
        torch.testing.assert_close(
            torch.nn.functional.glu(step[:, : 8 * ds]), torch.cat([i * e_, f, o, g], 1)
        )
    torch.testing.assert_close(w.read, P["Wread"].t(), rtol=0, atol=0)
    # eq:injection's scale alpha / r is folded into the correction maps
    assert torch.equal(w.corr_q, (layer.scale * P["Wdq"]).t()) and torch.equal(
        w.corr_o, (layer.scale * P["Wdo"]).t()
    )
    for j in range(layer.num_heads):  # W_q and W_k head by head
        torch.testing.assert_close(
            w.w_in[:, 2 * j * R : (2 * j + 1) * R], P["Wq"][j * R : (j + 1) * R].t(), rtol=0, atol=0
        )
        torch.testing.assert_close(
            w.w_in[:, (2 * j + 1) * R : (2 * j + 2) * R], P["Wk"][j * R : (j + 1) * R].t(), rtol=0, atol=0
        )
    torch.testing.assert_close(w.w_in[:, 2 * ds :], torch.cat([P["Wv"], P["Wx"]]).t(), rtol=0, atol=0)
    assert not w.b_in[: 3 * ds].any() and torch.equal(w.b_in[3 * ds :], P["bx"])


@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_triton_backend_matches_the_reference(path):
    """The layer with the Triton kernels (in place for one token; on a CPU-only machine under
    TRITON_INTERPRET=1) against the reference, and the caller's states are never written."""
    from lstmem_kernels import triton_available

    if not triton_available():
        pytest.skip("triton not installed")
    T, grad = PATHS[path]
    layer = make_layer()
    x, depth, cell, hidden, valid = layer_inputs(T, True, True, dtype=torch.float32)
    for states in (torch.float32, torch.bfloat16):
        c, h = cell.to(states), hidden.to(states)
        c0, h0 = c.clone(), h.clone()
        with torch.set_grad_enabled(grad):
            layer.backend = "triton"
            out = layer(x, c, h, depth=depth, valid=valid)
        assert torch.equal(c, c0) and torch.equal(h, h0)
        assert_close_to_reference(out, reference(layer, x, depth, c, h, valid), atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------- derived weights, cached
def _block(layer, x, states, **kw):
    with torch.no_grad():
        return layer(x, *states, **kw)


@pytest.mark.parametrize(
    "change",
    [
        "optimizer step",
        "load_state_dict",
        "to float64",
        "data replaced",
        "depth input removed",
        "train()",
        "written through .data, then eval()",
    ],
)
def test_derived_weights_are_cached_and_every_parameter_change_is_seen_by_the_next_forward(
    change, monkeypatch
):
    """Without gradients a layer derives its :class:`LayerWeights` once and reuses them; any change of a
    parameter (in place, by loading, by moving, by replacing it) is seen by the next forward, which
    then equals a forward over freshly derived weights (after an optimizer step the weights are
    derived by the step's hook, before the next forward)."""
    layer = make_layer(seed=4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, D_MODEL, generator=g)
    states = (torch.randn(2, 4, 8, 8, generator=g) * 0.1, torch.randn(2, 4, 8, 8, generator=g) * 0.1)
    calls = []
    derive = LSTMemLayer.weights
    monkeypatch.setattr(LSTMemLayer, "weights", lambda self, **kw: calls.append(1) or derive(self, **kw))
    first = _block(layer, x, states)
    again = _block(layer, x, states)
    assert len(calls) == 1 and torch.equal(first.correction(0), again.correction(0))  # derived once, reused

    if change == "optimizer step":
        opt = torch.optim.SGD(layer.parameters(), lr=0.5)
        with torch.enable_grad():
            layer(x, *states).correction(
                0
            ).square().sum().backward()  # with gradients: derived in the forward
        opt.step()
    elif change == "load_state_dict":
        layer.load_state_dict(make_layer(seed=9).state_dict())
    elif change == "to float64":
        layer.double()
        x, states = x.double(), tuple(s.double() for s in states)
    elif change == "data replaced":
        layer.w_gate.data = layer.w_gate.data + 0.5
    elif change == "depth input removed":
        layer.set_depth_input(False)
    elif change.startswith("written through .data"):  # unseen by the version counter: eval() drops the cache
        layer.w_gate.data.add_(0.5)
        layer.eval()
    else:
        layer.train()
        layer.eval()
    calls.clear()
    changed = _block(layer, x, states)
    # derived again: by the next forward, or after an optimizer step already by the step's hook (which
    # keeps compiled graphs, which cannot check the cache, current)
    assert len(calls) == (0 if change == "optimizer step" else 1)
    fresh = _block(layer, x, states, weights=derive(layer))
    assert torch.equal(changed.correction(0), fresh.correction(0)) and torch.equal(changed.cell, fresh.cell)
    if change not in ("train()", "depth input removed"):  # (without a depth input W~_pred never acts)
        assert not torch.equal(changed.correction(0).to(first.correction(0).dtype), first.correction(0))


def test_with_gradients_the_weights_are_derived_in_the_forward_and_carry_the_gradient():
    layer = make_layer(seed=5)
    layer.set_depth_input(False)  # no depth input is passed below
    x = torch.randn(1, 2, D_MODEL)
    states = (torch.zeros(1, 4, 8, 8), torch.zeros(1, 4, 8, 8))
    _block(layer, x, states)  # fills the cache
    out = layer(x, *states)
    (out.correction(0).sum() + out.correction(1).sum()).backward()
    assert all(p.grad is not None for p in layer.parameters())


def test_one_token_is_scanned_under_autograd_and_stepped_without(monkeypatch):
    """A forward that trains scans its one token (the gradient reaches the weights); without
    gradients the token is the decode step, here on the weights derived for training too. Both
    give the reference's values (float64: agreement to rounding)."""
    layer = make_layer(seed=6).double()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1, D_MODEL, generator=g, dtype=torch.float64)
    depth = torch.randn(2, 1, 4, 8, 8, generator=g, dtype=torch.float64) * 0.3
    states = [torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64) * 0.3 for _ in range(2)]
    training = layer.derived_weights()  # gradients on, parameters trainable
    assert training.w_in.requires_grad
    steps = []
    step = layer_module.lstmem_decode_step
    monkeypatch.setattr(layer_module, "lstmem_decode_step", lambda *a, **k: steps.append(1) or step(*a, **k))
    scanned = layer(x, *states, depth=depth, weights=training)
    assert not steps and scanned.read.requires_grad
    with torch.no_grad():
        stepped = layer(x, *states, depth=depth, weights=training)
        assert len(steps) == 1
        cached = layer(x, *states, depth=depth)  # the cached inference weights: the step
        assert len(steps) == 2
    for name in ("read", "cell", "hidden", "hidden_seq"):
        for got in (stepped, cached):
            torch.testing.assert_close(
                getattr(scanned, name).detach(), getattr(got, name), rtol=1e-12, atol=1e-12
            )
    assert_close_to_reference(stepped, reference(layer, x, depth, *states), atol=1e-12, rtol=1e-12)


def test_the_decode_member_is_chosen_once_and_again_when_the_layer_moves(monkeypatch):
    """The member of ``lstmem_decode_step`` a layer steps on is chosen when it is built, not per
    token: tokens ask nothing; a new backend, dtype (``.double()``) or device (a parameter replaced
    as accelerate loads a meta-device model) choose again, once, and the choice follows."""
    chosen, used = [], []
    choose, step = layer_module.decode_backend, layer_module.lstmem_decode_step
    monkeypatch.setattr(layer_module, "decode_backend", lambda *a, **k: chosen.append(1) or choose(*a, **k))
    monkeypatch.setattr(
        layer_module, "lstmem_decode_step", lambda *a, **k: used.append(k["backend"]) or step(*a, **k)
    )
    layer = make_layer(seed=7)
    layer.set_depth_input(False)
    assert len(chosen) == 2  # at construction: the member without and with feedback samples
    x, states = torch.randn(2, 1, D_MODEL), (torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8))
    for _ in range(3):
        _block(layer, x, states, aux=False)
        _block(layer, x, states)
    assert len(chosen) == 2 and used == ["torch"] * 6
    layer.backend = "naive"
    for _ in range(2):
        _block(layer, x, states, aux=False)
    assert len(chosen) == 4 and used[-2:] == ["naive"] * 2
    layer.backend = "triton"  # the choice alone: the Triton member gives way for float64 and samples
    assert (layer.decode_member(), layer.decode_member(samples=True)) == ("triton", "torch")
    layer.double()
    assert layer.decode_member() == "torch" and len(chosen) == 8
    for _ in range(2):
        _block(layer, x.double(), [t.double() for t in states], aux=False)
    assert len(chosen) == 8 and used[-2:] == ["torch"] * 2
    layer.backend = "auto"
    layer.decode_member()
    layer._parameters["w_in"] = torch.nn.Parameter(layer.w_in.detach().to("meta"))
    assert layer.decode_member() == "torch" and len(chosen) == 12  # the meta device: chosen again
    assert layer.decode_member() == "torch" and len(chosen) == 12


def test_importing_the_layer_registers_no_process_wide_hook():
    """The optimizer hook that keeps cached weights current is registered by the first layer that
    caches them (decoding without gradients), not by importing the module."""
    import subprocess
    import sys

    script = (
        "from torch.optim import optimizer as o\n"
        "before = len(o._global_optimizer_post_hooks)\n"
        "import lstmem_peft.memory.layer as m\n"
        "import torch\n"
        "assert len(o._global_optimizer_post_hooks) == before, 'registered at import'\n"
        "layer = m.LSTMemLayer(hidden_size=16, query_size=16, num_heads=2, head_dim=4, layer_idx=0)\n"
        "with torch.no_grad():\n"
        "    layer.derived_weights()\n"
        "assert len(o._global_optimizer_post_hooks) == before + 1\n"
        "with torch.no_grad():\n"
        "    m.LSTMemLayer(hidden_size=16, query_size=16, num_heads=2, head_dim=4, layer_idx=1).derived_weights()\n"
        "assert len(o._global_optimizer_post_hooks) == before + 1, 'registered twice'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
