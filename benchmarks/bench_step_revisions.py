"""Before and after in one process: the memory layer of a git revision against the working tree's.

    python benchmarks/bench_step_revisions.py --rev bb03b63              # one layer's eager step
    python benchmarks/bench_step_revisions.py --rev bb03b63 --generate   # cpu-small generate

Timing two checkouts in two processes compares two moments of a shared machine as much as two
versions of the code. This script takes the memory layer of ``--rev`` (``git show`` of every module
the revision has in ``lstmem_peft/memory/`` and its kernel package (``kernels/lstmem_kernels/``, or
``kernels/`` before that folder held the package), subfolders included: the layer and
what it imports, ``step.py`` and ``layer_common.py`` too since 4c9ef56 split the step out) into a
temporary package beside the installed one and alternates the two in one process, round by round in
rotating order:

* default: one layer's one-token step (``d`` 1024, ``n_h`` 4, ``r`` 8, batch 1, with a depth input)
  and its two corrections, ``--calls`` steps a round; ``--cold MB`` streams that many megabytes
  through the caches before each step, untimed, as a model's backbone layer does between two memory
  layers (``cpu-small``'s: about 45 MB). In a model the step pays the cold figure: on this
  workplace's CPU about 2.5 times the warm one (2026-11-27), so each operator costs more there
  than a warm loop shows;
* ``--generate``: ``generate`` on ``cpu-small`` (the preset of ``lstmem bench``), the model's memory
  layers switched between the two classes each round, and the plain backbone as a third side.
  Both layers must keep the same attributes (true while ``LSTMemLayer.__init__`` is unchanged).

Prints the medians and the per-round ratio (median and range): a ratio below 1 means the working
tree is faster. Both sides must produce the same outputs (checked before timing).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lstmem_peft.memory.layer import LSTMemLayer

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def copy_modules(rev: str, folder: str, into: Path) -> list[str]:
    """Every ``.py`` file of ``folder`` at ``rev`` (subfolders included) written under ``into``, with
    ``lstmem_kernels`` renamed ``rev_kernels``; returns their paths relative to ``folder``."""
    copied = []
    for path in _git("ls-tree", "-r", "--name-only", rev, folder).splitlines():
        if path.endswith(".py"):
            relative = Path(path).relative_to(folder)
            (into / relative).parent.mkdir(parents=True, exist_ok=True)
            (into / relative).write_text(
                _git("show", f"{rev}:{path}").replace("lstmem_kernels", "rev_kernels")
            )
            copied.append(relative.as_posix())
    return copied


def layer_class_at(rev: str, into: Path) -> type:
    """``LSTMemLayer`` as it was at ``rev``, imported from a copy under ``into``: the revision's
    kernels and memory modules, whichever it has (``layer_common.py`` exists from 4c9ef56 on,
    ``memory/step.py`` from 4c9ef56 until the decode step moved into ``lstmem_kernels.step``)."""
    kernels = (
        "kernels/lstmem_kernels/"
        if _git("ls-tree", "--name-only", rev, "kernels/lstmem_kernels")
        else "kernels/"
    )
    copy_modules(rev, kernels, into / "rev_kernels")
    memory = into / "rev_memory"
    if "layer.py" not in copy_modules(rev, "lstmem_peft/memory/", memory):
        raise SystemExit(f"{rev} has no lstmem_peft/memory/layer.py: pick a revision with the memory layer")
    (memory / "__init__.py").write_text("")  # the layer's modules only, not the package's re-exports
    sys.path.insert(0, str(into))
    return importlib.import_module("rev_memory.layer").LSTMemLayer


def rounds(sides: dict, n: int) -> dict[str, list[float]]:
    """Time each side once per round, the order rotating; returns the seconds per side."""
    names = list(sides)
    times = {name: [] for name in names}
    for i in range(n):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            start = time.perf_counter()
            spent = sides[name]()  # a side that times itself returns its seconds
            times[name].append(spent if isinstance(spent, float) else time.perf_counter() - start)
    return times


def report(times: dict[str, list[float]], scale: float, unit: str) -> None:
    for name, t in times.items():
        print(f"{name:8s} median {scale * statistics.median(t):9.1f} {unit}")
    for a, b in (("now", "rev"), ("now", "plain"), ("rev", "plain")):
        if a in times and b in times:
            r = [x / y for x, y in zip(times[a], times[b], strict=True)]
            print(f"{a}/{b}: median {statistics.median(r):.3f} (rounds {min(r):.3f}-{max(r):.3f})")


def step_sides(old: type, calls: int, cold_mb: float = 0.0) -> dict:
    def make(cls):
        torch.manual_seed(0)
        layer = cls(1024, 1024).eval()
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.05)
        layer.set_depth_input(True)
        return layer

    layers = {"now": make(LSTMemLayer), "rev": make(old)}
    H, R = layers["now"].num_heads, layers["now"].head_dim
    x, depth = torch.randn(1, 1, 1024), torch.randn(1, 1, H, R, R) * 0.1
    cell, hidden = torch.randn(1, H, R, R) * 0.1, torch.randn(1, H, R, R) * 0.1
    q, o = torch.randn(1, 1, 1024), torch.randn(1, 1, 1024)
    outs = {k: layer(x, cell, hidden, depth=depth, aux=False) for k, layer in layers.items()}
    torch.testing.assert_close(outs["now"].read, outs["rev"].read)
    torch.testing.assert_close(outs["now"].hidden, outs["rev"].hidden)

    flush = torch.ones(int(cold_mb * 2**18)) if cold_mb else None  # float32: 2^18 per MB

    def side(layer):
        def run():
            spent = 0.0
            for _ in range(calls):
                if flush is not None:
                    flush.mul_(1.0)  # a backbone layer's weights stream through the caches
                start = time.perf_counter()
                out = layer(x, cell, hidden, depth=depth, aux=False)
                out.add_to(q, 0), out.add_to(o, 1)
                spent += time.perf_counter() - start
            return spent

        return run

    return {k: side(layer) for k, layer in layers.items()}


def generate_sides(old: type, prompt_tokens: int, new_tokens: int) -> dict:
    from lstmem_peft.cli.bench.command import build_model
    from lstmem_peft.memory.cache import MemoryCache

    model = build_model("cpu-small", torch.device("cpu"), torch.float32)
    memory_layers = [m for m in model.modules() if isinstance(m, LSTMemLayer)]
    prompt = torch.randint(0, model.get_base_model().config.vocab_size, (1, prompt_tokens))
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def with_memory(cls):
        def run():
            for layer in memory_layers:
                layer.__class__ = cls
                layer.__dict__.pop("_derived", None)
            return model.generate(input_ids=prompt, memory_cache=MemoryCache(), **gen)

        return run

    def plain():
        with model.disable_adapter():
            model.generate(input_ids=prompt, **gen)

    sides = {"now": with_memory(LSTMemLayer), "rev": with_memory(old), "plain": plain}
    if not torch.equal(sides["now"](), sides["rev"]()):
        raise SystemExit("the two revisions generate different tokens: nothing to time")
    return sides


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", required=True, help="the git revision to compare with")
    parser.add_argument("--generate", action="store_true", help="time cpu-small generate, not one layer")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=100, help="layer steps per round")
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--cold", type=float, default=0.0, metavar="MB", help="layer step: MB streamed before each step"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        old = layer_class_at(args.rev, Path(tmp))
        if args.generate:
            sides = generate_sides(old, args.prompt_tokens, args.new_tokens)
            rounds(sides, 1)  # warm-up
            report(rounds(sides, args.rounds), 1e3, "ms per generate")
        else:
            sides = step_sides(old, args.calls, args.cold)
            rounds(sides, 3)
            report(rounds(sides, args.rounds), 1e6 / args.calls, "us per step")


if __name__ == "__main__":
    main()
