"""The short table that ends a GPU acceptance run (:mod:`.acceptance`): :func:`table`, one line
per step (status, largest error, tolerance, seconds, a note) then the totals, and :func:`ok`, whether
the run found nothing wrong."""

from __future__ import annotations

from pathlib import Path


def ok(record: dict) -> bool:
    """Whether the run found nothing wrong: no step failed, errored or ran out of time (skips are listed)."""
    return not any(r["status"] in ("failed", "error", "timed_out") for r in record["rows"])


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
