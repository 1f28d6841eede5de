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
    chunk when the function takes a ``chunk=`` keyword. Tolerances: the kernel tests'
    (:data:`.cases.TOLERANCES`).
``kernel-step``
    ``lstmem_step(backend="triton")`` against its PyTorch member and the float64 step.
``kernel-decode-step``
    ``lstmem_decode_step`` (one Triton launch) against the memory layer's PyTorch step, both measured
    against the layer's float64 step.
``model-train-grads``
    Qwen3-4B's dimensions (random weights, nothing downloaded), the adapter moved off its
    initialisation: one training step (a history written with gradients, then an answer's loss) with
    the Triton kernels and with the PyTorch members; each member's adapter gradients against the same
    step in float32 (:func:`.model_checks.check_train_grads` derives the tolerance).
``model-generate-exact``
    The test suite's exactness contract of ``generate`` (tests/test_generation.py): each generated
    token's logits against one forward without a KV cache over prompt + tokens so far from the
    starting memory, and the final memory against that memory fed the tokens kept
    (:func:`.model_checks.check_generate_exact` derives the tolerance).
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

This module holds the settings, the plan and the runner (each step isolated and timed, the record
written, the table printed last) and the ``pytest-kernels`` step; the steps themselves are in
:mod:`.kernel_checks`, :mod:`.model_checks` and :mod:`.timings`, how a case passes in
:mod:`.cases`, a step's time limit in :mod:`.step_limits`, the closing table in
:mod:`.table`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lstmem_peft.utils.errors import UsageError

from ..bench.records import REPO, save_record, suite_environment
from .cases import worst_case
from .kernel_checks import check_decode_step, check_scan, check_step, triton_mode
from .model_checks import ModelContext, build_model, check_generate_exact, check_train_grads
from .step_limits import StepTimeout, time_limit
from .step_limits import release as _release  # the runner's name for it (a test replaces it)
from .table import ok, table
from .timings import time_decode, time_scan, time_write

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
    # each function is looked up in this module when its step runs, so a test can replace one
    return [
        Step("kernel-scan", "check", lambda limit: check_scan(s, device, log=log)),
        Step("kernel-step", "check", lambda limit: check_step(s, device, log=log)),
        Step("kernel-decode-step", "check", lambda limit: check_decode_step(s, device, log=log)),
        Step("build-model", "setup", lambda limit: build_model(s, device, ctx, log=log)),
        Step(
            "model-train-grads",
            "check",
            lambda limit: check_train_grads(s, device, ctx, log=log),
            needs=("model",),
        ),
        Step(
            "model-generate-exact",
            "check",
            lambda limit: check_generate_exact(s, device, ctx, log=log),
            needs=("model",),
        ),
        Step("time-write", "timing", lambda limit: time_write(s, device, ctx, log=log), needs=("model",)),
        Step("time-scan", "timing", lambda limit: time_scan(s, device, log=log)),
        Step(
            "time-decode-eager",
            "timing",
            lambda limit: time_decode(s, device, ctx, dry_run, False, log=log),
            needs=("model",),
        ),
        Step(
            "time-decode-compiled",
            "timing",
            lambda limit: time_decode(s, device, ctx, dry_run, True, log=log),
            needs=("model",),
        ),
        Step("pytest-kernels", "check", lambda limit: run_kernel_tests(s, limit, dry_run, log=log)),
    ]


#: Every step's name, in order (the record holds one row for each, whatever happened).
STEPS = tuple(BUDGETS)
#: The steps that run a Triton kernel member (skipped, with the reason, where Triton cannot run as wanted).
TRITON_STEPS = ("kernel-scan", "kernel-step", "kernel-decode-step", "model-train-grads")


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
        worst = worst_case(result.get("cases", []))
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
    from ..bench.gpu_suite import require_gpu

    return require_gpu(device, dry_run, acceptance=True)


def _prepare_triton(dry_run: bool) -> str | None:
    """Before ``lstmem_kernels``' Triton modules are imported: interpreted on a dry run (CPU tensors),
    compiled for the GPU otherwise. Returns why the Triton checks cannot run as wanted, or ``None``."""
    if dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        os.environ.pop("TRITON_INTERPRET")
    try:
        mode = triton_mode()
    except ImportError as err:
        from lstmem_peft.utils.extras import install_command

        return f"triton is not importable ({_first_line(err)}): {install_command('triton')}"
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
