"""The GPU acceptance run's kernel checks (:mod:`.acceptance`: ``kernel-scan``, ``kernel-step``,
``kernel-decode-step``): each Triton member of ``lstmem_kernels`` against its float64 reference and
its PyTorch member, outputs and gradients, case by case (:mod:`.cases`), on the kernel tests'
inputs (:func:`scan_inputs`: ``(B, T, H, R)`` vectors, ``(B, T, H, R, R)`` depth, ``(B, H, R, R)``
states); and how the Triton kernels run in this process (:func:`triton_mode`).
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable

import torch

from .cases import close_case, max_error


def _jit_kind(module) -> str | None:
    """How the ``@triton.jit`` functions of ``module`` run; ``None`` when it holds none."""
    kinds = {type(v).__name__ for v in vars(module).values()}
    if "InterpretedFunction" in kinds:
        return "interpreted"
    return "compiled" if "JITFunction" in kinds else None


def triton_mode() -> str:
    """``"compiled"`` or ``"interpreted"``: how the Triton kernels of ``lstmem_kernels`` run here; ``"mixed"``
    when Triton's own library functions were made before ``TRITON_INTERPRET`` was set (or after it was
    unset) and ours after: such kernels fail on their first call of ``tl.sigmoid`` and the like."""
    import triton.language.standard

    from lstmem_kernels.scan import chunked as triton_scan

    library = _jit_kind(triton.language.standard) or "compiled"
    ours = _jit_kind(triton_scan) or library
    return ours if ours == library else "mixed"


def scan_chunk_keyword() -> dict:
    """Whether ``scan_triton`` takes ``chunk=`` (``inspect.signature``), and its default."""
    from lstmem_kernels.scan.chunked import scan_triton

    parameter = inspect.signature(scan_triton).parameters.get("chunk")
    if parameter is None:
        return dict(takes_chunk=False, default=None)
    default = None if parameter.default is inspect.Parameter.empty else parameter.default
    return dict(takes_chunk=True, default=default)


FLOAT_INPUTS = ("q", "k", "w", "f", "o", "depth", "initial_cell", "initial_hidden")


def scan_inputs(B: int, T: int, H: int, R: int, dtype, device, seed: int = 0) -> dict:
    """The kernel tests' inputs, in words of our own: random ``q, k, w``, gates in (0, 1), a depth term,
    padding (row 0: a left-padded quarter and holes; row 1 all valid; row 2 all padding) and initial
    states; ``(B, T, H, R)`` vectors, ``(B, T, H, R, R)`` depth, ``(B, H, R, R)`` states."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype)

    def gate(*shape):
        return torch.sigmoid(2.0 * torch.randn(*shape, generator=g)).to(dtype)

    valid = torch.rand(B, T, generator=g) > 0.25
    valid[0, : T // 4] = False
    if B > 1:
        valid[1] = True
    if B > 2:
        valid[2] = False
    inputs = dict(
        q=normal(B, T, H, R),
        k=normal(B, T, H, R),
        w=normal(B, T, H, R),
        f=gate(B, T, H, R),
        o=gate(B, T, H, R),
        depth=normal(B, T, H, R, R, scale=0.5),
        valid=valid,
        initial_cell=normal(B, H, R, R),
        initial_hidden=normal(B, H, R, R),
    )
    return {n: x.to(device) for n, x in inputs.items()}


def outputs_and_grads(scan: Callable, inputs: dict, as_dtype=None) -> tuple[tuple, dict]:
    """``scan(**inputs)`` on leaf copies (cast to ``as_dtype`` if given), backpropagating a fixed random
    weighting of all four outputs; the outputs and every float input's gradient."""
    leaves = {}
    for name, x in inputs.items():
        if name in FLOAT_INPUTS and x is not None:
            x = (x if as_dtype is None else x.to(as_dtype)).detach().clone().requires_grad_()
        leaves[name] = x
    outputs = scan(**leaves)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device) for out in outputs]
    sum((out.double() * wt).sum() for out, wt in zip(outputs, weights, strict=True)).backward()
    grads = {
        n: (torch.zeros_like(x) if x.grad is None else x.grad) for n, x in leaves.items() if n in FLOAT_INPUTS
    }
    return tuple(o.detach() for o in outputs), grads


def check_scan(s: dict, device: torch.device, log=print) -> dict:
    """The Triton scan against the float64 token loop (``scan_naive_pieces``), outputs and gradients, case
    by case."""
    from lstmem_kernels.scan.chunked import scan_triton
    from lstmem_kernels.scan.naive import scan_naive_pieces

    H, R = s["heads"], s["rank"]
    chunking = scan_chunk_keyword()
    chunks: list[int | None] = [None]
    if chunking["takes_chunk"]:
        chunks = [s["small_chunk"], None]  # None: the function's default
    shapes = [(3 if T < 1000 else 1, T) for T in s["scan_lengths"]] + [(2, s["scan_block"])]
    cases = []
    for B, T in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            inputs = scan_inputs(B, T, H, R, dtype, device, seed=T)
            ref_out, ref_grads = outputs_and_grads(scan_naive_pieces, inputs, as_dtype=torch.float64)
            for chunk in chunks:
                kw = {} if chunk is None else {"chunk": chunk}
                label = f"B{B} T{T} {str(dtype)[6:]} chunk {chunk or 'default'}"
                out, grads = outputs_and_grads(lambda **x: scan_triton(**x, **kw), inputs)  # noqa: B023
                names = ("read", "hidden", "final_cell", "final_hidden")
                found = [
                    close_case(f"{label}: {n}", a, e, dtype)
                    for n, a, e in zip(names, out, ref_out, strict=True)
                ]
                found += [close_case(f"{label}: grad {n}", grads[n], e, dtype) for n, e in ref_grads.items()]
                cases += found
                log(f"kernel-scan: {label}: {'ok' if all(c['passed'] for c in found) else 'FAILED'}")
    return dict(cases=cases, chunk_keyword=chunking, triton=triton_mode())


def check_step(s: dict, device: torch.device, log=print) -> dict:
    """``lstmem_step(backend="triton")`` against ``backend="torch"`` and the float64 step (``step_naive``):
    the read and the new states, with and without depth and padding, float32 and bfloat16 states."""
    from lstmem_kernels import lstmem_step, step_naive

    H, R, B = s["heads"], s["rank"], s["step_batch"]
    cases = []
    for dtype, state_dtype, extras in (
        (torch.float32, torch.float32, True),
        (torch.float32, torch.bfloat16, True),
        (torch.bfloat16, torch.bfloat16, False),
        (torch.bfloat16, torch.float32, True),
    ):
        seq = scan_inputs(B, 1, H, R, dtype, device, seed=7)
        args = {n: seq[n][:, 0] for n in ("q", "k", "w", "f", "o")}
        if extras:
            args.update(depth=seq["depth"][:, 0], valid=seq["valid"][:, 0])
        label = (
            f"{str(dtype)[6:]} inputs, {str(state_dtype)[6:]} states, {'depth+padding' if extras else 'bare'}"
        )
        states = {}
        with torch.no_grad():
            for member in ("triton", "torch"):
                cell = seq["initial_cell"].to(state_dtype).clone()
                hidden = seq["initial_hidden"].to(state_dtype).clone()
                read = lstmem_step(**args, cell=cell, hidden=hidden, backend=member)
                states[member] = (read, cell, hidden)
            exact = {n: x.double() if x.is_floating_point() else x for n, x in args.items()}
            cell64, hidden64 = (
                seq["initial_cell"].to(state_dtype).double(),
                seq["initial_hidden"].to(state_dtype).double(),
            )
            read64 = step_naive(**exact, cell=cell64, hidden=hidden64)
        found = []
        for member, (read, cell, hidden) in states.items():
            found += [
                close_case(f"{label}: {member} read vs float64", read, read64, dtype),
                close_case(f"{label}: {member} cell vs float64", cell, cell64, state_dtype),
                close_case(f"{label}: {member} hidden vs float64", hidden, hidden64, state_dtype),
            ]
        for i, n in enumerate(("read", "cell", "hidden")):
            found.append(
                close_case(
                    f"{label}: triton {n} vs torch",
                    states["triton"][i],
                    states["torch"][i],
                    state_dtype if i else dtype,
                )
            )
        cases += found
        log(f"kernel-step: {label}: {'ok' if all(c['passed'] for c in found) else 'FAILED'}")
    return dict(cases=cases, triton=triton_mode())


def _decode_layer(d: int, H: int, R: int, depth: bool, device: torch.device, seed: int = 0):
    """A memory layer with every parameter moved off its initialisation (so every path carries signal)."""
    from lstmem_peft import LSTMemLayer

    torch.manual_seed(seed)
    layer = LSTMemLayer(d, H * R, num_heads=H, head_dim=R)
    layer.set_depth_input(depth)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return layer.to(device).eval()


def check_decode_step(s: dict, device: torch.device, log=print) -> dict:
    """``lstmem_decode_step(backend="triton")`` against the memory layer's own PyTorch step
    (``LSTMemLayer.forward`` on one token, ``backend="torch"``), both measured against that step in
    float64.

    Tolerance, per output (``u``, ``C_t``, ``D_t``): the kernel tests' float32 one (:data:`TOLERANCES`)
    at the largest error, or, where the step's own math loses more (a projection over ``d`` = 2560
    inputs, a normalisation), four times the PyTorch member's error: the fused kernel must be as
    accurate as the member it replaces, up to a factor of four for a different order of operations."""
    from lstmem_kernels import lstmem_decode_step
    from lstmem_peft.memory import constants

    H, R, B, d = s["heads"], s["rank"], s["step_batch"], s["decode_hidden"]
    cases = []
    for depth in (False, True):
        layer = _decode_layer(d, H, R, depth, device)
        exact = copy.deepcopy(layer).double()
        exact.backend = layer.backend = "torch"
        for x_dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(11)
            x = torch.randn(B, d, generator=g).to(x_dtype).to(device)
            cell = torch.randn(B, H, R, R, generator=g).to(device)
            hidden = torch.randn(B, H, R, R, generator=g).to(device)
            dep = (0.5 * torch.randn(B, H, R, R, generator=g)).to(device) if depth else None
            valid = (torch.arange(B) % 2 == 0).to(device)  # every other row is padding
            label = f"{'depth' if depth else 'no depth'}, x {str(x_dtype)[6:]}"
            with torch.no_grad():
                w = layer.derived_weights()
                out = (torch.empty_like(cell), torch.empty_like(hidden))
                u = lstmem_decode_step(
                    x, w.w_in, w.b_in, w.eau_depth if depth else w.eau_first, w.b_eau, w.read,
                    cell, hidden, num_heads=H, out=out, depth=dep, valid=valid, norm_eps=constants.NORM_EPS,
                    backend="triton",
                )  # fmt: skip
                kw = dict(depth=None if dep is None else dep[:, None], valid=valid[:, None], aux=False)
                member = layer(x[:, None], cell, hidden, **kw)
                kw64 = dict(kw, depth=None if dep is None else dep[:, None].double())
                ref = exact(x[:, None].double(), cell.double(), hidden.double(), **kw64)
            found = []
            pairs = (
                ("u", u, member.read.reshape(B, -1), ref.read.reshape(B, -1)),
                ("cell", out[0], member.cell, ref.cell),
                ("hidden", out[1], member.hidden, ref.hidden),
            )
            for name, fused, torch_step, exact_value in pairs:
                strict = close_case(f"{label}: {name}", fused, exact_value, torch.float32)
                member_error = max_error(torch_step, exact_value)
                error = strict.get("max_error", math.inf)
                found.append(
                    dict(
                        strict,
                        passed=strict["passed"] or error <= 4 * member_error,
                        tolerance=max(strict.get("tolerance", 0.0), 4 * member_error),
                        pytorch_member_error=member_error,
                    )
                )
            cases += found
            log(f"kernel-decode-step: {label}: {'ok' if all(c['passed'] for c in found) else 'FAILED'}")
    return dict(cases=cases, triton=triton_mode())
