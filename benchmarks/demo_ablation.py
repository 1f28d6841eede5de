"""Do depth coupling and block-end feedback change recall on the demo backbone? (issue 26, item 2)

Trains fresh adapters on the shipped demo backbone with the shipped recipe
(:func:`lstmem_peft.cli.demo.training.train_adapter`: LSTMemTrainer, histories of 1 to 8 facts, batch 64,
lr 3e-3 cosine), one per (variant, seed), and scores each on the same held-out episodes:

* ``one_block_8``: 8 facts in one block (the shipped demo's task);
* ``facts_16`` / ``facts_32``: 16 and 32 facts (1 and 2 blocks of 64 tokens, feedback after each;
  the asked key appears once, anywhere);
* ``turns_4x2``: 8 facts written as 4 turns of 2 facts (one ``write_history`` call each, so
  block-end feedback runs after every 2 facts);
* ``update_newest``: 8 facts, then a later turn re-assigns 4 of the keys; the question asks an
  updated key and the newest value is gold (``update_oldest`` counts answers with the old value);
* ``update_kept``: the same histories, asking a key the later turn did not touch.

Adapters trained with feedback are also scored with feedback switched off while writing
(``recall_feedback_off_at_eval``): the same weights, so the difference is what feedback does at
inference, free of seed-to-seed variation.

Also the training loss (mean of the last 3 logged values). Each run appends one JSON line to
``--out`` (default ``benchmarks/demo/ablation-runs.jsonl``); ``--summarize`` turns the lines into
mean, sample standard deviation and min-max per variant (``ablation-summary.json``); ``--shipped``
scores the shipped adapters (seed 42, same recipe) on the same episodes::

    nice -n 10 python benchmarks/demo_ablation.py --variant full --seed 0
    nice -n 10 python benchmarks/demo_ablation.py --shipped
    python benchmarks/demo_ablation.py --summarize
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lstmem_peft.cli.bench.records import environment
from lstmem_peft.cli.demo import command as demo
from lstmem_peft.cli.demo import recall as demo_recall
from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.training.data import long_recall_episodes
from lstmem_peft.tuner.history import write_history

OUT = Path(__file__).parent / "demo" / "ablation-runs.jsonl"
EVAL_SEED = 4242


def turn_ids(tok, texts: list[str], first: bool) -> torch.Tensor:
    """Token ids of one turn per row (BOS first on the first turn)."""
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    if first:
        ids = [[tok.bos_token_id] + i for i in ids]
    return torch.tensor(ids)


@torch.no_grad()
def score(model, tok, num: int = 512) -> dict:
    out = {}
    for name, facts in (("one_block_8", 8), ("facts_16", 16), ("facts_32", 32)):
        episodes = long_recall_episodes(num, facts, seed=EVAL_SEED + facts)
        histories, reads, n_ans = demo_recall.episode_rows(tok, episodes)
        cache = demo_recall.write_histories(model, tok, histories)
        out[name] = demo_recall.answers_correct(model, tok, reads, n_ans, cache).float().mean().item()
    # 8 facts in 4 turns of 2: feedback after every 2 facts
    episodes = long_recall_episodes(num, 8, seed=EVAL_SEED + 8)
    cache = MemoryCache()
    for t in range(4):
        texts = [" ".join(e["history"].split(" ")[6 * t : 6 * t + 6]) for e in episodes]
        write_history(model, turn_ids(tok, texts, first=t == 0), cache, progress=False)
    histories, reads, n_ans = demo_recall.episode_rows(tok, episodes)
    out["turns_4x2"] = demo_recall.answers_correct(model, tok, reads, n_ans, cache).float().mean().item()
    # updates: the newest value wins (lstmem_peft.cli.demo.recall.evaluate_updates)
    updates = demo.evaluate_updates(model, tok, num_episodes=num, seed=EVAL_SEED)
    out.update({k: v for k, v in updates.items() if k.startswith("update_")})
    return {k: round(v, 4) for k, v in out.items()}


def score_without_feedback(model, num: int = 512) -> dict | None:
    """The same weights scored with block-end feedback switched off while writing (``None`` for an
    adapter trained without it): what feedback does at inference, free of seed-to-seed variation."""
    config = next(iter(model.peft_config.values()))
    if not config.block_feedback or not config.depth_coupling:
        return None
    with demo.feedback_off(model):
        return score(model, demo.demo_tokenizer(), num)


def train_and_score(variant: str, seed: int, steps: int, out: Path) -> dict:
    start = time.perf_counter()
    model, trainer = demo.train_adapter(
        demo.load_backbone(),
        demo.ADAPTERS[variant],
        max_steps=steps,
        seed=seed,
        output_dir=tempfile.mkdtemp(prefix="lstmem-ablation-"),
        progress=False,
    )
    seconds = round(time.perf_counter() - start, 1)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    record = {
        "variant": variant,
        "seed": seed,
        "steps": steps,
        "train_s": seconds,
        "threads": torch.get_num_threads(),
        "final_loss": round(statistics.fmean(losses[-3:]), 4),
        "recall": score(model.eval(), demo.demo_tokenizer()),
        "recall_feedback_off_at_eval": score_without_feedback(model),
        **environment(torch.device("cpu")),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as fh:
        fh.write(json.dumps(record) + "\n")
    return record


def score_shipped(out: Path) -> list[dict]:
    """The shipped adapters (seed 42, the same recipe, trained by ``lstmem_peft.cli.demo.training.build``) on
    the same episodes."""
    from peft import PeftModel

    records = []
    for variant in demo.ADAPTERS:
        model = PeftModel.from_pretrained(
            demo.load_backbone(), demo.DEMO_ASSETS / f"adapter_{variant}"
        ).eval()
        record = {
            "variant": variant,
            "seed": 42,
            "steps": 600,
            "shipped": True,
            "final_loss": None,
            "recall": score(model, demo.demo_tokenizer()),
            "recall_feedback_off_at_eval": score_without_feedback(model),
            **environment(torch.device("cpu")),
        }
        with out.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        records.append(record)
    return records


def summarize(path: Path) -> dict:
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    summary = {"runs": len(runs), "source": path.name, "variants": {}}
    for variant in demo.ADAPTERS:
        mine = [r for r in runs if r["variant"] == variant]
        if not mine:
            continue
        losses = [r["final_loss"] for r in mine if r.get("final_loss") is not None]
        metrics = {"final_loss": losses} if losses else {}
        for key in mine[0]["recall"]:
            metrics[key] = [r["recall"][key] for r in mine]
            off = [r["recall_feedback_off_at_eval"] for r in mine if r.get("recall_feedback_off_at_eval")]
            if len(off) == len(mine):
                metrics[f"{key}/feedback_off_at_eval"] = [o[key] for o in off]
                metrics[f"{key}/feedback_gain_at_eval"] = [
                    r["recall"][key] - o[key] for r, o in zip(mine, off, strict=True)
                ]
        summary["variants"][variant] = {
            "seeds": [r["seed"] for r in mine],
            **{
                k: {
                    "mean": round(statistics.fmean(v), 4),
                    "sd": round(statistics.stdev(v), 4) if len(v) > 1 else None,
                    "min": round(min(v), 4),
                    "max": round(max(v), 4),
                    "n": len(v),
                    **({"positive_runs": sum(x > 0 for x in v)} if k.endswith("_gain_at_eval") else {}),
                }
                for k, v in metrics.items()
            },
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", choices=list(demo.ADAPTERS), default="full")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--summarize", action="store_true")
    parser.add_argument(
        "--shipped", action="store_true", help="score the shipped adapters instead of training"
    )
    args = parser.parse_args()
    if args.shipped:
        torch.set_num_threads(args.threads)
        for record in score_shipped(args.out):
            print(json.dumps(record))
        return
    if args.summarize:
        summary = summarize(args.out)
        path = args.out.with_name("ablation-summary.json")
        path.write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary, indent=2))
        return
    torch.set_num_threads(args.threads)
    print(json.dumps(train_and_score(args.variant, args.seed, args.steps, args.out)))


if __name__ == "__main__":
    main()
