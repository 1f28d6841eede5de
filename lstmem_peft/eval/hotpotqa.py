"""HotpotQA: the distractor-setting protocol, and exact match / token F1 scoring.

Protocol (paper App. B): validation questions of the distractor setting, each with its passages in
the prompt (one history per question; memory reset before each), answers limited to 32 new tokens,
scored by exact match and token F1 after SQuAD-style normalisation. As in the official HotpotQA
evaluation, a yes/no/noanswer answer gets F1 0 unless the prediction normalises to the same word.

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

from .. import constants as K
from .protocol import Benchmark, History, Question, require_fields
from .text import squad_normalize, token_f1

_SPECIAL = ("yes", "no", "noanswer")

QA_PROMPT = (
    "\nAnswer the question using the passages above. Reply with the answer only: a few words, or yes or no."
    "\n\nQuestion: {}\nAnswer:"
)


def exact_match(prediction: str, gold: str) -> float:
    return float(squad_normalize(prediction) == squad_normalize(gold))


def f1(prediction: str, gold: str) -> float:
    pred, ref = squad_normalize(prediction), squad_normalize(gold)
    if (pred in _SPECIAL or ref in _SPECIAL) and pred != ref:
        return 0.0
    return token_f1(pred.split(), ref.split())


def score_answer(prediction: str, gold: str) -> dict[str, float]:
    """``{"em": ..., "f1": ...}`` for one question."""
    return {"em": exact_match(prediction, gold), "f1": f1(prediction, gold)}


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


def passages_text(example: dict[str, Any], passages: str = "all") -> str:
    """The example's passages, one paragraph per title: ``Title: sentence sentence ...``."""
    chosen = _passages(example)
    if passages == "supporting":
        titles = _supporting_titles(example)
        if not titles:
            raise ValueError(
                f"HotpotQA example {example.get('_id', example.get('id'))} has no supporting_facts"
            )
        chosen = [(t, s) for t, s in chosen if t in titles]
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
    ) -> None:
        from ..data import read_records

        if passages not in ("all", "supporting"):
            raise ValueError(f"passages must be 'all' or 'supporting', got {passages!r}")
        self.examples = list(read_records(source, split))[:limit]
        self.passages = passages
        self.max_new_tokens = max_new_tokens
        require_fields(self.examples, ("question", "answer", "context"), source, "the HotpotQA schema")

    def __len__(self) -> int:
        return len(self.examples)

    def histories(self) -> Iterator[History]:
        for n, example in enumerate(self.examples):
            example_id = str(example.get("_id", example.get("id", n)))
            question = Question(
                id=example_id,
                prompt=QA_PROMPT.format(example["question"]),
                answer=str(example["answer"]),
                max_new_tokens=self.max_new_tokens,
                group=str(example.get("type", "all")),
                meta={"question": example["question"], "level": example.get("level")},
            )
            yield History(id=example_id, text=passages_text(example, self.passages), questions=[question])

    def score(self, question: Question, prediction: str) -> dict[str, float]:
        return score_answer(prediction, question.answer)
