"""Recall by question position in a conversation through `lstmem serve`, on a real model (issue 45).

    python examples/serve_recall.py --model smollm2-135m --episodes 20 --positions 1,2,4,8 \\
        --out benchmarks/real_model/serve_recall_by_position.json

Starts `lstmem serve --model NAME` (its shipped adapter, or --adapter) on 127.0.0.1 and a free port,
with a fresh session store in a temporary folder and `--context-window` (256 by default: short
enough that chat's fact turn leaves the prompt within 8 turns), then, for each of `--episodes`
held-out English episodes (one fact among chatter; `english_episodes(split="heldout")`, fixed seed),
runs a session with the fact turn and one without it (the floor) on each endpoint, and asks the
question `k` turns after the fact turn for each `k` of `--positions`
(:mod:`lstmem_peft.eval.serve_recall`). Prints the table and writes a JSON record: the command, when
and where, versions, settings, per-cell counts with 95% bootstrap intervals, and every answer. The
server is stopped at the end, also on failure.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import sys
import tempfile
import time


def cpu_model() -> str:
    """The CPU's model name (Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="smollm2-135m", help="backbone: a short name of `lstmem models`, a folder"
    )
    ap.add_argument("--adapter", default=None, help="the adapter (default: the model's shipped one)")
    ap.add_argument("--out", default=None, help="the JSON record to write (default: none)")
    ap.add_argument("--episodes", type=int, default=20)
    ap.add_argument("--positions", default="1,2,4,8", help="question positions k, turns after the fact turn")
    ap.add_argument("--endpoints", default="completions,chat")
    ap.add_argument("--relations", default=None, help="comma list (default: the shipped adapter's)")
    ap.add_argument("--seed", type=int, default=4600, help="held-out episodes' seed")
    ap.add_argument("--context-window", type=int, default=256)
    ap.add_argument("--question-tokens", type=int, default=8, help="max_tokens of a question")
    ap.add_argument("--chat-tokens", type=int, default=8, help="max_tokens of a chat chatter turn")
    ap.add_argument("--concurrency", type=int, default=4, help="sessions at a time")
    ap.add_argument("--threads", type=int, default=2, help="the server's --threads")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per request")
    args = ap.parse_args()

    from lstmem_cli.quiet import quiet_command

    quiet_command(loads_models=True)
    from transformers import AutoTokenizer

    from lstmem_peft.eval import serve_recall as sr
    from lstmem_peft.tuner.backbones import resolve_model
    from lstmem_peft.utils.chat import ChatFormat
    from lstmem_peft.utils.shipped_adapters import SHIPPED_ADAPTERS

    positions = sorted(int(x) for x in args.positions.split(","))
    endpoints = [e for e in args.endpoints.split(",") if e]
    shipped = [a for a in SHIPPED_ADAPTERS.values() if a.backbone == args.model]
    if args.relations:
        relations = args.relations.split(",")
    else:
        relations = list(shipped[0].relations) if shipped and shipped[0].relations else None
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    episodes = sr.position_episodes(args.episodes, args.seed, relations, max(positions))
    settings = sr.Settings(
        positions=positions,
        window=args.context_window,
        chatter_tokens={"completions": 1, "chat": args.chat_tokens},
        question_tokens=args.question_tokens,
        text_prefix=tokenizer.bos_token or "",
        fmt=ChatFormat(tokenizer),
    )
    serve_args = ["--model", args.model, "--context-window", str(args.context_window)]
    serve_args += ["--threads", str(args.threads)] + (["--adapter", args.adapter] if args.adapter else [])
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="serve-recall-") as tmp:
        with sr.ServerProcess(
            serve_args, os.path.join(tmp, "store"), os.path.join(tmp, "serve.log")
        ) as server:
            client = sr.Client(server.url, timeout=args.timeout)
            records = sr.measure(
                client,
                episodes,
                settings,
                endpoints,
                concurrency=args.concurrency,
                progress=lambda line: print(line, file=sys.stderr, flush=True),
            )
            served = client.model
    rows = sr.summarise(records)
    table = sr.markdown_table(rows)
    print(table)
    if args.out:
        import torch

        record = {
            "what": "recall by question position in a conversation through lstmem serve (issue 45 item 3)",
            "command": "python " + shlex.join(sys.argv),
            "serve": "lstmem serve " + shlex.join(serve_args),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "seconds": round(time.time() - started, 1),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "where": {
                "machine": platform.machine(),
                "processor": cpu_model(),
                "cpus": os.cpu_count(),
                "load_average_after": os.getloadavg(),
            },
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                **{n: importlib.metadata.version(n) for n in ("transformers", "peft", "lstmem-peft")},
            },
            "served_model": served,
            "settings": {**vars(args), "relations": relations, "split": "heldout"},
            "endpoints": {e: sr.ENDPOINT_TITLES[e] for e in endpoints},
            "scores": {
                "exact": "the normalised answer starts with the normalised value (english_recall.recall_hit)",
                "leading_digit": "the answer's first word starts with the value's first digit (numbers only)",
                "mentions": "the normalised value appears anywhere in the normalised answer",
            },
            "rows": [{**row, "where": sr.where(row)} for row in rows],
            "table": table,
            "records": records,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=1)
            fh.write("\n")


if __name__ == "__main__":
    main()
