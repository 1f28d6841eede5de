"""What the vLLM plugin's padded prefill costs against running each chunk at its own length.

    python benchmarks/bench_prefill_padding.py                 # d = 1024, the mixes below, float32
    python benchmarks/bench_prefill_padding.py --hidden 2560 --query 4096 --out benchmarks/vllm/prefill-padding-cpu.json

A vLLM step that prefills ``P`` chunks runs each memory layer once over the chunks padded to the
longest (``(P, T_max, d)`` with a ``valid`` mask: :meth:`~lstmem_peft.integrations.vllm.state.LSTMemState._prefill`).
Sequence boundaries instead of padding (``cu_seqlens``, as varlen attention takes them) would do the
work of ``sum(T_i)`` tokens, not ``P * T_max``. This measures what that could save, outside vLLM, on
one memory layer with the plugin's calls:

* ``padded``: one forward over all the chunks padded to the longest (what the plugin ran before it
  grouped chunks);
* ``per_chunk``: one forward per chunk at its own length (the tokens a ``cu_seqlens`` scan would
  process; each chunk its own call, so any saving a packed kernel would add beyond fewer launches is
  not counted);
* ``grouped``: what the plugin runs now: one padded forward per group of chunks of similar length
  (:func:`lstmem_peft.integrations.vllm.prefill.prefill_groups`, from the boundaries).

Reported per mix: the median of ``--reps`` timings of each (milliseconds), the ratio padded /
grouped, and the padding (``P * T_max / sum(T_i)``). The figures depend on the machine and on what else runs on it;
the JSON record says where and when they were measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from lstmem_peft.integrations.vllm.prefill import prefill_groups
from lstmem_peft.memory.layer import LSTMemLayer

#: Prefill mixes of one step: chunk lengths (vLLM's budget splits into a long chunk and short ones,
#: or into equal chunks).
MIXES = {
    "equal 4 x 256": [256, 256, 256, 256],
    "one long, three short": [512, 16, 16, 16],
    "one long, seven short": [1024, 32, 32, 32, 32, 32, 32, 32],
    "graded": [256, 128, 64, 32],
}


def timed(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(layer: LSTMemLayer, lengths: list[int], reps: int, hidden: int) -> dict:
    g = torch.Generator().manual_seed(0)
    p, longest = len(lengths), max(lengths)
    n_h, r = layer.num_heads, layer.head_dim
    chunks = [torch.randn(1, t, hidden, generator=g) for t in lengths]
    cell = torch.randn(p, n_h, r, r, generator=g) * 0.1
    hidden_state = torch.randn(p, n_h, r, r, generator=g) * 0.1
    # the step's flat batch and its boundaries, as vLLM hands them to the memory op
    flat = torch.cat([x[0] for x in chunks])
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    everything = prefill_groups(starts, torch.arange(p), torch.zeros(p, dtype=torch.bool), limit=float("inf"))
    groups = prefill_groups(starts, torch.arange(p), torch.zeros(p, dtype=torch.bool))

    def scan(chosen):  # the plugin's call per group: gather the padded chunks, one masked scan
        for group in chosen:
            layer(
                flat[group.gather], cell[group.slots], hidden_state[group.slots], valid=group.write, aux=False
            )

    @torch.no_grad()
    def run_padded():
        scan(everything)

    @torch.no_grad()
    def run_per_chunk():
        for i, x in enumerate(chunks):
            layer(x, cell[i : i + 1], hidden_state[i : i + 1], aux=False)

    @torch.no_grad()
    def run_grouped():
        scan(groups)

    a, b, c = timed(run_padded, reps), timed(run_per_chunk, reps), timed(run_grouped, reps)
    return {
        "lengths": lengths,
        "padding": p * longest / sum(lengths),
        "groups": [list(g.rows) for g in groups],
        "padded_ms": a,
        "per_chunk_ms": b,
        "grouped_ms": c,
        "padded_over_grouped": a / c,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--query", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    layer = LSTMemLayer(
        hidden_size=args.hidden, query_size=args.query, num_heads=args.heads, head_dim=args.rank
    ).eval()
    rows = {name: measure(layer, lengths, args.reps, args.hidden) for name, lengths in MIXES.items()}
    print(f"{'mix':24} {'padding':>8} {'padded ms':>10} {'per chunk ms':>13} {'grouped ms':>11} {'ratio':>6}")
    for name, row in rows.items():
        print(
            f"{name:24} {row['padding']:8.2f} {row['padded_ms']:10.2f} {row['per_chunk_ms']:13.2f} "
            f"{row['grouped_ms']:11.2f} {row['padded_over_grouped']:6.2f}"
        )
    record = {
        "benchmark": "prefill_padding",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "settings": vars(args) | {"out": None if args.out is None else str(args.out)},
        "rows": rows,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
