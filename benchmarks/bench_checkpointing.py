"""Peak memory and time of one stage-1 training step with and without gradient checkpointing.

    python benchmarks/bench_checkpointing.py                          # CPU: history 2,048, hidden 512
    python benchmarks/bench_checkpointing.py --history 8192 --hidden 1024 --layers 8 --out results.json

One step as the paper's stage 1 runs it: the history written with gradients in blocks of
``--block`` tokens (block-end feedback after each), then an answer forward and ``backward``. The
backbone is a random Qwen3 (``--hidden`` wide, ``--layers`` deep, 4 query heads; weights frozen,
memory on every layer). Each mode runs in its own process, so that peak figures do not mix: on CUDA
the peak is ``torch.cuda.max_memory_allocated`` above the memory held before the step; on CPU it is
the process's peak resident set (``ru_maxrss``) above the resident set before the step (allocator
caching makes the CPU figure coarse). The checkpointed step is checked to give the same loss.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
import warnings


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def run_one(args) -> dict:
    import torch
    from peft import get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lstmem_peft import LSTMemConfig, MemoryCache, write_history

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        max_position_embeddings=max(args.block, 4096),
    )
    model = get_peft_model(Qwen3ForCausalLM(config), LSTMemConfig(block_size=args.block)).to(device)
    model.train()
    if args.mode == "checkpointing":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.base_model.model.gradient_checkpointing_enable()
    g = torch.Generator().manual_seed(1)
    history = torch.randint(3, args.vocab, (1, args.history), generator=g).to(device)
    question = torch.randint(3, args.vocab, (1, args.answer), generator=g).to(device)

    def step() -> float:
        cache = MemoryCache()
        write_history(model, history, cache, progress=False)
        loss = model(input_ids=question, labels=question, memory_cache=cache).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss)

    if device.type == "cuda":
        step()  # warm-up (kernels, allocator)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss_mib()
    start = time.perf_counter()
    loss = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        what = "torch.cuda.max_memory_allocated above the start of the step"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
        what = "peak resident set (ru_maxrss) above the resident set before the step"
    return {"mode": args.mode, "loss": loss, "seconds": seconds, "peak_mib": peak, "peak_is": what}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=2048)
    ap.add_argument("--block", type=int, default=2048)
    ap.add_argument("--answer", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument(
        "--mode", choices=["plain", "checkpointing"], default=None, help="run one mode (internal)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.mode is not None:
        print(json.dumps(run_one(args)))
        return
    rows = []
    for mode in ("plain", "checkpointing"):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    plain, ckpt = rows
    import torch

    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": torch.cuda.get_device_name() if torch.cuda.is_available() else _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "settings": {k: v for k, v in vars(args).items() if k not in ("mode", "out")},
        "results": rows,
        "peak_ratio": ckpt["peak_mib"] / plain["peak_mib"],
        "time_ratio": ckpt["seconds"] / plain["seconds"],
        "same_loss": abs(ckpt["loss"] - plain["loss"]) <= 1e-5 * abs(plain["loss"]),
    }
    print(json.dumps(record, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
