"""Evaluation: LoCoMo, HotpotQA and MemoryAgentBench under two protocols (``official``: the
benchmark's released code; ``paper``: the code the paper names), and a runner that reports the
adapter beside its plain backbone.

    from lstmem_peft.eval import evaluate, rescore, LoCoMo
    summary = evaluate(model, tokenizer, LoCoMo("locomo10.json"), "eval-results/locomo")
    rescore("eval-results/locomo/predictions.jsonl", LoCoMo("locomo10.json", protocol="paper"), "paper")

or from the shell: ``lstmem eval locomo locomo10.json --model <id> --adapter <path> [--protocol paper]``.
Named rows in one run (no context, the window, memory only, the paper's protocol, BM25), with bootstrap
intervals and costs: :func:`evaluate_rows` (``--rows``; :mod:`lstmem_peft.eval.rows`).
General capabilities: :mod:`lstmem_peft.eval.lm_eval_model` (lm-evaluation-harness).
"""

from .hotpotqa import HotpotQA
from .locomo import LoCoMo
from .mab import MemoryAgentBench
from .outputs import markdown_table, plot_scores, protocols_table
from .prompts import PromptBuilder
from .protocol import Benchmark, History, Question, question_weighted, require_fields
from .rows import ROWS, evaluate_rows
from .runner import Decoding, evaluate, rescore
from .scorers import PROTOCOLS

__all__ = [
    "Benchmark",
    "Decoding",
    "History",
    "HotpotQA",
    "LoCoMo",
    "MemoryAgentBench",
    "PROTOCOLS",
    "PromptBuilder",
    "Question",
    "ROWS",
    "evaluate",
    "evaluate_rows",
    "markdown_table",
    "plot_scores",
    "protocols_table",
    "question_weighted",
    "require_fields",
    "rescore",
]
