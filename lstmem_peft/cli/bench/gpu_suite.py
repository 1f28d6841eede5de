"""The GPU suite: the paper's decode sweep and the kernels' speed, in one command.

    lstmem bench gpu                    # on a CUDA machine: every step, records into benchmarks/results
    lstmem bench gpu --dry-run          # anywhere: every step at tiny sizes on CPU (records marked dry_run)
    lstmem bench gpu --acceptance       # first: what works, in one short run (cli/gpu/acceptance.py)

Steps, in order, each written as its own JSON record (device, CUDA / driver / torch / transformers /
triton / vllm versions, date, git commit, settings):

``gpu-hf-decode``
    Batch 1, Qwen3-4B's dimensions (random weights from the shipped config: nothing is downloaded),
    KV lengths 8K-128K (``--kv-lengths``), LSTMem against the plain backbone (the adapter disabled),
    interleaved, after warm-ups, synchronised. Three variants per length, from the same restored
    KV cache and memory: ``forward`` (one single-token ``model(...)`` step: the paper's equivalent
    decode speed), ``generate`` (greedy ``generate`` of ``--answer-tokens`` tokens, dynamic cache,
    eager) and ``generate-static-compile`` (the same from a static cache, whose decode step
    transformers compiles with ``torch.compile``; the record says whether it did). Lengths whose two
    KV caches do not fit in the free memory, or that run out of memory, are skipped with the reason.
``gpu-vllm-decode``
    ``benchmarks/bench_vllm.py sweep`` (CUDA graphs on, not ``enforce_eager``: vLLM's default
    ``FULL_AND_PIECEWISE`` for both, full graphs of the decode steps) at the same KV
    lengths on a random checkpoint with the same dimensions, plain and LSTMem, in a child process;
    a record that says why it was skipped when vllm is not importable.
``gpu-kernels``
    The block scan (naive / vectorised PyTorch / Triton; forward and forward + backward) at T = 2048
    and longer, and the single-token decode step of each backend.

Nothing is estimated: a figure in a record was measured by the run that wrote it, on the device it
names. Without a GPU the command refuses to run unless given ``--dry-run``, which runs every step
at tiny sizes on CPU (the Triton backends skipped with the reason) to test the suite itself; its
records carry ``"dry_run": true`` and ``lstmem bench report`` never shows them as figures.

How one decode variant is timed at one length is in :mod:`.decode_variants`.
"""

from __future__ import annotations

import collections
import datetime
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

import torch

from lstmem_peft.utils.errors import UsageError

from . import command as bench
from .decode_variants import measure_variant, prefill, variant_row
from .records import REPO, save_record, suite_environment

STEPS = ("hf", "vllm", "kernels")
VARIANTS = ("forward", "generate", "generate-static-compile")
BASELINE = (
    "the same model with the adapter disabled (the paper's baseline is delta-Mem, which this package "
    "does not implement)"
)
VLLM_SCRIPT = REPO / "benchmarks" / "bench_vllm.py"

#: The sizes of a run on a GPU (the paper's appendix: batch 1, BF16, 20 timed repetitions after two
#: warm-ups per model and length) and of a dry run (seconds on a CPU).
SETTINGS = {
    "gpu": dict(
        preset="qwen3-4b",
        dtype="bfloat16",
        kv_lengths=[8192, 16384, 32768, 65536, 131072],
        reps=20,
        warmup=2,
        new_tokens=128,
        generate_reps=5,
        generate_warmup=1,
        compile_warmup=2,  # compilation, then CUDA-graph recording
        block_size=2048,
        scan_lengths=[2048, 8192, 32768],
        scan_batches=[1],
        scan_reps=5,
        step_batches=[1],
        step_calls=1000,
        step_reps=5,
        vllm_hidden=None,
        vllm_layers=None,
    ),
    "dry-run": dict(
        preset="tiny",
        dtype="float32",
        kv_lengths=[16, 32],
        reps=1,
        warmup=1,
        new_tokens=3,
        generate_reps=1,
        generate_warmup=1,
        compile_warmup=1,
        block_size=16,
        scan_lengths=[8],
        scan_batches=[1],
        scan_reps=1,
        step_batches=[1],
        step_calls=3,
        step_reps=1,
        vllm_hidden=128,
        vllm_layers=2,
    ),
}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ---------------------------------------------------------------------- memory
def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 2**62  # unknown: let the run find out


def kv_bytes(config, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of one full-attention KV cache of ``tokens`` tokens for a causal LM config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    size = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * heads * head_dim * tokens * size


def _fits(config, tokens: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """``None`` when two KV caches of ``tokens`` tokens fit in 90% of the free memory, else why not."""
    need, free = 2 * kv_bytes(config, tokens, dtype), _free_bytes(device)
    if need <= 0.9 * free:
        return None
    return (
        f"does not fit: two KV caches of {tokens} tokens need {need / 2**30:.1f} GiB, "
        f"{free / 2**30:.1f} GiB free on {device.type}"
    )


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


# ---------------------------------------------------------------------- step a: HF decode sweep


@torch.no_grad()
def hf_decode_sweep(
    model, kv_lengths: list[int], s: dict, variants=VARIANTS, dry_run: bool = False, log=print
) -> tuple[list[dict], list[dict]]:
    """Rows (one per length and variant) and skipped runs (length, variant, reason; ``failed`` when an
    error other than running out of memory stopped it); see the module doc."""
    from transformers import DynamicCache, StaticCache

    from lstmem_peft.memory.cache import MemoryCache

    device = model.device
    dtype = next(model.parameters()).dtype
    config = model.get_base_model().config
    rows, skips = [], []
    for length in kv_lengths:
        capacity = length + s["new_tokens"] + 1
        reason = None
        if capacity > getattr(config, "max_position_embeddings", capacity):
            reason = f"longer than the config's max_position_embeddings ({config.max_position_embeddings})"
        reason = reason or _fits(config, capacity, dtype, device)
        if reason:
            skips += [dict(kv_length=length, variant=v, reason=reason) for v in variants]
            log(f"hf decode: KV {length} skipped: {reason}")
            continue
        g = torch.Generator().manual_seed(length)
        prompt = torch.randint(0, config.vocab_size, (1, length), generator=g).to(device)
        token = torch.randint(0, config.vocab_size, (1, 1), generator=g).to(device)
        ids = torch.cat([prompt, token], dim=1)
        for static in (False, True):
            wanted = [v for v in variants if (v == "generate-static-compile") == static]
            if not wanted:
                continue
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            failure, kv, memory = None, None, None
            try:
                if static:
                    kv = {m: StaticCache(config=config, max_cache_len=capacity) for m in (True, False)}
                else:
                    kv = {True: DynamicCache(), False: DynamicCache()}
                memory = MemoryCache()
                prefill(model, prompt, kv[True], memory, s["block_size"])
                prefill(model, prompt, kv[False], None, s["block_size"])
                for variant in wanted:
                    result, tokens, extra = measure_variant(
                        model, variant, kv, memory, length, token, ids, s, dry_run
                    )
                    if device.type == "cuda":
                        extra["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                    r = variant_row(result, length, variant, tokens, **extra)
                    rows.append(r)
                    log(
                        f"hf decode: KV {length} {variant}: LSTMem {r['lstmem_tok_s']:.2f} tok/s, "
                        f"plain {r['plain_tok_s']:.2f} tok/s, speed retained {r['speed_retained']:.3f}"
                    )
            except Exception as err:  # recorded with the run it stopped; the other runs go on
                if _is_oom(err):
                    failure = dict(reason=f"out of memory: {_first_line(err)}")
                else:
                    failure = dict(
                        reason=f"failed: {type(err).__name__}: {_first_line(err)}",
                        failed=True,
                        traceback=traceback.format_exc().splitlines()[-20:],
                    )
            finally:
                kv = memory = None
                _release(device)
            if failure:
                done = {(r["kv_length"], r["variant"]) for r in rows}
                skips += [
                    dict(kv_length=length, variant=v, **failure) for v in wanted if (length, v) not in done
                ]
                log(f"hf decode: KV {length} {'static' if static else 'dynamic'} cache: {failure['reason']}")
    return rows, skips


# ---------------------------------------------------------------------- step b: vLLM sweep
def _vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_sweep(s: dict, device: torch.device, dry_run: bool, log=print) -> dict:
    """``benchmarks/bench_vllm.py sweep`` in a child process; its record, or why it did not run."""
    if not _vllm_importable():
        from lstmem_peft.utils.extras import install_command

        return dict(skipped=f"vllm is not importable in this environment ({install_command('vllm')})")
    if not VLLM_SCRIPT.exists():
        return dict(skipped=f"{VLLM_SCRIPT} not found: run the suite from a source checkout")
    with tempfile.TemporaryDirectory(prefix="lstmem-gpu-vllm-") as tmp:
        command = [
            sys.executable,
            str(VLLM_SCRIPT),
            "sweep",
            "--kv",
            *map(str, s["kv_lengths"]),
            "--new",
            str(s["new_tokens"]),
            "--dtype",
            s["dtype"],
            "--out",
            tmp,
        ]
        if dry_run:  # bench_vllm's own random Qwen3, eager, a small CPU KV cache
            command += ["--hidden", str(s["vllm_hidden"]), "--layers", str(s["vllm_layers"])]
            command += ["--kv-cache-bytes", str(2**30)]
            checkpoint = f"random Qwen3 (hidden {s['vllm_hidden']}, {s['vllm_layers']} layers)"
        else:
            log("vllm: saving a random checkpoint with the preset's dimensions")
            base, adapter = _random_checkpoint(Path(tmp) / "ckpt", s["preset"], s["dtype"], device)
            command += ["--model", base, "--adapter", adapter, "--compile"]  # CUDA graphs
            checkpoint = f"random {s['preset']} dimensions (lstmem_peft/assets/configs)"
        log("vllm: " + " ".join(command))
        status, tail = _stream(command, log)
        records = sorted(Path(tmp).glob("vllm-decode-sweep-*.json"))
        if status != 0 or not records:
            return dict(failed=f"bench_vllm.py sweep exited with status {status}", output_tail=tail)
        inner = json.loads(records[-1].read_text())
    return dict(
        command=[Path(c).name if c.startswith(tmp) else c for c in command],
        checkpoint=checkpoint,
        cuda_graphs=not dry_run,
        bench_vllm=inner,
    )


def _stream(command: list[str], log) -> tuple[int, list[str]]:
    """Run ``command``, passing its output on line by line; its exit status and last 30 lines."""
    tail: collections.deque[str] = collections.deque(maxlen=30)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
        for line in child.stdout:
            tail.append(line.rstrip())
            log(f"vllm | {line.rstrip()}")
    return child.returncode, list(tail)


def _random_checkpoint(folder: Path, preset: str, dtype: str, device: torch.device) -> tuple[str, str]:
    """A random backbone with ``preset``'s dimensions and an LSTMem adapter on every layer, saved."""
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from lstmem_peft.tuner.config import LSTMemConfig

    spec = {k: v for k, v in bench.PRESETS[preset].items() if k != "torch_dtype"}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
    base.save_pretrained(folder / "base")
    get_peft_model(base, LSTMemConfig(memory_id="bench-gpu-suite")).save_pretrained(folder / "adapter")
    del base
    _release(device)
    return str(folder / "base"), str(folder / "adapter")


# ---------------------------------------------------------------------- step c: kernels
def kernels_speed(s: dict, device: torch.device, log=print) -> dict:
    from lstmem_kernels import triton_available

    skipped = {}
    if device.type != "cuda":
        skipped["triton"] = f"no CUDA device ({device.type}): the Triton kernels run on CUDA only"
    elif not triton_available():
        from lstmem_peft.utils.extras import install_command

        skipped["triton"] = f"triton is not importable ({install_command('triton')})"
    log(f"kernels: scan T={s['scan_lengths']} batch {s['scan_batches']}")
    scan = bench.bench_scan(s["scan_lengths"], s["scan_batches"], device, reps=s["scan_reps"])
    for row in scan:
        row["kind"] = "scan"
    log(f"kernels: decode step, {s['step_calls']} calls per repetition")
    step = bench.bench_step(s["step_batches"], device, calls=s["step_calls"], reps=s["step_reps"])
    for row in step:
        row["kind"] = "step"
    return dict(rows=scan + step, skipped_backends=skipped)


# ---------------------------------------------------------------------- the command
def settings_for(dry_run: bool, **overrides) -> dict:
    s = dict(SETTINGS["dry-run" if dry_run else "gpu"])
    s.update({k: v for k, v in overrides.items() if v is not None})
    return s


def require_gpu(device: str | None, dry_run: bool, acceptance: bool = False) -> torch.device:
    """The CUDA device to run on (CPU for a dry run); without one, a one-line refusal that names the
    fix (``acceptance``: worded for ``lstmem bench gpu --acceptance``)."""
    if dry_run:
        return torch.device("cpu")
    dev = torch.device(device or "cuda")
    if dev.type != "cuda" or not torch.cuda.is_available():
        seen = "torch sees no CUDA device here" if not torch.cuda.is_available() else f"--device {device}"
        if acceptance:
            raise UsageError(
                f"--acceptance needs a CUDA GPU ({seen}). Run lstmem bench gpu --acceptance --dry-run to run "
                "every step at tiny sizes on CPU (a test of the run itself, no figures)"
            )
        raise UsageError(
            f"needs a CUDA GPU ({seen}); no figure is written without one. Run lstmem bench gpu --dry-run "
            "to run every step at tiny sizes on CPU (records marked dry_run)"
        )
    return dev


def run_suite(
    out: str | os.PathLike | None = None,
    dry_run: bool = False,
    device: str | None = None,
    steps: list[str] | tuple[str, ...] = STEPS,
    log=print,
    **overrides,
) -> tuple[list[Path], bool]:
    """What ``lstmem bench gpu`` does; returns the records written and whether every step ran cleanly."""
    dev = require_gpu(device, dry_run)
    s = settings_for(dry_run, **overrides)
    if dry_run:  # every line says so: none of its timings is a figure
        log = partial(_dry_run_line, log)
    if out is None:
        out = tempfile.mkdtemp(prefix="lstmem-gpu-dry-run-") if dry_run else "benchmarks/results"
    records = _SuiteRecords(out, s, dry_run, suite_environment(dev), log)
    if "hf" in steps:
        records.write("gpu-hf-decode", _hf_settings(s), lambda: _hf_step(s, dev, dry_run, log))
    if "vllm" in steps:
        vllm_settings = dict(
            kv_lengths=s["kv_lengths"],
            new_tokens=s["new_tokens"],
            batch=1,
            cuda_graphs=not dry_run,
            baseline="the same vLLM on the backbone without the adapter",
        )
        records.write("gpu-vllm-decode", vllm_settings, lambda: vllm_sweep(s, dev, dry_run, log=log))
    if "kernels" in steps:
        kernel_settings = {
            k: s[k]
            for k in ("scan_lengths", "scan_batches", "scan_reps", "step_batches", "step_calls", "step_reps")
        }
        kernel_settings.update(heads=4, rank=8)
        records.write("gpu-kernels", kernel_settings, lambda: kernels_speed(s, dev, log=log))
    if dry_run:
        log(f"records (not measurements) in {out}")
    return records.paths, records.clean


def _dry_run_line(log, line: str) -> None:
    log(f"[dry run] {line}")


def _hf_settings(s: dict) -> dict:
    """The settings a ``gpu-hf-decode`` record carries."""
    settings = {k: s[k] for k in ("kv_lengths", "reps", "warmup", "new_tokens", "generate_reps")}
    settings.update(
        generate_warmup=s["generate_warmup"],
        compile_warmup=s["compile_warmup"],
        prefill_block_size=s["block_size"],
        batch=1,
        variants=list(VARIANTS),
        baseline=BASELINE,
    )
    return settings


def _hf_step(s: dict, device: torch.device, dry_run: bool, log) -> dict:
    """Step a: the preset's random model built, swept (:func:`hf_decode_sweep`), and freed."""
    model = bench.build_model(s["preset"], device, getattr(torch, s["dtype"]))
    attention = model.get_base_model().config._attn_implementation
    try:
        rows, skips = hf_decode_sweep(model, s["kv_lengths"], s, dry_run=dry_run, log=log)
    finally:
        del model
        _release(device)
    return dict(rows=rows, skipped_runs=skips, attention=attention)


class _SuiteRecords:
    """The records of one ``lstmem bench gpu`` run: each step's result (or the error that stopped it)
    written with the suite's fields and environment; ``clean`` turns false when any step failed."""

    def __init__(self, out: str | os.PathLike, s: dict, dry_run: bool, env: dict, log) -> None:
        self.out, self.s, self.dry_run, self.env, self.log = out, s, dry_run, env, log
        self.paths: list[Path] = []
        self.clean = True

    def write(self, name: str, settings: dict, body) -> None:
        """Run ``body()`` (a step) and write its record; an exception is recorded and the next step runs."""
        start = time.perf_counter()
        try:
            result = body()
        except Exception as err:  # recorded: the other steps still run
            self.clean = False
            result = dict(
                rows=[],
                error=f"{type(err).__name__}: {_first_line(err)}",
                traceback=traceback.format_exc().splitlines()[-30:],
            )
            self.log(f"{name}: failed: {result['error']}")
        if result.get("failed") or any(skip.get("failed") for skip in result.get("skipped_runs", [])):
            self.clean = False
        result.setdefault("rows", [])
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        full = {
            **self._fields(name, settings),
            **result,
            "date": date,
            "seconds": round(time.perf_counter() - start, 1),
        }
        self.paths.append(save_record(self.out, name, full))
        self.log(f"{name}: wrote {self.paths[-1]}")

    def _fields(self, name: str, settings: dict) -> dict:
        """What every record of the run carries: the suite, its start, the preset where it applies, the
        dtype, the step's settings and the environment (less its date: each record has its own)."""
        with_preset = name == "gpu-hf-decode" or (name == "gpu-vllm-decode" and not self.dry_run)
        return dict(
            benchmark=name,
            suite="lstmem bench gpu",
            suite_run=self.env["date"],
            dry_run=self.dry_run,
            preset=self.s["preset"] if with_preset else None,
            dtype=self.s["dtype"],
            settings=settings,
            **{k: v for k, v in self.env.items() if k != "date"},
        )
