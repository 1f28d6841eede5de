"""One-token ``model(...)`` decode steps compiled with ``torch.compile(fullgraph=True)``: LSTMem
inside ``traceable_memory()`` vs the plain backbone (adapter disabled), in one process.

    python benchmarks/bench_compiled_step.py                       # hidden 1024, 8 layers, fp32
    python benchmarks/bench_compiled_step.py --out benchmarks/compiled/step_cpu.json
    python benchmarks/bench_compiled_step.py --generate --out benchmarks/compiled/generate_cpu.json

``--generate`` times ``generate(cache_implementation="static", compile_config=CompileConfig(
fullgraph=True))`` instead: per decoding step, ``(t(steps + 1 tokens) - t(1 token)) / steps`` so that
the eager prefill cancels.

Each round prefills ``--prompt`` tokens eagerly (not timed) into a fresh KV cache and memory, then
times ``--steps`` compiled one-token steps; rounds alternate between the two models after one
warm-up round each (compilation, and the recompilation for the growing KV length). Reports the
median step time of each and the median of the per-round ratios. Memory on every layer (n_h 4, r 8),
random weights (timing does not need trained ones). The graph-break count of each step comes from
``torch._dynamo.explain``. Run it alone: other processes distort the figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch
import torch._dynamo as dynamo
import transformers
from bench_decode import random_model
from transformers import CompileConfig, DynamicCache

from lstmem_peft import MemoryCache, traceable_memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--generate", action="store_true", help="time compiled static-cache generate")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = random_model(args.hidden, args.layers)  # the model bench_decode.py times
    config = model.get_base_model().config
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt))
    tokens = torch.randint(0, config.vocab_size, (1, args.steps))
    state = {}

    def step(ids):
        kw = {} if state["cache"] is None else {"memory_cache": state["cache"]}
        return model(input_ids=ids, past_key_values=state["kv"], use_cache=True, **kw).logits

    compiled = torch.compile(step, fullgraph=True, backend=args.backend)

    def fresh(with_memory: bool) -> None:
        state["kv"], state["cache"] = DynamicCache(), MemoryCache() if with_memory else None
        step(prompt)  # eager prefill

    def step_round(with_memory: bool) -> float:
        """Median seconds per compiled step over one round."""
        with torch.no_grad():
            fresh(with_memory)
            times = []
            for t in range(args.steps):
                start = time.perf_counter()
                compiled(tokens[:, t : t + 1])
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    gen_config = CompileConfig(fullgraph=True, backend=args.backend)
    gen_config._compile_all_devices = True  # transformers compiles on CUDA only unless told otherwise

    def generate(with_memory: bool, new: int) -> float:
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static")
        kw["compile_config"] = gen_config
        if with_memory:
            kw["memory_cache"] = MemoryCache()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=prompt, **kw)
        return time.perf_counter() - start

    def generate_round(with_memory: bool) -> float:
        """Seconds per compiled decoding step of one generate call."""
        return (generate(with_memory, args.steps + 1) - generate(with_memory, 1)) / args.steps

    one_round = generate_round if args.generate else step_round

    def breaks(with_memory: bool) -> int:
        with torch.no_grad():
            fresh(with_memory)
            return dynamo.explain(step)(tokens[:, :1]).graph_break_count

    results = {"lstmem": [], "plain": []}
    with traceable_memory():
        counts = {"lstmem": breaks(True)}
        with model.disable_adapter():
            counts["plain"] = breaks(False)
        dynamo.reset()
        one_round(True)  # warm-up: compiles
        with model.disable_adapter():
            one_round(False)
        for r in range(args.rounds):
            for name in ("lstmem", "plain") if r % 2 == 0 else ("plain", "lstmem"):
                if name == "plain":
                    with model.disable_adapter():
                        results[name].append(one_round(False))
                else:
                    results[name].append(one_round(True))
    ratios = [a / b for a, b in zip(results["lstmem"], results["plain"], strict=True)]
    record = {
        "benchmark": "compiled_generate" if args.generate else "compiled_step",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "backend": args.backend,
        "hidden": args.hidden,
        "layers": args.layers,
        "prompt": args.prompt,
        "steps": args.steps,
        "graph_breaks": counts,
        "step_ms": {k: [round(1e3 * v, 3) for v in vs] for k, vs in results.items()},
        "median_step_ms": {k: round(1e3 * statistics.median(vs), 3) for k, vs in results.items()},
        "ratio_median": round(statistics.median(ratios), 4),
        "ratio_range": [round(min(ratios), 4), round(max(ratios), 4)],
    }
    print(json.dumps(record, indent=2))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=2)


if __name__ == "__main__":
    main()
