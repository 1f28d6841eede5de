"""The ``lstmem`` command.

    lstmem demo                 # offline recall demo on the embedded backbone and adapters
    lstmem demo --train         # retrain the adapters from scratch first (reports the time)
    lstmem demo --model ID      # the same flow on a Hub model or local path (with --train)
    lstmem bench decode|e2e|write|scan [--preset cpu-small|qwen3-4b]   # JSON records
    lstmem bench report benchmarks/results                                   # RESULTS.md + plots
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lstmem", description="LSTMem online memory for frozen LMs")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="offline recall demo: history in context vs in memory vs none")
    demo.add_argument("--train", action="store_true", help="retrain the adapters from scratch with LSTMemTrainer")
    demo.add_argument("--model", default=None, help="Hub id or local path of a causal LM (default: embedded tiny model)")
    demo.add_argument("--episodes", type=int, default=512, help="held-out episodes to score")
    demo.add_argument("--steps", type=int, default=600, help="training steps per adapter with --train")
    demo.add_argument("--no-ablations", action="store_true", help="skip the depth-coupling and feedback ablations")
    bench = sub.add_parser("bench", help="benchmarks against the plain backbone (JSON records, RESULTS.md, plots)")
    bench.add_argument("kind", choices=["decode", "e2e", "write", "scan", "report"])
    bench.add_argument("folder", nargs="?", default="benchmarks/results", help="records folder (report)")
    bench.add_argument("--preset", default="cpu-small", help="model dimensions: cpu-small or qwen3-4b")
    bench.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    bench.add_argument("--out", default="benchmarks/results", help="where JSON records go")
    bench.add_argument("--results", default="benchmarks/RESULTS.md", help="report: the markdown file to write")
    bench.add_argument("--reps", type=int, default=None)
    bench.add_argument("--kv-lengths", type=int, nargs="+", default=None, help="decode: KV cache lengths")
    bench.add_argument("--histories", type=int, nargs="+", default=None, help="e2e: history lengths")
    bench.add_argument("--answer-tokens", type=int, default=None, help="e2e: generated tokens")
    bench.add_argument("--tokens", type=int, default=None, help="write: history tokens")
    bench.add_argument("--lengths", type=int, nargs="+", default=None, help="scan: block lengths")
    bench.add_argument("--batches", type=int, nargs="+", default=None, help="scan: batch sizes")
    args = parser.parse_args(argv)
    if args.command == "bench":
        from . import bench as benchmarks

        if args.kind == "report":
            print(f"wrote {benchmarks.report(args.folder, args.results)}")
            return 0
        benchmarks.run(args.kind, preset=args.preset, device=args.device, dtype=args.dtype, out=args.out, reps=args.reps,
                       kv_lengths=args.kv_lengths, histories=args.histories, answer_tokens=args.answer_tokens,
                       tokens=args.tokens, lengths=args.lengths, batches=args.batches)
        return 0
    if args.command == "demo":
        from .demo import run

        run(train=args.train, model_id=args.model, num_episodes=args.episodes, ablations=not args.no_ablations,
            train_steps=args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
