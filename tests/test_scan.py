"""The vectorised scan and decode step against the naive token loop, forward and backward."""

import pytest
import torch

from lstmem_kernels import (
    lstmem_scan,
    lstmem_step,
    scan_naive,
    scan_parallel,
    step_naive,
    step_torch,
    triton_available,
)


def make_inputs(B, T, H=4, R=8, dtype=torch.float32, depth=True, padding=None, initial=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, kind="randn"):
        x = torch.randn(*shape, generator=g) if kind == "randn" else torch.rand(*shape, generator=g)
        return x.to(dtype)

    args = dict(
        q=rnd(B, T, H, R),
        k=rnd(B, T, H, R),
        w=rnd(B, T, H, R),
        f=rnd(B, T, H, R, kind="rand"),
        o=rnd(B, T, H, R, kind="rand"),
        depth=rnd(B, T, H, R, R) if depth else None,
        valid=None,
        initial_cell=rnd(B, H, R, R) if initial else None,
        initial_hidden=rnd(B, H, R, R) if initial else None,
    )
    if padding == "left":
        valid = torch.ones(B, T, dtype=torch.bool)
        for b in range(B):
            valid[b, : (b * T) // (B + 1)] = False
        args["valid"] = valid
    elif padding == "random":
        args["valid"] = torch.rand(B, T, generator=g) > 0.3
        args["valid"][-1] = False  # an all-padding row
    return args


def grads_of(fn, args):
    args = {
        k: (v.detach().clone().requires_grad_(v.is_floating_point()) if v is not None else None)
        for k, v in args.items()
    }
    read, hidden, cell_T, hidden_T = fn(**args)
    g = torch.Generator().manual_seed(1)
    loss = sum(
        (t.double() * torch.randn(t.shape, generator=g, dtype=torch.float64)).sum()
        for t in (read, hidden, cell_T, hidden_T)
    )
    loss.backward()
    outs = (read, hidden, cell_T, hidden_T)
    grads = {k: v.grad for k, v in args.items() if v is not None and v.is_floating_point()}
    return outs, grads


CASES = [
    dict(B=1, T=1),
    dict(B=2, T=63, padding="left"),
    dict(B=3, T=63, padding="random", depth=False),
    dict(B=2, T=100, initial=False),
    dict(B=1, T=2049, H=2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_parallel_matches_naive_fp32(case):
    args = make_inputs(**case)
    ref_args = {k: (v.double() if v is not None and v.is_floating_point() else v) for k, v in args.items()}
    ref_out, ref_grads = grads_of(scan_naive, ref_args)
    out, grads = grads_of(scan_parallel, args)
    for a, b in zip(out, ref_out, strict=True):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-5)
    for name in ref_grads:
        torch.testing.assert_close(grads[name].double(), ref_grads[name], atol=2e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_parallel_matches_naive_bf16(case):
    args = make_inputs(dtype=torch.bfloat16, **case)
    ref_args = {k: (v.double() if v is not None and v.is_floating_point() else v) for k, v in args.items()}
    ref_out = scan_naive(**ref_args)
    out = scan_parallel(**args)
    for a, b in zip(out, ref_out, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), b, atol=3e-2, rtol=2e-2)


def test_float64_is_exact_to_rounding():
    args = make_inputs(2, 200, dtype=torch.float64, padding="random")
    for a, b in zip(scan_parallel(**args), scan_naive(**args), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_padding_carries_states_and_matches_the_unpadded_run():
    args = make_inputs(1, 40, padding=None)
    valid = torch.ones(1, 40, dtype=torch.bool)
    valid[0, :10] = False
    padded = scan_parallel(**{**args, "valid": valid})
    alone = scan_parallel(
        **{
            k: (v[:, 10:] if k not in ("initial_cell", "initial_hidden") and v is not None else v)
            for k, v in args.items()
        }
    )
    torch.testing.assert_close(padded[1][:, 10:], alone[1])
    torch.testing.assert_close(padded[2], alone[2])
    # the padded prefix reads and carries the initial state
    assert torch.equal(padded[1][:, :10], args["initial_hidden"][:, None].expand(1, 10, 4, 8, 8))


def test_extreme_gates_stay_finite():
    args = make_inputs(1, 300)
    args["f"] = torch.where(
        torch.rand_like(args["f"]) > 0.5, torch.zeros_like(args["f"]), torch.ones_like(args["f"])
    )
    for a, b in zip(scan_parallel(**args), scan_naive(**args), strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _step_case(state_dtype, with_valid, with_depth):
    """One decode step's inputs (3 rows, the second padded when ``with_valid``), states in
    ``state_dtype``, and the naive step's ``(read, cell, hidden)`` computed in float32 on copies."""
    args = make_inputs(3, 1)
    x = {k: args[k][:, 0] for k in ("q", "k", "w", "f", "o")}
    cell = args["initial_cell"].to(state_dtype)
    hidden = args["initial_hidden"].to(state_dtype)
    depth = args["depth"][:, 0] if with_depth else None
    valid = torch.tensor([True, False, True]) if with_valid else None
    ref_c, ref_h = (t.to(torch.float32, copy=True) for t in (cell, hidden))
    ref_read = step_naive(**x, cell=ref_c, hidden=ref_h, depth=depth, valid=valid)
    return x, cell, hidden, depth, valid, (ref_read, ref_c, ref_h)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_valid", [False, True])
@pytest.mark.parametrize("with_depth", [False, True])
def test_step_matches_naive_in_place(state_dtype, with_valid, with_depth):
    """Every decode-step member updates the states in place and returns the read."""
    x, cell, hidden, depth, valid, (ref_read, ref_c, ref_h) = _step_case(state_dtype, with_valid, with_depth)
    c, h = cell.clone(), hidden.clone()
    read = step_torch(**x, cell=c, hidden=h, depth=depth, valid=valid)
    assert c.dtype == state_dtype and h.dtype == state_dtype
    torch.testing.assert_close(read, ref_read, atol=1e-5, rtol=1e-5)
    # float32 states: float32 rounding of one step; bf16 states: plus one bf16 rounding of the result
    tol = dict(atol=1e-5, rtol=1e-5) if state_dtype == torch.float32 else dict(atol=1e-2, rtol=2**-8)
    torch.testing.assert_close(c.float(), ref_c, **tol)
    torch.testing.assert_close(h.float(), ref_h, **tol)
    if with_valid:
        assert torch.equal(c[1], cell[1]) and torch.equal(h[1], hidden[1])


@pytest.mark.parametrize("backend", ["torch", "naive", "triton"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_valid", [False, True])
@pytest.mark.parametrize("with_depth", [False, True])
def test_step_into_out_leaves_the_states_and_equals_the_in_place_step(
    backend, state_dtype, with_valid, with_depth
):
    """``lstmem_step(..., out=(cell_out, hidden_out))``: the new states land in ``out`` (float32), the
    input states are untouched, padded rows get the old states, and the read and states equal the
    naive in-place step's (the Triton member under ``TRITON_INTERPRET=1`` on a CPU)."""
    if backend == "triton" and not triton_available():
        pytest.skip("Triton is not installed")
    x, cell, hidden, depth, valid, (ref_read, ref_c, ref_h) = _step_case(state_dtype, with_valid, with_depth)
    before = (cell.clone(), hidden.clone())
    out = (torch.full_like(ref_c, float("nan")), torch.full_like(ref_h, float("nan")))
    read = lstmem_step(**x, cell=cell, hidden=hidden, depth=depth, valid=valid, backend=backend, out=out)
    assert torch.equal(cell, before[0]) and torch.equal(hidden, before[1])
    torch.testing.assert_close(read, ref_read, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0], ref_c, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], ref_h, atol=1e-5, rtol=1e-5)
    if with_valid:
        assert torch.equal(out[0][1], cell[1].float()) and torch.equal(out[1][1], hidden[1].float())


@pytest.mark.parametrize("backend", ["torch", "naive", "triton"])
def test_a_step_without_a_query_reads_nothing_and_writes_the_same_states(backend):
    """``lstmem_step(q=None, ...)`` (a caller that took the read itself): no read comes back, and the
    new states equal those of the step with its query, on every member."""
    if backend == "triton" and not triton_available():
        pytest.skip("Triton is not installed")
    x, cell, hidden, depth, valid, _ = _step_case(torch.float32, True, True)
    outs = []
    for query in (x["q"], None):
        out = (torch.empty_like(cell), torch.empty_like(hidden))
        read = lstmem_step(
            **{**x, "q": query}, cell=cell, hidden=hidden, depth=depth, valid=valid, backend=backend, out=out
        )
        assert (read is None) == (query is None)
        outs.append(out)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("with_valid", [False, True])
@pytest.mark.parametrize("backend", ["torch", "naive", "triton"])
def test_a_step_given_rows_and_columns_writes_the_same_states(backend, with_valid):
    """``k`` as rows ``(B, H, 1, R)`` and ``w, f, o`` as columns ``(B, H, R, 1)`` (what a memory
    layer's step has as views): the same states, bit for bit, as the ``(B, H, R)`` vectors, on
    every member, with padding and without."""
    if backend == "triton" and not triton_available():
        pytest.skip("Triton is not installed")
    x, cell, hidden, depth, valid, _ = _step_case(torch.float32, with_valid, True)
    shaped = {**x, "q": None, "k": x["k"].unsqueeze(-2)}
    shaped.update({name: x[name].unsqueeze(-1) for name in ("w", "f", "o")})
    outs = []
    for args in ({**x, "q": None}, shaped):
        out = (torch.empty_like(cell), torch.empty_like(hidden))
        lstmem_step(**args, cell=cell, hidden=hidden, depth=depth, valid=valid, backend=backend, out=out)
        outs.append(out)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_scan_of_one_token_equals_step():
    args = make_inputs(2, 1)
    read, hidden, cell_T, hidden_T = lstmem_scan(**args)
    x = {k: args[k][:, 0] for k in ("q", "k", "w", "f", "o")}
    c, h = args["initial_cell"].clone(), args["initial_hidden"].clone()
    r = lstmem_step(**x, cell=c, hidden=h, depth=args["depth"][:, 0])
    torch.testing.assert_close(read[:, 0], r)
    torch.testing.assert_close(cell_T, c)
    torch.testing.assert_close(hidden_T, h)


def test_the_step_refuses_autograd_and_names_the_scan():
    args = make_inputs(2, 1)
    x = {k: args[k][:, 0] for k in ("q", "k", "w", "f", "o")}
    x["q"] = x["q"].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="lstmem_scan"):
        lstmem_step(**x, cell=args["initial_cell"].clone(), hidden=args["initial_hidden"].clone())
    with torch.no_grad():  # without autograd it runs
        lstmem_step(**x, cell=args["initial_cell"].clone(), hidden=args["initial_hidden"].clone())


def test_dispatch_validates_arguments():
    args = make_inputs(1, 4)
    with pytest.raises(ValueError, match="backend"):
        lstmem_scan(**args, backend="cuda")
    with pytest.raises(ValueError, match="k must have"):
        lstmem_scan(**{**args, "k": args["k"][:, :2]})
    with pytest.raises(ValueError, match="valid must have"):
        lstmem_scan(**{**args, "valid": torch.ones(1, 3, dtype=torch.bool)})


@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
def test_parallel_is_exact_for_every_chunk_length(chunk):
    args = make_inputs(2, 37, dtype=torch.float64, padding="left")
    for a, b in zip(scan_parallel(**args, chunk=chunk), scan_naive(**args), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
