"""What one memory layer costs per decoded token in eager PyTorch, outside any model.

    python benchmarks/bench_layer_step.py                     # d = 1024, n_h 4, r 8, batch 1
    python benchmarks/bench_layer_step.py --batch 8 --out benchmarks/layer_step/cpu.json

Runs what a decoding model runs per memory layer and token: the layer's one-token forward from the
cached derived weights (with and without a depth input), then ``Δq`` and ``Δo`` added to
projection outputs (:meth:`LayerOutput.add_to`). Reports, per layer step:

* ``torch_calls``: calls from Python into torch (functions, methods and views, counted by a
  ``TorchFunctionMode``; attribute reads such as ``.shape`` are not counted). In eager mode each
  costs the interpreter and the dispatcher a few microseconds whatever the tensor size, which is
  what a one-token step of a ``(4, 8, 8)`` state mostly pays, on a CPU and as launch overhead on a
  GPU;
* ``aten_ops``: aten operators that are neither views nor allocations (each is at least one kernel
  on a GPU);
* ``us``: the best of ``--reps`` timings of ``--calls`` steps (microseconds per step).

The counts are deterministic; the time depends on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from lstmem_peft.cli.bench.command import NO_KERNEL_OPS, count_ops
from lstmem_peft.memory.layer import LSTMemLayer


class _Calls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") != "__get__":  # attribute reads (.shape, .dtype) cost little
            self.n += 1
        return func(*args, **(kwargs or {}))


def make_step(hidden: int, batch: int, depth: bool):
    """A memory layer with random weights and states, and one decode step of it (a closure)."""
    torch.manual_seed(0)
    layer = LSTMemLayer(hidden_size=hidden, query_size=hidden).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05)
    H, R = layer.num_heads, layer.head_dim
    x = torch.randn(batch, 1, hidden)
    cell, state = torch.randn(batch, H, R, R), torch.randn(batch, H, R, R)
    below = torch.randn(batch, 1, H, R, R) if depth else None
    q_out, o_out = torch.randn(batch, 1, hidden), torch.randn(batch, 1, hidden)

    def step():
        out = layer(x, cell, state, depth=below, aux=False)
        out.add_to(q_out, 0)
        out.add_to(o_out, 1)

    return step


@torch.no_grad()
def measure(hidden: int, batch: int, depth: bool, calls: int, reps: int) -> dict:
    step = make_step(hidden, batch, depth)
    for _ in range(50):
        step()  # derives and caches the weights, warms the allocator
    with _Calls() as c:
        step()
    ops = count_ops(step)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, (time.perf_counter() - start) / calls)
    return dict(
        depth=depth,
        torch_calls=c.n,
        aten_ops=sum(n for op, n in ops.items() if op not in NO_KERNEL_OPS),
        us=round(best * 1e6, 1),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", help="write the record (JSON) here")
    args = parser.parse_args()
    rows = [measure(args.hidden, args.batch, depth, args.calls, args.reps) for depth in (False, True)]
    record = dict(
        benchmark="layer_step",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=f"{platform.machine()}, {torch.get_num_threads()} threads",
        torch=torch.__version__,
        hidden=args.hidden,
        batch=args.batch,
        rows=rows,
    )
    for row in rows:
        print(
            f"depth input {'yes' if row['depth'] else 'no '}: {row['torch_calls']:3d} torch calls, "
            f"{row['aten_ops']:3d} aten ops, {row['us']:7.1f} us per layer step"
        )
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
