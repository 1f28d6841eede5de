"""The ``lstmem`` command.

lstmem demo                 # offline recall demo on the embedded backbone and adapters
lstmem demo --train         # retrain the adapters from scratch first (reports the time)
lstmem demo --model ID      # the same flow on a Hub model or local path (with --train)
lstmem bench decode|generate|ops|e2e|write|scan [--preset cpu-small|qwen3-4b]   # JSON records
lstmem bench report benchmarks/results                                   # RESULTS.md + plots
lstmem eval locomo|hotpotqa|mab DATA --model ID --adapter PATH --out DIR [--protocol official|paper]
lstmem eval locomo|hotpotqa|mab DATA --rescore RUN/predictions.jsonl --protocol paper --out DIR
lstmem serve [--model ID --adapter PATH] [--store DIR] [--port N]   # OpenAI-compatible server with memory
"""

from __future__ import annotations

import argparse
import os
import sys


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    """The ``lstmem`` command. A user error (missing path, wrong format, bad number) prints one line
    and exits with 1 (argparse's own usage errors: 2); ``--debug`` shows the traceback instead."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        raise
    except Exception as err:  # one line for the user; the traceback is one flag away
        if args.debug:
            raise
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(
            f"lstmem {args.command}: error: {message} ({type(err).__name__}; --debug shows the traceback)",
            file=sys.stderr,
        )
        return 1


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="lstmem", description="LSTMem online memory for frozen LMs")
    parser.add_argument("--version", action="version", version=f"lstmem-peft {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="offline recall demo: history in context vs in memory vs none")
    demo.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    demo.add_argument(
        "--train", action="store_true", help="retrain the adapters from scratch with LSTMemTrainer"
    )
    demo.add_argument(
        "--model", default=None, help="Hub id or local path of a causal LM (default: embedded tiny model)"
    )
    demo.add_argument("--episodes", type=positive_int, default=512, help="held-out episodes to score")
    demo.add_argument(
        "--steps", type=positive_int, default=600, help="training steps per adapter with --train"
    )
    demo.add_argument(
        "--no-ablations", action="store_true", help="skip the depth-coupling and feedback ablations"
    )
    bench = sub.add_parser(
        "bench", help="benchmarks against the plain backbone (JSON records, RESULTS.md, plots)"
    )
    bench.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    bench.add_argument("kind", choices=["decode", "generate", "ops", "e2e", "write", "scan", "report"])
    bench.add_argument("folder", nargs="?", default="benchmarks/results", help="records folder (report)")
    bench.add_argument("--preset", default="cpu-small", help="model dimensions: cpu-small or qwen3-4b")
    bench.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    bench.add_argument("--out", default="benchmarks/results", help="where JSON records go")
    bench.add_argument(
        "--results", default="benchmarks/RESULTS.md", help="report: the markdown file to write"
    )
    bench.add_argument("--reps", type=positive_int, default=None)
    bench.add_argument(
        "--kv-lengths", type=positive_int, nargs="+", default=None, help="decode: KV cache lengths"
    )
    bench.add_argument("--histories", type=positive_int, nargs="+", default=None, help="e2e: history lengths")
    bench.add_argument(
        "--answer-tokens", type=positive_int, default=None, help="e2e, generate: generated tokens"
    )
    bench.add_argument("--prompt-tokens", type=positive_int, default=None, help="generate: prompt length")
    bench.add_argument("--tokens", type=positive_int, default=None, help="write: history tokens")
    bench.add_argument("--lengths", type=positive_int, nargs="+", default=None, help="scan: block lengths")
    bench.add_argument("--batches", type=positive_int, nargs="+", default=None, help="scan: batch sizes")
    ev = sub.add_parser(
        "eval", help="LoCoMo / HotpotQA / MemoryAgentBench: the adapter beside the plain backbone"
    )
    ev.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    ev.add_argument("benchmark", choices=["locomo", "hotpotqa", "mab"])
    ev.add_argument("data", help="local file/folder in the benchmark's official format, or a Hub dataset id")
    ev.add_argument("--model", default=None, help="base model: Hub id or local folder (not with --rescore)")
    ev.add_argument(
        "--protocol",
        default="official",
        choices=["official", "paper"],
        help="prompts and scoring: the benchmark's released code (official) or the code the paper names",
    )
    ev.add_argument(
        "--rescore",
        default=None,
        metavar="PREDICTIONS",
        help="re-score a run's predictions.jsonl under --protocol without generating (DATA gives the rules)",
    )
    ev.add_argument(
        "--resume",
        action="store_true",
        help="keep the answers an interrupted run with the same settings left in OUT.partial",
    )
    ev.add_argument("--no-plot", action="store_true", help="do not write scores.png")
    ev.add_argument(
        "--adapter", default=None, help="LSTMem adapter: Hub id or local folder (omit: backbone only)"
    )
    ev.add_argument("--out", default=None, help="output folder (default: eval-results/<benchmark>)")
    ev.add_argument(
        "--limit", type=positive_int, default=None, help="only the first N histories (per family for mab)"
    )
    ev.add_argument("--memory-only", action="store_true", help="history in memory only, not in the prompt")
    ev.add_argument("--greedy", action="store_true", help="greedy decoding instead of the paper's sampling")
    ev.add_argument("--seed", type=int, default=None, help="sampling seed (default: the paper's 42)")
    ev.add_argument("--no-base", action="store_true", help="skip the plain-backbone run")
    ev.add_argument(
        "--block-size", type=positive_int, default=None, help="history block length (default: the adapter's)"
    )
    ev.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        help="answer limit (locomo, hotpotqa); for mab a cap on the per-source limits (smoke runs)",
    )
    ev.add_argument(
        "--passages", default="all", choices=["all", "supporting"], help="hotpotqa: passages in the prompt"
    )
    ev.add_argument("--families", nargs="+", default=None, help="mab: families to run (AR TTL LRU SF)")
    ev.add_argument(
        "--max-questions", type=positive_int, default=None, help="mab: at most N questions per history"
    )
    ev.add_argument(
        "--entity-map", default=None, help="mab: the snapshot's entity2id.json (default: next to DATA)"
    )
    ev.add_argument(
        "--chunk-tokenizer",
        default="gpt-4o-mini",
        choices=["gpt-4o-mini", "model"],
        help="mab, official protocol: count chunk tokens with tiktoken's gpt-4o-mini encoding (the official "
        "rule; needs tiktoken and its cached encoding) or with the evaluated model's tokenizer",
    )
    ev.add_argument(
        "--max-context-chars",
        type=int,
        default=None,
        metavar="N",
        help="mab, paper protocol: pre-clip contexts longer than N characters as δ-mem's suite does (its "
        "first third and last two thirds around a marker; default 120000, the suite's; 0: whole contexts)",
    )
    ev.add_argument("--split", default=None, help="dataset split when DATA is a Hub id")
    ev.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ev.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ev.add_argument(
        "--no-chat-template",
        action="store_true",
        help="plain text prompts even if the tokenizer has a template",
    )
    ev.add_argument(
        "--template-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra chat-template argument, e.g. enable_thinking=false (VALUE read as JSON when it parses)",
    )
    sv = sub.add_parser(
        "serve", help="OpenAI-compatible server; every session keeps a persistent LSTMem memory"
    )
    sv.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sv.add_argument("--model", default=None, help="backbone: Hub id or local folder (default: embedded demo)")
    sv.add_argument("--adapter", default=None, help="LSTMem adapter: Hub id or local folder (with --model)")
    sv.add_argument("--store", default="lstmem-sessions", help="folder where session memory lives")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sv.add_argument("--port", type=positive_int, default=8000, help="port to listen on")
    sv.add_argument("--name", default=None, help="model id served at /v1/models (default: from the adapter)")
    sv.add_argument("--api-key", action="append", default=[], help="accepted bearer key (repeatable)")
    sv.add_argument("--api-keys-file", default=None, help="file with one accepted key per line")
    sv.add_argument(
        "--context-window", type=positive_int, default=None, help="prompt window in tokens (default: model's)"
    )
    sv.add_argument("--max-batch", type=positive_int, default=32, help="most sessions per batched forward")
    sv.add_argument("--batch-wait-ms", type=float, default=5.0, help="wait for more requests to batch")
    sv.add_argument("--no-batching", action="store_true", help="run requests one at a time")
    sv.add_argument("--max-body-bytes", type=positive_int, default=1 << 20, help="larger bodies get 413")
    sv.add_argument("--max-tokens", type=positive_int, default=64, help="default max_tokens of chat requests")
    sv.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    sv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    sv.add_argument(
        "--engine",
        default="hf",
        choices=["hf", "vllm"],
        help="what generates the answers: the model's generate (hf) or a vLLM engine (needs the vllm extra)",
    )
    sv.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra vllm.LLM argument with --engine vllm, e.g. max_model_len=8192 (VALUE read as JSON when it parses)",
    )
    sv.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (default: torch's; 1 suits tiny models)",
    )
    return parser


def _check_paths(**named: str | None) -> None:
    """A value that looks like a filesystem path (not a Hub id ``owner/name``) must exist."""
    for option, value in named.items():
        if value is None:
            continue
        looks_local = (
            value.startswith(("/", "./", "../", "~")) or os.path.isabs(value) or value.count("/") > 2
        )
        if looks_local and not os.path.exists(os.path.expanduser(value)):
            label = "DATA" if option == "data" else f"--{option}"
            raise FileNotFoundError(f"{label} {value}: no such file or folder")


def _dispatch(args) -> int:
    if args.command in ("eval", "demo"):
        _check_paths(
            model=args.model,
            **({"adapter": args.adapter, "data": args.data} if args.command == "eval" else {}),
            **({"rescore": args.rescore} if args.command == "eval" else {}),
        )
    if args.command == "eval":
        return _eval(args)
    if args.command == "serve":
        _check_paths(model=args.model, adapter=args.adapter)
        return _serve(args)
    if args.command == "bench":
        from . import bench as benchmarks

        if args.kind == "report":
            print(f"wrote {benchmarks.report(args.folder, args.results)}")
            return 0
        benchmarks.run(
            args.kind,
            preset=args.preset,
            device=args.device,
            dtype=args.dtype,
            out=args.out,
            reps=args.reps,
            kv_lengths=args.kv_lengths,
            histories=args.histories,
            answer_tokens=args.answer_tokens,
            prompt_tokens=args.prompt_tokens,
            tokens=args.tokens,
            lengths=args.lengths,
            batches=args.batches,
        )
        return 0
    if args.command == "demo":
        from .demo import run

        run(
            train=args.train,
            model_id=args.model,
            num_episodes=args.episodes,
            ablations=not args.no_ablations,
            train_steps=args.steps,
        )
    return 0


def _serve(args) -> int:
    keys = list(args.api_key)
    if args.api_keys_file is not None:
        with open(args.api_keys_file) as fh:
            keys += [line.strip() for line in fh if line.strip() and not line.startswith("#")]
        if not keys:
            raise ValueError(f"--api-keys-file {args.api_keys_file} holds no key")
    from .serve import serve

    serve(
        model=args.model,
        adapter=args.adapter,
        store=args.store,
        host=args.host,
        port=args.port,
        name=args.name,
        device=args.device,
        dtype=args.dtype,
        api_keys=keys,
        threads=args.threads,
        context_window=args.context_window,
        max_batch=args.max_batch,
        batch_wait_ms=args.batch_wait_ms,
        batching=not args.no_batching,
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.max_tokens,
        engine=args.engine,
        vllm_options=_key_values(args.vllm_arg, "--vllm-arg"),
    )
    return 0


def _key_values(pairs: list[str], option: str) -> dict:
    """``KEY=VALUE`` options as a dict (``VALUE`` read as JSON when it parses)."""
    import json

    kwargs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"{option} expects KEY=VALUE, got {pair!r}")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    return kwargs


def _eval(args) -> int:
    from .eval import runner

    options = {"limit": args.limit, "max_new_tokens": args.max_new_tokens, "protocol": args.protocol}
    if args.split:
        if args.benchmark == "mab":
            raise SystemExit(
                "--split does not apply to mab: its four splits are the families (use --families)"
            )
        options["split"] = args.split
    if args.benchmark != "mab" and args.max_new_tokens is None:
        del options["max_new_tokens"]  # the benchmark's own (the paper's) limit
    if args.benchmark != "mab" and (args.max_questions is not None or args.entity_map is not None):
        raise SystemExit("--max-questions and --entity-map apply to mab only")
    if args.max_context_chars is not None and (args.benchmark != "mab" or args.protocol != "paper"):
        raise SystemExit("--max-context-chars applies to mab with --protocol paper only")
    if args.max_context_chars is not None and args.max_context_chars < 0:
        raise SystemExit(
            f"--max-context-chars: expected 0 (no clipping) or more, got {args.max_context_chars}"
        )
    if args.benchmark == "locomo":
        from .eval.locomo import LoCoMo as make
    elif args.benchmark == "hotpotqa":
        from .eval.hotpotqa import HotpotQA as make

        options["passages"] = args.passages
    else:
        from .eval.mab import MemoryAgentBench as make

        options.update(families=args.families, max_questions=args.max_questions, entity_map=args.entity_map)
        if args.max_context_chars is not None:
            options["max_context_chars"] = args.max_context_chars
    if args.rescore is None and args.model is None:
        raise SystemExit("lstmem eval: --model is required (unless --rescore re-scores an existing run)")
    if args.rescore is not None and (args.model is not None or args.resume):
        raise SystemExit("--rescore re-scores without a model: drop --model/--adapter/--resume")
    benchmark = make(args.data, **options)
    out = args.out or f"eval-results/{args.benchmark}"
    if args.rescore is not None:
        summary = runner.rescore(args.rescore, benchmark, out, plot=not args.no_plot)
        print(runner.markdown_table(summary))
        print(f"wrote {out}/predictions.jsonl, {out}/summary.json, {out}/results.md")
        return 0
    model, tokenizer = runner.load_model(args.model, args.adapter, args.dtype, args.device)
    if args.benchmark == "mab" and args.chunk_tokenizer == "model":  # histories are built when iterated
        benchmark.count_tokens = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    decoding = runner.Decoding(greedy=args.greedy)
    if args.seed is not None:
        decoding.seed = args.seed
    summary = runner.evaluate(
        model,
        tokenizer,
        benchmark,
        out,
        memory_only=args.memory_only,
        decoding=decoding,
        block_size=args.block_size,
        compare_base=not args.no_base,
        chat_template=False if args.no_chat_template else None,
        template_kwargs=_key_values(args.template_arg, "--template-arg"),
        run_info={"model": args.model, "adapter": args.adapter, "data": args.data}
        | ({"chunk_tokenizer": args.chunk_tokenizer} if args.benchmark == "mab" else {}),
        resume=args.resume,
        plot=not args.no_plot,
    )
    print(runner.markdown_table(summary))
    print(f"wrote {out}/predictions.jsonl, {out}/summary.json, {out}/results.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
