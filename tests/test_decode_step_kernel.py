"""The fused decode step of one memory layer (``lstmem_decode_step``, Triton: one launch) against the
paper's float64 reference and the layer's own PyTorch step, its launch count, and its refusals.

Without a GPU the kernel runs on CPU tensors under the Triton interpreter (``conftest.py`` sets
``TRITON_INTERPRET=1``), so the shapes stay small; the largest ones (``d_s = 256``) are in the slow
tier.

Tolerances are a float32 error bound (:func:`float32_error_bound`) computed from the data, never a
constant: every dot product of ``n`` terms is within ``gamma(n) = n u / (1 - n u)``
(``u = 2^-24``) of the exact one relative to the sum of its terms' magnitudes, each elementwise
function adds a few units of rounding, and the errors of a stage are carried through the next ones
with the largest slope of each function near its exact argument. The bound drops only terms of
order ``u`` times an error; the assertions allow twice it.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from decode_steps import decode_slots, run_step
from launch_count import count_launches_and_ops

from lstmem_kernels import decode_backend, lstmem_decode_step
from lstmem_peft import LSTMemLayer
from lstmem_peft.memory import constants as K
from lstmem_peft.memory.reference import memory_layer_ref

triton = pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
U32 = 2.0**-24  # float32 unit roundoff
# absolute error of the kernels' inline tanh = 2 / (1 + exp(-2x)) - 1 and sigmoid = 1 / (1 + exp(-x)) with
# a GPU's arithmetic (tests/gpu_arithmetic.py): exp(y) is ex2.approx of t = y log2(e) rounded to float32,
# so 2.5 ulps (5 u) plus |y| 1.22 u relative; division is div.full, 2.5 ulps of the quotient. Through
# the slopes (d tanh = sech^2(x) / 2 de / e, d sigmoid = s (1 - s) de / e): tanh within 3 u (exp) + 2 u
# (1 + e rounded) + 5 u (a quotient below 2) = 10 u, the sigmoid within 1.5 u + u + 2.5 u = 5 u. Both
# emulated over x in [-12, 12] (2026-11-27): at most 10.0 u and 3.9 u (3.0 u and 1.5 u with the CPU's
# IEEE operations). The 1.6x slack of TANH_ERR also covers n(.): with sqrt.approx (2^-23) and div.full
# its rounding is up to (r / 2 + 7) u |q|, beyond the bound's gamma(r + 3) |q| by at most 4 u, while the
# bound carries at least 2 * 6 u * sqrt(r) / ||t|| >= 12 u more of the tanh error than there is.
TANH_ERR, SIGMOID_ERR = 16 * U32, 8 * U32
MARGIN = 2.0  # room for the terms of order u * error the bound drops


# ---------------------------------------------------------------------- layers, inputs, the error bound
def make_layer(d, num_heads, head_dim, *, seed=0, grid=True, depth_input=True):
    """A layer with every parameter moved off its initialisation; ``query_size = d_s`` and ``W_dq =
    (r / alpha) I``, so the reference's ``delta_q`` is the read ``u`` itself.

    ``grid``: the maps that :meth:`LSTMemLayer.weights` multiplies together (``W~_gate``, ``W~_pred``,
    ``b_pred``, ``b_gate``) are rounded to multiples of 1/64 in [-2, 2], so that their products and
    sums (multiples of 1/4096 below 2^10) are exact in float32: the float32 derived weights are then
    exactly the paper's maps, and the only error left is the kernel's.
    """
    ds = num_heads * head_dim
    torch.manual_seed(seed)
    layer = LSTMemLayer(d, ds, num_heads=num_heads, head_dim=head_dim)
    layer.set_depth_input(depth_input)
    with torch.no_grad():
        for p in layer.parameters():
            if (
                p is not layer.w_in
            ):  # W_q, W_k, W_v, W_x keep their random Kaiming values (order-1 projections)
                p.add_(0.3 * torch.randn_like(p))
        layer.w_dq.copy_(torch.eye(ds) / layer.scale)
        if grid:
            for p in (layer.w_gate, layer.w_pred, layer.b_pred, layer.b_gate):
                if p is not None:
                    p.copy_((p * 64).round().clamp(-128, 128) / 64)
    return layer


def make_inputs(B, d, H, R, *, depth, valid, dtype=torch.float32, state_dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, d, generator=g).to(dtype)
    cell = torch.randn(B, H, R, R, generator=g).to(state_dtype)
    hidden = torch.randn(B, H, R, R, generator=g).to(state_dtype)
    dep = (0.5 * torch.randn(B, H, R, R, generator=g)).to(dtype) if depth else None
    keep = None
    if valid:
        keep = torch.ones(B, dtype=torch.bool)
        keep[1::2] = False  # every other row is padding
    return {
        "x": x.to(DEVICE),
        "cell": cell.to(DEVICE),
        "hidden": hidden.to(DEVICE),
        "depth": None if dep is None else dep.to(DEVICE),
        "valid": None if keep is None else keep.to(DEVICE),
    }


def weights(layer, *, depth):
    """The op's weight arguments from the layer's derived weights (``eau_depth`` with a depth input,
    else ``eau_first``)."""
    with torch.no_grad():
        w = layer.weights()
    eau = w.eau_depth if depth else w.eau_first
    return {"w_in": w.w_in, "b_in": w.b_in, "eau": eau, "b_eau": w.b_eau, "read": w.read}


def run_op(wts, inputs, num_heads):
    """The Triton member into fresh outputs (float64 for float64 states, else float32): ``u``,
    ``C_t`` and ``D_t``."""
    u, (cell, hidden), _, _ = run_step(tuple(wts.values()), inputs, "triton", num_heads=num_heads)
    return u, cell, hidden


def layer_step_float64(layer, w, inputs):
    """``u``, ``C_t``, ``D_t`` of the layer's PyTorch forward for one token, in float64, with the
    derived weights ``w`` given (so a bfloat16 adapter's maps are evaluated exactly as derived)."""
    dep, keep = inputs["depth"], inputs["valid"]
    exact = copy.deepcopy(layer).double()
    exact.backend = "torch"
    with torch.no_grad():
        out = exact(
            inputs["x"][:, None].double(),
            inputs["cell"].double(),
            inputs["hidden"].double(),
            depth=None if dep is None else dep[:, None].double(),
            valid=None if keep is None else keep[:, None],
            weights=type(w)(*(t.double() for t in w)),
            aux=False,
        )
    return out.read.reshape(out.read.shape[0], -1), out.cell, out.hidden


def reference(layer, inputs):
    """``u``, ``C_t``, ``D_t`` of the paper's float64 token loop (``delta_q = u``, see make_layer)."""
    dep, valid = inputs["depth"], inputs["valid"]
    with torch.no_grad():
        ref = memory_layer_ref(
            layer.paper_parameters(),
            inputs["x"][:, None],
            inputs["cell"],
            inputs["hidden"],
            None if dep is None else dep[:, None],
            None if valid is None else valid[:, None],
            num_heads=layer.num_heads,
            alpha=layer.alpha,
        )
    return ref.delta_q[:, 0], ref.cell, ref.hidden


def gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def float32_error_bound(wts, inputs, num_heads, u_store=0.0):
    """A bound on ``|float32 evaluation - exact|`` of ``u``, ``C_t``, ``D_t``, elementwise, for the
    step with the weights ``wts`` (as the kernel gets them) on ``inputs``.

    Stage by stage (``|.|`` elementwise, ``E`` the bound carried so far, values in float64; a smooth
    function's error is its largest slope within ``E`` of the exact argument times ``E``)::

        proj:    gamma(d + 1) (|x| |w_in| + |b_in|)
        t=tanh:  max tanh' on [proj - E, proj + E] E_proj + TANH_ERR
        q = n(t): 2 ||E_t||_2 / (||t||_2 - ||E_t||_2) per head + gamma(r + 3) |q|  (squares, sqrt, division)
        reads:   gamma(r) |D^(l-1)| |q| + |D^(l-1)| E_q
        eau:     gamma(K + 1) (|in| |eau| + |b_eau|) + E_in |eau|
        gates:   max sigmoid' on [a - E, a + E] E_a + SIGMOID_ERR
        C_t:     the products f C and (i e) k (cross terms E E included), gamma(2) for their two roundings
        D_t:     o tanh(C_t) + g D^(l-1) alike, tanh's slope as above
        r_time:  gamma(r) |D| |q| + |D| E_q
        u:       gamma(d_s + 1) (|r_time| |read| + |u_dep|) + E_rtime |read| + E_udep + u_store |u|

    Float64 states are rounded to float32 when loaded (``u |C|``, ``u |D|``); ``u_store`` is the unit
    roundoff of ``u``'s dtype when it is narrower than float32. Rows where ``valid`` is ``False`` keep
    their states exactly (bound 0). Dropped: terms of order ``u E``, relatively ``2^-24`` smaller.
    """
    w = {n: t.double() for n, t in wts.items()}
    x = inputs["x"].double()
    B, d = x.shape
    ds = w["read"].shape[1]
    H, R = num_heads, ds // num_heads
    dep = None if inputs["depth"] is None else inputs["depth"].double()
    C, D = inputs["cell"].double(), inputs["hidden"].double()
    state_in = U32 if inputs["cell"].dtype == torch.float64 else 0.0  # loaded into float32
    a = torch.abs

    def tanh_slope(v, err):  # largest tanh' on [v - err, v + err]
        return 1 - torch.tanh((a(v) - err).clamp_min(0)) ** 2

    def sigmoid_slope(v, err):
        s = torch.sigmoid((a(v) - err).clamp_min(0))
        return s * (1 - s)

    def product(v, e_v, y, e_y):  # error of v * y from the errors of v and y, and its rounding
        return a(v) * e_y + e_v * a(y) + e_v * e_y + U32 * a(v * y)

    proj = x @ w["w_in"] + w["b_in"]
    e_proj = gamma(d + 1) * (a(x) @ a(w["w_in"]) + a(w["b_in"]))
    pre_qk, e_pre_qk = proj[:, : 2 * ds].view(B, H, 2, R), e_proj[:, : 2 * ds].view(B, H, 2, R)
    t = torch.tanh(pre_qk)
    e_t = tanh_slope(pre_qk, e_pre_qk) * e_pre_qk + TANH_ERR
    norm, e_norm = t.norm(dim=-1, keepdim=True), e_t.norm(dim=-1, keepdim=True)
    qk = t / norm.clamp_min(K.NORM_EPS)
    e_qk = 2 * e_norm / (norm - e_norm).clamp_min(1e-300) + gamma(R + 3) * a(qk)
    s, e_s = proj[:, 2 * ds :], e_proj[:, 2 * ds :]
    if dep is None:
        inp, e_inp = s, e_s
    else:
        per_head = lambda m, v: torch.einsum("bhac,bhpc->bhpa", m, v).reshape(B, 2 * ds)  # noqa: E731
        reads = per_head(dep, qk)
        e_reads = gamma(R) * per_head(a(dep), a(qk)) + per_head(a(dep), e_qk)
        inp, e_inp = torch.cat([s, reads], 1), torch.cat([e_s, e_reads], 1)
    W = w["eau"][: inp.shape[1]]
    eau = inp @ W + w["b_eau"]
    e_eau = gamma(inp.shape[1] + 1) * (a(inp) @ a(W) + a(w["b_eau"])) + e_inp @ a(W)
    e, pre, u_dep = eau.split([ds, 4 * ds, ds], 1)
    e_e, e_pre, e_udep = e_eau.split([ds, 4 * ds, ds], 1)
    i, f, o, g = torch.sigmoid(pre).view(B, 4, H, R).unbind(1)
    e_gates = sigmoid_slope(pre, e_pre) * e_pre + SIGMOID_ERR
    e_i, e_f, e_o, e_g = e_gates.view(B, 4, H, R).unbind(1)
    e, e_e = e.view(B, H, R), e_e.view(B, H, R)
    q, k = qk.unbind(2)
    e_q, e_k = e_qk.unbind(2)
    ie, e_ie = i * e, product(i, e_i, e, e_e)
    col = lambda v: v[..., None]  # noqa: E731  (one value per row of a state)
    row = lambda v: v[..., None, :]  # noqa: E731  (one value per column)
    e_C0 = state_in * a(C)
    fC, e_fC = col(f) * C, product(col(f), col(e_f), C, e_C0)
    iek, e_iek = col(ie) * row(k), product(col(ie), col(e_ie), row(k), row(e_k))
    C_new = fC + iek
    e_C = e_fC + e_iek + U32 * a(C_new)
    tanh_c = torch.tanh(C_new)
    e_tanh = tanh_slope(C_new, e_C) * e_C + TANH_ERR
    D_new = col(o) * tanh_c
    e_D = product(col(o), col(e_o), tanh_c, e_tanh)
    if dep is not None:
        D_new = D_new + col(g) * dep
        e_D = e_D + product(col(g), col(e_g), dep, 0.0) + U32 * a(D_new)
    e_D0 = state_in * a(D)
    per_row = lambda m, v: torch.einsum("bhac,bhc->bha", m, v).reshape(B, ds)  # noqa: E731
    r_time = per_row(D, q)
    e_rt = gamma(R) * per_row(a(D), a(q)) + per_row(a(D) + e_D0, e_q) + per_row(e_D0, a(q))
    Wr = w["read"][:ds]
    u = u_dep + r_time @ Wr
    e_u = gamma(ds + 1) * (a(r_time) @ a(Wr) + a(u_dep)) + e_rt @ a(Wr) + e_udep + u_store * a(u)
    if inputs["valid"] is not None:
        padded = ~inputs["valid"].view(B, 1, 1, 1)
        e_C, e_D = e_C.masked_fill(padded, 0.0), e_D.masked_fill(padded, 0.0)
    return e_u, e_C, e_D


def assert_within(got, want, bound, name, scale=MARGIN):
    """``|got - want| <= scale * bound`` elementwise, reporting the worst ratio."""
    err = (got.double() - want.double()).abs()
    ratio = (err / (scale * bound).clamp_min(1e-300)).max().item()
    assert ratio <= 1.0, f"{name}: max error {err.max().item():.3g} is {ratio:.3g} x the allowed bound"


def assert_padding_kept(inputs, cell_out, hidden_out):
    """Padded rows get the caller's states bit for bit (in the outputs' dtype)."""
    valid = inputs["valid"]
    if valid is None:
        return
    padded = ~valid
    assert padded.any()
    assert torch.equal(cell_out[padded], inputs["cell"][padded].to(cell_out.dtype))
    assert torch.equal(hidden_out[padded], inputs["hidden"][padded].to(hidden_out.dtype))


# ---------------------------------------------------------------------- values
# The projection walks d in chunks of BLOCK_D = 64 when n_h r pads to 32 (8 when it pads to 256): d = 48
# is one partial chunk, 100 two, 300 five (the last partial), 128 two full ones, 130 seventeen.
CASES = [
    # id, B, d, n_h, r, depth, valid, input dtype (x, depth), state dtype
    ("depth-valid", 3, 48, 4, 8, True, True, torch.float32, torch.float32),
    ("no-depth", 2, 100, 4, 8, False, False, torch.float32, torch.float32),
    ("no-depth-valid-r6", 3, 40, 2, 6, False, True, torch.float32, torch.float32),
    ("depth-r6-h3-d300", 2, 300, 3, 6, True, True, torch.float32, torch.float32),
    ("bf16-inputs-and-states", 3, 128, 4, 8, True, True, torch.bfloat16, torch.bfloat16),
    ("fp16-inputs-fp64-states", 3, 33, 2, 4, True, True, torch.float16, torch.float64),
    ("d1-r1", 2, 1, 3, 1, True, True, torch.float32, torch.float32),
    ("paper-d2560", 2, 2560, 4, 8, True, True, torch.float32, torch.float32),
    ("ds256-r32", 2, 520, 8, 32, True, True, torch.float32, torch.float32),
    ("ds256-r4-h64", 2, 130, 64, 4, True, True, torch.bfloat16, torch.float32),
]
SLOW = {"ds256-r32", "ds256-r4-h64"}  # seconds under the interpreter


def cases():
    return [pytest.param(*c[1:], id=c[0], marks=pytest.mark.slow if c[0] in SLOW else ()) for c in CASES]


@pytest.mark.parametrize("B, d, H, R, depth, valid, dtype, state_dtype", cases())
def test_matches_the_paper_reference(B, d, H, R, depth, valid, dtype, state_dtype):
    """The Triton step against the float64 token loop of the paper (``memory_layer_ref``), within the
    float32 bound; padded rows keep their states exactly; the caller's states are not written."""
    layer = make_layer(d, H, R, depth_input=depth)
    wts = weights(layer, depth=depth)
    inputs = make_inputs(B, d, H, R, depth=depth, valid=valid, dtype=dtype, state_dtype=state_dtype)
    before = {n: t.clone() for n, t in inputs.items() if t is not None}
    out_dtype = torch.float64 if state_dtype == torch.float64 else torch.float32
    u, cell, hidden = run_op(wts, inputs, H)
    assert all(torch.equal(inputs[n], t) for n, t in before.items())
    assert u.dtype == torch.float32 and u.shape == (B, H * R) and cell.dtype == out_dtype
    want_u, want_c, want_h = reference(layer, inputs)
    e_u, e_c, e_h = float32_error_bound(wts, inputs, H)
    assert_within(u, want_u, e_u, "u")
    assert_within(cell, want_c, e_c, "cell")
    assert_within(hidden, want_h, e_h, "hidden")
    assert_padding_kept(inputs, cell, hidden)


@pytest.mark.parametrize("depth", [False, True], ids=["no-depth", "depth"])
@pytest.mark.parametrize("valid", [False, True], ids=["all-valid", "padded"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_matches_the_layers_pytorch_step(depth, valid, x_dtype):
    """Against ``LSTMemLayer.forward`` for one token without gradients (its decode step, PyTorch
    kernels), with unrounded weights: two float32 evaluations of the same derived weights, so each is
    within the bound of the exact value."""
    d, H, R, B = 56, 4, 8, 4
    layer = make_layer(d, H, R, grid=False, depth_input=depth)
    inputs = make_inputs(B, d, H, R, depth=depth, valid=valid, dtype=x_dtype)
    dep, keep = inputs["depth"], inputs["valid"]
    layer.backend = "torch"  # the recurrence's kernel (LSTMemConfig.scan_backend)
    with torch.no_grad():
        want = layer(
            inputs["x"][:, None],
            inputs["cell"],
            inputs["hidden"],
            depth=None if dep is None else dep[:, None],
            valid=None if keep is None else keep[:, None],
            aux=False,
        )
    wts = weights(layer, depth=depth)
    u, cell, hidden = run_op(wts, inputs, H)
    e_u, e_c, e_h = float32_error_bound(wts, inputs, H)
    assert_within(u, want.read.reshape(B, -1), e_u, "u", scale=2 * MARGIN)
    assert_within(cell, want.cell, e_c, "cell", scale=2 * MARGIN)
    assert_within(hidden, want.hidden, e_h, "hidden", scale=2 * MARGIN)
    assert_padding_kept(inputs, cell, hidden)


@pytest.mark.parametrize("eau", ["eau_first", "eau_depth"])
def test_bf16_weights_without_depth_take_either_map(eau):
    """A bfloat16 adapter (weights derived in bfloat16): against the float64 evaluation of the same
    weights (the layer's PyTorch forward in float64, itself tested against the paper reference);
    without a depth input the ``(4 d_s, 6 d_s)`` map works as well as the ``(2 d_s, 6 d_s)`` one."""
    d, H, R, B = 40, 4, 8, 3
    layer = make_layer(d, H, R, grid=False).bfloat16()
    with torch.no_grad():
        w = layer.weights()
    wts = {"w_in": w.w_in, "b_in": w.b_in, "eau": getattr(w, eau), "b_eau": w.b_eau, "read": w.read}
    inputs = make_inputs(B, d, H, R, depth=False, valid=True, dtype=torch.bfloat16)
    u, cell, hidden = run_op(wts, inputs, H)
    assert u.dtype == torch.bfloat16
    want_u, want_c, want_h = layer_step_float64(layer, w, inputs)
    e_u, e_c, e_h = float32_error_bound(wts, inputs, H, u_store=2.0**-8)
    assert_within(u, want_u, e_u, "u")
    assert_within(cell, want_c, e_c, "cell")
    assert_within(hidden, want_h, e_h, "hidden")
    assert_padding_kept(inputs, cell, hidden)


# ---------------------------------------------------------------------- one launch
@pytest.mark.parametrize("depth", [False, True], ids=["no-depth", "depth"])
def test_one_triton_launch_and_no_other_compute(depth):
    """One call: exactly one Triton kernel launch, and no aten operator besides allocations and views
    (no copy, cast, or contiguous of any input)."""
    d, H, R, B = 24, 2, 4, 2
    layer = make_layer(d, H, R, depth_input=depth)
    wts = weights(layer, depth=depth)
    inputs = make_inputs(B, d, H, R, depth=depth, valid=True, dtype=torch.bfloat16)
    out = (
        torch.empty_like(inputs["cell"], dtype=torch.float32),
        torch.empty_like(inputs["hidden"], dtype=torch.float32),
    )
    args = (inputs["x"], *wts.values(), inputs["cell"], inputs["hidden"])
    kw = dict(
        num_heads=H,
        depth=inputs["depth"],
        valid=inputs["valid"],
        out=out,
        norm_eps=K.NORM_EPS,
        backend="triton",
    )
    with torch.no_grad():
        with count_launches_and_ops() as counts:
            lstmem_decode_step(*args, **kw)
        assert counts.launches == ["_decode_step_kernel"], counts.launches
        assert counts.ops == [], counts.ops


# ---------------------------------------------------------------------- state slots, in place
def _slot_case(depth: bool, x_dtype=torch.float32):
    """A layer, 3 sequences whose states are rows 5, 0 and 3 of 7-row tables, the middle one
    read-only (``valid`` False), and their inputs."""
    d, H, R, S = 40, 4, 8, 7
    layer = make_layer(d, H, R, grid=False, depth_input=depth)
    g = torch.Generator().manual_seed(3)
    cells = torch.randn(S, H, R, R, generator=g).to(DEVICE)
    hiddens = torch.randn(S, H, R, R, generator=g).to(DEVICE)
    slots = torch.tensor([5, 0, 3], device=DEVICE)
    valid = torch.tensor([True, False, True], device=DEVICE)
    x = torch.randn(3, d, generator=g).to(x_dtype).to(DEVICE)
    dep = (0.5 * torch.randn(3, H, R, R, generator=g)).to(DEVICE) if depth else None
    return layer, cells, hiddens, slots, valid, x, dep


@pytest.mark.parametrize("depth", [False, True], ids=["no-depth", "depth"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_the_slot_step_updates_the_tables_in_place_like_the_gathered_pytorch_step(depth, x_dtype):
    """``lstmem_decode_step`` with slots, the Triton member (one launch reading and writing the
    slots where they are) against the PyTorch member (gather, step, scatter back): ``u``, ``D_t``
    and the stepped rows within the float32 bound, the read-only row and the rows of no sequence
    bit for bit unchanged."""
    layer, cells, hiddens, slots, valid, x, dep = _slot_case(depth, x_dtype)
    tables = {}
    for backend in ("torch", "triton"):
        layer.backend = backend
        c, h = cells.clone(), hiddens.clone()
        with torch.no_grad():
            u, seq = decode_slots(layer, x, c, h, slots, depth=dep, valid=valid)
        tables[backend] = (u, seq, c, h)
    u_t, seq_t, c_t, h_t = tables["torch"]
    u, seq, c, h = tables["triton"]
    wts = weights(layer, depth=depth)
    rows = {"x": x, "cell": cells[slots], "hidden": hiddens[slots], "depth": dep, "valid": valid}
    e_u, e_c, e_h = float32_error_bound(wts, rows, layer.num_heads)
    assert_within(u, u_t, e_u, "u", scale=2 * MARGIN)
    assert_within(c[slots], c_t[slots], e_c, "cell", scale=2 * MARGIN)
    assert_within(h[slots], h_t[slots], e_h, "hidden", scale=2 * MARGIN)
    assert_within(seq, seq_t, e_h, "hidden_seq", scale=2 * MARGIN)
    untouched = [i for i in range(cells.shape[0]) if i not in (5, 3)]  # slot 0 only reads
    for table, before in ((c, cells), (h, hiddens), (c_t, cells), (h_t, hiddens)):
        assert torch.equal(table[untouched], before[untouched])
    assert torch.equal(seq[1], hiddens[0]) and torch.equal(seq_t[1], hiddens[0])  # read-only: D_{t-1}


def test_a_negative_slot_is_padding_that_touches_no_state():
    """vLLM pads a CUDA graph's batch with slot ``-1``: such a row reads no table row and writes
    none (the tables' other rows, the last one included, stay bit for bit), and the real rows step
    exactly as they do without the padding."""
    layer, cells, hiddens, slots, valid, x, dep = _slot_case(True)
    layer.backend = "triton"
    pad = torch.tensor([-1], device=DEVICE)
    padded = dict(
        x=torch.cat([x, torch.randn_like(x[:1])]),
        slots=torch.cat([slots, pad]),
        depth=torch.cat([dep, dep[:1]]),
        valid=torch.cat([valid, torch.ones_like(valid[:1])]),  # the padding row "writes"
    )
    results = []
    for case in (dict(x=x, slots=slots, depth=dep, valid=valid), padded):
        c, h = cells.clone(), hiddens.clone()
        with torch.no_grad():
            u, seq = decode_slots(
                layer, case["x"], c, h, case["slots"], depth=case["depth"], valid=case["valid"]
            )
        results.append((u[:3], seq[:3], c, h))
    for plain, with_pad in zip(*results, strict=True):
        assert torch.equal(plain, with_pad)
    for table, before in zip(results[1][2:], (cells, hiddens), strict=True):
        untouched = [i for i in range(cells.shape[0]) if i not in (5, 3)]
        assert torch.equal(table[untouched], before[untouched])  # row -1 (the last) included


def test_the_slot_step_is_one_launch_and_no_copy_of_the_states():
    """With slots the Triton step gathers and scatters nothing: one launch, no aten operator besides
    allocations and views (the states never leave their tables)."""
    layer, cells, hiddens, slots, valid, x, dep = _slot_case(True)
    layer.backend = "triton"
    with torch.no_grad():
        decode_slots(layer, x, cells, hiddens, slots, depth=dep, valid=valid)  # derives the weights once
        with count_launches_and_ops() as counts:
            decode_slots(layer, x, cells, hiddens, slots, depth=dep, valid=valid)
    assert counts.launches == ["_decode_step_kernel"], counts.launches
    assert counts.ops == [], counts.ops


@pytest.mark.parametrize("depth", [False, True], ids=["no-depth", "depth"])
def test_the_pytorch_slot_step_costs_the_step_two_gathers_and_two_writes(depth):
    """The slot step on the PyTorch member (a serving engine on a CPU): the rows are gathered,
    stepped and written back, and nothing else: with every sequence writing (``valid=None``) and
    ``D_t`` made where it is wanted (a float32 ``hidden_seq``), the step's own 13 operators (15
    with a depth input) plus two gathers and two writes. The tables and ``D_t`` are those of the
    call given its own ``hidden_seq``, bit for bit."""
    layer, cells, hiddens, slots, _, x, dep = _slot_case(depth)
    layer.backend = "torch"
    with torch.no_grad():
        given = torch.empty(3, *cells.shape[1:])
        c, h = cells.clone(), hiddens.clone()
        u_given, seq_given = decode_slots(layer, x, c, h, slots, depth=dep, hidden_seq=given)
        assert seq_given is given
        with count_launches_and_ops() as counts:
            u, seq = decode_slots(layer, x, cells, hiddens, slots, depth=dep)
    step = 15 if depth else 13
    assert counts.ops.count("aten.index_select.default") == 2, counts.ops
    assert counts.ops.count("aten.index_copy_.default") == 2, counts.ops
    assert len(counts.ops) == step + 4, counts.ops
    assert seq.dtype == torch.float32
    assert torch.equal(u, u_given) and torch.equal(seq, seq_given)
    assert torch.equal(cells, c) and torch.equal(hiddens, h)


def test_only_slots_let_a_state_table_be_its_own_output():
    """Without slots an output that is an input is refused (the step reads while it writes); with
    slots the tables may be their own outputs, but not a shifted view of them."""
    args = _args()
    args["out"] = (args["cell"], args["hidden"])
    with pytest.raises(ValueError, match="only with slots= may a state table be its own output"):
        lstmem_decode_step(**args)
    args["slots"] = torch.tensor([1, 0], device=DEVICE)
    with torch.no_grad():
        lstmem_decode_step(**args)  # in place
    table = torch.zeros(3, *args["cell"].shape[1:], device=DEVICE)
    args.update(cell=table[:2], out=(table[1:], args["hidden"]))
    with pytest.raises(ValueError, match="cell_out overlaps the memory of cell"):
        lstmem_decode_step(**args)


# ---------------------------------------------------------------------- refusals
def _args(depth=True, dtype=torch.float32):
    d, H, R, B = 16, 2, 4, 2
    layer = make_layer(d, H, R)
    wts = {n: t.to(dtype) for n, t in weights(layer, depth=depth).items()}
    inputs = make_inputs(B, d, H, R, depth=depth, valid=True, dtype=dtype, state_dtype=dtype)
    out = (torch.empty_like(inputs["cell"]), torch.empty_like(inputs["hidden"]))
    return {
        **{"x": inputs["x"]},
        **wts,
        "cell": inputs["cell"],
        "hidden": inputs["hidden"],
        "num_heads": H,
        "depth": inputs["depth"],
        "valid": inputs["valid"],
        "out": out,
        "norm_eps": K.NORM_EPS,
        "backend": "triton",
    }


def test_float64_is_refused_naming_the_pytorch_path_and_a_float64_layer_never_asks_for_it():
    args = _args(dtype=torch.float64)
    with torch.no_grad(), pytest.raises(ValueError, match="decodes in PyTorch"):
        lstmem_decode_step(**args)
    assert decode_backend("triton", args["x"], torch.float64) == "torch"
    assert decode_backend("triton", args["x"], torch.float32) == "triton"
    assert decode_backend("triton", args["x"], torch.float32, samples=True) == "torch"  # feedback samples
    assert decode_backend("auto", args["x"], torch.float32) == "torch"  # CPU tensors: PyTorch


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {"x": a["x"][:, None]}, r"x must have shape \(B, d\)"),
        (lambda a: {"w_in": a["w_in"][:-1]}, "w_in has shape"),
        (lambda a: {"b_eau": a["b_eau"][:-1]}, "b_eau has shape"),
        (lambda a: {"eau": a["eau"][: a["eau"].shape[0] // 2]}, "eau has shape .*with a depth input"),
        (lambda a: {"read": a["read"][:-1]}, r"read must have shape \(2 d_s, d_s\)"),
        (lambda a: {"num_heads": 3}, "num_heads must be a positive int dividing"),
        (lambda a: {"cell": a["cell"][:1]}, "cell has shape"),
        (lambda a: {"depth": a["depth"][..., :-1]}, "depth has shape"),
        (lambda a: {"valid": a["valid"][:1]}, "valid has shape"),
        (lambda a: {"valid": a["valid"].float()}, "valid must be a bool tensor"),
        (lambda a: {"out": (a["out"][0],)}, "out must be a pair"),
        (lambda a: {"out": (a["out"][0][:1], a["out"][1])}, "cell_out has shape"),
        (lambda a: {"out": (a["cell"], a["out"][1])}, "cell_out overlaps the memory of cell"),
        (lambda a: {"out": (a["out"][0], a["depth"])}, "hidden_out overlaps the memory of depth"),
        (lambda a: {"b_in": a["b_in"].bfloat16()}, "b_in has dtype"),
        (lambda a: {"x": a["x"].int()}, "x has dtype"),
    ],
    ids=[
        "x-rank",
        "w_in",
        "b_eau",
        "eau-without-depth-rows",
        "read",
        "num_heads",
        "cell",
        "depth",
        "valid-shape",
        "valid-dtype",
        "out-pair",
        "out-shape",
        "out-is-cell",
        "out-is-depth",
        "weights-mixed-dtypes",
        "x-int",
    ],
)
def test_bad_inputs_are_refused(change, match):
    args = _args()
    args.update(change(args))
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        lstmem_decode_step(**args)


def test_autograd_is_refused():
    args = _args()
    args["w_in"] = args["w_in"].clone().requires_grad_()
    with pytest.raises(RuntimeError, match=r"no gradient.*torch\.no_grad\(\)"):
        lstmem_decode_step(**args)
    with torch.no_grad():
        lstmem_decode_step(**args)


# ---------------------------------------------------------------------- a model's decode step
def test_a_models_pytorch_decode_step_costs_at_most_seventeen_operators_per_memory_layer():
    """``model(...)`` on one token with a KV cache and memory, the PyTorch backend (the CPU default):
    what each memory layer adds to the plain backbone's step, operator by operator. The first memory
    layer (no depth input) adds 15, each layer above it 17 (its depth reads and ``g D^(l-1)``); the
    forward adds one (the cache's token count). The step reads ``D_{t-1}`` before it writes, so one
    product gives ``e``, the gate pre-activations and ``u`` whole, and one GLU the gates with ``i e``.
    Eager PyTorch runs each of these as its own kernel:
    fewer needs fusion (``scan_backend="triton"``: three launches per layer, the test below; or
    ``torch.compile`` inside ``traceable_memory()``, tests/test_compile.py)."""
    from tiny_models import make
    from transformers import DynamicCache

    from lstmem_peft import MemoryCache

    layers = 3
    model = make("qwen3", r=4, num_heads=2, layers_to_transform=list(range(layers)), scan_backend="torch")
    g = torch.Generator().manual_seed(0)
    prompt, token = torch.randint(3, 90, (2, 6), generator=g), torch.randint(3, 90, (2, 1), generator=g)

    def step(enabled):
        cache, kv = MemoryCache(), DynamicCache()
        with torch.no_grad():
            model(input_ids=prompt, memory_cache=cache, past_key_values=kv)
            adapter = contextlib.nullcontext() if enabled else model.disable_adapter()
            with count_launches_and_ops() as counts, adapter:
                model(input_ids=token, past_key_values=kv, **({"memory_cache": cache} if enabled else {}))
        return counts

    extra = list(step(True).ops)
    for op in step(False).ops:  # the plain backbone's own operators, once each
        extra.remove(op)
    assert not step(True).launches
    first, above = 15, 17
    assert len(extra) == first + above * (layers - 1) + 1, sorted(extra)
    # the products, per layer: the projections, [e | 1 | a | u], and the two corrections; one GLU
    assert extra.count("aten.addmm.default") == 4 * layers
    assert extra.count("aten.glu.default") == layers and "aten.sigmoid.default" not in extra


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_a_models_decode_step_costs_three_launches_per_memory_layer_and_gives_its_pytorch_tokens(padded):
    """``model(...)`` on one token with a KV cache and memory, the adapter's ``scan_backend="triton"``:
    each memory layer adds one Triton launch (the fused step) and two aten operators (``Δq`` and ``Δo``,
    each one ``addmm`` into its projection's output) to the plain backbone's step: three launches
    (and the forward adds one operator, the cache's token count).
    The logits and memory equal the PyTorch path's within float32 rounding."""
    from tiny_models import make
    from transformers import DynamicCache

    from lstmem_peft import MemoryCache

    layers = 3
    model = make("qwen3", r=4, num_heads=2, layers_to_transform=list(range(layers)), scan_backend="triton")
    g = torch.Generator().manual_seed(0)
    prompt, token = torch.randint(3, 90, (2, 6), generator=g), torch.randint(3, 90, (2, 1), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    if padded:
        mask[1, :2] = 0

    def step(backend, count=False, enabled=True):
        for memory in (m for name, m in model.named_modules() if type(m) is LSTMemLayer):
            memory.backend = backend
        cache, kv = MemoryCache(), DynamicCache()
        with torch.no_grad():
            model(input_ids=prompt, attention_mask=mask[:, :6], memory_cache=cache, past_key_values=kv)
            context = count_launches_and_ops() if count else contextlib.nullcontext()
            adapter = contextlib.nullcontext() if enabled else model.disable_adapter()
            with context as counts, adapter:
                kw = {"memory_cache": cache} if enabled else {}
                logits = model(input_ids=token, attention_mask=mask, past_key_values=kv, **kw).logits
        return logits, cache, counts

    fused, fused_cache, counts = step("triton", count=True)
    _, _, plain = step("triton", count=True, enabled=False)
    torch_logits, torch_cache, _ = step("torch")
    assert counts.launches == ["_decode_step_kernel"] * layers, counts.launches
    extra = list(counts.ops)
    for op in plain.ops:  # the plain backbone's own operators, once each
        extra.remove(op)
    # per memory layer: Δq and Δo; per forward, whatever the number of layers: the cache's token count
    assert sorted(extra) == ["aten.add.Tensor"] + ["aten.addmm.default"] * (2 * layers), extra
    torch.testing.assert_close(fused, torch_logits, atol=1e-5, rtol=1e-5)
    for a, b in zip(fused_cache.layers, torch_cache.layers, strict=True):
        torch.testing.assert_close(a.cell, b.cell, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.hidden, b.hidden, atol=1e-5, rtol=1e-5)
