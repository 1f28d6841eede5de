"""The decode-step family (``lstmem_decode_step``: a float64 reference, a PyTorch and a Triton
member behind one signature): the reference against the paper's token loop, each member against the
reference, the PyTorch and Triton members against each other, on state slots too, and the caller's
states never written without slots.

Tolerances. The reference computes in float64 (unit roundoff 2^-53), so it agrees with the paper's
float64 token loop to ~1e-12 on these order-one values. The other members compute in float32 (unit
roundoff u = 2^-24 ~ 6e-8): each output is the end of a chain of at most a few dot products (the
projection over ``d`` <= 64 inputs, the ``eau`` map over <= 4 d_s = 128 terms, the read over d_s)
and a few elementwise functions, so its error is a few times ``n u`` times the sum of the terms'
magnitudes: ``d u`` ~ 4e-6 for the largest sum here, on values of order one. ``atol = rtol = 5e-5``
allows ten times that. bfloat16 layer inputs (``x``, ``depth``; the weights stay float32, as a
serving engine runs a float32 adapter on bfloat16 activations) are exact in float32 and float64, so
the members see the same values and the float32 tolerance still holds. The Triton kernel's
error is bounded tightly, per element, in tests/test_decode_step_kernel.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from decode_steps import step

from lstmem_kernels import lstmem_decode_step, triton_available
from lstmem_kernels.step.decode_torch import step_maps
from lstmem_peft import LSTMemLayer
from lstmem_peft.memory import constants as K
from lstmem_peft.memory.reference import memory_layer_ref

D, H, R, B, S = 24, 2, 4, 3, 6  # d, n_h, r, batch rows, state-table rows
TOL = dict(atol=5e-5, rtol=5e-5)  # float32 against float64 (module docstring)
EXACT = dict(atol=1e-12, rtol=1e-12)  # float64 against float64


def make_layer(depth: bool, seed: int = 0) -> LSTMemLayer:
    """A layer with every parameter moved off its initialisation; ``W_dq = (r / alpha) I`` and
    ``query_size = d_s``, so the paper reference's ``delta_q`` is the read ``u`` itself."""
    torch.manual_seed(seed)
    layer = LSTMemLayer(D, H * R, num_heads=H, head_dim=R)
    layer.set_depth_input(depth)
    with torch.no_grad():
        for p in layer.parameters():
            if p is not layer.w_in:
                p.add_(0.3 * torch.randn_like(p))
        layer.w_dq.copy_(torch.eye(H * R) / layer.scale)
    return layer


def make_inputs(depth: bool, valid: bool, dtype=torch.float32, rows: int = B, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(B, D, generator=g).to(dtype),
        "cell": torch.randn(rows, H, R, R, generator=g),
        "hidden": torch.randn(rows, H, R, R, generator=g),
        "depth": (0.5 * torch.randn(B, H, R, R, generator=g)).to(dtype) if depth else None,
        "valid": torch.tensor([True, False, True]) if valid else None,
    }


def paper(layer, inputs):
    """``u``, ``C_t``, ``D_t`` of the paper's float64 token loop (``memory_layer_ref``)."""
    dep, valid = inputs["depth"], inputs["valid"]
    with torch.no_grad():
        ref = memory_layer_ref(
            layer.paper_parameters(),
            inputs["x"][:, None],
            inputs["cell"],
            inputs["hidden"],
            None if dep is None else dep[:, None],
            None if valid is None else valid[:, None],
            num_heads=H,
            alpha=layer.alpha,
        )
    return ref.delta_q[:, 0], ref.cell, ref.hidden


FLAGS = [
    pytest.param(depth, valid, id=f"{'depth' if depth else 'no-depth'}-{'valid' if valid else 'all'}")
    for depth in (False, True)
    for valid in (False, True)
]
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@pytest.mark.parametrize("depth, valid", FLAGS)
def test_the_reference_is_the_papers_token_loop(depth, valid):
    """The float64 member against ``memory_layer_ref``, and ``D_t`` also in ``hidden_seq``; the
    caller's states are not written."""
    layer = make_layer(depth).double()
    inputs = _double(make_inputs(depth, valid))
    before = {n: t.clone() for n, t in inputs.items() if t is not None}
    u, (cell, hidden), seq, _ = step(layer, inputs, "naive")
    assert all(torch.equal(inputs[n], t) for n, t in before.items())
    want_u, want_c, want_h = paper(layer, inputs)
    torch.testing.assert_close(u, want_u, **EXACT)
    torch.testing.assert_close(cell, want_c, **EXACT)
    torch.testing.assert_close(hidden, want_h, **EXACT)
    torch.testing.assert_close(seq, want_h.float())


@pytest.mark.parametrize("depth, valid", FLAGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pytorch_member_matches_the_reference(depth, valid, dtype):
    """Float32 weights, float32 or bfloat16 inputs: within the float32 tolerance of the reference on
    the same weights and inputs; padded rows keep their states bit for bit; samples agree too."""
    layer = make_layer(depth)
    inputs = make_inputs(depth, valid, dtype)
    u, (cell, hidden), seq, found = step(layer, inputs, "torch", samples=True)
    want_u, (want_c, want_h), want_seq, want_found = step(layer, inputs, "naive", samples=True)
    assert u.dtype == torch.float32 and want_u.dtype == torch.float32
    torch.testing.assert_close(u.float(), want_u.float(), **TOL)
    torch.testing.assert_close(cell, want_c, **TOL)
    torch.testing.assert_close(hidden, want_h, **TOL)
    torch.testing.assert_close(seq, want_seq, **TOL)
    for a, b in zip(found, want_found, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **TOL)
    if valid:
        padded = ~inputs["valid"]
        assert torch.equal(cell[padded], inputs["cell"][padded])
        assert torch.equal(hidden[padded], inputs["hidden"][padded])


@needs_triton
@pytest.mark.parametrize("depth, valid", FLAGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_member_matches_the_reference_and_the_pytorch_member(depth, valid, dtype):
    """The Triton kernel (``TRITON_INTERPRET=1`` without a GPU) against the reference and the
    PyTorch member, within the float32 tolerance."""
    layer = make_layer(depth)
    inputs = make_inputs(depth, valid, dtype)
    got = step(layer, inputs, "triton")
    for backend in ("naive", "torch"):
        want = step(layer, inputs, backend)
        torch.testing.assert_close(got[0].float(), want[0].float(), **TOL)
        for a, b in zip((*got[1], got[2]), (*want[1], want[2]), strict=True):
            torch.testing.assert_close(a, b, **TOL)


SLOTS = {"naive": [4, 0, -1], "torch": [4, 0, 2], "triton": [4, 0, -1]}  # -1: a padding row


@pytest.mark.parametrize("backend", ["naive", "torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("depth, valid", FLAGS)
def test_slots_step_the_table_rows_in_place_like_the_gathered_rows(backend, depth, valid):
    """With ``slots`` the tables are their own outputs: the stepped rows are the reference's step of
    the gathered rows, a read-only row (``valid`` False) and the rows of no sequence (a negative
    slot's too: the members that take it) stay bit for bit."""
    layer = make_layer(depth)
    slots = torch.tensor(SLOTS[backend])
    inputs = make_inputs(depth, valid, rows=S)
    u, (cells, hiddens), seq, _ = step(layer, inputs, backend, slots=slots)
    real = slots >= 0
    gathered = dict(
        inputs, cell=inputs["cell"][slots.clamp_min(0)], hidden=inputs["hidden"][slots.clamp_min(0)]
    )
    gathered["cell"][~real] = 0  # a padding row steps zero states
    gathered["hidden"][~real] = 0
    want_u, (want_c, want_h), want_seq, _ = step(copy.deepcopy(layer).double(), _double(gathered), "naive")
    stepped = [
        int(s) for s, v in zip(slots, inputs["valid"] if valid else [True] * B, strict=True) if s >= 0 and v
    ]
    rows = [i for i, s in enumerate(slots.tolist()) if s >= 0]
    torch.testing.assert_close(u[rows], want_u[rows].float(), **TOL)
    torch.testing.assert_close(seq[rows], want_seq[rows], **TOL)
    torch.testing.assert_close(cells[slots[rows]], want_c[rows].float(), **TOL)
    torch.testing.assert_close(hiddens[slots[rows]], want_h[rows].float(), **TOL)
    untouched = [i for i in range(S) if i not in stepped]
    assert torch.equal(cells[untouched], inputs["cell"][untouched])
    assert torch.equal(hiddens[untouched], inputs["hidden"][untouched])


def _double(inputs: dict) -> dict:
    return {n: t if t is None or not t.is_floating_point() else t.double() for n, t in inputs.items()}


@pytest.mark.parametrize("backend", ["naive", "torch", pytest.param("triton", marks=needs_triton)])
def test_without_slots_the_callers_states_and_inputs_are_never_written(backend):
    layer = make_layer(True)
    inputs = make_inputs(True, True)
    before = {n: t.clone() for n, t in inputs.items() if t is not None}
    with torch.no_grad():
        w = layer.weights()
        out = (torch.empty_like(inputs["cell"]), torch.empty_like(inputs["hidden"]))
        args = {n: inputs[n] for n in ("depth", "valid")}
        lstmem_decode_step(
            inputs["x"], *w.step_weights(True), inputs["cell"], inputs["hidden"],
            num_heads=H, out=out, norm_eps=K.NORM_EPS, backend=backend, **args,
        )  # fmt: skip
    assert all(torch.equal(inputs[n], t) for n, t in before.items())


def test_the_pytorch_members_maps_are_built_once_and_again_when_a_weight_changes():
    """The PyTorch member keeps its step maps while the same weight tensors come unchanged; an in-place
    write (its version counter moves) or another tensor builds them again; inference tensors (a
    serving engine's) are kept too."""
    layer = make_layer(True)
    with torch.no_grad():
        w = layer.weights()
        first = step_maps(w.eau_depth, w.b_eau, w.read, H)
        assert step_maps(w.eau_depth, w.b_eau, w.read, H) is first
        w.b_eau.add_(1.0)
        again = step_maps(w.eau_depth, w.b_eau, w.read, H)
        assert again is not first and torch.equal(again.bias[: R * H], w.b_eau[: R * H])
        other = w.read.clone()
        assert step_maps(w.eau_depth, w.b_eau, other, H) is not again
    with torch.inference_mode():  # inference tensors have no version counter: kept by identity
        w = layer.weights()
        assert step_maps(w.eau_first, w.b_eau, w.read, H) is step_maps(w.eau_first, w.b_eau, w.read, H)


def test_the_triton_member_returns_no_samples_and_float64_is_the_pytorch_members():
    from lstmem_kernels import decode_backend

    x = torch.zeros(1, D)
    assert decode_backend("triton", x, torch.float32) == "triton"
    assert decode_backend("triton", x, torch.float32, samples=True) == "torch"
    assert decode_backend("triton", x, torch.float64) == "torch"
    assert decode_backend("naive", x, torch.float32, samples=True) == "naive"
    if triton_available():
        with pytest.raises(ValueError, match="no feedback samples"):
            step(make_layer(False), make_inputs(False, False), "triton", samples=True)


@pytest.mark.parametrize("backend", ["naive", "torch", pytest.param("triton", marks=needs_triton)])
def test_state_tables_may_share_one_buffer(backend):
    """A serving engine's two state tables may interleave their rows in one buffer (vLLM's state
    layout): with ``slots`` they are their own outputs, and the step is that of separate tables."""
    layer = make_layer(True)
    inputs = make_inputs(True, True, rows=S)
    slots = torch.tensor([4, 0, 2])
    buffer = torch.stack([inputs["cell"], inputs["hidden"]], 1)  # (S, 2, n_h, r, r)
    shared = dict(inputs, cell=buffer[:, 0], hidden=buffer[:, 1])
    with torch.no_grad():
        w = layer.weights()
        lstmem_decode_step(
            inputs["x"], *w.step_weights(True), shared["cell"], shared["hidden"], num_heads=H,
            out=(shared["cell"], shared["hidden"]), depth=inputs["depth"], valid=inputs["valid"],
            norm_eps=K.NORM_EPS, slots=slots, backend=backend,
        )  # fmt: skip
    _, (cells, hiddens), _, _ = step(layer, inputs, backend, slots=slots)
    assert torch.equal(buffer[:, 0], cells) and torch.equal(buffer[:, 1], hiddens)


def test_a_layer_on_the_meta_device_steps_without_a_false_overlap():
    """A model laid out on the meta device (accelerate's big-model loading, the sharded tests) has no
    memory, so every tensor's address is 0: the overlap check must not read that as the new states
    overlapping the inputs. The step gives a meta ``u`` of the right shape."""
    layer = make_layer(True).to("meta")
    inputs = {n: None if t is None else t.to("meta") for n, t in make_inputs(True, True).items()}
    with torch.no_grad():
        w = layer.weights()
        out = (torch.empty_like(inputs["cell"]), torch.empty_like(inputs["hidden"]))
        u = lstmem_decode_step(
            inputs["x"], *w.step_weights(True), inputs["cell"], inputs["hidden"],
            num_heads=H, out=out, depth=inputs["depth"], valid=inputs["valid"], norm_eps=K.NORM_EPS,
            backend="torch",
        )  # fmt: skip
    assert u.is_meta and tuple(u.shape) == (B, H * R)


def test_a_layers_step_checks_the_shapes_but_not_the_overlaps_of_the_states_it_made(monkeypatch):
    """A memory layer's decode step allocates its new states itself (``fresh_out=True``), so the
    op skips the overlap check, the costly part of checking a call, and checks the shapes at every
    token: a state of the wrong batch still fails loudly through the layer. A caller's own ``out``
    is compared with the inputs at every call, however many calls passed before."""
    from lstmem_kernels.step import ops

    counts = {"shapes": 0, "overlaps": 0}
    for name in counts:
        real = getattr(ops, f"_check_decode_{name}")
        monkeypatch.setattr(
            ops,
            f"_check_decode_{name}",
            lambda *a, _f=real, _n=name: counts.update({_n: counts[_n] + 1}) or _f(*a),
        )
    layer = make_layer(True)
    inputs = make_inputs(True, True)
    x, depth, valid = inputs["x"][:, None], inputs["depth"][:, None], inputs["valid"][:, None]
    with torch.no_grad():
        for _ in range(3):
            layer(x, inputs["cell"], inputs["hidden"], depth=depth, valid=valid, aux=False)
        assert counts == {"shapes": 3, "overlaps": 0}
        with pytest.raises(ValueError, match=r"cell has shape \(2, 2, 4, 4\), expected \(3, 2, 4, 4\)"):
            layer(x, inputs["cell"][:2], inputs["hidden"][:2], depth=depth, valid=valid)
        w = layer.weights()

        def call(out):
            lstmem_decode_step(
                inputs["x"], *w.step_weights(True), inputs["cell"], inputs["hidden"], num_heads=H,
                out=out, depth=inputs["depth"], valid=inputs["valid"], norm_eps=K.NORM_EPS, backend="torch",
            )  # fmt: skip

        good = (torch.empty_like(inputs["cell"]), torch.empty_like(inputs["hidden"]))
        call(good)
        call(good)
        with pytest.raises(ValueError, match="cell_out overlaps the memory of cell"):
            call((inputs["cell"], good[1]))
    assert counts == {"shapes": 7, "overlaps": 3}


def test_the_overlap_check_reads_spans_of_contiguous_and_strided_tensors():
    """``_overlap`` on views of one buffer: touching blocks do not overlap, shared elements do, and a
    strided view overlaps what lies between its elements (its span), as a contiguous one does."""
    from lstmem_kernels.step.ops import _overlap

    buffer = torch.zeros(64)
    first, second = buffer[:32], buffer[32:]
    assert not _overlap(first, second) and not _overlap(second, first)
    assert _overlap(buffer[:33], second) and _overlap(buffer[16:48], first)
    assert not _overlap(first, torch.zeros(32))
    strided = buffer[:48:2]  # elements 0, 2, ..., 46
    assert not strided.is_contiguous()
    assert _overlap(strided, buffer[40:41].view(1)) and not _overlap(strided, buffer[47:])
    table = buffer.view(4, 16)
    assert _overlap(table[1:3].reshape(2, 4, 4), buffer[35:36]) and not _overlap(table[1:3], buffer[48:])
