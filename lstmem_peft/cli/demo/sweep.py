"""``lstmem demo --sweep``: recall against history length, from one block of facts to many, past the
backbone's :data:`~.recall.WINDOW`, against the plain backbone cut to that window.

:func:`sweep` measures (per length, every condition of :func:`recall_conditions`, recall by the asked
fact's age and the state of the full adapter's cells), :func:`format_sweep` prints the table,
:func:`plot_sweep` draws it and :func:`run_sweep` does all three and writes the record.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.training.data import long_recall_episodes
from lstmem_peft.utils.offline import NUM_KEYS, NUM_VALUES, demo_tokenizer

from .recall import (
    WINDOW,
    answers_correct,
    caption,
    episode_rows,
    in_context_row,
    memory_state_size,
    window_row,
    write_histories,
)

#: History lengths of the sweep, in facts: one block (8 facts, 25 tokens) to 13 (256 facts, 769 tokens).
SWEEP_FACTS = (8, 16, 32, 64, 128, 256)
#: Bucket edges for recall against a fact's age (facts written after it).
AGE_EDGES = (0, 4, 8, 16, 32, 64, 128, 256)


# ---------------------------------------------------------------------- measuring
def cell_statistics(cache: MemoryCache) -> list[dict]:
    """Per memory layer: the RMS of the cell ``C`` and the share of its entries with ``|C| > 2``,
    where ``tanh`` (which ``D = o * tanh(C) + g * D_below`` expresses) is saturated (slope < 0.07)."""
    return [
        {
            "cell_rms": layer.cell.double().pow(2).mean().sqrt().item(),
            "cell_saturated": (layer.cell.abs() > 2).double().mean().item(),
        }
        for layer in cache.layers
    ]


@torch.no_grad()
def recall_conditions(
    models: dict,
    tok,
    episodes: list[dict],
    window: int = WINDOW,
    batch_size: int = 64,
    cells: list | None = None,
) -> dict[str, torch.Tensor]:
    """Per-episode exact-match correctness under every condition of the sweep.

    ``memory/<name>``: the whole history written into that adapter's memory (blocks of its
    ``block_size``, feedback after each), then the question alone. ``memory+window``: the full
    adapter's memory and the window in context (LSTMem as the paper evaluates it; the shipped
    adapters were trained memory-only). ``window``: the plain backbone with history and question
    cut to the last ``window`` tokens (what a user gets without memory). ``in_context``: the plain
    backbone with the whole history in context, window or not. ``no_history``: the question alone.
    ``cells``: if given, receives ``(rows, cell_statistics)`` of the full adapter's memory per batch.
    """
    histories, reads, n_ans = episode_rows(tok, episodes)
    windowed = [window_row(tok, h, r, n, window) for h, r, n in zip(histories, reads, n_ans, strict=True)]
    whole = [in_context_row(tok, h, r) for h, r in zip(histories, reads, strict=True)]
    plain = next(iter(models.values()))
    hits: dict[str, list[torch.Tensor]] = {}

    def add(key, value):
        hits.setdefault(key, []).append(value)

    for i in range(0, len(episodes), batch_size):
        chunk = slice(i, i + batch_size)
        for name, model in models.items():
            cache = write_histories(model, tok, histories[chunk])
            add(f"memory/{name}", answers_correct(model, tok, reads[chunk], n_ans[chunk], cache))
            if name == "full":
                add("memory+window", answers_correct(model, tok, windowed[chunk], n_ans[chunk], cache))
                if cells is not None:
                    cells.append((len(histories[chunk]), cell_statistics(cache)))
        with plain.disable_adapter():
            add("window", answers_correct(plain, tok, windowed[chunk], n_ans[chunk]))
            add("in_context", answers_correct(plain, tok, whole[chunk], n_ans[chunk]))
            add("no_history", answers_correct(plain, tok, reads[chunk], n_ans[chunk]))
    return {k: torch.cat(v) for k, v in hits.items()}


@torch.no_grad()
def sweep(
    models: dict,
    tokenizer=None,
    facts=SWEEP_FACTS,
    num_episodes: int = 256,
    window: int = WINDOW,
    seed: int = 2024,
    progress: bool = False,
) -> dict:
    """Recall against history length, from one block of facts to many, with the window marked.

    Histories come from :func:`~lstmem_peft.training.data.long_recall_episodes` (the asked key appears once,
    anywhere in the history). Returns a JSON-ready record: per length, recall under every condition
    of :func:`recall_conditions`, recall by the asked fact's age, and the sizes that bound it.
    """
    tok = tokenizer or demo_tokenizer()
    full = models.get("full", next(iter(models.values())))
    block = memory_state_size(full)["block_size"]
    window_facts = _window_facts(tok, window)
    edges = sorted(set(AGE_EDGES) | {window_facts})
    start = time.perf_counter()
    rows = []
    for n in tqdm(facts, desc="sweep", disable=not progress):
        episodes = long_recall_episodes(num_episodes, n, NUM_KEYS, NUM_VALUES, seed=seed + n)
        rows.append(_sweep_row(models, tok, episodes, n, window, block, edges))
    return {
        "benchmark": "demo-sweep",
        "window_tokens": window,
        "window_facts": window_facts,
        "num_episodes": num_episodes,
        "num_keys": NUM_KEYS,
        "num_values": NUM_VALUES,
        "chance": 1 / NUM_VALUES,
        "seed": seed,
        "adapters": {name: memory_state_size(m) for name, m in models.items()},
        "rows": rows,
        "seconds": round(time.perf_counter() - start, 1),
    }


def _window_facts(tok, window: int) -> int:
    """How many whole facts fit in ``window`` tokens beside the question."""
    one, two = (episode_rows(tok, long_recall_episodes(1, n))[0][0] for n in (1, 2))
    _, reads, n_ans = episode_rows(tok, long_recall_episodes(1, 1))
    question = len(reads[0]) - n_ans[0]
    return (window - question) // (len(two) - len(one))


def _sweep_row(models: dict, tok, episodes: list[dict], facts: int, window: int, block: int, edges) -> dict:
    """One history length of :func:`sweep`: its sizes, recall per condition overall and by the asked
    fact's age (buckets between ``edges``), and the full adapter's cells after writing."""
    histories, reads, n_ans = episode_rows(tok, episodes)
    cells: list = []
    hits = recall_conditions(models, tok, episodes, window, cells=cells)
    longest = max(len(h) for h in histories)
    context = longest + len(reads[0]) - n_ans[0] - (tok.bos_token_id is not None)
    ages = torch.tensor([e["facts_after"] for e in episodes])
    return {
        "facts": facts,
        "history_tokens": longest,
        "context_tokens": context,
        "blocks": -(-longest // block),
        "fits_window": context <= window,
        "recall": {k: round(v.float().mean().item(), 4) for k, v in hits.items()},
        "by_age": _recall_by_age(hits, ages, edges),
        "full_adapter_cells": _mean_cells(cells),
    }


def _recall_by_age(hits: dict[str, torch.Tensor], ages: torch.Tensor, edges) -> list[dict]:
    """Recall per condition over the episodes whose asked fact has ``lo`` to ``hi - 1`` facts after it,
    for consecutive ``edges`` (empty buckets left out)."""
    by_age = []
    for lo, hi in zip(edges, edges[1:], strict=False):
        pick = (ages >= lo) & (ages < hi)
        if int(pick.sum()):
            by_age.append(
                {
                    "facts_after": [lo, hi - 1],
                    "episodes": int(pick.sum()),
                    **{k: round(v[pick].float().mean().item(), 4) for k, v in hits.items()},
                }
            )
    return by_age


def _mean_cells(cells: list[tuple[int, list[dict]]]) -> list[dict]:
    """Per memory layer, :func:`cell_statistics` over every batch of ``cells`` (``(rows, statistics)``
    pairs), weighted by rows: the RMS of all cells, the share of saturated entries."""
    total = sum(rows for rows, _ in cells)
    return [
        {
            "cell_rms": round((sum(rows * c[i]["cell_rms"] ** 2 for rows, c in cells) / total) ** 0.5, 3),
            "cell_saturated": round(sum(rows * c[i]["cell_saturated"] for rows, c in cells) / total, 4),
        }
        for i in range(len(cells[0][1]) if cells else 0)
    ]


# ---------------------------------------------------------------------- printing and plotting
def format_sweep(record: dict) -> str:
    """One row per history length: the conditions' recall; in context in parentheses where the history
    does not fit the window (given whole anyway)."""
    names = [k for k in record["rows"][0]["recall"] if k.startswith("memory/")]
    head = f"{'facts':>6}{'tokens':>8}{'blocks':>7}" + "".join(f"{n[7:][:17]:>18}" for n in names)
    head += f"{'memory+window':>15}{'window':>8}{'in context':>12}{'no history':>12}"
    explained = caption(
        f"Recall against history length ({record['num_episodes']} episodes per length; the asked key "
        "appears once, anywhere). memory/ADAPTER: the history written into that adapter's memory, then "
        "the question alone reads it. memory+window: the same with the last "
        f"{record['window_tokens']} tokens in context too. window: the plain backbone cut to that window. "
        "in context: the whole history in context. no history: the plain backbone, question alone (the "
        "floor). Recall falls as the history grows: memory's state has a fixed size (last line), "
        "the window keeps only the latest facts, and the backbone never read histories past its window."
    )
    lines = [explained, head, "-" * len(head)]
    for row in record["rows"]:
        r = row["recall"]
        ctx = f"{r['in_context']:.3f}" if row["fits_window"] else f"({r['in_context']:.3f})"
        lines.append(
            f"{row['facts']:>6}{row['history_tokens']:>8}{row['blocks']:>7}"
            + "".join(f"{r[n]:>18.3f}" for n in names)
            + f"{r['memory+window']:>15.3f}{r['window']:>8.3f}{ctx:>12}{r['no_history']:>12.3f}"
        )
    if record["rows"][0].get("full_adapter_cells"):
        lines.append(
            "full adapter's cells after writing, per memory layer (RMS of C, share of |C| > 2 where tanh "
            "saturates): "
            + "; ".join(
                f"{row['facts']} facts "
                + " ".join(
                    f"{c['cell_rms']:.1f}/{c['cell_saturated']:.2f}" for c in row["full_adapter_cells"]
                )
                for row in record["rows"]
            )
        )
    full = record["adapters"].get("full") or next(iter(record["adapters"].values()))
    lines.append(
        f"window: {record['window_tokens']} tokens (the question and the last {record['window_facts']} facts); "
        "(in context) past the window: the whole history given anyway. Memory: "
        f"{full['memory_layers']} layers x n_h {full['num_heads']} x r {full['r']}^2 = "
        f"{full['cell_numbers_total']} cell numbers (+ as many in D) per sequence; chance {record['chance']:.3f}."
    )
    return "\n".join(lines)


#: Line colour, style and width of each adapter's memory-only curve (others: ``_OTHER_ADAPTER``).
_ADAPTER_STYLE = {
    "full": ("C0", "-", 2.4),
    "no_depth_coupling": ("C4", "--", 1.2),
    "no_feedback": ("C2", ":", 1.4),
}
_OTHER_ADAPTER = ("C5", "-", 1.2)
#: The age panel's conditions: colour, marker, label.
_AGE_CONDITIONS = {
    "memory/full": ("C0", "o", "LSTMem memory only (full)"),
    "memory/no_depth_coupling": ("C4", "o", "memory only, no depth coupling"),
    "memory/no_feedback": ("C2", "o", "memory only, no feedback"),
    "window": ("C1", "s", "plain backbone, cut to the window"),
    "memory+window": ("C9", "^", "LSTMem memory + window"),
}


def plot_sweep(record: dict, path: str | Path) -> Path | None:
    """Two panels: recall against history length (window marked) and against the asked fact's age
    in the longest history. Returns the PNG path, or ``None`` (with a message) without matplotlib."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        from lstmem_peft.utils.extras import install_command

        print(f"matplotlib is not installed: no plot ({install_command('bench')})")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12.5, 6))
    _draw_lengths(left, record)
    _draw_ages(right, record)
    full = record["adapters"].get("full") or next(iter(record["adapters"].values()))
    fig.suptitle(
        f"lstmem demo --sweep: {record['num_episodes']} episodes per length; memory "
        f"{full['memory_layers']} layers x {full['num_heads']} heads x {full['r']}x{full['r']} cells "
        f"({full['cell_numbers_total']} numbers); {record.get('device', '')} {record.get('date', '')[:10]}",
        fontsize=9,
    )
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _length_curves(record: dict) -> list[tuple[list, list, str, dict]]:
    """The left panel's curves, in drawing order: ``(x, y, format, line options)`` per condition."""
    rows = record["rows"]
    facts = [r["facts"] for r in rows]
    fits = [r for r in rows if r["fits_window"]]

    def recall(key: str, among: list[dict] = rows) -> list[float]:
        return [r["recall"][key] for r in among]

    curves = []
    for key in (k for k in rows[0]["recall"] if k.startswith("memory/")):
        color, line, width = _ADAPTER_STYLE.get(key[7:], _OTHER_ADAPTER)
        label = f"LSTMem memory only ({key[7:].replace('_', ' ')})"
        curves.append((facts, recall(key), "o", dict(ls=line, lw=width, color=color, label=label)))
    window = f"plain backbone, history cut to its {record['window_tokens']}-token window"
    return curves + [
        (
            facts,
            recall("memory+window"),
            "^-",
            dict(color="C9", lw=1.2, label="LSTMem memory + window in context"),
        ),
        (facts, recall("window"), "s-", dict(color="C1", lw=2, label=window)),
        (
            [r["facts"] for r in fits],
            recall("in_context", fits),
            "D-",
            dict(color="k", label="plain backbone, whole history in context (fits)"),
        ),
        (
            facts,
            recall("in_context"),
            ":",
            dict(color="0.6", label="whole history in context, past the window"),
        ),
        (facts, recall("no_history"), "x-", dict(color="C3", label="no history")),
    ]


def _draw_lengths(ax, record: dict) -> None:
    """Recall against history length (log scale), the window and chance marked."""
    facts = [r["facts"] for r in record["rows"]]
    for x, y, fmt, options in _length_curves(record):
        ax.plot(x, y, fmt, **options)
    ax.axhline(record["chance"], color="0.75", lw=0.8)
    ax.axvline(record["window_facts"], color="C1", ls="--", lw=1)
    ax.text(record["window_facts"] * 1.04, 0.97, "window", color="C1", va="top")
    ax.set_xscale("log", base=2)
    ax.set_xticks(facts, [str(f) for f in facts])
    ax.set_xlabel("facts in the history (3 tokens each)")
    ax.set_ylabel("recall (exact match)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Recall against history length")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)


def _age_curves(record: dict) -> tuple[dict, list[tuple[range, list, str, dict]]]:
    """The history length the age panel shows and its curves, ``(x, y, format, line options)``.

    The length is the first that outgrows the window by half again (32 facts here), where the memory
    still recalls something, so old facts show whether it holds what the window lost."""
    rows = record["rows"]
    past = [r for r in rows if r["facts"] * 2 >= 3 * record["window_facts"]]
    chosen = past[0] if past else rows[-1]
    buckets = chosen["by_age"]
    curves = [
        (
            range(len(buckets)),
            [b[key] for b in buckets],
            marker + "-",
            dict(color=color, lw=2.2 if key in ("memory/full", "window") else 1.0, label=label),
        )
        for key, (color, marker, label) in _AGE_CONDITIONS.items()
        if key in buckets[0]
    ]
    return chosen, curves


def _draw_ages(ax, record: dict) -> None:
    """Recall against the asked fact's age (facts written after it) in one history length."""
    chosen, curves = _age_curves(record)
    buckets = chosen["by_age"]
    for x, y, fmt, options in curves:
        ax.plot(x, y, fmt, **options)
    ax.set_xticks(
        list(range(len(buckets))), [f"{b['facts_after'][0]}-{b['facts_after'][1]}" for b in buckets]
    )
    edge = next((i for i, b in enumerate(buckets) if b["facts_after"][0] >= record["window_facts"]), None)
    if edge is not None:
        ax.axvline(edge - 0.5, color="C1", ls="--", lw=1)
        ax.text(edge - 0.45, 0.97, "past the window", color="C1", va="top", fontsize=8)
    ax.axhline(record["chance"], color="0.75", lw=0.8)
    ax.set_xlabel(f"facts written after the asked one ({chosen['facts']}-fact histories)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Recall against the fact's age")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)


# ---------------------------------------------------------------------- the command's part
def run_sweep(
    models: dict,
    tokenizer=None,
    out: str | Path = ".",
    facts=SWEEP_FACTS,
    num_episodes: int = 256,
    window: int = WINDOW,
    command: str = "lstmem demo --sweep",
) -> dict:
    """The sweep, its table, and its record (``demo-sweep-<stamp>.json``) and plot (``.png``) in ``out``."""
    from ..bench.records import environment

    env = environment(torch.device("cpu"))
    record = sweep(models, tokenizer, facts=facts, num_episodes=num_episodes, window=window, progress=True)
    record.update(env, command=command, threads=torch.get_num_threads())
    print(format_sweep(record))
    stamp = env["date"].replace(":", "").replace("-", "")[:15]
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"demo-sweep-{stamp}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    png = plot_sweep(record, path.with_suffix(".png"))
    return {"record": str(path), "plot": str(png) if png else None, "seconds": record["seconds"]}
