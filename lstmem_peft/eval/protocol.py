"""What a benchmark hands the evaluation runner: histories, their questions, and how to score them.

Every benchmark the harness runs (LoCoMo, HotpotQA, MemoryAgentBench) reduces to the same shape:
independent *histories* (a LoCoMo conversation, a HotpotQA example's passages, a MemoryAgentBench
context), each with one or more *questions*. The model sees ``history.text + question.prompt`` as
one user turn (inside the model's chat template when it has one); the runner writes the history
part into memory and the KV cache once, snapshots both, and answers every question from that
snapshot (see :mod:`lstmem_peft.eval.runner`).

A benchmark subclasses :class:`Benchmark` and implements :meth:`~Benchmark.histories`,
:meth:`~Benchmark.score` and :meth:`~Benchmark.summarize`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Question:
    """One question on a history.

    Attributes:
        id: unique within the benchmark run (written to the per-question JSONL).
        prompt: the text that follows the history in the benchmark's official prompt format
            (instructions, the question, the answer cue).
        answer: the gold answer(s) the scorer compares against (a string, or a list of aliases).
        max_new_tokens: the benchmark's generation limit for this question.
        group: the aggregation key (LoCoMo category name, MemoryAgentBench source, ...).
        meta: anything else worth keeping in the per-question record (category number, type, ...).
    """

    id: str
    prompt: str
    answer: Any
    max_new_tokens: int
    group: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class History:
    """One independent history: memory is reset before it, and all its questions share its snapshot.

    Attributes:
        id: unique within the benchmark run.
        text: the history in the benchmark's official prompt format; the runner writes it into
            memory (and, unless in memory-only mode, keeps it in the prompt's KV cache).
        questions: the questions asked about it, answered independently from the same snapshot.
        segments: optionally, ``text`` cut into parts that are replayed into memory one after
            another (LoCoMo sessions); block boundaries then also fall between segments. They must
            concatenate to ``text``. ``None``: the text is one stream.
        system: the protocol's system message (a system turn of the chat template), or ``None``.
    """

    id: str
    text: str
    questions: list[Question]
    segments: list[str] | None = None
    system: str | None = None


class Benchmark:
    """Base class of a benchmark protocol: data, scoring and aggregation.

    Attributes:
        name: short name used in file names and tables (``"locomo"``, ``"hotpotqa"``, ``"mab"``).
        metrics: the metric names :meth:`score` returns, primary first (the markdown table shows
            all of them).
    """

    name: str = "benchmark"
    metrics: tuple[str, ...] = ("score",)

    def histories(self) -> Iterator[History]:
        """The histories to evaluate, in a fixed order."""
        raise NotImplementedError

    def __len__(self) -> int:
        """Number of histories (for progress bars)."""
        raise NotImplementedError

    def score(self, question: Question, prediction: str) -> dict[str, float]:
        """``{metric: value}`` for one prediction, every metric in :attr:`metrics`."""
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        """What decides this benchmark's histories, prompts and scores (recorded in ``summary.json``,
        and compared when an interrupted run is resumed). Subclasses add their options."""
        return {"benchmark": self.name, "protocol": getattr(self, "protocol", None)}

    def with_protocol(self, protocol: str) -> Benchmark:
        """A copy that *scores* under ``protocol`` (its histories and prompts are unchanged): used to
        re-score predictions under the other protocol."""
        clone = copy.copy(self)
        clone.protocol = protocol
        return clone

    def summarize(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Aggregate per-question records into the summary.

        Args:
            records: one dict per question with at least ``"group"`` and ``"scores"`` (the dict
                :meth:`score` returned).

        Returns:
            ``{"groups": {group: {metric: mean, "questions": n}}, "overall": {metric: mean,
            "questions": n}}`` plus any benchmark-specific levels (e.g. MemoryAgentBench families).
            Means are question-weighted.
        """
        return question_weighted(records, self.metrics)


def question_weighted(records: list[dict[str, Any]], metrics: tuple[str, ...]) -> dict[str, Any]:
    """Question-weighted means of ``metrics`` per ``record["group"]`` and overall (group order kept)."""
    groups: dict[str, list[dict[str, float]]] = {}
    for record in records:
        groups.setdefault(record["group"], []).append(record["scores"])

    def mean(rows: list[dict[str, float]]) -> dict[str, Any]:
        out: dict[str, Any] = {m: sum(r[m] for r in rows) / len(rows) if rows else 0.0 for m in metrics}
        out["questions"] = len(rows)
        return out

    return {
        "groups": {name: mean(rows) for name, rows in groups.items()},
        "overall": mean([r["scores"] for r in records]),
    }


def require_fields(rows: list[dict[str, Any]], fields: tuple[str, ...], source: str, schema: str) -> None:
    """Raise a ValueError naming the file, row and field when a row lacks one of ``fields``."""
    for n, row in enumerate(rows):
        missing = [key for key in fields if key not in row]
        if missing:
            raise ValueError(f"{source}: record {n} has no {missing[0]!r} field (expected {schema})")
