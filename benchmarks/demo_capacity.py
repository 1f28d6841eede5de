"""Where does memory-only recall fall, and why? (issue 26, item 1: capacity)

The shipped demo adapter (n_h 4, r 8: 2 x 4 x 8 x 8 = 512 cell numbers per sequence) recalls 0.85
of 8 facts, 0.53 of 16 and is at chance by 64. Two things could set that limit: the state's size,
or the training histories (1 to 8 facts, so nothing taught the memory to hold more). This trains
fresh adapters on the shipped backbone with the shipped recipe (:func:`lstmem_peft.cli.demo.training.train_adapter`,
600 steps, batch 64, lr 3e-3 cosine) varying ``r`` and the longest training history, and scores
memory-only recall on held-out histories of 8 to 64 facts (the asked key appears once, anywhere;
blocks of 64 tokens, feedback after each; the same episodes as ``demo_ablation.py`` at 8, 16, 32)::

    nice -n 10 python benchmarks/demo_capacity.py --r 16 --max-facts 16 --seed 0
    nice -n 10 python benchmarks/demo_capacity.py --shipped   # the shipped adapter on the same episodes

Each run appends one JSON line to ``benchmarks/demo/capacity-runs.jsonl``.
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
from lstmem_peft.training.data import long_recall_episodes

OUT = Path(__file__).parent / "demo" / "capacity-runs.jsonl"
EVAL_SEED = 4242  # as demo_ablation.py
FACTS = (8, 16, 24, 32, 64)


@torch.no_grad()
def memory_recall(model, tok, facts=FACTS, num: int = 512) -> dict:
    out = {}
    for n in facts:
        episodes = long_recall_episodes(num, n, seed=EVAL_SEED + n)
        histories, reads, n_ans = demo_recall.episode_rows(tok, episodes)
        cache = demo_recall.write_histories(model, tok, histories)
        out[str(n)] = round(
            demo_recall.answers_correct(model, tok, reads, n_ans, cache).float().mean().item(), 4
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--max-facts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--shipped", action="store_true", help="score the shipped full adapter (r 8, 1-8 facts)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.shipped:
        from peft import PeftModel

        model = PeftModel.from_pretrained(demo.load_backbone(), demo.DEMO_ASSETS / "adapter_full").eval()
        record = {
            "r": 8,
            "num_heads": 4,
            "max_facts": 8,
            "seed": 42,
            "steps": 600,
            "shipped": True,
            "cell_numbers_total": demo.memory_state_size(model)["cell_numbers_total"],
            "recall_by_facts": memory_recall(model, demo.demo_tokenizer()),
            **environment(torch.device("cpu")),
        }
        with args.out.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        print(json.dumps(record))
        return
    start = time.perf_counter()
    model, trainer = demo.train_adapter(
        demo.load_backbone(),
        {"r": args.r, "num_heads": args.heads},
        max_steps=args.steps,
        seed=args.seed,
        output_dir=tempfile.mkdtemp(prefix="lstmem-capacity-"),
        progress=False,
        max_facts=args.max_facts,
    )
    seconds = round(time.perf_counter() - start, 1)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    size = demo.memory_state_size(model)
    record = {
        "r": args.r,
        "num_heads": args.heads,
        "max_facts": args.max_facts,
        "seed": args.seed,
        "steps": args.steps,
        "train_s": seconds,
        "threads": torch.get_num_threads(),
        "cell_numbers_total": size["cell_numbers_total"],
        "final_loss": round(statistics.fmean(losses[-3:]), 4),
        "recall_by_facts": memory_recall(model.eval(), demo.demo_tokenizer()),
        **environment(torch.device("cpu")),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as fh:
        fh.write(json.dumps(record) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
