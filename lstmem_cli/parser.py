"""The ``lstmem`` command line: its argument types and one function per subcommand's arguments.

:data:`SUBCOMMANDS` lists the subcommands in the order ``lstmem --help`` shows them. A new subcommand
is an entry there (its name, its one-line help and the function that adds its arguments) and its
runner in :data:`lstmem_peft.cli.commands.RUNNERS`. Every subcommand takes ``--debug``.

Building the parser, and ``--version`` and every ``--help``, import nothing of ``lstmem_peft`` (nor
torch, PEFT or transformers): the subcommands' options are written here, not read from the library.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .argument_types import count, non_negative_float, port_number, positive_float, positive_int
from .eval_arguments import eval_arguments
from .version import installed_version


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's help, each option's default appended as ``(default: ...)`` unless its help already
    speaks of its default, or it has none worth showing (``None``, an off switch, an empty list);
    descriptions and epilogs keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings:
            return text
        if action.default is None or action.default is False or action.default in ([], argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (``lstmem eval: error: argument --limit: ...``) ending
    in where the options are listed, with exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---------------------------------------------------------------------- the subcommands' arguments
def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    """``lstmem demo``: the recall table, or the episodes (``--show``) and the sweep (``--sweep``)."""
    parser.add_argument(
        "--train", action="store_true", help="retrain the adapters from scratch with LSTMemTrainer"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a causal LM: a short name of `lstmem models` (e.g. smollm2-135m), a local folder or a Hub id "
        "(default: embedded tiny model); without --train: its shipped adapter on held-out English notes",
    )
    parser.add_argument(
        "--adapter", help="with --model: the LSTMem adapter to show (default: the one shipped for it)"
    )
    parser.add_argument(
        "--episodes", type=positive_int, help="held-out episodes to score (default 512; --model: 24)"
    )
    parser.add_argument(
        "--steps", type=positive_int, default=600, help="training steps per adapter with --train"
    )
    parser.add_argument(
        "--chat-steps",
        type=count,
        default=150,
        help="with --train on the embedded model: then train this many steps on conversations (default "
        "150, as the shipped adapters; 0: none)",
    )
    parser.add_argument(
        "--no-ablations", action="store_true", help="skip the depth-coupling and feedback ablations"
    )
    parser.add_argument(
        "--show",
        type=count,
        default=None,
        metavar="N",
        help="first print N episodes: history, question, gold, the answers from memory and without (--model: 3)",
    )
    parser.add_argument(
        "--facts", type=positive_int, default=8, help="facts per history of --show (default 8)"
    )
    parser.add_argument(
        "--sweep",
        nargs="*",
        type=positive_int,
        default=None,
        metavar="FACTS",
        help="instead of the table: recall against history length (default 8 16 32 64 128 256 facts, "
        "--episodes each), the window marked; writes a JSON record and a plot to --out",
    )
    parser.add_argument(
        "--window",
        type=positive_int,
        default=64,
        help="the backbone's context window in tokens (default 64, the embedded backbone's)",
    )
    parser.add_argument(
        "--out", help="where --sweep writes its record and plot (default: here), or --model its record"
    )


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``lstmem bench KIND``: one benchmark's sizes and where its records go, or ``report``."""
    parser.add_argument(
        "kind", choices=list(BENCH_KINDS), metavar="KIND", help="the benchmark: " + ", ".join(BENCH_KINDS)
    )
    parser.epilog = "KIND:\n" + "\n".join(f"  {kind:<9} {what}" for kind, what in BENCH_KINDS.items())
    parser.add_argument(
        "folder", nargs="?", default=None, help="report: the records folder (default: benchmarks/results)"
    )
    parser.add_argument(
        "--preset", default=None, help="model dimensions: cpu-small (default) or qwen3-4b (gpu: qwen3-4b)"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="decode, generate, ops, e2e, write: time this backbone's real weights instead of --preset's "
        "random ones: a short name of `lstmem models` (e.g. smollm2-135m), a local folder or a Hub id",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default float32 (gpu: bfloat16)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="where JSON records go (default benchmarks/results; gpu --dry-run: a temp folder)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="gpu: every step at tiny sizes on CPU, records marked dry_run (a test of the suite, no figures)",
    )
    parser.add_argument(
        "--acceptance",
        action="store_true",
        help="gpu: the acceptance run instead of the suite: kernel and model checks, timings, a table "
        "(docs/gpu.md)",
    )
    parser.add_argument(
        "--budget-s",
        type=positive_float,
        default=None,
        help="gpu --acceptance: the overall deadline in seconds; steps left after it are skipped (default 480)",
    )
    parser.add_argument(
        "--steps",
        nargs="+",
        choices=["hf", "vllm", "kernels"],
        default=None,
        help="gpu: the steps to run (default all)",
    )
    parser.add_argument(
        "--results", default="benchmarks/RESULTS.md", help="report: the markdown file to write"
    )
    parser.add_argument(
        "--reps",
        type=positive_int,
        default=None,
        help="timed repetitions of each measurement after warm-up, each side's median, min and max recorded "
        "(default on a CPU: decode 5, scan 3, generate, write and e2e 2; on CUDA: decode 10, generate 6, "
        "scan 5, write and e2e 3; gpu 20; ops counts and ignores it)",
    )
    _bench_size_arguments(parser)


def _bench_size_arguments(parser: argparse.ArgumentParser) -> None:
    """``lstmem bench KIND``: the sizes each benchmark measures at (default: the benchmark's own)."""
    parser.add_argument(
        "--kv-lengths",
        type=positive_int,
        nargs="+",
        default=None,
        help="decode, gpu: KV cache lengths (default: 128 256 on a CPU, 8192 16384 32768 65536 131072 on CUDA)",
    )
    parser.add_argument(
        "--histories",
        type=positive_int,
        nargs="+",
        default=None,
        help="e2e: history lengths (default: 256 on a CPU, 8192 32768 131072 on CUDA)",
    )
    parser.add_argument(
        "--answer-tokens",
        type=positive_int,
        default=None,
        help="e2e, generate, gpu: generated tokens (default: e2e 8 on a CPU, 2048 on CUDA; generate 8 "
        "on a CPU, 256 on CUDA; gpu 128)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=None,
        help="generate: prompt length (default: 64 on a CPU, 2048 on CUDA)",
    )
    parser.add_argument(
        "--tokens",
        type=positive_int,
        default=None,
        help="write: history tokens (default: 256 on a CPU, 32768 on CUDA)",
    )
    parser.add_argument(
        "--lengths",
        type=positive_int,
        nargs="+",
        default=None,
        help="scan, gpu: block lengths (default: scan 63 256 on a CPU, 63 2048 on CUDA; gpu 2048 8192 32768)",
    )
    parser.add_argument(
        "--batches",
        type=positive_int,
        nargs="+",
        default=None,
        help="scan, gpu: batch sizes (default: scan 1 4; gpu 1)",
    )


#: ``lstmem serve --max-tokens``: what it sets and its default, which fits any window.
MAX_TOKENS_HELP = "max_tokens of a chat request that sets none (default: 64, at most half the context window)"


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    """``lstmem serve``: the model, the session store, the address, the keys and the batching."""
    parser.add_argument(
        "--model",
        default=None,
        help="backbone: a short name of `lstmem models` (e.g. smollm2-135m), a local folder or a Hub id "
        "(default: embedded demo)",
    )
    parser.add_argument(
        "--adapter",
        default=None,
        help="LSTMem adapter: Hub id, local folder or a shipped adapter's short name (with --model)",
    )
    parser.add_argument("--store", default="lstmem-sessions", help="folder where session memory lives")
    parser.add_argument(
        "--session-versions",
        type=positive_int,
        default=16,
        help="versions kept per session for rollback (edit, regenerate) and fork; the oldest are pruned first",
    )
    parser.add_argument(
        "--session-version-bytes",
        type=positive_int,
        default=64 << 20,
        help="most bytes of memory files kept per session (default 64 MiB); the newest version is always kept",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=port_number, default=8000, help="port to listen on")
    parser.add_argument(
        "--name", default=None, help="model id served at /v1/models (default: from the adapter)"
    )
    parser.add_argument("--api-key", action="append", default=[], help="accepted bearer key (repeatable)")
    parser.add_argument(
        "--api-keys-file", default=None, help="file with one accepted key per line (default: none)"
    )
    parser.add_argument(
        "--context-window",
        type=positive_int,
        default=None,
        help=(
            "prompt window in tokens (default: the positions the backbone was trained for, at most 4096; "
            "a larger one is refused)"
        ),
    )
    parser.add_argument(
        "--max-batch", type=positive_int, default=32, help="most sessions per batched forward"
    )
    parser.add_argument(
        "--batch-wait-ms", type=non_negative_float, default=5.0, help="wait for more requests to batch"
    )
    parser.add_argument("--no-batching", action="store_true", help="run requests one at a time")
    parser.add_argument("--max-body-bytes", type=positive_int, default=1 << 20, help="larger bodies get 413")
    parser.add_argument("--max-tokens", type=positive_int, default=None, help=MAX_TOKENS_HELP)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights' dtype; auto: the checkpoint's",
    )
    parser.add_argument(
        "--engine",
        default="hf",
        choices=["hf", "vllm"],
        help="what generates the answers: the model's generate (hf) or a vLLM engine (needs the vllm extra)",
    )
    parser.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra vllm.LLM argument with --engine vllm, e.g. max_model_len=8192 (VALUE read as JSON when it parses)",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (default: torch's; 1 suits tiny models)",
    )


def _data_arguments(parser: argparse.ArgumentParser) -> None:
    """``lstmem data long``: the stage-2 Long dataset (its options: :mod:`.data_long`)."""
    from .data_long import add_arguments

    kinds = parser.add_subparsers(dest="kind", required=True, metavar="KIND", help="the dataset to build")
    add_arguments(
        kinds.add_parser(
            "long",
            help="build the paper's stage-2 Long dataset through an OpenAI-compatible endpoint",
            formatter_class=HelpFormatter,
        )
    )


def _models_arguments(parser: argparse.ArgumentParser) -> None:
    """``lstmem models [list|prepare NAME|remove NAME]``: the real backbones known by short name."""
    actions = parser.add_subparsers(dest="action", metavar="ACTION", help="what to do (default: list)")
    listing = actions.add_parser(
        "list",
        help="each backbone: what it is, whether its package is installed and it is converted, how to install it",
        formatter_class=HelpFormatter,
    )
    listing.add_argument("--json", action="store_true", help="print the list as JSON")
    prepare = actions.add_parser(
        "prepare",
        help="convert a backbone's installed GGUF once into a float32 folder (progress bar) and print its path",
        formatter_class=HelpFormatter,
    )
    prepare.add_argument("name", help="the backbone's short name (see lstmem models list)")
    prepare.add_argument(
        "--force", action="store_true", help="convert again even when a current conversion exists"
    )
    remove = actions.add_parser(
        "remove", help="delete a backbone's converted folder", formatter_class=HelpFormatter
    )
    remove.add_argument("name", help="the backbone's short name")
    parser.set_defaults(action="list", json=False)


#: ``lstmem bench KIND``: each kind and what it measures (its help).
BENCH_KINDS: dict[str, str] = {
    "decode": "one decode forward with memory against the plain backbone, by --kv-lengths",
    "generate": "generate from an empty memory: a --prompt-tokens prompt, then --answer-tokens tokens",
    "ops": "operator calls per decode step, with memory and plain (counts, not times)",
    "e2e": "write a history, prefill a question, generate the answer, by --histories",
    "write": "writing --tokens of history into memory against the plain forward of the same blocks",
    "scan": "the recurrence's naive, PyTorch and (CUDA) Triton scans, by --lengths and --batches",
    "gpu": "the GPU suite (decode, generate, vLLM, kernels); --acceptance: the prepared acceptance run",
    "report": "RESULTS.md and plots from the JSON records in FOLDER",
}


#: Each subcommand (in ``lstmem --help`` order): its one-line help and the function adding its arguments.
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "demo": ("offline recall demo: history in context vs in memory vs none", _demo_arguments),
    "bench": ("benchmarks against the plain backbone (JSON records, RESULTS.md, plots)", _bench_arguments),
    "eval": ("LoCoMo / HotpotQA / MemoryAgentBench: the adapter beside the plain backbone", eval_arguments),
    "serve": ("OpenAI-compatible server; every session keeps a persistent LSTMem memory", _serve_arguments),
    "data": (
        "training data: build the stage-2 Long dataset through an OpenAI-compatible endpoint",
        _data_arguments,
    ),
    "models": (
        "real backbones by short name (--model smollm2-135m): list, install hints, convert once offline",
        _models_arguments,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``lstmem`` parser: ``--version``, then a subparser per entry of :data:`SUBCOMMANDS`, each
    taking ``--debug`` before its own arguments."""
    parser = _Parser(
        prog="lstmem", description="LSTMem online memory for frozen LMs", formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"lstmem-peft {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True, help="what to run")
    for name, (summary, add_arguments) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=summary, description=summary, formatter_class=HelpFormatter)
        command.add_argument("--debug", action="store_true", help="show the full traceback of an error")
        add_arguments(command)
    return parser
