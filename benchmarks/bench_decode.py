"""Generation with LSTMem vs the plain backbone (adapter disabled) in one process.

    python benchmarks/bench_decode.py                         # CPU preset: hidden 1024, 8 layers
    python benchmarks/bench_decode.py --prompt 256 --new 32 --reps 6 --out benchmarks/out/decode_cpu.json

Times ``generate`` (prompt prefill plus ``--new`` greedy tokens, min_new_tokens = new) from an empty
memory, with memory on every layer (n_h 4, r 8), alternating the order of the two models in each
repetition after one warm-up each; reports medians and min-max, and the median of the per-repetition
ratios (both models timed back to back: robust to slow changes of the machine's load). Weights are
random: timing does not need trained weights. Other processes on the machine (a test run, another
benchmark) distort the figures: run it alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch
import transformers
from peft import get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from lstmem_peft import LSTMemConfig, MemoryCache
from lstmem_peft.cli.bench.command import adapter_off


def random_model(hidden: int, layers: int):
    """A random-init Qwen3 of width ``hidden`` (heads of 64, 2 queries per KV head, MLP 2.75x) with
    an LSTMem adapter (memory on every layer, n_h 4, r 8), in eval mode, seed 0."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=int(2.75 * hidden),
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        head_dim=64,
    )
    return get_peft_model(Qwen3ForCausalLM(config).eval(), LSTMemConfig()).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = random_model(args.hidden, args.layers)
    config = model.get_base_model().config
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt))
    gen = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)

    def run(with_memory: bool) -> float:
        # PEFT's disable_adapter() walks the model on entry and exit: outside the clock
        with torch.no_grad(), adapter_off(model)(with_memory):
            start = time.perf_counter()
            if with_memory:
                model.generate(input_ids=prompt, memory_cache=MemoryCache(), **gen)
            else:
                model.generate(input_ids=prompt, **gen)
            return time.perf_counter() - start

    run(True), run(False)  # warm-ups
    times = {True: [], False: []}
    for i in range(args.reps):
        for with_memory in (True, False) if i % 2 else (False, True):
            times[with_memory].append(run(with_memory))
    med = {k: statistics.median(v) for k, v in times.items()}
    # each repetition times both models back to back: its ratio is robust to slow load changes
    paired = statistics.median(a / b for a, b in zip(times[True], times[False], strict=True))
    record = dict(
        benchmark="decode",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=f"CPU ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)",
        torch=torch.__version__,
        transformers=transformers.__version__,
        hidden=args.hidden,
        layers=args.layers,
        prompt=args.prompt,
        new_tokens=args.new,
        reps=args.reps,
        lstmem_s=dict(median=med[True], min=min(times[True]), max=max(times[True])),
        plain_s=dict(median=med[False], min=min(times[False]), max=max(times[False])),
        ratio=med[True] / med[False],
        ratio_paired_median=paired,
    )
    print(
        f"lstmem {med[True]:.3f} s  plain {med[False]:.3f} s  ratio {record['ratio']:.3f}  (paired {paired:.3f})"
    )
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=2)


if __name__ == "__main__":
    main()
