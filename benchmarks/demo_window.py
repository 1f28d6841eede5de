"""Does LSTMem memory add recall past the backbone's window? (issue 26, the paper's setting)

The demo's sweep (``lstmem demo --sweep``, docs/demo.md "Past the window") scores "memory + window"
with the shipped adapters, which were trained memory-only: the question alone read memory. Here
adapters are trained for the setting the paper evaluates, recent history in the context window and
the whole history in memory, and scored against the plain backbone cut to the same window, on the
same held-out episodes.

Training episodes (:func:`window_training_rows`): histories of ``--min-facts`` to ``--max-facts``
key-value facts (:func:`~lstmem_peft.training.data.long_recall_episodes`: the asked key appears
once, anywhere), written into memory by :class:`~lstmem_peft.training.trainer.LSTMemTrainer` in
blocks of 64 tokens with block-end feedback (stage 1: gradients through writing and feedback); the
read sequence is what :func:`lstmem_peft.cli.demo.recall.window_row` keeps, BOS, the last history tokens
that fit the demo's 64-token :data:`~lstmem_peft.cli.demo.recall.WINDOW`, the question, then the answer.
So a fact that fell out of the window can only come from memory. ``--memory-only-share`` of the
episodes instead hold 1 to 8 facts with the question alone (the shipped recipe's histories, which
bootstrap the key-value binding); ``--init shipped`` starts from the shipped full adapter instead of
the paper's initialisation. Everything else is the shipped recipe
(:func:`lstmem_peft.cli.demo.training.train_adapter`: the full adapter n_h 4, r 8, alpha 16 on both layers,
batch 64, lr 3e-3 cosine, 5% warmup, no context dropout).

Scoring (:func:`score`, 512 episodes per length, the same episodes for every run, so runs pair):
:func:`lstmem_peft.cli.demo.sweep.recall_conditions` on histories of 16, 32, 64 and 128 facts gives per
episode ``memory+window`` (this adapter), ``memory/full`` (this adapter, question alone),
``window`` (plain backbone cut to the window), ``in_context`` (plain backbone, whole history) and
``no_history``; each is reported over all episodes and over those whose asked fact fell outside the
window (the asked key's token is not in the window's history part), where only memory can help.
Also per length: the discordant pairs of memory + window against the window alone (episodes one
gets right and the other wrong), and the cells' RMS and saturation after writing.

Each run appends one JSON line to ``--out`` (default ``benchmarks/demo/window-runs.jsonl``) with
the date it was recorded (UTC), machine, torch version and timings; ``--summarize`` turns the lines into mean, sample
standard deviation and min-max per recipe (``window-summary.json``); ``--shipped`` scores the
shipped memory-only adapter on the same episodes::

    nice -n 10 python benchmarks/demo_window.py --seed 0                            # window only
    nice -n 10 python benchmarks/demo_window.py --seed 0 --memory-only-share 0.5    # + bootstrap
    nice -n 10 python benchmarks/demo_window.py --seed 0 --steps 300 --init shipped
    nice -n 10 python benchmarks/demo_window.py --shipped
    python benchmarks/demo_window.py --summarize

``--quick`` is a scaled-down run (a few steps, few episodes, 16 and 32 facts) for the test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from lstmem_peft.cli.demo.recall import WINDOW, window_row
from lstmem_peft.cli.demo.sweep import recall_conditions
from lstmem_peft.cli.demo.training import train_adapter
from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.training.data import left_pad, long_recall_episodes, tokenize_episode
from lstmem_peft.tuner.history import write_history
from lstmem_peft.tuner.loading import load_demo_backbone
from lstmem_peft.utils.offline import DEMO_ASSETS, NUM_KEYS, NUM_VALUES, demo_tokenizer

OUT = Path(__file__).parent / "demo" / "window-runs.jsonl"
#: Held-out episodes: ``EVAL_SEED + facts`` per history length (disjoint from the training seeds).
EVAL_SEED = 9090
EVAL_FACTS = (16, 32, 64, 128)
#: Facts per history in the memory-only share of training (the shipped recipe's 1 to 8).
MEMORY_ONLY_FACTS = (1, 8)


# ---------------------------------------------------------------------- where and when
def environment() -> dict:
    """Date (UTC), machine, Python, torch and transformers versions, threads."""
    import transformers

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores ({platform.node()})",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------- training episodes
def windowed_row(tok, episode: dict, window: int = WINDOW, add_eos: bool = True) -> dict[str, list[int]]:
    """One episode as the trainer's token lists, the read sequence cut to the window.

    ``history_input_ids`` (BOS + the whole history, all of it written into memory); ``input_ids``:
    :func:`~lstmem_peft.cli.demo.recall.window_row`, i.e. BOS, the last history tokens that fit ``window``
    beside the question, the question, then the answer (EOS included when ``add_eos``); ``labels``:
    -100 except on the answer. The same rows the demo's "memory + window" condition scores."""
    row = tokenize_episode(tok, episode, history_max_tokens=1 << 30, add_eos=add_eos)
    n_answer = sum(1 for y in row["labels"] if y != -100)
    read = window_row(tok, row["history_input_ids"], row["input_ids"], n_answer, window)
    return {
        "history_input_ids": row["history_input_ids"],
        "input_ids": read,
        "labels": [-100] * (len(read) - n_answer) + read[len(read) - n_answer :],
    }


def window_training_rows(
    tok,
    num_rows: int,
    min_facts: int,
    max_facts: int,
    memory_only_share: float = 0.0,
    window: int = WINDOW,
    seed: int = 0,
) -> list[dict[str, list[int]]]:
    """``num_rows`` training rows, shuffled.

    A share ``1 - memory_only_share`` are :func:`windowed_row` episodes with ``min_facts`` to
    ``max_facts`` facts (uniform, equally many per length); the rest hold 1 to 8 facts with the
    question alone (what the shipped adapters trained on). Each length draws its episodes from its
    own seed, ``seed * 1000 + facts`` (windowed) or ``seed * 1000 + 500 + facts`` (memory-only), so
    they never coincide with :data:`EVAL_SEED`'s held-out episodes for seeds below 9."""
    if not 1 <= min_facts <= max_facts:
        raise ValueError(f"need 1 <= min_facts <= max_facts, got {min_facts} and {max_facts}")
    if not 0.0 <= memory_only_share < 1.0:
        raise ValueError(f"memory_only_share must be in [0, 1), got {memory_only_share}")
    n_memory = round(num_rows * memory_only_share)
    rows = []
    lengths = range(min_facts, max_facts + 1)
    per = -(-(num_rows - n_memory) // len(lengths))
    for n in lengths:
        rows += [windowed_row(tok, e, window) for e in long_recall_episodes(per, n, seed=seed * 1000 + n)]
    rows = rows[: num_rows - n_memory]
    if n_memory:
        short = range(MEMORY_ONLY_FACTS[0], MEMORY_ONLY_FACTS[1] + 1)
        per = -(-n_memory // len(short))
        memory_only = [
            tokenize_episode(tok, e)
            for n in short
            for e in long_recall_episodes(per, n, seed=seed * 1000 + 500 + n)
        ]
        rows += memory_only[:n_memory]
    random.Random(seed).shuffle(rows)
    return rows


def train_window_adapter(
    backbone,
    rows: list[dict],
    max_steps: int,
    seed: int,
    init: str = "fresh",
    batch_size: int = 64,
    lr: float = 3e-3,
    output_dir: str | None = None,
):
    """Train an adapter on ``rows`` with the shipped recipe (:func:`lstmem_peft.cli.demo.training.train_adapter`);
    returns ``(model, trainer)``. ``init``: ``"fresh"`` (the paper's initialisation, the demo's adapter
    config) or ``"shipped"`` (the shipped full adapter's weights, trained further)."""
    if init not in ("fresh", "shipped"):
        raise ValueError(f"init must be 'fresh' or 'shipped', got {init!r}")
    model = None
    if init == "shipped":
        from peft import PeftModel

        model = PeftModel.from_pretrained(backbone, DEMO_ASSETS / "adapter_full", is_trainable=True)
    return train_adapter(
        backbone, max_steps=max_steps, batch_size=batch_size, lr=lr, seed=seed, output_dir=output_dir,
        progress=False, rows=rows, model=model,
    )  # fmt: skip


# ---------------------------------------------------------------------- scoring
def outside_window(tok, episodes: list[dict], window: int = WINDOW) -> torch.Tensor:
    """Per episode: did the asked fact fall out of the window? True when the asked key's token is
    not among the history tokens :func:`~lstmem_peft.cli.demo.recall.window_row` keeps (a fact cut in two
    at the window's edge counts as outside: its key is gone)."""
    flags = []
    for e in episodes:
        row = tokenize_episode(tok, e, history_max_tokens=1 << 30, add_eos=False)
        n_answer = sum(1 for y in row["labels"] if y != -100)
        read = window_row(tok, row["history_input_ids"], row["input_ids"], n_answer, window)
        question = len(row["input_ids"]) - n_answer - (tok.bos_token_id is not None)
        kept = read[: len(read) - n_answer - question]
        key = tok(e["prompt"], add_special_tokens=False)["input_ids"][-1]
        flags.append(key not in kept)
    return torch.tensor(flags)


@torch.no_grad()
def cell_statistics(model, tok, episodes: list[dict], batch_size: int = 128) -> list[dict]:
    """Per memory layer, after writing the histories: RMS of the cell ``C`` and the share of its
    entries with ``|C| > 2`` (where ``tanh`` in ``D = o * tanh(C) + ...`` is saturated)."""
    sums: list[list[float]] = []
    count = 0
    for i in range(0, len(episodes), batch_size):
        rows = [
            tokenize_episode(tok, e, history_max_tokens=1 << 30)["history_input_ids"]
            for e in episodes[i : i + batch_size]
        ]
        ids, mask = left_pad(rows, tok.pad_token_id)
        cache = MemoryCache()
        write_history(model, ids, cache, attention_mask=mask, progress=False)
        for j, layer in enumerate(cache.layers):
            if len(sums) <= j:
                sums.append([0.0, 0.0])
            c = layer.cell.double()
            sums[j][0] += c.pow(2).mean().item() * len(rows)
            sums[j][1] += (c.abs() > 2).double().mean().item() * len(rows)
        count += len(rows)
    return [
        {"cell_rms": round((s / count) ** 0.5, 3), "cell_saturated": round(t / count, 4)} for s, t in sums
    ]


def _mean(x: torch.Tensor) -> float | None:
    return round(x.float().mean().item(), 4) if x.numel() else None


@torch.no_grad()
def score(model, tok, facts=EVAL_FACTS, num_episodes: int = 512, window: int = WINDOW) -> dict:
    """Recall per history length under every condition, overall and for the asked facts that fell
    outside the window; the discordant pairs of memory + window against the window alone."""
    out = {}
    for n in facts:
        episodes = long_recall_episodes(num_episodes, n, NUM_KEYS, NUM_VALUES, seed=EVAL_SEED + n)
        hits = recall_conditions({"full": model}, tok, episodes, window)
        outside = outside_window(tok, episodes, window)
        row = {
            "episodes": num_episodes,
            "outside_episodes": int(outside.sum()),
            "recall": {k: _mean(v) for k, v in hits.items()},
            "recall_outside": {k: _mean(v[outside]) for k, v in hits.items()},
            "recall_inside": {k: _mean(v[~outside]) for k, v in hits.items()},
        }
        for name, pick in (("all", torch.ones_like(outside)), ("outside", outside)):
            mw, w = hits["memory+window"][pick], hits["window"][pick]
            row[f"discordant_{name}"] = {
                "memory_window_only": int((mw & ~w).sum()),
                "window_only": int((w & ~mw).sum()),
            }
        row["cells"] = cell_statistics(model, tok, episodes)
        out[str(n)] = row
    return out


def _append(out: Path, record: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as fh:
        fh.write(json.dumps(record) + "\n")


def train_and_score(args) -> dict:
    tok = demo_tokenizer()
    rows = window_training_rows(
        tok,
        args.steps * args.batch_size,
        args.min_facts,
        args.max_facts,
        args.memory_only_share,
        seed=args.seed,
    )
    start = time.perf_counter()
    model, trainer = train_window_adapter(
        load_demo_backbone(), rows, args.steps, args.seed, init=args.init, batch_size=args.batch_size
    )
    train_s = round(time.perf_counter() - start, 1)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    start = time.perf_counter()
    scores = score(model, tok, args.facts, args.episodes)
    record = {
        "recipe": recipe_name(args),
        "seed": args.seed,
        "init": args.init,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "train_facts": [args.min_facts, args.max_facts],
        "memory_only_share": args.memory_only_share,
        "window_tokens": WINDOW,
        "train_s": train_s,
        "score_s": round(time.perf_counter() - start, 1),
        "loss_first": round(statistics.fmean(losses[:3]), 4) if losses else None,
        "final_loss": round(statistics.fmean(losses[-3:]), 4) if losses else None,
        "scores": scores,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        **environment(),
    }
    _append(args.out, record)
    return record


def score_shipped(args) -> dict:
    """The shipped full adapter (trained memory-only, seed 42) on the same episodes."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_demo_backbone(), DEMO_ASSETS / "adapter_full").eval()
    start = time.perf_counter()
    record = {
        "recipe": "shipped (memory-only training, 1-8 facts)",
        "seed": 42,
        "init": "fresh",
        "steps": 600,
        "shipped": True,
        "window_tokens": WINDOW,
        "score_s": None,
        "scores": score(model, demo_tokenizer(), args.facts, args.episodes),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        **environment(),
    }
    record["score_s"] = round(time.perf_counter() - start, 1)
    _append(args.out, record)
    return record


def recipe_name(args) -> str:
    name = f"window {args.min_facts}-{args.max_facts} facts"
    if args.memory_only_share:
        name += f" + {args.memory_only_share:.0%} memory-only 1-8 facts"
    if args.init == "shipped":
        name += ", from the shipped adapter"
    return f"{name}, {args.steps} steps"


# ---------------------------------------------------------------------- summary
def _stats(values: list[float]) -> dict:
    return {
        "mean": round(statistics.fmean(values), 4),
        "sd": round(statistics.stdev(values), 4) if len(values) > 1 else None,
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "n": len(values),
    }


def mcnemar_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for ``b`` and ``c`` discordant pairs (a binomial test of
    ``min(b, c)`` successes in ``b + c`` fair coin flips); 1.0 without discordant pairs."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def summarize(path: Path) -> dict:
    """Per recipe and history length: mean, sample sd and min-max over runs of every condition,
    overall, outside and inside the window, and of the paired gain of memory + window over the
    window alone (same episodes); the discordant pairs per run and summed over runs."""
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    recipes: dict[str, list[dict]] = {}
    for r in runs:
        recipes.setdefault(r["recipe"], []).append(r)
    summary = {"runs": len(runs), "source": path.name, "recipes": {}}
    for name, mine in recipes.items():
        entry = {
            "seeds": [r["seed"] for r in mine],
            "dates": sorted({r["date"][:10] for r in mine}),
            "machines": sorted({r["machine"] for r in mine}),
            "torch": sorted({r["torch"] for r in mine}),
        }
        for key in ("train_s", "score_s", "final_loss"):
            vals = [r[key] for r in mine if r.get(key) is not None]
            if vals:
                entry[key] = _stats(vals)
        for n in mine[0]["scores"]:
            rows = [r["scores"][n] for r in mine if n in r["scores"]]
            by = {"episodes": rows[0]["episodes"], "outside_episodes": rows[0]["outside_episodes"]}
            for part in ("recall", "recall_outside", "recall_inside"):
                by[part] = {
                    k: _stats([row[part][k] for row in rows])
                    for k in rows[0][part]
                    if rows[0][part][k] is not None
                }
                if rows[0][part].get("memory+window") is not None:
                    gains = [row[part]["memory+window"] - row[part]["window"] for row in rows]
                    by[part]["gain_memory+window_over_window"] = {
                        **_stats(gains),
                        "positive_runs": sum(g > 0 for g in gains),
                    }
            for part in ("all", "outside"):
                runs_ = [
                    {**d, "mcnemar_p": float(f"{mcnemar_p(d['memory_window_only'], d['window_only']):.2g}")}
                    for d in (row[f"discordant_{part}"] for row in rows)
                ]
                by[f"discordant_{part}"] = {
                    "per_run": runs_,
                    **{k: sum(d[k] for d in runs_) for k in ("memory_window_only", "window_only")},
                }
            by["cells"] = [row["cells"] for row in rows]
            entry[f"facts_{n}"] = by
        summary["recipes"][name] = entry
    summary["chance"] = 1 / NUM_VALUES
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--min-facts", type=int, default=16)
    parser.add_argument("--max-facts", type=int, default=48)
    parser.add_argument(
        "--memory-only-share",
        type=float,
        default=0.0,
        help="share of training episodes with 1-8 facts and the question alone (the shipped recipe's)",
    )
    parser.add_argument("--init", choices=("fresh", "shipped"), default="fresh")
    parser.add_argument("--facts", type=int, nargs="+", default=list(EVAL_FACTS))
    parser.add_argument("--episodes", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--summarize", action="store_true")
    parser.add_argument("--shipped", action="store_true", help="score the shipped adapter instead")
    parser.add_argument(
        "--quick", action="store_true", help="scaled down: 20 steps of batch 16, 32 episodes, 16 and 32 facts"
    )
    args = parser.parse_args(argv)
    if args.summarize:
        summary = summarize(args.out)
        path = args.out.with_name("window-summary.json")
        path.write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary, indent=2))
        return
    if args.quick:
        args.steps, args.batch_size, args.episodes, args.facts = 20, 16, 32, [16, 32]
    torch.set_num_threads(args.threads)
    record = score_shipped(args) if args.shipped else train_and_score(args)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
