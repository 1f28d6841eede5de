"""The ``lstmem`` command.

    lstmem demo                 # offline recall demo on the embedded backbone and adapters
    lstmem demo --train         # retrain the adapters from scratch first (reports the time)
    lstmem demo --model ID      # the same flow on a Hub model or local path (with --train)
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
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        run(train=args.train, model_id=args.model, num_episodes=args.episodes, ablations=not args.no_ablations,
            train_steps=args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
