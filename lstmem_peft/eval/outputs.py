"""What an evaluation writes: the tables, the plot, the predictions file and the output folder.

A run writes into ``<out_dir>.partial`` (:class:`PartialRun`: ``settings.json`` and
``predictions.jsonl``, one line per answer), then ``summary.json``, ``results.md`` (the systems side
by side, then both protocols side by side: :func:`markdown_table`, :func:`protocols_table`) and
``scores.png`` (:func:`plot_scores`), and only then moves the folder over ``out_dir``
(:func:`replace_folder`), so a run that fails never leaves a mix of two runs' files.
:func:`read_predictions` reads a finished run's predictions back (``lstmem eval --rescore``).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any

import torch

from lstmem_peft.utils.errors import DataFormatError, MissingDataError, describe

from .scorers import PROTOCOLS

#: The systems a run compares, in the order the reports show them, and their names there.
SYSTEMS = ("base", "lstmem")
SYSTEM_NAMES = {"base": "backbone", "lstmem": "LSTMem"}
#: The settings of a run in progress, kept in ``<out_dir>.partial`` so that ``resume`` can check them.
SETTINGS_FILE = "settings.json"
#: The fields every line of ``predictions.jsonl`` has.
PREDICTION_FIELDS = ("system", "history", "id", "group", "prediction", "gold")


# ---------------------------------------------------------------------- tables and plot
def _percent(value: float) -> str:
    return f"{100 * value:.2f}"


def markdown_table(summary: dict[str, Any]) -> str:
    """The systems side by side: one row per group (and family, when present) and overall.

    Scores are percentages; ``Δ`` is LSTMem minus the backbone.
    """
    systems = [s for s in SYSTEMS if s in summary["systems"]]
    metrics = summary["metrics"]
    header = ["", "questions"]
    for metric in metrics:
        header += [f"{SYSTEM_NAMES[s]} {metric}" for s in systems]
        if len(systems) == 2:
            header.append(f"Δ {metric}")
    first = summary["systems"][systems[0]]
    levels = [("groups", name) for name in first["groups"]]
    levels += [
        (level, name) for level, rows in first.items() if level not in ("groups", "overall") for name in rows
    ]
    levels.append(("overall", None))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for level, name in levels:
        cells = [
            summary["systems"][s][level] if name is None else summary["systems"][s][level][name]
            for s in systems
        ]
        row = [
            "**overall**" if name is None else (f"*{name}*" if level != "groups" else name),
            str(cells[0]["questions"]),
        ]
        for metric in metrics:
            row += [_percent(c[metric]) for c in cells]
            if len(systems) == 2:
                row.append(f"{100 * (cells[1][metric] - cells[0][metric]):+.2f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def protocols_table(summary: dict[str, Any]) -> str:
    """The primary metric per group (and family) and overall, each system under each protocol.

    Reads ``summary["by_protocol"]``; scores are percentages.
    """
    by_protocol = summary["by_protocol"]
    protocols = [p for p in PROTOCOLS if p in by_protocol]
    systems = [s for s in SYSTEMS if s in by_protocol[protocols[0]]]
    metric = summary["metrics"][0]
    header = ["", "questions"] + [f"{SYSTEM_NAMES[s]} {metric} ({p})" for p in protocols for s in systems]
    first = by_protocol[protocols[0]][systems[0]]
    levels = [("groups", name) for name in first["groups"]]
    levels += [(lvl, n) for lvl, rows in first.items() if lvl not in ("groups", "overall") for n in rows]
    levels.append(("overall", None))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for level, name in levels:

        def cell(p: str, s: str, level=level, name=name) -> dict:
            block = by_protocol[p][s][level]
            return block if name is None else block[name]

        label = "**overall**" if name is None else (f"*{name}*" if level != "groups" else name)
        row = [label, str(cell(protocols[0], systems[0])["questions"])]
        row += [_percent(cell(p, s)[metric]) for p in protocols for s in systems]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot_scores(summary: dict[str, Any], path: str) -> str | None:
    """Bar chart of the primary metric per group (and family) and overall, one bar per system and
    protocol, written to ``path``. Returns ``path``, or ``None`` (with a warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: no scores.png (pip install matplotlib)", stacklevel=2)
        return None
    by_protocol = summary.get("by_protocol") or {summary.get("protocol") or "own": summary["systems"]}
    metric = summary["metrics"][0]
    bars = [(p, s) for p in by_protocol for s in SYSTEMS if s in by_protocol[p]]
    first = by_protocol[bars[0][0]][bars[0][1]]
    names = list(first["groups"]) + [
        n for lvl in first if lvl not in ("groups", "overall") for n in first[lvl]
    ]

    def value(block: dict, name: str | None) -> float:
        if name is None:
            return block["overall"][metric]
        for level, rows in block.items():
            if level != "overall" and name in rows:
                return rows[name][metric if metric in rows[name] else "score"]
        return float("nan")

    labels = names + ["overall"]
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) * len(bars) / 2 + 2), 4))
    for i, (protocol, system) in enumerate(bars):
        heights = [100 * value(by_protocol[protocol][system], n) for n in names + [None]]
        offsets = [x + (i - (len(bars) - 1) / 2) * width for x in range(len(labels))]
        ax.bar(offsets, heights, width, label=f"{SYSTEM_NAMES[system]} ({protocol})")
    ax.set_ylim(0, 100)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel(f"{metric} (%)")
    ax.set_title(f"{summary['benchmark']}: LSTMem against its backbone")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def versions() -> dict[str, str]:
    """The versions of lstmem-peft, torch, transformers and peft (``summary.json``'s ``versions``)."""
    import peft
    import transformers

    from lstmem_peft.utils.version import __version__

    return {
        "lstmem_peft": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


# ---------------------------------------------------------------------- the output folder
class PartialRun:
    """An evaluation's outputs while it runs, in ``<out_dir>.partial``.

    The folder holds the run's ``settings.json`` and ``predictions.jsonl``, one line per answer
    (:meth:`write`, flushed after every history); :meth:`finish` adds the reports and moves the
    folder over ``out_dir``. With ``resume``, the answers an interrupted run with the same
    ``settings`` left there are kept (:attr:`kept`, by history id) and new ones appended; a partial
    run made with other settings raises ``ValueError`` naming what differs.
    """

    def __init__(self, out_dir: str | os.PathLike, settings: dict[str, Any], resume: bool = False) -> None:
        self.out_dir = os.fspath(out_dir).rstrip("/\\")
        self.stage = self.out_dir + ".partial"
        self.resume = resume
        self.kept: dict[str, list[dict]] = _resumable(self.stage, settings) if resume else {}
        if not self.kept:
            shutil.rmtree(self.stage, ignore_errors=True)
            os.makedirs(self.stage)
            with open(os.path.join(self.stage, SETTINGS_FILE), "w", encoding="utf-8") as fh:
                json.dump(settings, fh, indent=2, ensure_ascii=False)
        self.predictions = os.path.join(self.stage, "predictions.jsonl")
        self._sink = open(self.predictions, "a" if self.kept else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._sink.write(json.dumps(record, ensure_ascii=False) + "\n")

    def flush(self) -> None:
        self._sink.flush()

    def close(self) -> None:
        self._sink.close()

    def finish(self, summary: dict[str, Any], records: dict[str, list[dict]], plot: bool) -> None:
        """Write the reports and put the folder in place of ``out_dir`` (``records``: by system, in run order)."""
        if self.resume:  # the file now holds the kept histories' lines first: write it in run order
            write_records(self.predictions, records, list(records))
        write_reports(self.stage, summary, plot)
        os.remove(os.path.join(self.stage, SETTINGS_FILE))
        replace_folder(self.stage, self.out_dir)


def _resumable(stage: str, settings: dict[str, Any]) -> dict[str, list[dict]]:
    """Records an interrupted run left in ``stage``, by history id; ``{}`` when there is nothing to
    resume. Raises ValueError when that run used other settings."""
    path = os.path.join(stage, SETTINGS_FILE)
    predictions = os.path.join(stage, "predictions.jsonl")
    if not (os.path.isfile(path) and os.path.isfile(predictions)):
        return {}
    with open(path, encoding="utf-8") as fh:
        previous = json.load(fh)
    differ = sorted(k for k in set(previous) | set(settings) if previous.get(k) != settings.get(k))
    if differ:
        details = "; ".join(f"{k}: {previous.get(k)!r} then, {settings.get(k)!r} now" for k in differ)
        raise ValueError(
            f"cannot resume {stage}: it was started with other settings ({details}); "
            "run again with the same settings, or without --resume to start over"
        )
    kept: dict[str, list[dict]] = {}
    with open(predictions, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by the interruption
                    continue
                kept.setdefault(record["history"], []).append(record)
    return kept


def write_records(path: str, records: dict[str, list[dict]], systems: list[str]) -> None:
    """Per-question records in run order (history by history, system by system), atomically."""
    by_history: dict[str, list[dict]] = {}
    for system in systems:
        for record in records[system]:
            by_history.setdefault(record["history"], []).append(record)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        for rows in by_history.values():
            for system in systems:
                for record in rows:
                    if record["system"] == system:
                        fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)


def write_reports(folder: str, summary: dict[str, Any], plot: bool) -> None:
    """``summary.json``, ``results.md`` (both protocols side by side) and, with ``plot``, ``scores.png``."""
    with open(os.path.join(folder, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2, ensure_ascii=False)
    title = f"# {summary['benchmark']} ({summary['mode']}, {summary.get('protocol') or 'own'} protocol)"
    text = f"{title}\n\n{markdown_table(summary)}"
    if summary.get("by_protocol"):
        text += f"\n## Scored under both protocols\n\n{protocols_table(summary)}"
    with open(os.path.join(folder, "results.md"), "w", encoding="utf-8") as fh:
        fh.write(text)
    if plot:
        plot_scores(summary, os.path.join(folder, "scores.png"))


def replace_folder(new: str, target: str) -> None:
    """Put folder ``new`` in place of ``target`` by renames: a run that fails before this point
    leaves the previous run's files untouched, and at no point is either set lost."""
    previous = target + ".previous"
    shutil.rmtree(previous, ignore_errors=True)
    if os.path.exists(target):
        os.replace(target, previous)
    os.replace(new, target)
    shutil.rmtree(previous, ignore_errors=True)


# ---------------------------------------------------------------------- reading predictions back
def read_predictions(path: str) -> list[dict[str, Any]]:
    """The per-question records of an ``lstmem eval`` run's ``predictions.jsonl``; anything else raises a
    :class:`~lstmem_peft.utils.errors.DataFormatError` naming the file and the line."""
    expected = (
        "the predictions.jsonl an lstmem eval run wrote (one JSON object a line with "
        + ", ".join(PREDICTION_FIELDS)
        + ")"
    )
    fix = "Pass RUN/predictions.jsonl of a finished lstmem eval run (RUN: its --out folder)"
    if not os.path.exists(path):
        raise MissingDataError(path, expected, "no such file", fix)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "predictions.jsonl")):
            fix = f"Pass {os.path.join(path, 'predictions.jsonl')}"
        raise DataFormatError(path, expected, "a folder", fix)
    rows = []
    try:
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    got = f"line {n} is not JSON ({err.msg} at column {err.colno})"
                    raise DataFormatError(path, expected, got, fix) from None
                if not isinstance(row, dict):
                    raise DataFormatError(path, expected, f"line {n} is {describe(row)}", fix)
                missing = [k for k in PREDICTION_FIELDS if k not in row]
                if missing:
                    got = f"line {n} has no {missing[0]!r} field ({describe(row)})"
                    raise DataFormatError(path, expected, got, fix)
                rows.append(row)
    except UnicodeDecodeError:
        raise DataFormatError(path, expected, "not UTF-8 text", fix) from None
    if not rows:
        raise DataFormatError(path, expected, "the file is empty (no predictions)", fix)
    return rows
