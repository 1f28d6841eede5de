"""HotpotQA: the distractor-setting protocol, and exact match / token F1 scoring.

Protocol (paper App. B): validation questions of the distractor setting, each with its passages in
the prompt (one history per question; memory reset before each), answers limited to 32 new tokens,
scored by exact match and token F1. Two protocols:

* ``official`` -- scoring exactly as ``hotpot_evaluate_v1.py`` (SQuAD normalisation; a yes/no/noanswer
  answer gets F1 0 unless the prediction normalises to the same word) on the whole reply. HotpotQA's
  release has no prompt; the prompt is ours (:data:`QA_PROMPT`, passages as ``Title: sentences``).
* ``paper`` -- δ-Mem's ``benchmark_compare.py``: its ``HOTPOTQA_PROMPT_TEMPLATE`` (instructions, then
  ``Passage <i> - <title>:`` paragraphs, then the question), the reply's first line, its normalisation,
  F1 rounded to 4 decimals (:func:`~lstmem_peft.eval.scorers.hotpot_paper_scores`).

Data: the official ``hotpot_dev_distractor_v1.json`` (a list of examples whose ``context`` is a list
of ``[title, [sentence, ...]]``), or rows in the Hugging Face ``hotpot_qa`` layout (``context`` as
``{"title": [...], "sentences": [[...], ...]}``) from a ``.json``/``.jsonl``/``.parquet`` file or the
Hub dataset (``hotpotqa/hotpot_qa/distractor``, split ``validation``).
``passages="all"`` (default) puts every passage of the example in the prompt (the two supporting
ones and the eight distractors); ``passages="supporting"`` only those named by ``supporting_facts``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lstmem_peft.memory import constants as K
from lstmem_peft.utils.errors import DataFormatError, describe

from . import scorers
from .protocol import Benchmark, DataSpec, History, Question, read_benchmark

QA_PROMPT = (
    "\nAnswer the question using the passages above. Reply with the answer only: a few words, or yes or no."
    "\n\nQuestion: {}\nAnswer:"
)


# Source: declare-lab/delta-Mem, deltamem/eval/benchmark_compare.py, HOTPOTQA_PROMPT_TEMPLATE (split at
# {context}: the part before it opens the history, the part after it is the question prompt).
PAPER_HEAD = "Answer the question using only the passages below.\nReply with a short span or yes/no only.\n\n"
PAPER_QUESTION = "\n\nQuestion: {}\nAnswer:"


def _example_problem(example: dict[str, Any]) -> str | None:
    """What keeps a record from being a HotpotQA example (``None``: nothing)."""
    context = example["context"]
    if isinstance(context, dict):  # Hugging Face layout
        titles, sentences = context.get("title"), context.get("sentences")
        if not (isinstance(titles, list) and isinstance(sentences, list) and len(titles) == len(sentences)):
            return f'"context" is {describe(context)}, not {{"title": [...], "sentences": [[...], ...]}}'
        return None
    if not isinstance(context, list):
        return f'"context" is {describe(context)}, not a list of [title, sentences] pairs'
    for i, passage in enumerate(context):
        if not (isinstance(passage, (list, tuple)) and len(passage) == 2 and isinstance(passage[1], list)):
            return f'"context" item {i} is {describe(passage)}, not a [title, [sentence, ...]] pair'
    return None


DATA = DataSpec(
    expected="HotpotQA distractor examples (the list in hotpot_dev_distractor_v1.json, or rows of the Hub "
    'dataset hotpotqa/hotpot_qa), each with "question", "answer" and "context"',
    fix="Download hotpot_dev_distractor_v1.json from https://hotpotqa.github.io and pass its path, or pass "
    "the Hub id hotpotqa/hotpot_qa/distractor",
    fields=("question", "answer", "context"),
    check=_example_problem,
)


def score_answer(prediction: str, gold: str, protocol: str = "official") -> dict[str, float]:
    """``{"em": ..., "f1": ...}`` for one question under ``protocol``."""
    if scorers.check_protocol(protocol) == "official":
        return scorers.hotpot_official_scores(prediction, gold)
    return scorers.hotpot_paper_scores(prediction, gold)


def _passages(example: dict[str, Any]) -> list[tuple[str, list[str]]]:
    context = example["context"]
    if isinstance(context, dict):  # Hugging Face layout
        return list(zip(context["title"], context["sentences"], strict=True))
    return [(title, sentences) for title, sentences in context]


def _supporting_titles(example: dict[str, Any]) -> set[str]:
    facts = example.get("supporting_facts") or []
    if isinstance(facts, dict):
        return set(facts["title"])
    return {title for title, _ in facts}


def passages_text(example: dict[str, Any], passages: str = "all", protocol: str = "official") -> str:
    """The example's passages: ``Title: sentence sentence ...`` paragraphs (official), or δ-Mem's
    ``Passage <i> - <title>:`` blocks (paper; ``i`` counts every passage, empty ones are skipped)."""
    chosen = _passages(example)
    if passages == "supporting":
        titles = _supporting_titles(example)
        if not titles:
            raise ValueError(
                f"HotpotQA example {example.get('_id', example.get('id'))} has no supporting_facts"
            )
        chosen = [(t, s) for t, s in chosen if t in titles]
    if protocol == "paper":
        blocks = []
        for i, (title, sentences) in enumerate(chosen, start=1):
            text = " ".join(str(s).strip() for s in sentences if str(s).strip()).strip()
            if text:
                blocks.append(f"Passage {i} - {title}:\n{text}")
        return PAPER_HEAD + ("\n\n".join(blocks) if blocks else "No passages provided.")
    return "".join(f"{title}: {''.join(sentences).strip()}\n\n" for title, sentences in chosen)


class HotpotQA(Benchmark):
    """The HotpotQA distractor protocol.

    Args:
        source: ``hotpot_dev_distractor_v1.json`` (or a ``.jsonl``/``.parquet``, or a folder), or a Hub
            dataset id ``owner/name[/folder]``, e.g. ``hotpotqa/hotpot_qa/distractor``.
        limit: evaluate only the first ``limit`` questions.
        passages: ``"all"`` passages of each example in the prompt, or only the ``"supporting"`` ones.
        max_new_tokens: answer limit (the paper: 32).
        split: which data file to read from a folder or Hub id (files named after the split).
        protocol: ``"official"`` or ``"paper"`` (see the module docstring).
    """

    name = "hotpotqa"
    metrics = ("em", "f1")

    def __init__(
        self,
        source: str,
        limit: int | None = None,
        passages: str = "all",
        max_new_tokens: int = K.HOTPOTQA_MAX_NEW_TOKENS,
        split: str = "validation",
        protocol: str = "official",
    ) -> None:
        self.protocol = scorers.check_protocol(protocol)
        if passages not in ("all", "supporting"):
            raise ValueError(f"passages must be 'all' or 'supporting', got {passages!r}")
        self.examples = read_benchmark(source, split, DATA)[:limit]
        self.passages = passages
        self.max_new_tokens = max_new_tokens
        if passages == "supporting":  # checked now, not when the history is built after the model loads
            for n, example in enumerate(self.examples):
                if not _supporting_titles(example):
                    got = (
                        f'example {n} ({example.get("_id", example.get("id", n))}) has no "supporting_facts"'
                    )
                    raise DataFormatError(
                        source,
                        "examples with supporting_facts (--passages supporting)",
                        got,
                        "Pass --passages all, or the official file, which has them",
                    )

    def __len__(self) -> int:
        return len(self.examples)

    def histories(self) -> Iterator[History]:
        for n, example in enumerate(self.examples):
            example_id = str(example.get("_id", example.get("id", n)))
            question = Question(
                id=example_id,
                prompt=QA_PROMPT.format(example["question"])
                if self.protocol == "official"
                else PAPER_QUESTION.format(str(example["question"]).strip()),
                answer=str(example["answer"]),
                max_new_tokens=self.max_new_tokens,
                group=str(example.get("type", "all")),
                meta={"question": example["question"], "level": example.get("level")},
            )
            text = passages_text(example, self.passages, self.protocol)
            yield History(id=example_id, text=text, questions=[question])

    def settings(self) -> dict[str, Any]:
        options = {"examples": len(self.examples), "passages": self.passages}
        return {**super().settings(), **options, "max_new_tokens": self.max_new_tokens}

    def score(self, question: Question, prediction: str) -> dict[str, float]:
        return score_answer(prediction, question.answer, self.protocol)
