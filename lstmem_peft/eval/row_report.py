"""What a run of named rows (:mod:`.rows`) records and shows: scores with bootstrap intervals and
counts per group, under both protocols, and each row's costs beside them.

``summary.json`` holds everything the tables show (:func:`render` draws ``results.md`` from it alone,
so a table never exists without its record); ``python -m lstmem_peft.eval.row_report RUN`` redraws
``RUN/results.md`` from ``RUN/summary.json``.

Intervals: percentile bootstrap, 95%, over the questions of each cell (a group of a row, or all of a
row's questions), ``resamples`` resamples drawn with torch's CPU generator seeded with ``seed``, the same
draws for every cell of the same size (rows are resampled in pairs, question for question).
Costs, per row: memory state bytes per history; the KV bytes the row keeps for a history (measured
on its cache), those of the context in each question's prompt and those the whole history would take
(tokens times the bytes of one token's keys and values in a full-attention cache of the model's
dtype); the history write time per history (memory and KV; ``bm25``: building its index); the answer
time per question (generation; ``bm25``: retrieval too); prompt and context tokens per question; all
on the machine named in ``where``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from dataclasses import asdict
from typing import Any

import torch

from .outputs import SETTINGS_FILE, replace_folder, versions, write_records
from .protocol import Benchmark
from .scorers import PROTOCOLS

LEVEL = 0.95


# ---------------------------------------------------------------------- intervals
def bootstrap_interval(values, resamples: int = 1000, seed: int = 0, level: float = LEVEL) -> list[float]:
    """The percentile bootstrap interval of the mean of ``values``: ``[low, high]`` (``[]`` for none)."""
    data = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if data.numel() == 0 or resamples < 1:
        return []
    generator = torch.Generator().manual_seed(seed)  # on the CPU: the same draws on every machine
    draws = torch.randint(0, data.numel(), (resamples, data.numel()), generator=generator)
    means = data[draws].mean(dim=1)
    tail = (1 - level) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return [low, high]


def with_intervals(summary: dict, records: list[dict], metrics, resamples: int, seed: int) -> dict:
    """``summary`` (:meth:`Benchmark.summarize`'s) with ``"ci": {metric: [low, high]}`` in every group
    and overall."""
    by_group: dict[str, list[dict]] = {}
    for record in records:
        by_group.setdefault(record["group"], []).append(record["scores"])
    out = json.loads(json.dumps(summary))
    for name, block in out["groups"].items():
        rows = by_group.get(name, [])
        block["ci"] = {m: bootstrap_interval([r[m] for r in rows], resamples, seed) for m in metrics}
    everything = [r["scores"] for r in records]
    out["overall"]["ci"] = {
        m: bootstrap_interval([r[m] for r in everything], resamples, seed) for m in metrics
    }
    return out


# ---------------------------------------------------------------------- costs
def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def row_costs(records: list[dict], kv_per_token: int) -> dict[str, Any]:
    """One row's costs: per-history figures averaged over histories, per-question ones over questions."""
    histories: dict[str, dict] = {}
    for record in records:
        histories.setdefault(record["history"], record["cost"])
    per_history = list(histories.values())
    costs = [r["cost"] for r in records]
    return {
        "histories": len(per_history),
        "questions": len(costs),
        "state_bytes_per_history": _mean([c["state_bytes"] for c in per_history]),
        "kv_bytes_per_history": _mean([c["kv_bytes"] for c in per_history]),
        "history_tokens": _mean([c["history_tokens"] for c in per_history]),
        "full_history_kv_bytes": _mean([c["history_tokens"] * kv_per_token for c in per_history]),
        "write_s_per_history": _mean([c["write_s"] for c in per_history]),
        "answer_s_per_question": _mean([c["answer_s"] for c in costs]),
        "prompt_tokens_per_question": _mean([c["prompt_tokens"] for c in costs]),
        "context_tokens_per_question": _mean([c["context_tokens"] for c in costs]),
        "context_kv_bytes_per_question": _mean([c["context_tokens"] * kv_per_token for c in costs]),
        "context_turns_per_question": _mean([c["context_turns"] for c in costs]),
        "new_tokens_per_question": _mean([c["new_tokens"] for c in costs]),
    }


def where() -> dict[str, Any]:
    """The machine the costs were measured on."""
    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    )
    return {"device": device, "torch_threads": torch.get_num_threads(), "host": platform.node()}


# ---------------------------------------------------------------------- the record
def settings(benchmark: Benchmark, run, options: dict, run_info: dict | None) -> dict[str, Any]:
    """What decides the run's answers (compared when it is resumed)."""
    out = {
        **benchmark.settings(),
        "mode": "rows",
        **options,
        "decoding": asdict(run.decoding),
        "block_size": run.block_size,
        "chat_template": run.builder.chat_template,
        "template_kwargs": run.builder.template_kwargs,
        **(run_info or {}),
    }
    return json.loads(json.dumps(out))


def _scored(benchmark: Benchmark, records: dict[str, list[dict]], protocol: str, boot: dict) -> dict:
    from .runner import rescore_records

    scorer = (
        benchmark if protocol == getattr(benchmark, "protocol", None) else benchmark.with_protocol(protocol)
    )
    out = {}
    for row, rows in records.items():
        rows = rows if scorer is benchmark else rescore_records(scorer, rows)
        out[row] = with_intervals(
            scorer.summarize(rows), rows, benchmark.metrics, boot["resamples"], boot["seed"]
        )
    return out


def summarize(
    benchmark: Benchmark,
    run,
    settings: dict,
    records: dict[str, list[dict]],
    kv_per_token: int,
    command: str | None = None,
):
    """The run's ``summary.json`` (``command``: the command line that made it)."""
    rows = list(records)
    boot = settings["bootstrap"]
    first = records[rows[0]]
    summary = {
        "kind": "eval-rows",
        "benchmark": benchmark.name,
        "protocol": getattr(benchmark, "protocol", None),
        "rows": rows,
        "row_notes": settings.get("row_notes", {}),
        "metrics": list(benchmark.metrics),
        "window": settings["window"],
        "window_from": settings["window_from"],
        "top_k": settings["top_k"],
        "bootstrap": boot,
        "histories": len({r["history"] for r in first}),
        "questions": len(first),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "where": where(),
        "command": command,
        "versions": versions(),
        "settings": settings,
        "results": _scored(benchmark, records, getattr(benchmark, "protocol", None), boot)
        if getattr(benchmark, "protocol", None)
        else {
            r: with_intervals(benchmark.summarize(v), v, benchmark.metrics, boot["resamples"], boot["seed"])
            for r, v in records.items()
        },
        "kv_bytes_per_token": kv_per_token,
        "costs": {r: row_costs(v, kv_per_token) for r, v in records.items()},
    }
    if getattr(benchmark, "protocol", None) is not None:
        summary["by_protocol"] = {p: _scored(benchmark, records, p, boot) for p in PROTOCOLS}
    return summary


def finish(partial, summary: dict, records: dict[str, list[dict]]) -> None:
    """Write the reports into the partial folder and put it in place of the output folder."""
    if partial.resume:
        write_records(partial.predictions, records, list(records))
    write(partial.stage, summary)
    os.remove(os.path.join(partial.stage, SETTINGS_FILE))
    replace_folder(partial.stage, partial.out_dir)


def write(folder: str, summary: dict) -> None:
    """``summary.json`` and ``results.md`` (drawn from it) in ``folder``."""
    with open(os.path.join(folder, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2, ensure_ascii=False)
    with open(os.path.join(folder, "results.md"), "w", encoding="utf-8") as fh:
        fh.write(render(summary))


# ---------------------------------------------------------------------- tables
def _cell(block: dict, metric: str) -> str:
    ci = (block.get("ci") or {}).get(metric) or []
    text = f"{100 * block[metric]:.1f}"
    return text + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "")


def scores_table(results: dict[str, dict], metric: str) -> str:
    """One line per row: ``metric`` (percent) with its 95% interval per group and overall; the
    header gives each group's question count."""
    rows = list(results)
    first = results[rows[0]]
    groups = list(first["groups"])
    header = ["row"] + [f"{g} (n={first['groups'][g]['questions']})" for g in groups]
    header.append(f"overall (n={first['overall']['questions']})")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        block = results[row]
        cells = [_cell(block["groups"][g], metric) if g in block["groups"] else "-" for g in groups]
        lines.append("| " + " | ".join([row, *cells, _cell(block["overall"], metric)]) + " |")
    return "\n".join(lines) + "\n"


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def costs_table(costs: dict[str, dict]) -> str:
    """One line per row: state and KV bytes per history, the KV bytes of the whole history, write time
    per history, answer time, prompt and context tokens per question."""
    header = [
        "row",
        "memory state / history",
        "KV kept / history",
        "context KV / question",
        "KV of the whole history",
        "write s / history",
        "answer s / question",
        "prompt tokens / question",
        "context turns / question",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row, c in costs.items():
        cells = [
            row,
            _size(c["state_bytes_per_history"]),
            _size(c["kv_bytes_per_history"]),
            _size(c.get("context_kv_bytes_per_question")),
            _size(c["full_history_kv_bytes"]),
            _number(c["write_s_per_history"], ".3f"),
            _number(c["answer_s_per_question"], ".3f"),
            _number(c["prompt_tokens_per_question"], ".0f"),
            _number(c["context_turns_per_question"], ".1f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _release(settings: dict) -> str:
    """`` (SHA-256 ..., which release)`` for a record of a local DATA file, else nothing."""
    if not settings.get("data_sha256"):
        return ""
    release = settings.get("data_release") or "not an official release this harness knows"
    return f" (SHA-256 {settings['data_sha256'][:16]}..., {release})"


def render(summary: dict) -> str:
    """``results.md``: where, when and from which files; the rows; each protocol's scores; the costs."""
    settings = summary.get("settings", {})
    metric = summary["metrics"][0]
    boot = summary["bootstrap"]
    lines = [
        f"# {summary['benchmark']}: {', '.join(summary['rows'])} ({summary.get('protocol') or 'own'} prompts)",
        "",
        f"- when: {summary['date']}; where: {summary['where']['device']}, "
        f"{summary['where']['torch_threads']} torch threads",
        f"- data: {settings.get('data')}{_release(settings)}; model: {settings.get('model')}; "
        f"adapter: {settings.get('adapter')}",
        f"- window: {summary['window']} positions ({summary.get('window_from')}); bm25 top-k: {summary['top_k']}; "
        f"{summary['histories']} histories, {summary['questions']} questions",
        f"- intervals: {int(100 * boot['level'])}% percentile bootstrap over questions, "
        f"{boot['resamples']} resamples, seed {boot['seed']}",
    ]
    if summary.get("command"):
        lines.append(f"- command: `{summary['command']}`")
    lines += ["", "| row | what it is |", "|---|---|"]
    lines += [f"| {row} | {summary.get('row_notes', {}).get(row, '')} |" for row in summary["rows"]]
    by_protocol = summary.get("by_protocol") or {summary.get("protocol") or "own": summary["results"]}
    for protocol, results in by_protocol.items():
        lines += ["", f"## {metric} (%), {protocol} scoring", "", scores_table(results, metric)]
    lines += ["", "## Costs", "", costs_table(summary["costs"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m lstmem_peft.eval.row_report RUN``: redraw ``RUN/results.md`` from ``RUN/summary.json``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m lstmem_peft.eval.row_report RUN", file=sys.stderr)
        return 2
    with open(os.path.join(args[0], "summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    text = render(summary)
    with open(os.path.join(args[0], "results.md"), "w", encoding="utf-8") as fh:
        fh.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
