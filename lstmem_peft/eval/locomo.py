"""LoCoMo: the ``official`` and ``paper`` protocols over the official ``locomo10.json``.

Both protocols ask the category 1-4 questions (1,540 in LoCoMo-10; category 5 is excluded), replay each
conversation's sessions into memory in chronological (session number) order, one segment per session,
and reset the memory before every conversation. Category-2 (temporal) questions carry the official
suffix "Use DATE of CONVERSATION to answer with an approximate date."

* ``official`` -- LoCoMo's API-model path (``task_eval/evaluate_gpts.py``, batch size 1): no system
  message; one user turn ``CONV_START_PROMPT + conversation + "\n\n" + QA_PROMPT``; each session is
  ``DATE: ...\nCONVERSATION:\n`` and its turns ``<speaker> said, "<text>"`` (an image turn adds
  ``[shares <caption>]`` when it has ``img_file``, as that code checks); the ``"\n\n"`` the code adds per
  session all land after the last session; 32 new tokens (its ``num_tokens_request``); the whole reply
  is scored (:func:`~lstmem_peft.eval.scorers.locomo_official_score`).
* ``paper`` -- δ-Mem's ``locomo_protocol.py`` ``official_prompt`` mode: its system prompt, its question
  prompt ("... write a short answer for the following question in a few words ..."), turns rendered
  ``<speaker> said, "<text>"`` plus `` and shared <caption>.``, 50 new tokens, the first line of the reply
  lower-cased with option markers and ``answer:`` removed
  (:func:`~lstmem_peft.eval.scorers.locomo_paper_score`). Unlike that code, sessions are listed oldest
  first (it lists the newest first).

Data: the official ``locomo10.json`` (a list of samples with ``conversation`` and ``qa``), or a Hub
dataset id with the same fields. Deviations from the released code are listed in the README.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import Any

from . import scorers
from .protocol import Benchmark, History, Question, question_weighted, require_fields

SCORED_CATEGORIES = (1, 2, 3, 4)
LOCOMO10_QUESTIONS = 1540  # category 1-4 questions of the 10 LoCoMo-10 conversations (paper App. B)
CATEGORY_NAMES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
MAX_NEW_TOKENS = {"official": 32, "paper": 50}
TEMPORAL_SUFFIX = " Use DATE of CONVERSATION to answer with an approximate date."

# Source: snap-research/locomo, task_eval/evaluate_gpts.py (CONV_START_PROMPT, QA_PROMPT), word for word,
# its spelling included.
CONVERSATION_START = (
    "Below is a conversation between two people: {} and {}. The conversation takes place over multiple days "
    "and the date of each conversation is wriiten at the beginning of the conversation.\n\n"
)
OFFICIAL_QA_PROMPT = (
    "\nBased on the above context, write an answer in the form of a short phrase for the following question. "
    "Answer with exact words from the context whenever possible.\n\nQuestion: {} Short answer:\n"
)
# Source: declare-lab/delta-Mem, deltamem/eval/locomo_protocol.py (OFFICIAL_SYSTEM_PROMPT, OFFICIAL_QA_PROMPT;
# its OFFICIAL_CONV_START_PROMPT is CONVERSATION_START above).
PAPER_SYSTEM = (
    "You are a helpful, respectful and honest assistant whose job is to understand "
    "the following conversation and answer questions based on the conversation. "
    "If you don't know the answer to a question, please don't share false information."
)
PAPER_QA_PROMPT = (
    "Based on the above conversations, write a short answer for the following question "
    "in a few words. Do not write complete and lengthy sentences. "
    "Answer with exact words from the conversations whenever possible.\n\n"
    "Question: {}"
)

_SESSION = re.compile(r"^session_(\d+)$")


def _session_numbers(conversation: dict[str, Any]) -> list[int]:
    numbers = sorted(int(m.group(1)) for key in conversation if (m := _SESSION.match(key)))
    if not numbers:
        raise ValueError("a LoCoMo conversation needs session_<n> lists (the official locomo10.json schema)")
    for n in numbers:
        if f"session_{n}_date_time" not in conversation:
            raise ValueError(f"LoCoMo conversation has session_{n} but no session_{n}_date_time")
    return numbers


def official_sessions(conversation: dict[str, Any]) -> list[str]:
    """The official API path's conversation text, one string per session (oldest first), the opening
    line on the first; the per-session ``"\\n\\n"`` all after the last session."""
    numbers = _session_numbers(conversation)
    last = max((n for n in numbers if conversation[f"session_{n}"]), default=None)
    if last is None:
        raise ValueError("a LoCoMo conversation has no turns")
    numbers = [n for n in numbers if n <= last]
    sessions = []
    for n in numbers:
        turns = []
        for turn in conversation[f"session_{n}"]:
            line = f'{turn["speaker"]} said, "{turn["text"]}"\n'
            if turn.get("img_file"):
                line += f"[shares {turn.get('blip_caption')}]\n"
            turns.append(line)
        sessions.append(f"DATE: {conversation[f'session_{n}_date_time']}\nCONVERSATION:\n" + "".join(turns))
    sessions[0] = (
        CONVERSATION_START.format(conversation.get("speaker_a"), conversation.get("speaker_b")) + sessions[0]
    )
    sessions[-1] += "\n\n" * len(numbers)
    return sessions


def paper_sessions(conversation: dict[str, Any]) -> list[str]:
    """δ-Mem's conversation text, one string per session, oldest first (δ-Mem: newest first)."""
    sessions = []
    for n in _session_numbers(conversation):
        turns = []
        for turn in conversation[f"session_{n}"]:
            line = f'{turn["speaker"]} said, "{turn["text"]}"\n'
            if turn.get("blip_caption"):
                line += f" and shared {turn['blip_caption']}."
            turns.append(line + "\n")
        sessions.append(f"\nDATE: {conversation[f'session_{n}_date_time']}\nCONVERSATION:\n" + "".join(turns))
    sessions[0] = (
        CONVERSATION_START.format(conversation.get("speaker_a"), conversation.get("speaker_b")) + sessions[0]
    )
    return sessions


def question_prompt(question: str, category: int, protocol: str = "official") -> str:
    """What follows the conversation for one question (category 2 asks for the date form)."""
    if category == 2:
        question = question + TEMPORAL_SUFFIX
    template = OFFICIAL_QA_PROMPT if protocol == "official" else PAPER_QA_PROMPT
    return "\n\n" + template.format(question)


class LoCoMo(Benchmark):
    """The LoCoMo protocols over the official ``locomo10.json`` (or a Hub dataset id in its schema).

    Args:
        source: path of ``locomo10.json`` (or a ``.jsonl``/``.parquet`` of samples, or a folder holding
            one), or a Hub dataset id ``owner/name[/folder]`` (downloaded once, then read from the cache).
        limit: evaluate only the first ``limit`` conversations (smoke runs).
        max_new_tokens: answer limit; default: the protocol's (official 32, paper 50).
        split: which data file to read when ``source`` is a folder or Hub id holding several (files
            named after the split).
        protocol: ``"official"`` or ``"paper"`` (see the module docstring).
    """

    name = "locomo"
    metrics = ("f1",)

    def __init__(
        self,
        source: str,
        limit: int | None = None,
        max_new_tokens: int | None = None,
        split: str = "train",
        protocol: str = "official",
    ) -> None:
        from ..data import read_records

        self.protocol = scorers.check_protocol(protocol)
        self.samples = list(read_records(source, split))[:limit]
        self.max_new_tokens = max_new_tokens or MAX_NEW_TOKENS[protocol]
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
        official = self.protocol == "official"
        for n, sample in enumerate(self.samples):
            sample_id = str(sample.get("sample_id", n))
            conversation = sample["conversation"]
            sessions = official_sessions(conversation) if official else paper_sessions(conversation)
            questions = [
                Question(
                    id=f"{sample_id}/{i}",
                    prompt=question_prompt(qa["question"], int(qa["category"]), self.protocol),
                    answer=str(qa["answer"]),
                    max_new_tokens=self.max_new_tokens,
                    group=CATEGORY_NAMES[int(qa["category"])],
                    meta={"category": int(qa["category"]), "question": qa["question"]},
                )
                for i, qa in enumerate(sample["qa"])
                if int(qa["category"]) in SCORED_CATEGORIES
            ]
            system = None if official else PAPER_SYSTEM
            yield History(sample_id, "".join(sessions), questions, segments=sessions, system=system)

    def settings(self) -> dict[str, Any]:
        return {
            **super().settings(),
            "conversations": len(self.samples),
            "max_new_tokens": self.max_new_tokens,
        }

    def score(self, question: Question, prediction: str) -> dict[str, float]:
        category = question.meta["category"]
        if category not in SCORED_CATEGORIES:
            raise ValueError(f"LoCoMo category {category} is not scored (categories 1-4; 5 is adversarial)")
        if self.protocol == "official":
            return {"f1": scorers.locomo_official_score(prediction, question.answer, category)}
        return {"f1": scorers.locomo_paper_score(prediction, question.answer, category)}

    def summarize(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Question-weighted F1 per category (in category order) and overall."""
        order = {name: c for c, name in CATEGORY_NAMES.items()}
        return question_weighted(sorted(records, key=lambda r: order[r["group"]]), self.metrics)
