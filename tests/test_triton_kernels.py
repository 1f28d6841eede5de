"""The Triton scan and decode step against the naive token loop, forward and backward.

Without a GPU the kernels run on CPU tensors under the Triton interpreter (``conftest.py`` sets
``TRITON_INTERPRET=1``), which costs milliseconds per time step and program, so the long-sequence
case uses a single ``(batch, head)`` pair.
"""

from functools import partial

import pytest
import torch

pytest.importorskip("triton")

from lstmem_kernels.scan.chunked import scan_triton  # noqa: E402
from lstmem_kernels.scan.naive import scan_naive, scan_naive_pieces  # noqa: E402
from lstmem_kernels.step.fused import step_triton  # noqa: E402
from lstmem_kernels.step.naive import step_naive  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOAT_NAMES = ("q", "k", "w", "f", "o", "depth", "initial_cell", "initial_hidden")
# (atol, rtol) against the float64 reference, atol scaled by the reference's largest magnitude
# (at least 1); bf16/fp16 tolerances cover the rounding of the stored outputs and gradients (and
# of the stored hidden states the backward reads).
# They hold for a GPU's arithmetic (tests/gpu_arithmetic.py emulates it: ex2.approx and div.full 2
# ulps off, fused multiply-adds, bf16 rounded to nearest even). With u = 2^-24, float32's 1e-5 is 168 u:
# each step rounds C_t = f C_{t-1} + w k^T twice (about 2 u |C_t|) and multiplies the error carried
# from earlier steps by f < 1, so the carried error is a geometric sum of per-step errors that does not
# grow with T (the gates here, sigmoid(2 z), average 1/2); tanh(C) adds at most 10 u (derived beside
# TANH_ERR in test_decode_step_kernel.py); reads, chunk summaries and adjoints sum r such terms: tens of
# u times the scale. bf16's 2e-2 is 10 units of 2^-9: one rounding of each stored output or gradient,
# and of the stored D_{t-1} in the sum that gives grad q; fp16's 4e-3 is 8 units of 2^-11 (its casts
# round to nearest in both). Worst error / tolerance over this file (2026-11-27, 2-core CPU,
# LSTMEM_TOLERANCE_RATIOS=1), emulated (either direction) and not: float32 0.13 and 0.05 (T = 2049:
# 0.07 and 0.02), bf16 0.12 and 0.22 (the interpreter truncates to bf16), fp16 0.07 and 0.07.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


def make_valid(B, T, generator):
    """Row 0: left padding plus holes; row 1: all valid; row 2: all padding; others: random."""
    valid = torch.rand(B, T, generator=generator) > 0.25
    valid[0, : T // 4] = False
    if B > 1:
        valid[1] = True
    if B > 2:
        valid[2] = False
    return valid


def make_inputs(B, T, H, R, dtype, depth=True, valid=True, initial=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype)

    def gate(*shape):
        return torch.sigmoid(2.0 * torch.randn(*shape, generator=g)).to(dtype)

    inputs = dict(
        q=randn(B, T, H, R),
        k=randn(B, T, H, R),
        w=randn(B, T, H, R),
        f=gate(B, T, H, R),
        o=gate(B, T, H, R),
        depth=randn(B, T, H, R, R, scale=0.5) if depth else None,
        valid=make_valid(B, T, g) if valid else None,
        initial_cell=randn(B, H, R, R) if initial else None,
        initial_hidden=randn(B, H, R, R) if initial else None,
    )
    return {name: None if x is None else x.to(DEVICE) for name, x in inputs.items()}


def run_with_grads(fn, inputs, ref_dtype, loss_terms):
    """Call ``fn`` on leaf copies of ``inputs`` (cast to ``ref_dtype`` if given) and backprop.

    The loss is a fixed random weighting of the outputs selected by ``loss_terms`` (indices into
    ``(read, hidden, final_cell, final_hidden)``). Returns the outputs and the input gradients
    (zeros for an input the selected outputs do not depend on).
    """
    leaves = {}
    for name, x in inputs.items():
        if x is not None and name in FLOAT_NAMES:
            x = (x if ref_dtype is None else x.to(ref_dtype)).detach().clone().requires_grad_()
        leaves[name] = x
    outputs = fn(**leaves)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(out.shape, generator=g, dtype=torch.float64).to(DEVICE) for out in outputs]
    loss = sum((outputs[i].double() * weights[i]).sum() for i in loss_terms)
    loss.backward()
    grads = {
        name: torch.zeros_like(x) if x.grad is None else x.grad
        for name, x in leaves.items()
        if name in FLOAT_NAMES and x is not None
    }
    return outputs, grads


def assert_close(actual, expected, dtype, name):
    atol, rtol = TOLERANCES[dtype]
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=atol * scale, rtol=rtol, msg=lambda m: f"{name}: {m}"
    )


SCAN_CASES = [
    # id, B, T, H, R, dtype, depth, valid, initial
    ("t1-all", 3, 1, 2, 8, torch.float32, True, True, True),
    ("t1-padded-r5", 2, 1, 1, 5, torch.float32, False, True, False),
    ("t1-bf16", 3, 1, 2, 8, torch.bfloat16, True, True, True),
    ("t63-all", 3, 63, 1, 8, torch.float32, True, True, True),
    ("t63-bf16-all", 2, 63, 1, 8, torch.bfloat16, True, True, True),
    ("t63-bf16-bare-r6", 2, 63, 1, 6, torch.bfloat16, False, False, False),
    ("t9-fp16-all", 3, 9, 1, 8, torch.float16, True, True, True),
    ("t2049-all", 1, 2049, 1, 8, torch.float32, True, True, True),
]


@pytest.mark.parametrize(  # the long sequence (thousands of interpreted steps) is in the slow tier
    "B, T, H, R, dtype, depth, valid, initial",
    [pytest.param(*c[1:], id=c[0], marks=pytest.mark.slow if c[2] > 1000 else ()) for c in SCAN_CASES],
)
def test_scan_matches_naive(B, T, H, R, dtype, depth, valid, initial):
    inputs = make_inputs(B, T, H, R, dtype, depth=depth, valid=valid, initial=initial)
    terms = (0, 1, 2, 3)
    out, grads = run_with_grads(scan_triton, inputs, None, terms)
    ref_out, ref_grads = run_with_grads(scan_naive_pieces, inputs, torch.float64, terms)
    for name, a, e in zip(("read", "hidden", "final_cell", "final_hidden"), out, ref_out, strict=True):
        assert a.dtype == dtype and a.shape == e.shape
        assert_close(a, e, dtype, name)
    assert grads.keys() == ref_grads.keys()
    for name, e in ref_grads.items():
        assert grads[name].dtype == dtype
        assert_close(grads[name], e, dtype, f"grad {name}")


@pytest.mark.parametrize("scan", [scan_naive, scan_triton], ids=["naive", "triton"])
def test_a_scan_resumed_from_its_final_states_equals_one_scan(scan):
    """Writing history block by block relies on it (and ``scan_naive_pieces`` on the naive scan)."""
    inputs = make_inputs(3, 10, 2, 8, torch.float32)
    whole = scan(**inputs)
    per_token = ("q", "k", "w", "f", "o", "depth", "valid")
    first = scan(**{n: x[:, :4] if n in per_token else x for n, x in inputs.items()})
    rest = {n: x[:, 4:] if n in per_token else x for n, x in inputs.items()}
    second = scan(**{**rest, "initial_cell": first[2], "initial_hidden": first[3]})
    for name, index in (("read", 0), ("hidden", 1)):
        assert_close(torch.cat([first[index], second[index]], 1), whole[index], torch.float32, name)
    assert_close(second[2], whole[2], torch.float32, "final_cell")
    assert_close(second[3], whole[3], torch.float32, "final_hidden")


@pytest.mark.parametrize(
    "terms", [(0,), (1,), (2,), (3,), (2, 3)], ids=["read", "hidden", "cell_T", "hidden_T", "finals"]
)
def test_scan_partial_losses(terms):
    """Outputs without a gradient reach the backward as ``None``; each term alone is checked."""
    inputs = make_inputs(2, 6, 2, 8, torch.float32)
    _, grads = run_with_grads(scan_triton, inputs, None, terms)
    _, ref_grads = run_with_grads(scan_naive_pieces, inputs, torch.float64, terms)
    for name, e in ref_grads.items():
        assert_close(grads[name], e, torch.float32, f"grad {name}")


def test_scan_without_grad_and_non_contiguous():
    inputs = make_inputs(2, 7, 3, 8, torch.float32)
    strided = {
        name: None if x is None or x.dim() < 4 else x.transpose(1, 2).contiguous().transpose(1, 2)
        for name, x in inputs.items()
    }
    strided["valid"] = inputs["valid"]
    strided["initial_cell"] = inputs["initial_cell"].transpose(-1, -2).contiguous().transpose(-1, -2)
    strided["initial_hidden"] = inputs["initial_hidden"]
    assert not strided["q"].is_contiguous() and not strided["initial_cell"].is_contiguous()
    with torch.no_grad():
        out = scan_triton(**strided)
        ref = scan_naive(**{n: x.double() if n in FLOAT_NAMES else x for n, x in inputs.items()})
    for a, e in zip(out, ref, strict=True):
        assert not a.requires_grad
        assert_close(a, e, torch.float32, "output")
    _, grads = run_with_grads(scan_triton, strided, None, (0, 1, 2, 3))
    _, ref_grads = run_with_grads(scan_naive_pieces, inputs, torch.float64, (0, 1, 2, 3))
    for name, e in ref_grads.items():
        assert_close(grads[name], e, torch.float32, f"grad {name}")


def test_scan_initial_state_dtype_differs():
    """Initial states may have their own float dtype; their gradients come back in it."""
    inputs = make_inputs(2, 5, 2, 8, torch.bfloat16)
    inputs["initial_cell"] = inputs["initial_cell"].float()
    _, grads = run_with_grads(scan_triton, inputs, None, (0, 1, 2, 3))
    _, ref_grads = run_with_grads(scan_naive_pieces, inputs, torch.float64, (0, 1, 2, 3))
    assert grads["initial_cell"].dtype == torch.float32
    for name, e in ref_grads.items():
        assert_close(grads[name], e, torch.bfloat16, f"grad {name}")


@pytest.mark.parametrize("initial", [False, True])
def test_scan_empty_sequence(initial):
    inputs = make_inputs(2, 0, 3, 8, torch.float32, initial=initial)
    read, hidden, cell_T, hidden_T = scan_triton(**inputs)
    assert read.shape == (2, 0, 3, 8) and hidden.shape == (2, 0, 3, 8, 8)
    if initial:
        assert torch.equal(cell_T, inputs["initial_cell"]) and torch.equal(hidden_T, inputs["initial_hidden"])
    else:
        assert not cell_T.any() and not hidden_T.any()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(k=torch.zeros(2, 4, 3, 7)), "k has shape"),
        (dict(depth=torch.zeros(2, 4, 3, 8)), "depth has shape"),
        (dict(valid=torch.ones(2, 4)), "valid must be a bool"),
        (dict(valid=torch.ones(2, 5, dtype=torch.bool)), "valid has shape"),
        (dict(f=torch.zeros(2, 4, 3, 8, dtype=torch.float64)), "f has dtype"),
        (dict(initial_hidden=torch.zeros(2, 3, 8)), "initial_hidden has shape"),
        (dict(initial_cell=torch.zeros(2, 3, 8, 8, dtype=torch.int32)), "floating point"),
    ],
    ids=["k-shape", "depth-shape", "valid-dtype", "valid-shape", "f-dtype", "state-shape", "state-dtype"],
)
def test_scan_rejects_bad_inputs(change, match):
    inputs = make_inputs(2, 4, 3, 8, torch.float32)
    inputs.update({name: x.to(DEVICE) for name, x in change.items()})
    with pytest.raises(ValueError, match=match):
        scan_triton(**inputs)


def test_scan_rejects_float64_and_bad_rank():
    inputs = make_inputs(1, 2, 1, 4, torch.float64)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        scan_triton(**inputs)
    with pytest.raises(ValueError, match=r"\(B, T, H, R\)"):
        scan_triton(*(torch.zeros(2, 3, 4, device=DEVICE) for _ in range(5)))


# The chunked parallel scan (module docstring of lstmem_kernels.scan.chunked): chunk lengths that cut
# the block into many chunks, padding runs across chunk ends, whole chunks of padding.
CHUNKED_CASES = [
    # id, B, T, H, R, dtype, chunk, depth, valid, initial
    ("t63-c4-all", 3, 63, 1, 8, torch.float32, 4, True, True, True),
    ("t63-c16-bare-r5", 2, 63, 2, 5, torch.float32, 16, False, False, False),
    ("t17-c1-all", 3, 17, 1, 8, torch.float32, 1, True, True, True),
    ("t63-c8-bf16-all", 2, 63, 1, 8, torch.bfloat16, 8, True, True, True),
    ("t9-c2-fp16-all", 3, 9, 1, 8, torch.float16, 2, True, True, True),
    ("t130-default-all", 2, 130, 1, 6, torch.float32, None, True, True, True),
]


@pytest.mark.parametrize(
    "B, T, H, R, dtype, chunk, depth, valid, initial",
    [pytest.param(*c[1:], id=c[0]) for c in CHUNKED_CASES],
)
def test_chunked_scan_matches_naive(B, T, H, R, dtype, chunk, depth, valid, initial):
    inputs = make_inputs(B, T, H, R, dtype, depth=depth, valid=valid, initial=initial)
    terms = (0, 1, 2, 3)
    out, grads = run_with_grads(partial(scan_triton, chunk=chunk), inputs, None, terms)
    ref_out, ref_grads = run_with_grads(scan_naive_pieces, inputs, torch.float64, terms)
    for name, a, e in zip(("read", "hidden", "final_cell", "final_hidden"), out, ref_out, strict=True):
        assert a.dtype == dtype and a.shape == e.shape
        assert_close(a, e, dtype, name)
    for name, e in ref_grads.items():
        assert grads[name].dtype == dtype
        assert_close(grads[name], e, dtype, f"grad {name}")


def test_chunked_scan_carries_states_over_chunks_of_padding():
    """Padding runs that cover whole chunks, cross chunk ends and end the block: the states (and
    their adjoints) pass through unchanged, in the forward and in the backward."""
    inputs = make_inputs(3, 40, 1, 8, torch.float32)
    valid = torch.ones(3, 40, dtype=torch.bool)
    valid[0, 5:23] = False  # chunks 1 to 4 of 4 tokens: two whole, two cut
    valid[1, 33:] = False  # the block ends in padding: the final states come from position 32
    valid[2, :17] = False  # the first four chunks are all padding
    inputs["valid"] = valid.to(DEVICE)
    terms = (0, 1, 2, 3)
    out, grads = run_with_grads(partial(scan_triton, chunk=4), inputs, None, terms)
    ref_out, ref_grads = run_with_grads(scan_naive_pieces, inputs, torch.float64, terms)
    for name, a, e in zip(("read", "hidden", "final_cell", "final_hidden"), out, ref_out, strict=True):
        assert_close(a, e, torch.float32, name)
    for name, e in ref_grads.items():
        assert_close(grads[name], e, torch.float32, f"grad {name}")
    torch.testing.assert_close(out[3][1], out[1][1, 32])  # D_T of row 1 is D at its last valid position


@pytest.mark.parametrize("terms", [(0,), (1,), (2, 3)], ids=["read", "hidden", "finals"])
def test_chunked_scan_partial_losses(terms):
    """Outputs without a gradient reach the chunked backward as ``None`` (its summaries skip them)."""
    inputs = make_inputs(2, 11, 2, 8, torch.float32)
    _, grads = run_with_grads(partial(scan_triton, chunk=3), inputs, None, terms)
    _, ref_grads = run_with_grads(scan_naive_pieces, inputs, torch.float64, terms)
    for name, e in ref_grads.items():
        assert_close(grads[name], e, torch.float32, f"grad {name}")


def test_the_result_does_not_depend_on_the_chunk_length():
    """Every chunk length gives the one-chunk (sequential) scan's result, to float32 rounding."""
    inputs = make_inputs(2, 24, 2, 8, torch.float32)
    with torch.no_grad():
        whole = scan_triton(**inputs, chunk=24)
        for chunk in (1, 5, 8, 23):
            for name, a, e in zip(
                ("read", "hidden", "cell", "hidden_T"), scan_triton(**inputs, chunk=chunk), whole, strict=True
            ):
                torch.testing.assert_close(
                    a, e, atol=2e-6, rtol=2e-6, msg=lambda m, c=chunk, n=name: f"{c} {n}: {m}"
                )


def test_the_paper_block_runs_in_parallel(monkeypatch):
    """At batch 1, n_h 4 and a 2,048-token block every launch runs at least 128 programs and no
    program walks more than 100 dependent steps (a sequential scan: 4 programs of 2,048 steps)."""
    from lstmem_kernels.scan import chunked as triton_scan

    launches = []

    class Recorder:
        """Stands in for a kernel: records the grid and the chunk plan, launches nothing."""

        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((self.name, grid, args[-5:]))

            return launch

    for name in ("_fwd_summary_kernel", "_fwd_replay_kernel", "_bwd_summary_kernel", "_bwd_replay_kernel"):
        monkeypatch.setattr(triton_scan, name, Recorder(name))
    inputs = make_inputs(1, 2048, 4, 8, torch.float32, valid=False)
    leaves = {n: x.requires_grad_() if n in FLOAT_NAMES and x is not None else x for n, x in inputs.items()}
    outputs = scan_triton(**leaves)
    sum(out.sum() for out in outputs).backward()

    assert [name for name, _, _ in launches] == [
        "_fwd_summary_kernel",
        "_fwd_replay_kernel",
        "_bwd_summary_kernel",
        "_bwd_replay_kernel",
    ]
    for name, grid, (T, H, R, L, NC) in launches:
        assert (T, H, R) == (2048, 4, 8)
        assert grid[0] * grid[1] >= 128, (name, grid)
        walk = L if "summary" in name else NC - 1 + L  # the replay first scans the chunks before it
        assert walk <= 100, (name, L, NC)
    assert triton_scan.chunk_length(2048) == 32


def test_chunk_length_rule():
    from lstmem_kernels.scan.chunked import SINGLE_CHUNK_MAX, chunk_length

    assert chunk_length(1) == 1 and chunk_length(SINGLE_CHUNK_MAX) == SINGLE_CHUNK_MAX  # one chunk
    for T in (SINGLE_CHUNK_MAX + 1, 2048, 2049, 8192, 131072):
        L = chunk_length(T)
        assert 16 <= L <= 1024 and L & (L - 1) == 0
        assert -(-T // L) - 1 + L <= 3 * T**0.5  # the longest walk grows as sqrt(T)
    assert chunk_length(10**9) == 1024


@pytest.mark.parametrize("chunk", [0, -3, 2.0, True])
def test_scan_rejects_a_bad_chunk_length(chunk):
    inputs = make_inputs(1, 4, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        scan_triton(**inputs, chunk=chunk)


STEP_CASES = [
    # id, B, H, R, dtype, state dtype, depth, valid
    ("fp32", 3, 2, 8, torch.float32, torch.float32, True, True),
    ("fp32-bare-r5", 2, 3, 5, torch.float32, torch.float32, False, False),
    ("bf16-states", 4, 2, 8, torch.float32, torch.bfloat16, True, True),
    ("bf16-all", 3, 4, 8, torch.bfloat16, torch.bfloat16, False, True),
    ("fp16-fp32-states", 2, 2, 8, torch.float16, torch.float32, True, False),
]


@pytest.mark.parametrize(
    "B, H, R, dtype, state_dtype, depth, valid", [c[1:] for c in STEP_CASES], ids=[c[0] for c in STEP_CASES]
)
@pytest.mark.parametrize("transposed_state", [False, True], ids=["contiguous", "strided"])
def test_step_matches_naive(B, H, R, dtype, state_dtype, depth, valid, transposed_state):
    seq = make_inputs(B, 1, H, R, dtype, depth=depth, valid=valid)
    args = {
        name: None if x is None else x[:, 0]
        for name, x in seq.items()
        if name not in ("initial_cell", "initial_hidden")
    }
    cell = seq["initial_cell"].to(state_dtype)
    hidden = seq["initial_hidden"].to(state_dtype)
    if transposed_state:
        cell = cell.transpose(-1, -2).contiguous().transpose(-1, -2)
        hidden = hidden.transpose(0, 1).contiguous().transpose(0, 1)
    cell_before, hidden_before = cell.clone(), hidden.clone()
    ref_cell, ref_hidden = cell.double(), hidden.double()
    ref_args = {n: x.double() if x is not None and x.is_floating_point() else x for n, x in args.items()}
    ref_read = step_naive(**ref_args, cell=ref_cell, hidden=ref_hidden)
    pointers = (cell.data_ptr(), hidden.data_ptr())

    read = step_triton(**args, cell=cell, hidden=hidden)

    assert (cell.data_ptr(), hidden.data_ptr()) == pointers and cell.dtype == state_dtype
    assert read.dtype == dtype and read.shape == (B, H, R)
    assert_close(read, ref_read, dtype, "read")
    assert_close(cell, ref_cell, state_dtype, "cell")
    assert_close(hidden, ref_hidden, state_dtype, "hidden")
    if valid:
        padded = ~args["valid"]
        assert padded.any()
        assert torch.equal(cell[padded], cell_before[padded])
        assert torch.equal(hidden[padded], hidden_before[padded])


def test_step_chain_matches_scan():
    """Running the step token by token reproduces the scan outputs and final states."""
    inputs = make_inputs(2, 5, 2, 8, torch.float32)
    with torch.no_grad():
        read, hidden, cell_T, hidden_T = scan_triton(**inputs)
    cell, state = inputs["initial_cell"].clone(), inputs["initial_hidden"].clone()
    for t in range(5):
        token = (inputs[n][:, t] for n in "qkwfo")
        r = step_triton(*token, cell, state, inputs["depth"][:, t], inputs["valid"][:, t])
        torch.testing.assert_close(r, read[:, t], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(state, hidden[:, t], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cell, cell_T, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, hidden_T, atol=1e-6, rtol=1e-6)


def test_step_rejects_grad_and_bad_shapes():
    seq = make_inputs(2, 1, 2, 8, torch.float32)
    args = [seq[n][:, 0] for n in "qkwfo"]
    cell, hidden = seq["initial_cell"], seq["initial_hidden"]
    with pytest.raises(RuntimeError, match="not differentiable"):
        step_triton(args[0].requires_grad_(), *args[1:], cell, hidden)
    with torch.no_grad():
        step_triton(*args, cell, hidden)
    args[0] = args[0].detach()
    with pytest.raises(ValueError, match="hidden has shape"):
        step_triton(*args, cell, hidden[:, :1])
    with pytest.raises(ValueError, match="valid has shape"):
        step_triton(*args, cell, hidden, valid=torch.ones(3, dtype=torch.bool, device=DEVICE))
