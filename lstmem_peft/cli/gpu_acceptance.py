"""The GPU acceptance run: what works on one GPU, said by one short command.

    lstmem bench gpu --acceptance                 # on a CUDA machine: every check and timing, <= --budget-s
    lstmem bench gpu --acceptance --dry-run       # anywhere: the same steps at tiny sizes on CPU

Steps, in order (:data:`STEPS`), each isolated: a failure or an error is recorded and the next step
runs; each has its own time budget, and the whole run an overall deadline (``--budget-s``, default
480 s) after which the steps left are skipped with the reason.

Checks (pass or fail, each case with its largest error and its tolerance):

``kernel-scan``
    The Triton block scan (``lstmem_kernels.scan.chunked.scan_triton``), forward and backward, against
    the float64 token loop (``scan_naive``): float32 and bfloat16, padding, initial states, depth;
    T = 1, 63, 2049 and a 2,048-token block at the paper's n_h 4, r 8; with a small and the default
    chunk when the function takes a ``chunk=`` keyword. Tolerances: the kernel tests' (:data:`TOLERANCES`).
``kernel-step``
    ``lstmem_step(backend="triton")`` against its PyTorch member and the float64 step.
``kernel-decode-step``
    ``lstmem_decode_step`` (one Triton launch) against the memory layer's PyTorch step, both measured
    against the layer's float64 step.
``model-train-grads``
    Qwen3-4B's dimensions (random weights, nothing downloaded), the adapter moved off its
    initialisation: one training step (a history written with gradients, then an answer's loss) with
    the Triton kernels and with the PyTorch members; each member's adapter gradients against the same
    step in float32 (:func:`check_train_grads` derives the tolerance).
``model-generate-exact``
    The test suite's exactness contract of ``generate`` (tests/test_generation.py): each generated
    token's logits against one forward without a KV cache over prompt + tokens so far from the
    starting memory, and the final memory against that memory fed the tokens kept
    (:func:`check_generate_exact` derives the tolerance).
``pytest-kernels``
    When pytest is importable: ``pytest -q tests/test_triton_kernels.py tests/test_decode_step_kernel.py``
    in a child process with a time limit; its summary line.

Timings (``lstmem bench``'s helpers, few repetitions): ``time-write`` (history writing in 2,048-token
blocks against the plain prefill), ``time-scan`` (each scan member at T = 2048, forward and forward +
backward), ``time-decode-eager`` and ``time-decode-compiled`` (two KV lengths; the compiled one from a
static cache inside ``traceable_memory()``, with transformers' default ``reduce-overhead`` mode, i.e.
CUDA graphs, and says whether the memory step was in the graph: graph breaks and CUDA-graph skips).

It writes one JSON record (``gpu-acceptance-<device kind>-<date>.json``: device, compute capability,
CUDA / driver / torch / triton / transformers versions, date, git commit, every step) and a log beside
it into ``--out`` (default ``benchmarks/results``; a dry run: a temporary folder), then prints a short
table last. Nothing is estimated: every figure comes from the run that wrote it; a dry run's records
say ``"dry_run": true`` and are never figures.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util
import inspect
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lstmem_peft.utils.errors import UsageError

from .bench_records import REPO, save_record, suite_environment

#: (atol, rtol) against a float64 reference, atol scaled by the reference's largest magnitude (at
#: least 1): the values of ``TOLERANCES`` in tests/test_triton_kernels.py (tests/test_gpu_acceptance.py
#: checks they stay equal).
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}

#: The sizes of a run on a GPU and of a dry run (seconds on a CPU, Triton interpreted).
SETTINGS = {
    "gpu": dict(
        preset="qwen3-4b",
        dtype="bfloat16",
        heads=4,
        rank=8,
        scan_lengths=[1, 63, 2049],
        scan_block=2048,
        small_chunk=16,
        step_batch=4,
        decode_hidden=2560,  # Qwen3-4B's hidden size
        history_tokens=2048,
        question_tokens=128,
        prompt_tokens=32,
        generate_tokens=16,
        block_size=2048,
        write_tokens=4096,
        write_reps=2,
        kv_lengths=[4096, 32768],
        reps=5,
        warmup=2,
        new_tokens=32,
        generate_reps=2,
        generate_warmup=1,
        compile_warmup=2,  # compilation, then CUDA-graph recording
        time_scan_length=2048,
        time_scan_reps=3,
        pytest_selection=None,
    ),
    "dry-run": dict(
        preset="tiny",
        dtype="bfloat16",
        heads=2,
        rank=8,
        scan_lengths=[1, 7, 17],
        scan_block=16,
        small_chunk=4,
        step_batch=3,
        decode_hidden=48,
        history_tokens=16,
        question_tokens=8,
        prompt_tokens=6,
        generate_tokens=4,
        block_size=8,
        write_tokens=32,
        write_reps=1,
        kv_lengths=[16, 32],
        reps=1,
        warmup=1,
        new_tokens=3,
        generate_reps=1,
        generate_warmup=1,
        compile_warmup=1,
        time_scan_length=16,
        time_scan_reps=1,
        pytest_selection="t1-all",  # one case per scan dtype: the child-process path, in seconds
    ),
}

#: Seconds each step may take (a step cut off is recorded ``timed_out``).
BUDGETS = {
    "kernel-scan": 120,
    "kernel-step": 30,
    "kernel-decode-step": 30,
    "build-model": 90,
    "model-train-grads": 90,
    "model-generate-exact": 60,
    "time-write": 45,
    "time-scan": 60,
    "time-decode-eager": 60,
    "time-decode-compiled": 180,
    "pytest-kernels": 150,
}
#: A step starts only if at least this many seconds are left before the overall deadline.
MIN_START_S = 5.0
#: The overall deadline of a run in seconds (``--budget-s``): 8 minutes.
BUDGET_S = 480.0

#: What a finished step's ``status`` may be.
STATUSES = ("passed", "failed", "measured", "error", "timed_out", "skipped")


# ---------------------------------------------------------------------- time limits
class StepTimeout(BaseException):
    """Raised inside a step when its time is up: a ``BaseException``, so that a step's own ``except
    Exception`` (one failing length of a sweep) does not swallow it and run on past the limit."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise :class:`StepTimeout` in the main thread after ``seconds`` (``SIGALRM``); an alarm set by
    the caller (e.g. pytest-timeout) is restored after. Elsewhere (another thread, no ``setitimer``) the
    limit is only checked after the step: yields whether it is enforced."""
    usable = (
        seconds is not None
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield False
        return

    def on_alarm(signum, frame):
        raise StepTimeout(f"time budget of {seconds:.0f} s spent")

    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay:
            left = max(outer_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


# ---------------------------------------------------------------------- comparisons
def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected|`` in float64 (0 for empty tensors; inf where either is not finite)."""
    if expected.numel() == 0:
        return 0.0
    diff = (actual.double() - expected.double()).abs()
    finite = torch.isfinite(actual.double()).all() and torch.isfinite(expected.double()).all()
    return float(diff.max()) if bool(finite) else math.inf


def close_case(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> dict:
    """One case compared as the kernel tests' ``assert_close`` does: ``|a - e| <= atol * max(1, max|e|)
    + rtol |e|`` elementwise, with ``(atol, rtol) = TOLERANCES[dtype]``. The case records the largest
    error, the tolerance at that element, the largest ratio of error to tolerance over all elements, and
    whether every element passed."""
    atol, rtol = TOLERANCES[dtype]
    if actual.shape != expected.shape:
        return dict(name=name, passed=False, reason=f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if expected.numel() == 0:
        return dict(name=name, passed=True, max_error=0.0, tolerance=atol)
    a, e = actual.double(), expected.double()
    allowed = atol * max(1.0, float(e.abs().max())) + rtol * e.abs()
    diff = torch.nan_to_num((a - e).abs(), nan=math.inf)
    largest = int(diff.flatten().argmax())
    return dict(
        name=name,
        passed=bool((diff <= allowed).all()),
        max_error=max_error(a, e),
        tolerance=float(allowed.flatten()[largest]),
        worst_ratio=float((diff / allowed).max()),
    )


def bound_case(name: str, error: float, tolerance: float, **extra) -> dict:
    """A case whose tolerance was derived by the check: passed when ``error <= tolerance``."""
    passed = math.isfinite(error) and error <= tolerance
    return dict(name=name, passed=passed, max_error=error, tolerance=tolerance, **extra)


def _worst(cases: list[dict]) -> dict:
    """The case nearest to (or furthest past) its tolerance."""
    scored = [c for c in cases if "max_error" in c]
    if not scored:
        return {}

    def ratio(c):
        if not math.isfinite(c["max_error"]):
            return math.inf
        if c["tolerance"] <= 0:
            return math.inf if c["max_error"] > 0 else 0.0
        return c["max_error"] / c["tolerance"]

    return max(scored, key=ratio)


# ---------------------------------------------------------------------- a: the kernels
def _jit_kind(module) -> str | None:
    """How the ``@triton.jit`` functions of ``module`` run; ``None`` when it holds none."""
    kinds = {type(v).__name__ for v in vars(module).values()}
    if "InterpretedFunction" in kinds:
        return "interpreted"
    return "compiled" if "JITFunction" in kinds else None


def _triton_mode() -> str:
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


def chunked_reference(q, k, w, f, o, depth=None, valid=None, initial_cell=None, initial_hidden=None):
    """``scan_naive`` over consecutive pieces of at most 256 tokens, carrying the states: the same token
    loop (resuming from final states is exact), without autograd's per-token slices of a long input
    costing ``O(T^2)`` in the backward."""
    from lstmem_kernels import scan_naive

    piece, T = 256, q.shape[1]
    reads, hiddens = [], []
    cell, hidden = initial_cell, initial_hidden
    for start in range(0, max(T, 1), piece):
        part = slice(start, start + piece)
        read, hidden_seq, cell, hidden = scan_naive(
            *(x[:, part] for x in (q, k, w, f, o)),
            None if depth is None else depth[:, part],
            None if valid is None else valid[:, part],
            cell,
            hidden,
        )
        reads.append(read)
        hiddens.append(hidden_seq)
    return torch.cat(reads, 1), torch.cat(hiddens, 1), cell, hidden


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
    """The Triton scan against the float64 token loop, outputs and gradients, case by case."""
    from lstmem_kernels.scan.chunked import scan_triton

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
            ref_out, ref_grads = outputs_and_grads(chunked_reference, inputs, as_dtype=torch.float64)
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
    return dict(cases=cases, chunk_keyword=chunking, triton=_triton_mode())


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
    return dict(cases=cases, triton=_triton_mode())


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
    """``lstmem_decode_step`` against the memory layer's own PyTorch step (``LSTMemLayer.forward`` on one
    token, ``backend="torch"``), both measured against that step in float64.

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
    return dict(cases=cases, triton=_triton_mode())


# ---------------------------------------------------------------------- b: the model
@dataclass
class ModelContext:
    """What the model steps share: the random model with the preset's dimensions, and its dtype."""

    model: object = None
    dtype: torch.dtype = torch.bfloat16


def build_model(s: dict, device: torch.device, ctx: ModelContext, log=print) -> dict:
    """``bench.build_model`` (random weights from the shipped config, nothing downloaded) with the adapter
    moved off its initialisation, which zeroes the gate maps, the depth predictor and the biases
    (App. C.4): until then several paths carry no signal, and a comparison of them would pass on zeros."""
    from lstmem_peft import memory_layers

    from . import bench

    ctx.dtype = getattr(torch, s["dtype"])
    model = bench.build_model(s["preset"], device, ctx.dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in memory_layers(model):
            for p in layer.parameters():
                p.add_((0.05 * torch.randn(p.shape, generator=g)).to(p.dtype).to(p.device))
    ctx.model = model
    config = model.get_base_model().config
    n_memory = len(memory_layers(model))
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(
        f"build-model: {s['preset']} ({config.num_hidden_layers} layers, hidden {config.hidden_size}), "
        f"{n_memory} memory layers"
    )
    return dict(
        preset=s["preset"],
        dtype=s["dtype"],
        layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        memory_layers=n_memory,
        adapter_parameters=adapter,
        attention=config._attn_implementation,
    )


def set_backend(model, backend: str) -> None:
    """Every memory layer's kernel member (``LSTMemConfig.scan_backend`` sets it at injection)."""
    from lstmem_peft import memory_layers

    for layer in memory_layers(model):
        layer.backend = backend


@contextlib.contextmanager
def backbone_dtype(model, dtype: torch.dtype):
    """The frozen backbone's float weights in ``dtype`` for the block (the adapter's own parameters, float32
    whatever the backbone, are left alone), then back: a bfloat16 weight survives the round trip exactly."""
    frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
    before = [p.dtype for p in frozen]
    for p in frozen:
        p.data = p.data.to(dtype)
    try:
        yield
    finally:
        for p, old in zip(frozen, before, strict=True):
            p.data = p.data.to(old)


def _episode(model, s: dict, device: torch.device, seed: int):
    vocab = model.get_base_model().config.vocab_size
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(3, vocab, (1, s["history_tokens"]), generator=g).to(device)
    question = torch.randint(3, vocab, (1, s["question_tokens"]), generator=g).to(device)
    return history, question


def train_step_grads(model, history, question, block_size: int) -> tuple[float, dict]:
    """One training step's loss and adapter gradients: the history written into a fresh memory with
    gradients (the paper's stage 1), then the question read against it (``memory_write=False``), next-
    token cross-entropy over the question: what ``LSTMemTrainer.compute_loss`` does in stage 1."""
    from lstmem_peft import MemoryCache, write_history

    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        cache = MemoryCache()
        write_history(model, history, cache, block_size=block_size, progress=False)
        logits = model(input_ids=question, memory_cache=cache, memory_write=False, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), question[:, 1:].flatten()
        )
        loss.backward()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _relative(grads: dict, reference: dict) -> float:
    """``||g - g_ref|| / ||g_ref||`` over every adapter gradient together."""
    diff = sum(float((grads[n] - reference[n]).pow(2).sum()) for n in reference)
    norm = sum(float(reference[n].pow(2).sum()) for n in reference)
    return math.sqrt(diff / norm) if norm > 0 else math.inf


def check_train_grads(s: dict, device: torch.device, ctx: ModelContext, log=print) -> dict:
    """A training step's adapter gradients with the Triton kernels and with the PyTorch members.

    Derived tolerance: both run in the model's dtype and are measured against the same step with the
    backbone in float32 (float64 for a float32 model; the PyTorch members), ``rel = ||g - g_ref|| /
    ||g_ref||`` over all adapter gradients. The Triton run passes when ``rel_triton <= 2 rel_torch +
    eps`` (``eps`` = the dtype's machine epsilon, 2^-7 for bfloat16): the kernels lose no more to the
    low precision than the PyTorch members do, up to a factor of two. The gradients must not vanish
    (the check would pass on zeros)."""
    model, dtype = ctx.model, ctx.dtype
    history, question = _episode(model, s, device, seed=5)
    results = {}
    for backend in ("torch", "triton"):
        set_backend(model, backend)
        results[backend] = train_step_grads(model, history, question, s["block_size"])
        log(f"model-train-grads: {backend} members, loss {results[backend][0]:.4f}")
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    set_backend(model, "torch")
    with backbone_dtype(model, wide):
        reference_loss, reference = train_step_grads(model, history, question, s["block_size"])
    set_backend(model, "auto")
    _release(device)
    rel = {b: _relative(results[b][1], reference) for b in results}
    eps = torch.finfo(dtype).eps
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in reference.values()))
    per_parameter = {
        n: _relative({n: results["triton"][1][n]}, {n: reference[n]}) for n in reference if reference[n].any()
    }
    worst = max(per_parameter, key=per_parameter.get) if per_parameter else None
    cases = [
        bound_case(
            "triton gradients vs the wide reference",
            rel["triton"],
            2 * rel["torch"] + eps,
            pytorch_member_error=rel["torch"],
        ),
        bound_case("the PyTorch members' gradients vs the wide reference (the yardstick)", rel["torch"], 1.0),
        dict(name="the gradients do not vanish", passed=norm > 0 and math.isfinite(norm), gradient_norm=norm),
    ]
    log(f"model-train-grads: relative error triton {rel['triton']:.3g}, torch {rel['torch']:.3g} (vs {wide})")
    return dict(
        cases=cases,
        metric="relative L2 error over all adapter gradients",
        reference_dtype=str(wide),
        losses={b: results[b][0] for b in results} | {"reference": reference_loss},
        worst_parameter=None if worst is None else dict(name=worst, relative_error=per_parameter[worst]),
        history_tokens=s["history_tokens"],
        question_tokens=s["question_tokens"],
    )


def _no_cache_logits(model, start, ids, memory: bool) -> torch.Tensor:
    """Last-position logits of one forward over ``ids`` without a KV cache, from a copy of the memory
    ``start`` (the oracle of tests/test_generation.py); ``memory=False``: the adapter disabled."""
    with torch.no_grad():
        if not memory:
            with model.disable_adapter():
                return model(input_ids=ids, use_cache=False).logits[:, -1].float()
        return model(input_ids=ids, memory_cache=start.clone(), use_cache=False).logits[:, -1].float()


def _logit_errors(model, start, prompt, generated, logits_per_step) -> tuple[float, float, float, float]:
    """For :func:`check_generate_exact`: the largest error of ``generate``'s logits against no-cache
    forwards from the memory ``start``, the plain backbone's own error (KV-cached steps against
    no-cache forwards on the same tokens), how far memory moves the logits, and the largest logit."""
    from transformers import DynamicCache

    memory_err, plain_err, effect, scale = 0.0, 0.0, 0.0, 0.0
    kv = DynamicCache()
    with torch.no_grad(), model.disable_adapter():
        plain_step = model(input_ids=prompt, past_key_values=kv, use_cache=True).logits[:, -1].float()
    for j, logits in enumerate(logits_per_step):
        ids = torch.cat([prompt, generated[:, :j]], 1)
        ref = _no_cache_logits(model, start, ids, memory=True)
        plain_ref = _no_cache_logits(model, start, ids, memory=False)
        if j:  # the plain backbone's KV-cached step on the same token
            with torch.no_grad(), model.disable_adapter():
                token = generated[:, j - 1 : j]
                plain_step = model(input_ids=token, past_key_values=kv, use_cache=True).logits[:, -1].float()
        memory_err = max(memory_err, max_error(logits.float(), ref))
        plain_err = max(plain_err, max_error(plain_step, plain_ref))
        effect = max(effect, max_error(ref, plain_ref))
        scale = max(scale, float(ref.abs().max()))
    return memory_err, plain_err, effect, scale


def check_generate_exact(s: dict, device: torch.device, ctx: ModelContext, log=print) -> dict:
    """``generate`` with memory against recomputation (tests/test_generation.py's contract), greedy.

    Derived tolerance for the logits: in bfloat16 a KV-cached decode step and a full forward do not
    round alike even without memory. The plain backbone (adapter disabled) is measured on the same
    tokens, step by step with a KV cache against the same no-cache forwards; LSTMem passes when its
    largest logit error is at most twice the plain one plus two units in the last place of the largest
    logit (``2 eps max|logit|``): memory adds no more than the backbone's own path difference. The
    memory must move the logits by more than that tolerance (else the check says nothing). The final
    memory (float32 states fed bfloat16 activations) uses the kernel tests' tolerance of the model's
    dtype (:data:`TOLERANCES`)."""
    from lstmem_peft import MemoryCache, write_history

    model, dtype = ctx.model, ctx.dtype
    set_backend(model, "auto")
    history, _ = _episode(model, s, device, seed=9)
    vocab = model.get_base_model().config.vocab_size
    g = torch.Generator().manual_seed(10)
    prompt = torch.randint(3, vocab, (1, s["prompt_tokens"]), generator=g).to(device)
    start = MemoryCache()
    with torch.no_grad():
        write_history(model, history, start, block_size=s["block_size"], progress=False)
        cache = start.clone()
        n = s["generate_tokens"]
        out = model.generate(
            input_ids=prompt, memory_cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            return_dict_in_generate=True, output_logits=True, pad_token_id=0,
        )  # fmt: skip
    generated = out.sequences[:, prompt.shape[1] :]
    memory_err, plain_err, effect, scale = _logit_errors(model, start, prompt, generated, out.logits)
    eps = torch.finfo(dtype).eps
    tolerance = 2 * plain_err + 2 * eps * scale
    # the memory after generate: the start fed the prompt and every generated token but the last
    expected = start.clone()
    with torch.no_grad():
        model(input_ids=torch.cat([prompt, generated[:, :-1]], 1), memory_cache=expected, use_cache=False)
    cases = [
        bound_case("logits vs no-cache recomputation", memory_err, tolerance, plain_backbone_error=plain_err),
        dict(
            name="memory moves the logits past that tolerance",
            passed=effect > tolerance,
            memory_effect=effect,
            tolerance=tolerance,
        ),
        dict(
            name="tokens written",
            passed=bool(torch.equal(cache.tokens_written, expected.tokens_written)),
            got=cache.tokens_written.tolist(),
            expected=expected.tokens_written.tolist(),
        ),  # fmt: skip
    ]
    state_dtype = dtype if dtype in TOLERANCES else torch.float32
    for i, (got, want) in enumerate(zip(cache.layers, expected.layers, strict=True)):
        cases.append(close_case(f"memory layer {i}: cell", got.cell, want.cell, state_dtype))
        cases.append(close_case(f"memory layer {i}: hidden", got.hidden, want.hidden, state_dtype))
    log(
        f"model-generate-exact: logit error {memory_err:.3g} (plain backbone {plain_err:.3g}, "
        f"tolerance {tolerance:.3g})"
    )
    return dict(
        cases=cases,
        generated_tokens=n,
        history_tokens=s["history_tokens"],
        prompt_tokens=s["prompt_tokens"],
        largest_logit=scale,
    )


# ---------------------------------------------------------------------- c: timings
def time_write(s: dict, device: torch.device, ctx: ModelContext, log=print) -> dict:
    """History writing in ``block_size`` blocks (KV cache kept) against the plain prefill of the same blocks."""
    from . import bench

    set_backend(ctx.model, "auto")
    row = bench.bench_write(
        ctx.model, s["write_tokens"], block_size=s["block_size"], reps=s["write_reps"], warmup=1, kv=True
    )
    log(
        f"time-write: LSTMem {row['lstmem']['median']:.4g} s, plain {row['plain']['median']:.4g} s "
        f"for {s['write_tokens']} tokens"
    )
    return dict(rows=[row])


def time_scan(s: dict, device: torch.device, log=print) -> dict:
    """Each scan member (naive, torch, and triton on CUDA) at T = ``time_scan_length``, n_h 4, r 8."""
    from lstmem_kernels import triton_available

    from . import bench

    rows = bench.bench_scan([s["time_scan_length"]], [1], device, reps=s["time_scan_reps"], naive_reps=1)
    skipped = {}
    if device.type != "cuda":
        skipped["triton"] = f"no CUDA device ({device.type}): bench_scan times Triton on CUDA only"
    elif not triton_available():
        skipped["triton"] = "triton is not importable"
    for r in rows:
        log(f"time-scan: {r['backend']} {r['mode']} T={r['T']}: {r['median'] * 1e3:.3g} ms")
    return dict(rows=rows, skipped_members=skipped)


def _decode_settings(s: dict) -> dict:
    keys = (
        "reps",
        "warmup",
        "new_tokens",
        "generate_reps",
        "generate_warmup",
        "compile_warmup",
        "block_size",
    )
    return {k: s[k] for k in keys}


def time_decode(
    s: dict, device: torch.device, ctx: ModelContext, dry_run: bool, compiled: bool, log=print
) -> dict:
    """Decode at ``kv_lengths`` (``bench_gpu.hf_decode_sweep``): eager (one ``model(...)`` step, and greedy
    ``generate``), or compiled (``generate`` from a static cache, transformers' ``CompileConfig``: inductor
    with ``reduce-overhead``, CUDA graphs) inside ``traceable_memory()`` so that the memory's step can be
    traced into the graph. Each compiled row says whether it was: no graph break, no CUDA-graph skip."""
    from lstmem_peft import traceable_memory

    from . import bench_gpu

    set_backend(ctx.model, "auto")
    variants = ("generate-static-compile",) if compiled else ("forward", "generate")
    context = traceable_memory() if compiled else contextlib.nullcontext()
    with context:
        rows, skips = bench_gpu.hf_decode_sweep(
            ctx.model, s["kv_lengths"], _decode_settings(s), variants=variants, dry_run=dry_run, log=log
        )
    for r in rows:
        if compiled:
            graphs = device.type == "cuda" and not dry_run
            r["cuda_graphs"] = graphs
            r["memory_in_graph"] = (
                bool(r.get("compiled"))
                and r.get("graph_breaks") == 0
                and (r.get("cudagraph_skips") == 0 or not graphs)
            )
    result = dict(rows=rows, skipped_runs=skips)
    if compiled and dry_run:
        result["note"] = (
            "dry run: the 'eager' compile backend on CPU traces the graph; no CUDA graph is recorded"
        )
    if any(skip.get("failed") for skip in skips):
        result["failed_runs"] = sum(1 for skip in skips if skip.get("failed"))
    return result


# ---------------------------------------------------------------------- the pytest child
KERNEL_TESTS = ("tests/test_triton_kernels.py", "tests/test_decode_step_kernel.py")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def run_kernel_tests(s: dict, limit_s: float, dry_run: bool, log=print) -> dict:
    """``pytest -q`` on the kernel test files in a child process (``--dry-run``: one case), its exit
    status and summary line; skipped when pytest is not importable or the files are not here."""
    if not _importable("pytest"):
        return dict(skipped="pytest is not importable here; the kernel checks above ran without it")
    missing = [f for f in KERNEL_TESTS if not (REPO / f).is_file()]
    if missing:
        return dict(skipped=f"{', '.join(missing)} not found under {REPO}: run from a source checkout")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS]
    if s["pytest_selection"]:
        command += ["-k", s["pytest_selection"]]
    env = dict(os.environ)
    if not dry_run:
        env.pop("TRITON_INTERPRET", None)  # the kernels compiled for the GPU, not interpreted
    log("pytest-kernels: " + " ".join(command[1:]))
    try:
        done = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(limit_s, 1.0), check=False
        )
    except subprocess.TimeoutExpired as err:
        tail = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return dict(timed_out=f"pytest ran past {limit_s:.0f} s", output_tail=tail.splitlines()[-30:])
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    summary = next(
        (
            line.strip("= ")
            for line in reversed(lines)
            if " in " in line and ("passed" in line or "failed" in line or "error" in line)
        ),
        None,
    )
    log(f"pytest-kernels: exit status {done.returncode}: {summary}")
    return dict(
        command=command[1:],
        returncode=done.returncode,
        summary=summary,
        cases=[dict(name="pytest exit status 0", passed=done.returncode == 0, summary=summary)],
        output_tail=lines[-30:],
    )


# ---------------------------------------------------------------------- the run
@dataclass
class Step:
    """One step of the run: its name, ``"check"`` or ``"timing"`` (``"setup"``: the model build), its
    time budget, what it needs (``"model"``), and ``run(limit_s) -> dict``."""

    name: str
    kind: str
    run: Callable[[float], dict]
    needs: tuple[str, ...] = ()


def plan(s: dict, device: torch.device, dry_run: bool, ctx: ModelContext, log) -> list[Step]:
    """The steps in the order they run (kernels first: what most needs a GPU to be known)."""
    mod = sys.modules[__name__]  # looked up when a step runs, so a test can replace one

    def model_step(fn, *args):
        return lambda limit: getattr(mod, fn)(s, device, ctx, *args, log=log)

    return [
        Step("kernel-scan", "check", lambda limit: mod.check_scan(s, device, log=log)),
        Step("kernel-step", "check", lambda limit: mod.check_step(s, device, log=log)),
        Step("kernel-decode-step", "check", lambda limit: mod.check_decode_step(s, device, log=log)),
        Step("build-model", "setup", lambda limit: mod.build_model(s, device, ctx, log=log)),
        Step("model-train-grads", "check", model_step("check_train_grads"), needs=("model",)),
        Step("model-generate-exact", "check", model_step("check_generate_exact"), needs=("model",)),
        Step("time-write", "timing", model_step("time_write"), needs=("model",)),
        Step("time-scan", "timing", lambda limit: mod.time_scan(s, device, log=log)),
        Step("time-decode-eager", "timing", model_step("time_decode", dry_run, False), needs=("model",)),
        Step("time-decode-compiled", "timing", model_step("time_decode", dry_run, True), needs=("model",)),
        Step("pytest-kernels", "check", lambda limit: mod.run_kernel_tests(s, limit, dry_run, log=log)),
    ]


#: Every step's name, in order (the record holds one row for each, whatever happened).
STEPS = tuple(BUDGETS)
#: The steps that run a Triton kernel member (skipped, with the reason, where Triton cannot run as wanted).
TRITON_STEPS = ("kernel-scan", "kernel-step", "kernel-decode-step", "model-train-grads")


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _after_interruption(device: torch.device) -> None:
    """After a step was cut off mid-way: drop compiled graphs and wait for the device to settle."""
    if "torch._dynamo" in sys.modules:  # nothing was compiled otherwise
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
    with contextlib.suppress(Exception):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    _release(device)


def _status(kind: str, result: dict) -> str:
    if result.get("skipped"):
        return "skipped"
    if result.get("timed_out"):
        return "timed_out"
    if kind == "check":
        cases = result.get("cases", [])
        return "passed" if cases and all(c.get("passed") for c in cases) else "failed"
    if kind == "timing" and result.get("failed_runs"):
        return "error"
    return "measured" if kind == "timing" else "passed"


def run_step(step: Step, deadline: float, budget_s: float, available: set[str], device, log) -> dict:
    """Run one step within ``min(its budget, the time left)``; its row, whatever happened."""
    row = dict(name=step.name, kind=step.kind, budget_s=BUDGETS[step.name])
    missing = [n for n in step.needs if n not in available]
    left = deadline - time.monotonic()
    if missing:
        return dict(
            row, status="skipped", reason=f"needs the {', '.join(missing)}, which did not build", seconds=0.0
        )
    if left < MIN_START_S:
        reason = f"the overall deadline (--budget-s {budget_s:g}) left {max(left, 0):.0f} s"
        return dict(row, status="skipped", reason=reason, seconds=0.0)
    limit = min(BUDGETS[step.name], left)
    log(f"{step.name}: start (up to {limit:.0f} s)")
    start = time.monotonic()
    try:
        with time_limit(limit):
            result = step.run(limit)
    except StepTimeout as err:
        result = dict(
            timed_out=f"{err} (budget {BUDGETS[step.name]} s, {left:.0f} s left before the deadline)"
        )
        _after_interruption(device)
    except Exception as err:  # recorded: the other steps still run
        row.update(
            status="error",
            reason=f"{type(err).__name__}: {_first_line(err)}",
            traceback=traceback.format_exc().splitlines()[-25:],
        )
        result = None
        _after_interruption(device)
    seconds = round(time.monotonic() - start, 2)
    _release(device)
    if result is not None:
        row.update(result)
        row["status"] = _status(step.kind, result)
        if result.get("skipped"):
            row["reason"] = result["skipped"]
        if result.get("timed_out"):
            row["reason"] = result["timed_out"]
        worst = _worst(result.get("cases", []))
        if worst:
            row.update(max_error=worst["max_error"], tolerance=worst["tolerance"], worst_case=worst["name"])
    row["seconds"] = seconds
    log(
        f"{step.name}: {row['status']} in {seconds:.1f} s"
        + (f": {row['reason']}" if row.get("reason") else "")
    )
    return row


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def require_device(device: str | None, dry_run: bool) -> torch.device:
    """The CUDA device to run on (CPU for a dry run); without one, a one-line refusal that names the fix."""
    from .bench_gpu import require_gpu

    return require_gpu(device, dry_run, acceptance=True)


def _prepare_triton(dry_run: bool) -> str | None:
    """Before ``lstmem_kernels``' Triton modules are imported: interpreted on a dry run (CPU tensors),
    compiled for the GPU otherwise. Returns why the Triton checks cannot run as wanted, or ``None``."""
    if dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        os.environ.pop("TRITON_INTERPRET")
    try:
        mode = _triton_mode()
    except ImportError as err:
        return f"triton is not importable ({_first_line(err)}): pip install 'lstmem-peft[triton]'"
    if dry_run and mode != "interpreted":
        return (
            f"the Triton kernels are {mode} here, not interpreted: triton was imported (peft imports it where "
            "torchao or bitsandbytes is installed) before TRITON_INTERPRET=1 was set. Start the dry run with "
            "TRITON_INTERPRET=1 in the environment to run these checks on CPU"
        )
    if not dry_run and mode != "compiled":
        return (
            f"the Triton kernels are {mode} here, not compiled for the GPU: unset TRITON_INTERPRET before "
            "starting the run"
        )
    return None


def settings_for(dry_run: bool, **overrides) -> dict:
    s = dict(SETTINGS["dry-run" if dry_run else "gpu"])
    s.update({k: v for k, v in overrides.items() if v is not None})
    return s


def run_acceptance(
    out: str | os.PathLike | None = None,
    dry_run: bool = False,
    device: str | None = None,
    budget_s: float = BUDGET_S,
    log_to: Callable[[str], None] = print,
    **overrides,
) -> tuple[Path, dict]:
    """What ``lstmem bench gpu --acceptance`` does: every step of :func:`plan`, then the record (JSON) and
    its log written into ``out``, then :func:`table` printed last. Returns the record's path and the record."""
    dev = require_device(device, dry_run)
    triton_problem = _prepare_triton(dry_run)
    s = settings_for(dry_run, **overrides)
    if out is None:
        out = tempfile.mkdtemp(prefix="lstmem-gpu-acceptance-dry-run-") if dry_run else "benchmarks/results"
    Path(out).mkdir(parents=True, exist_ok=True)
    env = suite_environment(dev)
    started = time.monotonic()
    deadline = started + budget_s
    lines: list[str] = []

    def log(line: str) -> None:
        line = f"[dry run] {line}" if dry_run else line
        lines.append(f"{time.monotonic() - started:7.1f}s {line}")
        log_to(line)

    log(
        f"gpu acceptance on {env['device']}: torch {env['torch']}, triton {env['triton']}, budget {budget_s:g} s"
    )
    ctx = ModelContext()
    available: set[str] = set()
    rows = []
    for step in plan(s, dev, dry_run, ctx, log):
        if triton_problem and step.name in TRITON_STEPS:
            rows.append(
                dict(
                    name=step.name,
                    kind=step.kind,
                    budget_s=BUDGETS[step.name],
                    status="skipped",
                    reason=triton_problem,
                    seconds=0.0,
                )
            )
            continue
        row = run_step(step, deadline, budget_s, available, dev, log)
        if step.name == "build-model" and row["status"] == "passed":
            available.add("model")
        rows.append(row)
    ctx.model = None
    _release(dev)
    record = dict(
        benchmark="gpu-acceptance",
        suite="lstmem bench gpu --acceptance",
        dry_run=dry_run,
        preset=s["preset"],
        dtype=s["dtype"],
        budget_s=budget_s,
        seconds=round(time.monotonic() - started, 1),
        settings={k: v for k, v in s.items()},
        budgets=dict(BUDGETS),
        **env,
        rows=rows,
        summary={status: sum(1 for r in rows if r["status"] == status) for status in STATUSES},
    )
    record["all_checks_passed"] = all(r["status"] == "passed" for r in rows if r["kind"] != "timing")
    path = save_record(out, "gpu-acceptance", record)
    log_path = path.with_suffix(".log")
    log(f"wrote {path} and {log_path.name}")
    summary = table(record, path)
    log_path.write_text("\n".join(lines + summary) + "\n")
    for line in summary:  # last: a remote runner may show only the end of the output
        log_to(line)
    return path, record


def ok(record: dict) -> bool:
    """Whether the run found nothing wrong: no step failed, errored or ran out of time (skips are listed)."""
    return not any(r["status"] in ("failed", "error", "timed_out") for r in record["rows"])


# ---------------------------------------------------------------------- the table
def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2e}" if value and (abs(value) < 1e-2 or abs(value) >= 1e4) else f"{value:.3g}"
    return str(value)


def _timing_note(row: dict) -> str:
    """One short line of what a timing step measured (seconds are medians)."""
    found = row.get("rows") or []
    if row["name"] == "time-write" and found:
        r = found[0]
        return f"{r['tokens']} tok: LSTMem {r['lstmem']['median']:.3g}s, plain {r['plain']['median']:.3g}s"
    if row["name"] == "time-scan" and found:
        parts = [
            f"{r['backend']} {'fwd' if r['mode'] == 'forward' else 'f+b'} {r['median'] * 1e3:.3g}ms"
            for r in found
        ]
        return ", ".join(parts)
    if row["name"].startswith("time-decode") and found:
        parts = []
        for r in found:
            part = f"KV {r['kv_length']} {r['variant']}: x{r['ratio']:.3g}"
            if "memory_in_graph" in r:
                part += (
                    f" (in graph: {'yes' if r['memory_in_graph'] else 'no'}, breaks {r.get('graph_breaks')})"
                )
            parts.append(part)
        return "; ".join(parts)
    return ""


def table(record: dict, path: Path | None = None) -> list[str]:
    """The short table printed at the end of a run: one line per step, then the totals."""
    git = (record.get("git") or {}).get("commit") or "unknown"
    head = (
        f"GPU acceptance{' (DRY RUN, not measurements)' if record['dry_run'] else ''}: {record['device']}, "
        f"sm {record.get('compute_capability')}, CUDA {record.get('cuda')}, driver {record.get('driver')}, "
        f"torch {record['torch']}, triton {record.get('triton')}, transformers {record.get('transformers')}, "
        f"commit {git[:12]}, {record['date']}"
    )
    lines = ["", head, f"{'step':<22} {'status':<9} {'max err':>9} {'tol':>9} {'sec':>6}  note"]
    for r in record["rows"]:
        if r.get("reason"):
            note = r["reason"]
        elif r["kind"] == "timing":
            note = _timing_note(r)
        else:
            note = r.get("summary") or r.get("worst_case") or ""
        lines.append(
            f"{r['name']:<22} {r['status']:<9} {_fmt(r.get('max_error')):>9} {_fmt(r.get('tolerance')):>9} "
            f"{r['seconds']:>6.1f}  {note[:150]}"
        )
    counts = ", ".join(f"{n} {status}" for status, n in record["summary"].items() if n)
    if path is not None:
        lines.append(f"record: {path}")
    lines.append(
        f"{counts}; {record['seconds']:.0f} s of a {record['budget_s']:g} s budget; ok: {ok(record)}"
    )
    return lines


def run_from_args(args) -> int:
    """``lstmem bench gpu --acceptance`` from the parsed arguments; exit status 0 when :func:`ok`."""
    if args.steps:
        raise UsageError("--steps does not apply to --acceptance, which runs every step. Drop it")
    require_device(args.device, args.dry_run)  # before anything loads
    if args.out is not None and os.path.isfile(os.path.expanduser(args.out)):
        raise UsageError(
            f"--out {args.out}: a file; expected a folder for the record and log (created when missing)"
        )
    _, record = run_acceptance(
        out=args.out,
        dry_run=args.dry_run,
        device=args.device,
        budget_s=args.budget_s or BUDGET_S,
        preset=args.preset,
        dtype=args.dtype,
        kv_lengths=args.kv_lengths,
    )
    return 0 if ok(record) else 1
