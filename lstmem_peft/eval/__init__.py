"""Evaluation: the paper's benchmark protocols, official-rule scorers, and a runner that reports the
adapter beside its plain backbone.

    from lstmem_peft.eval import evaluate, LoCoMo
    summary = evaluate(model, tokenizer, LoCoMo("locomo10.json"), "eval-results/locomo")

or from the shell: ``lstmem eval locomo locomo10.json --model <id> --adapter <path>``.
"""

from .hotpotqa import HotpotQA
from .locomo import LoCoMo
from .mab import MemoryAgentBench
from .protocol import Benchmark, History, Question, question_weighted, require_fields
from .runner import Decoding, PromptBuilder, evaluate, load_model, markdown_table

__all__ = [
    "Benchmark",
    "Decoding",
    "History",
    "HotpotQA",
    "LoCoMo",
    "MemoryAgentBench",
    "PromptBuilder",
    "Question",
    "evaluate",
    "load_model",
    "markdown_table",
    "question_weighted",
    "require_fields",
]
