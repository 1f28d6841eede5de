"""``lstmem eval``'s arguments: the run, each benchmark's own options, the rows and the model."""

from __future__ import annotations

import argparse

from .argument_types import positive_int


def eval_arguments(parser: argparse.ArgumentParser) -> None:
    """``lstmem eval BENCHMARK DATA``: the run, then each benchmark's own options, then the model."""
    parser.add_argument(
        "benchmark",
        choices=["locomo", "hotpotqa", "mab"],
        help="locomo (LoCoMo), hotpotqa (HotpotQA, distractor setting) or mab (MemoryAgentBench)",
    )
    parser.add_argument(
        "data", help="local file/folder in the benchmark's official format, or a Hub dataset id"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="base model: a short name of `lstmem models` (e.g. smollm2-135m), a local folder or a Hub id "
        "(not with --rescore)",
    )
    parser.add_argument(
        "--protocol",
        default="official",
        choices=["official", "paper"],
        help="prompts and scoring: the benchmark's released code (official) or the code the paper names",
    )
    parser.add_argument(
        "--rescore",
        default=None,
        metavar="PREDICTIONS",
        help="re-score a run's predictions.jsonl under --protocol without generating (DATA gives the rules)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the answers an interrupted run with the same settings left in OUT.partial",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not write scores.png")
    parser.add_argument(
        "--adapter",
        default=None,
        help="LSTMem adapter: Hub id, local folder or a shipped adapter's short name (omit: backbone only)",
    )
    parser.add_argument("--out", default=None, help="output folder (default: eval-results/<benchmark>)")
    parser.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        help="only the first N histories (per family for mab; default: all)",
    )
    parser.add_argument(
        "--memory-only", action="store_true", help="history in memory only, not in the prompt"
    )
    parser.add_argument(
        "--greedy", action="store_true", help="greedy decoding instead of the paper's sampling"
    )
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: the paper's 42)")
    parser.add_argument("--no-base", action="store_true", help="skip the plain-backbone run")
    parser.add_argument(
        "--block-size", type=positive_int, default=None, help="history block length (default: the adapter's)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        help="answer limit (locomo, hotpotqa; default: the benchmark's own); for mab a cap on the per-source "
        "limits (smoke runs; default: none)",
    )
    _eval_row_arguments(parser)
    _eval_benchmark_arguments(parser)
    _eval_model_arguments(parser)


def _eval_row_arguments(parser: argparse.ArgumentParser) -> None:
    """``lstmem eval ... --rows``: the named rows of one run (:mod:`lstmem_peft.eval.rows`)."""
    parser.add_argument(
        "--rows",
        default=None,
        metavar="ROWS",
        help="named rows in one run, comma-separated: no-context, window, memory-only, paper, bm25 (or all); "
        "per-group scores with 95%% bootstrap intervals, and costs (docs/evaluation.md, 'Rows')",
    )
    parser.add_argument(
        "--window",
        type=positive_int,
        default=None,
        help="--rows: positions prompt and answer may take (default: the model config's max_position_embeddings)",
    )
    parser.add_argument(
        "--top-k",
        type=positive_int,
        default=None,
        help="--rows bm25: turns retrieved per question (default 10)",
    )
    parser.add_argument(
        "--bootstrap",
        type=positive_int,
        default=1000,
        help="--rows: bootstrap resamples of the questions for the 95%% intervals (seed 0)",
    )


def _eval_benchmark_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of one benchmark (``hotpotqa:``, ``mab:`` in their help); :mod:`.commands` refuses them
    with another benchmark."""
    parser.add_argument(
        "--passages", default="all", choices=["all", "supporting"], help="hotpotqa: passages in the prompt"
    )
    parser.add_argument("--categories", metavar="LIST", help="locomo: categories, 1-5 or all (default 1-4)")
    parser.add_argument(
        "--families",
        nargs="+",
        default=None,
        choices=["AR", "TTL", "LRU", "SF"],
        help="mab: families to run (default: all four, AR TTL LRU SF)",
    )
    parser.add_argument(
        "--max-questions",
        type=positive_int,
        default=None,
        help="mab: at most N questions per history (default: all)",
    )
    parser.add_argument(
        "--entity-map", default=None, help="mab: the snapshot's entity2id.json (default: next to DATA)"
    )
    parser.add_argument(
        "--chunk-tokenizer",
        default="gpt-4o-mini",
        choices=["gpt-4o-mini", "model"],
        help="mab, official protocol: count chunk tokens with tiktoken's gpt-4o-mini encoding (the official "
        "rule; needs tiktoken and its cached encoding) or with the evaluated model's tokenizer",
    )
    parser.add_argument(
        "--max-context-chars",
        type=int,
        default=None,
        metavar="N",
        help="mab, paper protocol: pre-clip contexts longer than N characters as δ-mem's suite does (its "
        "first third and last two thirds around a marker; default 120000, the suite's; 0: whole contexts)",
    )
    parser.add_argument(
        "--split", default=None, help="dataset split when DATA is a Hub id (default: the benchmark's)"
    )


def _eval_model_arguments(parser: argparse.ArgumentParser) -> None:
    """How ``lstmem eval`` loads the model and writes its prompts."""
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights' dtype; auto: the checkpoint's",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--no-chat-template",
        action="store_true",
        help="plain text prompts even if the tokenizer has a template",
    )
    parser.add_argument(
        "--template-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra chat-template argument, e.g. enable_thinking=false (VALUE read as JSON when it parses)",
    )
