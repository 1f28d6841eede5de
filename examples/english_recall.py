"""Recall of English facts by history length on a real model: the README's table (issue 45).

    python examples/english_recall.py --model smollm2-135m --adapter smollm2-135m-english-numbers \\
        --relations age,appointment,room,extension,price --lengths 64,1024,4096,12288 --episodes 16 \\
        --out /tmp/english-recall

For each history length, ``--episodes`` held-out English episodes (``english_episodes(split="heldout")``:
names, sentence forms and chatter training never saw; ``--facts`` facts stated once among chatter, the
history padded with chatter to about that many tokens), one greedy answer each under every condition of
:mod:`lstmem_peft.eval.english_recall`: the whole history in the plain model's prompt (where it fits
the window), the history's last tokens that fit the window, no history, and memory only. Writes
``<out>/recall.json`` (settings, where and when, every answer, per-length recall with 95% bootstrap
intervals) and ``<out>/recall.md`` (the table). Rerun the same command to resume: answered episodes are
kept in ``<out>/journal.jsonl``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="smollm2-135m", help="backbone (a short name of `lstmem models`, a folder)"
    )
    ap.add_argument(
        "--adapter",
        default=None,
        help="the LSTMem adapter: a folder or a shipped adapter's short name (the memory condition needs one)",
    )
    ap.add_argument("--out", required=True, help="output folder (resumed when it holds a journal)")
    ap.add_argument("--lengths", default="64,512,4096", help="history lengths in tokens, comma separated")
    ap.add_argument("--episodes", type=int, default=24, help="held-out episodes per length")
    ap.add_argument("--facts", default="1", help="facts per history: N or LOW-HIGH")
    ap.add_argument("--relations", default="", help="comma list of relations ('': every held-out one)")
    ap.add_argument(
        "--window", type=int, default=None, help="the prompt window (default: the model's positions)"
    )
    ap.add_argument("--conditions", default="context,window,none,memory")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=None, help="history block (default: the adapter's)")
    ap.add_argument("--seed", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from lstmem_cli.quiet import quiet_command

    quiet_command(loads_models=True)
    from lstmem_peft.eval.english_recall import CONDITION_TITLES, markdown_table, recall_by_length
    from lstmem_peft.training.english import english_episodes
    from lstmem_peft.tuner.loading import load_model_and_adapter

    conditions = [c for c in args.conditions.split(",") if c]
    if "memory" in conditions and args.adapter is None:
        ap.error("the memory condition needs --adapter (or leave it out of --conditions)")
    lengths = sorted(int(x) for x in args.lengths.split(","))
    low, _, high = args.facts.partition("-")
    facts = (int(low), int(high or low))
    relations = args.relations.split(",") if args.relations else None
    model, tokenizer = load_model_and_adapter(args.model, args.adapter, dtype="float32", device="cpu")
    window = args.window or model.config.max_position_embeddings

    def episodes_for(length: int) -> list[dict]:
        return english_episodes(
            args.episodes,
            "heldout",
            seed=args.seed + length,
            num_facts=facts,
            chatter=(1.0, 3.0),
            history_tokens=length,
            tokenizer=tokenizer,
            same_relation=1.0,
            style="notes",
            relations=relations,
        )

    os.makedirs(args.out, exist_ok=True)
    journal = os.path.join(args.out, "journal.jsonl")
    done: dict[int, list[dict]] = {}
    if os.path.exists(journal):
        with open(journal) as fh:
            for line in fh:
                if line.strip():
                    entry = json.loads(line)
                    done.setdefault(entry["length"], []).append(entry["record"])

    def on_record(length: int, record: dict) -> None:
        with open(journal, "a") as fh:
            fh.write(json.dumps({"length": length, "record": record}) + "\n")

    start = time.time()
    result = recall_by_length(
        model,
        tokenizer,
        episodes_for,
        lengths,
        conditions=conditions,
        window=window,
        max_new_tokens=args.max_new_tokens,
        block_size=args.block_size,
        done=done,
        on_record=on_record,
    )
    result.update(
        settings=vars(args),
        titles={c: CONDITION_TITLES[c] for c in conditions},
        where=f"{platform.machine()} CPU, torch {torch.__version__}, {torch.get_num_threads()} threads",
        versions={name: importlib.metadata.version(name) for name in ("transformers", "peft", "lstmem-peft")},
        when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        seconds_this_run=round(time.time() - start, 1),
    )
    with open(os.path.join(args.out, "recall.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    table = markdown_table(result)
    with open(os.path.join(args.out, "recall.md"), "w") as fh:
        fh.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
