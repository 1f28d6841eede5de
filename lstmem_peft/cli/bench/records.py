"""Benchmark records: what each one carries about where it ran, writing and reading them, and the report.

Every ``lstmem bench`` run writes one JSON record (:func:`save_record`) holding its rows and the
machine it ran on (:func:`environment`; the GPU suite adds CUDA, driver, versions and the git commit:
:func:`suite_environment`). ``lstmem bench report`` reads a folder of them (:func:`read_records`)
and renders ``RESULTS.md`` with PNG plots beside it (:func:`report`). Records of
``lstmem bench gpu --dry-run`` are listed there but never shown as figures.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from lstmem_peft.utils.extras import missing_extra

#: The checkout this package runs from (its git commit goes into the GPU suite's records).
REPO = Path(__file__).resolve().parents[3]
#: The fields every record has; :func:`read_records` refuses a file without them.
RECORD_KEYS = ("benchmark", "device", "device_kind", "date", "torch", "rows")


# ---------------------------------------------------------------------- where a record was made
def environment(device: torch.device) -> dict:
    """The device's name, the torch, transformers and triton versions, and the date (UTC)."""
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else (f"CPU ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)")
    )
    return dict(
        device=name,
        torch=torch.__version__,
        transformers=transformers.__version__,
        triton=triton_version,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run_text(*command: str) -> str | None:
    """One command's stdout, stripped; ``None`` when it is missing or fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def _driver() -> str | None:
    """The NVIDIA driver version (``nvidia-smi``), or ``None``."""
    text = _run_text("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
    return text.splitlines()[0].strip() if text else None


def git_state() -> dict:
    """The commit of the checkout this package runs from, and whether its tracked files differ."""
    if not (REPO / ".git").exists():
        return dict(commit=None, dirty=None)
    commit = _run_text("git", "-C", str(REPO), "rev-parse", "HEAD")
    status = _run_text("git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no")
    return dict(commit=commit, dirty=None if commit is None else bool(status))


def suite_environment(device: torch.device) -> dict:
    """:func:`environment` plus CUDA, driver, GPU memory, vllm, peft, Python and git: what a record of
    ``lstmem bench gpu`` carries."""
    env = environment(device)
    cuda = device.type == "cuda"
    env.update(
        device_kind=device.type,
        cuda=torch.version.cuda,
        driver=_driver() if cuda else None,
        gpu_memory_gib=round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
        if cuda
        else None,
        compute_capability=".".join(map(str, torch.cuda.get_device_capability(device))) if cuda else None,
        vllm=_version("vllm"),
        peft=_version("peft"),
        lstmem_peft=_version("lstmem-peft"),
        python=platform.python_version(),
        git=git_state(),
    )
    return env


# ---------------------------------------------------------------------- writing and reading records
def save_record(out_dir: str | os.PathLike, name: str, record: dict) -> Path:
    """Write ``record`` as ``<name>-<device kind>-<date stamp>.json`` in ``out_dir`` (created when missing)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = record["date"].replace(":", "").replace("-", "")[:15]
    path = out / f"{name}-{record['device_kind']}-{stamp}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read_records(out_dir: str | os.PathLike) -> list[dict]:
    """The JSON records ``lstmem bench`` wrote to ``out_dir``; a folder that is missing or holds none, or a
    record that is not one, raises :class:`~lstmem_peft.utils.errors.DataFormatError` naming it."""
    from lstmem_peft.utils.errors import DataFormatError, MissingDataError

    folder = Path(out_dir)
    expected = "a folder of the JSON records lstmem bench KIND --out FOLDER wrote"
    fix = "Run lstmem bench decode|generate|ops|e2e|write|scan|gpu --out FOLDER first, then report FOLDER"
    if not folder.exists():
        raise MissingDataError(folder, expected, "no such folder", fix)
    if not folder.is_dir():
        raise DataFormatError(folder, expected, "a file, not a folder", fix)
    paths = sorted(folder.glob("*.json"))
    if not paths:
        raise MissingDataError(folder, expected, "no .json record in it", fix)
    return [_read_record(path) for path in paths]


def _read_record(path: Path) -> dict:
    """One record file, or a :class:`~lstmem_peft.utils.errors.DataFormatError` saying what is wrong with it."""
    from lstmem_peft.utils.errors import DataFormatError, describe

    expected = "a JSON record of lstmem bench (an object with " + ", ".join(RECORD_KEYS) + ")"
    fix = "Remove it from the folder or run that benchmark again"
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataFormatError(path, expected, "not UTF-8 text", fix) from None
    if not text.strip():
        raise DataFormatError(path, expected, "the file is empty", fix)
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        got = f"not JSON ({err.msg} at line {err.lineno} column {err.colno})"
        raise DataFormatError(path, expected, got, fix) from None
    missing = [k for k in RECORD_KEYS if not isinstance(record, dict) or k not in record]
    if missing or not isinstance(record["rows"], list):
        raise DataFormatError(path, expected, f"the file holds {describe(record)}", fix)
    return record


# ---------------------------------------------------------------------- the report
#: What ``RESULTS.md`` says when no record was measured on a GPU: the commands that make them.
NOT_MEASURED_ON_GPU = [
    "**GPU: not yet measured.** No GPU was available when these records were made. On a GPU run:",
    "",
    "```bash",
    "lstmem bench gpu --out benchmarks/results   # the paper's decode sweep (HF, vLLM) and the kernels",
    "lstmem bench decode --preset qwen3-4b --dtype bfloat16 --out benchmarks/results",
    "lstmem bench generate --preset qwen3-4b --dtype bfloat16 --out benchmarks/results",
    "lstmem bench e2e --preset qwen3-4b --dtype bfloat16 --out benchmarks/results",
    "lstmem bench write --preset qwen3-4b --dtype bfloat16 --out benchmarks/results",
    "lstmem bench scan --out benchmarks/results",
    "lstmem bench report benchmarks/results",
    "```",
    "",
]


#: In RESULTS.md, what follows this line is written by hand (the history of re-measurements): a
#: report keeps it.
HAND_WRITTEN = (
    "<!-- Everything below this line is written by hand, not by `lstmem bench report`: "
    "keep it when regenerating. -->"
)


def report(out_dir: str | os.PathLike, results_md: str | os.PathLike) -> Path:
    """Render every record under ``out_dir`` into ``results_md`` (tables) and PNG plots beside it;
    the hand-written part of an existing ``results_md`` (from :data:`HAND_WRITTEN` on) is kept."""
    records = read_records(out_dir)
    # records of ``lstmem bench gpu --dry-run``: a test of the suite at tiny sizes on CPU, never figures
    dry_runs = [r for r in records if r.get("dry_run")]
    records = [r for r in records if not r.get("dry_run")]
    md = Path(results_md)
    lines = [
        "# Benchmark results",
        "",
        "Generated by `lstmem bench report` from the JSON records in "
        f"`{Path(out_dir).as_posix()}`. Every figure was measured on the device named beside it.",
        "",
    ]
    if not any(r["device_kind"] == "cuda" for r in records):
        lines += NOT_MEASURED_ON_GPU
    for r in records:
        model = f" — {r['preset']}" if r.get("preset") else ""
        lines += [f"## {r['benchmark']} — {r['device']}{model} ({r['date']}, torch {r['torch']})", ""]
        lines += _record_lines(r, md.parent)
        lines.append("")
    if dry_runs:
        lines += _dry_run_lines(dry_runs)
    kept = md.read_text().partition(HAND_WRITTEN) if md.exists() else ("", "", "")
    if kept[1]:
        lines += ["", kept[1] + kept[2].rstrip("\n")]
    md.write_text("\n".join(lines) + ("\n" if kept[1] else ""))
    return md


def _record_lines(r: dict, folder: Path) -> list[str]:
    """The tables (and plot lines) of one record, by its kind; nothing for a kind this report does not know."""
    kind = r["benchmark"]
    if kind.startswith("gpu-"):
        return _gpu_suite_lines(r, folder)
    if kind == "decode":
        return _decode_lines(r, folder)
    if kind == "ops":
        return _ops_lines(r)
    if kind in ("e2e", "write", "generate"):
        return _timed_lines(r, folder)
    if kind == "scan":
        return _scan_lines(r["rows"])
    return []


def _dry_run_lines(dry_runs: list[dict]) -> list[str]:
    """The list of ``lstmem bench gpu --dry-run`` records: named, never shown as figures."""
    lines = [
        "## Dry runs of `lstmem bench gpu` (not measurements)",
        "",
        "Records of `lstmem bench gpu --dry-run`: every step of the GPU suite at tiny sizes on CPU, a "
        "test of the suite itself. Their timings are not figures and are not shown.",
        "",
    ]
    lines += [
        f"- {r['benchmark']}, {r['date']}, {r['device']}: dry run, {len(r['rows'])} rows" for r in dry_runs
    ]
    return lines + [""]


def _ms(stats: dict, per: int = 1) -> str:
    """``median (min-max)`` in milliseconds, per ``per`` tokens."""
    return (
        f"{1e3 * stats['median'] / per:.2f} ({1e3 * stats['min'] / per:.2f}-{1e3 * stats['max'] / per:.2f})"
    )


def _ratio(row: dict) -> str:
    """The ratio of the medians, and (records since 2026-11-27) the median and range of the ratios
    within each repetition."""
    pairs = row.get("ratio_pairs")
    text = f"{row['ratio']:.3f}"
    if pairs is None:
        return text
    return f"{text} (pairs {pairs['median']:.3f}, {pairs['min']:.3f}-{pairs['max']:.3f})"


def _num(value) -> str:
    """A table cell: one decimal, or a dash for a figure an older record does not have."""
    return "-" if value is None else f"{value:.1f}"


def _decode_lines(r: dict, folder: Path) -> list[str]:
    """``lstmem bench decode``: time per decode step and tokens per second against the KV length, plotted."""
    lines = [
        "| KV length | LSTMem ms (min-max) | plain ms (min-max) | LSTMem tok/s | plain tok/s | ratio |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['kv_length']} | {_ms(row['lstmem'])} | {_ms(row['plain'])} | "
            f"{row['lstmem_tok_s']:.2f} | {row['plain_tok_s']:.2f} | {_ratio(row)} |"
        )
    return lines + ["", _plot(folder, r, "decode", "decode speed", partial(_draw_decode, rows=r["rows"]))]


def _ops_lines(r: dict) -> list[str]:
    """``lstmem bench ops``: aten operators per decode step, with and without memory."""
    lines = [
        "| aten operators per decode step: LSTMem | plain | extra per memory layer | of which launch kernels |"
        " same, one `model(...)` step | top extra operators per layer |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in r["rows"]:
        top = ", ".join(f"{k} {v:.1f}" for k, v in list(row["extra_by_op"].items())[:6])
        lines.append(
            f"| {row['lstmem_per_step']:.1f} | {row['plain_per_step']:.1f} | {row['extra_per_layer']:.1f} | "
            f"{row['extra_non_view_per_layer']:.1f} | {_num(row.get('forward_extra_non_view_per_layer'))} | "
            f"{top} |"
        )
    return lines


def _timed_lines(r: dict, folder: Path) -> list[str]:
    """``lstmem bench e2e|write|generate``: seconds per call against the size the row varies (e2e plotted)."""
    kind = r["benchmark"]
    key = {"e2e": "history_tokens", "write": "tokens", "generate": "prompt_tokens"}[kind]
    extra = " new tokens |" if kind == "generate" else ""
    lines = [
        f"| {key.replace('_', ' ')} |{extra} LSTMem s (min-max) | plain s (min-max) | ratio |",
        "| --- |" + " --- |" * (4 if extra else 3),
    ]
    for row in r["rows"]:
        lm, pl = row["lstmem"], row["plain"]
        new_tokens = f" {row['new_tokens']} |" if extra else ""
        label = row[key] if row.get("kv_cache", True) else f"{row[key]}, no KV cache"
        lines.append(
            f"| {label} |{new_tokens} {lm['median']:.3f} ({lm['min']:.3f}-{lm['max']:.3f}) | "
            f"{pl['median']:.3f} ({pl['min']:.3f}-{pl['max']:.3f}) | {_ratio(row)} |"
        )
    if kind == "e2e":
        lines += ["", _plot(folder, r, "e2e", "end to end", partial(_draw_e2e, rows=r["rows"]))]
    return lines


def _scan_lines(rows: list[dict]) -> list[str]:
    """Block-scan rows (``lstmem bench scan``, and the scans of ``gpu-kernels``): time and speed-up."""
    lines = [
        "| batch | T | backend | mode | median ms (min-max) | x naive |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['batch']} | {row['T']} | {row['backend']} | {row['mode']} | {_ms(row)} | "
            f"{row['speedup_vs_naive']:.1f} |"
        )
    return lines


# ---------------------------------------------------------------------- the GPU suite's records
def _gpu_suite_lines(r: dict, folder: Path) -> list[str]:
    """The tables of one ``lstmem bench gpu`` record (gpu-hf-decode, gpu-vllm-decode, gpu-kernels)."""
    git = r.get("git") or {}
    commit = (git.get("commit") or "unknown")[:12] + (" (with local changes)" if git.get("dirty") else "")
    lines = [
        f"CUDA {r.get('cuda')}, driver {r.get('driver')}, transformers {r.get('transformers')}, "
        f"triton {r.get('triton')}, vllm {r.get('vllm')}, {r.get('dtype')}, commit {commit}.",
        "",
    ]
    if r.get("error"):
        return lines + [f"Failed: {r['error']}"]
    if r.get("skipped") and isinstance(r["skipped"], str):
        return lines + [f"Skipped: {r['skipped']}"]
    if r.get("failed"):
        return lines + [f"Failed: {r['failed']}"]
    if r["benchmark"] == "gpu-hf-decode":
        return lines + _gpu_hf_lines(r, folder)
    if r["benchmark"] == "gpu-vllm-decode":
        return lines + _gpu_vllm_lines(r)
    if r["benchmark"] == "gpu-kernels":
        return lines + _gpu_kernel_lines(r)
    return lines


def _gpu_hf_lines(r: dict, folder: Path) -> list[str]:
    """``gpu-hf-decode``: per KV length and variant, both speeds and their ratio; skipped runs; a plot."""
    lines = [
        "| KV length | variant | cache | compiled | LSTMem tok/s | plain tok/s | LSTMem / plain speed "
        "| LSTMem ms/token (min-max) | plain ms/token (min-max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in r["rows"]:
        n = row["tokens_per_call"]
        lines.append(
            f"| {row['kv_length']} | {row['variant']} | {row['cache']} | {'yes' if row['compiled'] else 'no'} | "
            f"{row['lstmem_tok_s']:.2f} | {row['plain_tok_s']:.2f} | {row['speed_retained']:.3f} | "
            f"{_ms(row['lstmem'], n)} | {_ms(row['plain'], n)} |"
        )
    for skip in r.get("skipped_runs") or []:
        lines += ["", f"Skipped: KV {skip['kv_length']}, {skip['variant']}: {skip['reason']}"]
    if r["rows"]:
        draw = partial(_draw_hf_decode, rows=r["rows"])
        lines += ["", _plot(folder, r, "gpu-hf-decode", "HF decode sweep", draw)]
    return lines


def _gpu_vllm_lines(r: dict) -> list[str]:
    """``gpu-vllm-decode``: vLLM's decode speed with and without the adapter per KV length."""
    speeds = r["bench_vllm"]["decode_tokens_per_s"]
    modes = [
        f"{name}: {speeds[name]['cudagraph_mode']}"
        for name in ("lstmem", "plain")
        if "cudagraph_mode" in speeds[name]
    ]
    resolved = f" (resolved by vLLM, {', '.join(modes)})" if modes else ""
    lines = [
        f"vLLM, CUDA graphs {'on' if r.get('cuda_graphs') else 'off'}{resolved}, {r.get('checkpoint')}.",
        "",
        "| KV length | LSTMem tok/s | plain tok/s | LSTMem / plain speed |",
        "| --- | --- | --- | --- |",
    ]
    for length in r["bench_vllm"]["settings"]["kv"]:
        lm, pl = speeds["lstmem"][str(length)], speeds["plain"][str(length)]
        lines.append(f"| {length} | {lm:.2f} | {pl:.2f} | {lm / pl:.3f} |")
    return lines


def _gpu_kernel_lines(r: dict) -> list[str]:
    """``gpu-kernels``: the block scans, then the one-token decode steps, then the skipped backends."""
    lines = _scan_lines([row for row in r["rows"] if row.get("kind") == "scan"])
    lines += [
        "",
        "| decode step: batch | backend | median us per call (min-max) | x naive |",
        "| --- | --- | --- | --- |",
    ]
    for row in (row for row in r["rows"] if row.get("kind") == "step"):
        lines.append(
            f"| {row['batch']} | {row['backend']} | {1e6 * row['median']:.1f} "
            f"({1e6 * row['min']:.1f}-{1e6 * row['max']:.1f}) | {row['speedup_vs_naive']:.1f} |"
        )
    for backend, reason in (r.get("skipped_backends") or {}).items():
        lines += ["", f"Skipped: {backend}: {reason}"]
    return lines


# ---------------------------------------------------------------------- plots
def _plot(folder: Path, record: dict, name: str, title: str, draw: Callable) -> str:
    """Draw one figure with ``draw(ax)``, save it as PNG in ``folder``; returns the markdown image line."""
    try:
        import matplotlib
    except ModuleNotFoundError as err:
        raise missing_extra(err, "bench", "Benchmark plots (lstmem bench report)") from err

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    draw(ax)
    ax.set_title(f"{title}, {record.get('preset') or ''}, {record['device']}", fontsize=9)
    ax.legend()
    png = folder / f"{name}-{record['device_kind']}-{record.get('preset') or ''}.png"
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return f"![{title}]({png.name})"


def _draw_decode(ax, rows: list[dict]) -> None:
    """Decode speed with and without memory against the KV length."""
    ks = [row["kv_length"] for row in rows]
    ax.plot(ks, [row["lstmem_tok_s"] for row in rows], "o-", label="LSTMem")
    ax.plot(ks, [row["plain_tok_s"] for row in rows], "s--", label="plain backbone")
    ax.set_xlabel("KV cache length (tokens)")
    ax.set_ylabel("equivalent decode speed (tok/s)")


def _draw_e2e(ax, rows: list[dict]) -> None:
    """Seconds for history plus answer, with and without memory, one pair of bars per history length."""
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [row["lstmem"]["median"] for row in rows], 0.4, label="LSTMem")
    ax.bar([x + 0.2 for x in xs], [row["plain"]["median"] for row in rows], 0.4, label="plain backbone")
    ax.set_xticks(list(xs), [str(row["history_tokens"]) for row in rows])
    ax.set_xlabel("history tokens")
    ax.set_ylabel(f"seconds (history + {rows[0]['answer_tokens']}-token answer)")


def _draw_hf_decode(ax, rows: list[dict]) -> None:
    """The GPU suite's decode speeds against the KV length, one pair of curves per variant."""
    for variant in dict.fromkeys(row["variant"] for row in rows):
        mine = [row for row in rows if row["variant"] == variant]
        ks = [row["kv_length"] for row in mine]
        ax.plot(ks, [row["lstmem_tok_s"] for row in mine], "o-", label=f"LSTMem, {variant}")
        ax.plot(ks, [row["plain_tok_s"] for row in mine], "s--", label=f"plain, {variant}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV cache length (tokens)")
    ax.set_ylabel("decode speed (tok/s)")
