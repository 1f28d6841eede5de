"""LoCoMo: the evaluation protocol and the official scorer's rules.

Protocol (paper App. B): categories 1-4 (1,540 questions in LoCoMo-10; category 5 is excluded);
each conversation is one history, its sessions replayed in chronological order (session number
order) with their dates, in the official single-prompt format::

    Below is a conversation between two people: A and B. The conversation takes place over ...
    DATE: 1:56 pm on 8 May, 2023
    CONVERSATION:
    A said, "..."
    B said, "..." and shared a photo of ...
    ...
    Based on the above context, write an answer in the form of a short phrase for the following
    question. Answer with exact words from the context whenever possible.

    Question: ... Short answer:

Category-2 (temporal) questions carry the official suffix asking for the date form ("Use DATE of
CONVERSATION to answer with an approximate date."). Answers are limited to 50 new tokens. Data: the
official ``locomo10.json`` (a list of samples with ``conversation`` and ``qa``), or a Hub dataset id
with the same fields.

Scoring follows the official LoCoMo scorer:

* normalisation: commas removed, lower-cased, punctuation removed, the words ``a``, ``an``,
  ``the`` and ``and`` removed, whitespace folded;
* tokens Porter-stemmed (nltk, a hard dependency so a score never depends on an optional import);
* token F1 between prediction and gold;
* category 1 (multi-hop) is multi-answer: prediction and gold are split on commas, and the score is
  the mean over gold parts of the best F1 against any predicted part;
* category 3 (open-domain) scores against the gold text before the first ``;``;
* categories 2 (temporal) and 4 (single-hop): plain token F1. Category 5 is not scored.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

from nltk.stem import PorterStemmer

from .. import constants as K
from .protocol import Benchmark, History, Question, question_weighted, require_fields
from .text import squad_normalize, token_f1, tokens

SCORED_CATEGORIES = (1, 2, 3, 4)
LOCOMO10_QUESTIONS = 1540  # category 1-4 questions of the 10 LoCoMo-10 conversations (paper App. B)
CATEGORY_NAMES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
_STEMMER = PorterStemmer()


@lru_cache(maxsize=65536)
def _stem(word: str) -> str:
    return _STEMMER.stem(word)


def normalize(text: str) -> str:
    """LoCoMo's answer normalisation (commas and the words a/an/the/and removed)."""
    return squad_normalize(str(text).replace(",", ""), articles=("a", "an", "the", "and"))


def f1(prediction: str, gold: str) -> float:
    """Token F1 of Porter-stemmed, normalised tokens."""
    return token_f1(tokens(prediction, normalize, _stem), tokens(gold, normalize, _stem))


def score_answer(prediction: str, answer: str, category: int) -> float:
    """Score one LoCoMo answer (categories 1-4) in [0, 1]."""
    if category not in SCORED_CATEGORIES:
        raise ValueError(f"LoCoMo category {category} is not scored (categories 1-4; 5 is adversarial)")
    prediction, answer = str(prediction), str(answer)
    if category == 1:
        predictions = [p.strip() for p in prediction.split(",")]
        golds = [g.strip() for g in answer.split(",")]
        return sum(max(f1(p, g) for p in predictions) for g in golds) / len(golds)
    if category == 3:
        answer = answer.split(";")[0].strip()
    return f1(prediction, answer)


# ---------------------------------------------------------------------- protocol
# The official prompt texts (LoCoMo's evaluation scripts), kept verbatim, their spelling included,
# so scores compare with published numbers.
CONVERSATION_START = (
    "Below is a conversation between two people: {} and {}. The conversation takes place over multiple days "
    "and the date of each conversation is wriiten at the beginning of the conversation.\n\n"
)
QA_PROMPT = (
    "Based on the above context, write an answer in the form of a short phrase for the following question. "
    "Answer with exact words from the context whenever possible.\n\nQuestion: {} Short answer:"
)
TEMPORAL_SUFFIX = " Use DATE of CONVERSATION to answer with an approximate date."

_SESSION = re.compile(r"^session_(\d+)$")


def session_text(date: str, turns: list[dict[str, Any]]) -> str:
    """One session in the official format: its date, then each turn (and any shared image caption)."""
    lines = [f"DATE: {date}\nCONVERSATION:\n"]
    for turn in turns:
        line = f'{turn["speaker"]} said, "{turn["text"]}"'
        if turn.get("blip_caption"):
            line += f" and shared {turn['blip_caption']}."
        lines.append(line + "\n")
    return "".join(lines) + "\n"


def conversation_sessions(conversation: dict[str, Any]) -> list[str]:
    """The sessions' texts in chronological (session number) order; the first opens the conversation."""
    numbers = sorted(int(m.group(1)) for key in conversation if (m := _SESSION.match(key)))
    if not numbers:
        raise ValueError("a LoCoMo conversation needs session_<n> lists (the official locomo10.json schema)")
    sessions = []
    for n in numbers:
        date = conversation.get(f"session_{n}_date_time")
        if date is None:
            raise ValueError(f"LoCoMo conversation has session_{n} but no session_{n}_date_time")
        if conversation[f"session_{n}"]:
            sessions.append(session_text(date, conversation[f"session_{n}"]))
    speakers = (conversation.get("speaker_a"), conversation.get("speaker_b"))
    sessions[0] = CONVERSATION_START.format(*speakers) + sessions[0]
    return sessions


def question_prompt(question: str, category: int) -> str:
    """What follows the conversation for one question (category 2 asks for the date form)."""
    if category == 2:
        question = question + TEMPORAL_SUFFIX
    return "\n" + QA_PROMPT.format(question)


class LoCoMo(Benchmark):
    """The LoCoMo protocol over the official ``locomo10.json`` (or a Hub dataset id in its schema).

    Args:
        source: path of ``locomo10.json`` (or a ``.jsonl``/``.parquet`` of samples, or a folder holding
            one), or a Hub dataset id ``owner/name[/folder]`` (downloaded once, then read from the cache).
        limit: evaluate only the first ``limit`` conversations (smoke runs).
        max_new_tokens: answer limit (the paper: 50).
        split: which data file to read when ``source`` is a folder or Hub id holding several (files
            named after the split).
    """

    name = "locomo"
    metrics = ("f1",)

    def __init__(
        self,
        source: str,
        limit: int | None = None,
        max_new_tokens: int = K.LOCOMO_MAX_NEW_TOKENS,
        split: str = "train",
    ) -> None:
        from ..data import read_records

        self.samples = list(read_records(source, split))[:limit]
        self.max_new_tokens = max_new_tokens
        require_fields(self.samples, ("conversation", "qa"), source, "the official locomo10.json schema")
        scored = sum(
            int(qa["category"]) in SCORED_CATEGORIES for sample in self.samples for qa in sample["qa"]
        )
        if limit is None and len(self.samples) == 10 and scored != LOCOMO10_QUESTIONS:
            warnings.warn(
                f"{source}: {scored} category 1-4 questions, not LoCoMo-10's {LOCOMO10_QUESTIONS}; "
                "is this the official locomo10.json?",
                stacklevel=2,
            )

    def __len__(self) -> int:
        return len(self.samples)

    def histories(self) -> Iterator[History]:
        for n, sample in enumerate(self.samples):
            sample_id = str(sample.get("sample_id", n))
            sessions = conversation_sessions(sample["conversation"])
            questions = [
                Question(
                    id=f"{sample_id}/{i}",
                    prompt=question_prompt(qa["question"], int(qa["category"])),
                    answer=str(qa["answer"]),
                    max_new_tokens=self.max_new_tokens,
                    group=CATEGORY_NAMES[int(qa["category"])],
                    meta={"category": int(qa["category"]), "question": qa["question"]},
                )
                for i, qa in enumerate(sample["qa"])
                if int(qa["category"]) in SCORED_CATEGORIES
            ]
            yield History(id=sample_id, text="".join(sessions), questions=questions, segments=sessions)

    def score(self, question: Question, prediction: str) -> dict[str, float]:
        return {"f1": score_answer(prediction, question.answer, question.meta["category"])}

    def summarize(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Question-weighted F1 per category (in category order) and overall."""
        order = {name: c for c, name in CATEGORY_NAMES.items()}
        return question_weighted(sorted(records, key=lambda r: order[r["group"]]), self.metrics)
