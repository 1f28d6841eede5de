"""Would compiling only the memory layers' one-token step speed up an eager model's decode? One
``model(...)`` decode step of ``cpu-small`` (the preset of ``lstmem bench``), three sides in one
process, rounds in rotating order:

* ``plain``: the backbone alone (adapter disabled, outside the clock);
* ``eager``: LSTMem as it ships (the PyTorch step);
* ``compiled``: each memory layer's one-token step (:meth:`LSTMemLayer.forward` on one token,
  without gradients) run through one ``torch.compile(fullgraph=True)`` function, inside the
  otherwise eager model.

    python benchmarks/bench_compiled_layer_step.py
    python benchmarks/bench_compiled_layer_step.py --out benchmarks/compiled/layer_step_cpu.json

Each step starts from the same KV cache (cropped back to the prompt) and a copy of the same memory.
Both LSTMem sides must give the same logits to float32 rounding (checked before timing). On
2026-11-27 the compiled side was the slower one: a compiled region's entry (its guards and its
wrapper) costs more per layer than the fused kernels save; the whole step compiled at once does
reach the plain backbone's speed (``bench_compiled_step.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from lstmem_peft.cli.bench.command import build_model
from lstmem_peft.cli.bench.records import environment
from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.memory.layer import LSTMemLayer

EAGER = LSTMemLayer.forward


def _one_token_step(layer, x, cell, hidden, depth, weights):
    return EAGER(layer, x, cell, hidden, depth=depth, weights=weights, aux=False)


def compiled_forward(backend: str):
    """A ``LSTMemLayer.forward`` that runs one-token writing steps without gradients compiled."""
    step = torch.compile(_one_token_step, fullgraph=True, backend=backend)

    def forward(self, x, cell, hidden, *, depth=None, valid=None, write=True, weights=None, aux=True):
        if x.shape[1] != 1 or aux or valid is not None or not write or torch.is_grad_enabled():
            return EAGER(
                self, x, cell, hidden, depth=depth, valid=valid, write=write, weights=weights, aux=aux
            )
        return step(self, x, cell, hidden, depth, self.derived_weights() if weights is None else weights)

    return forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=36)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = build_model("cpu-small", torch.device("cpu"), torch.float32)
    vocab = model.get_base_model().config.vocab_size
    prompt, token = torch.randint(0, vocab, (1, args.prompt)), torch.randint(0, vocab, (1, 1))
    memory, kv = MemoryCache(), {True: DynamicCache(), False: DynamicCache()}
    forwards = {"eager": EAGER, "compiled": compiled_forward(args.backend)}

    def step(side: str) -> torch.Tensor | None:
        """One timed decode step of ``side``; returns LSTMem's logits."""
        cache = kv[side != "plain"]
        if cache.get_seq_length() > args.prompt:
            cache.crop(-1)
        if side == "plain":
            with model.disable_adapter():
                start = time.perf_counter()
                model(input_ids=token, past_key_values=cache, use_cache=True)
                times[side].append(time.perf_counter() - start)
            return None
        LSTMemLayer.forward = forwards[side]
        state = memory.clone()
        start = time.perf_counter()
        logits = model(input_ids=token, past_key_values=cache, use_cache=True, memory_cache=state).logits
        times[side].append(time.perf_counter() - start)
        return logits

    times = {"plain": [], "eager": [], "compiled": []}
    try:
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=kv[True], use_cache=True, memory_cache=memory)
            with model.disable_adapter():
                model(input_ids=prompt, past_key_values=kv[False], use_cache=True)
            start = time.perf_counter()
            torch.testing.assert_close(step("compiled"), step("eager"), rtol=1e-4, atol=1e-4)
            compile_s = time.perf_counter() - start
            sides = list(times)
            for name in times:
                times[name].clear()
            for i in range(args.rounds):
                for side in sides[i % 3 :] + sides[: i % 3]:
                    step(side)
    finally:
        LSTMemLayer.forward = EAGER
    ratios = {
        side: [a / b for a, b in zip(times[side], times["plain"], strict=True)]
        for side in ("eager", "compiled")
    }
    record = {
        "benchmark": "compiled_layer_step",
        **environment(torch.device("cpu")),
        "preset": "cpu-small",
        "prompt": args.prompt,
        "rounds": args.rounds,
        "first_calls_s": round(compile_s, 1),
        "median_step_ms": {k: round(1e3 * statistics.median(v), 3) for k, v in times.items()},
        "ratio_to_plain_median_of_rounds": {k: round(statistics.median(v), 4) for k, v in ratios.items()},
        "ratio_to_plain_range": {k: [round(min(v), 3), round(max(v), 3)] for k, v in ratios.items()},
    }
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
