"""MemoryAgentBench (Hu et al., 2025): data, prompts, per-source scoring and family aggregation.

Data. The official snapshot (Hub dataset ``ai-hyz/MemoryAgentBench``) holds one parquet file per split,
``data/<Split>-00000-of-00001.parquet``, for the splits Accurate_Retrieval, Test_Time_Learning,
Long_Range_Understanding and Conflict_Resolution. A row is one context with its questions: ``context``
(str), ``questions`` (list[str]), ``answers`` (list[list[str]], the accepted strings per question) and
``metadata`` (a struct: ``source`` names the sub-dataset, e.g. ``eventqa_full`` or
``factconsolidation_mh_32k``; ``qa_pair_ids`` per question; LongMemEval rows also carry ``question_ids``
and ``question_types``). ReDial answers are movie entity ids; the snapshot's ``entity2id.json`` (entity
URI -> id) turns them into titles. The full benchmark has 146 rows and 3,671 questions
(:data:`PAPER_QUESTIONS`). Each row is one :class:`History`; :data:`SOURCES` (keyed by source prefix)
decides family, metric and generation limit, and a file named after a split may hold only that split's
sources.

Scoring, one ``"score"`` in [0, 1] per question (App. B of the paper we reproduce):

* ``alias`` -- :func:`alias_accuracy` for question answering and classification;
* ``f1`` -- :func:`summary_f1` for InfiniteBench summarisation;
* ``recall@5`` -- :func:`recall_at_5` for ReDial movie recommendation.

Family and overall scores are means over questions, so families weigh by their question counts.

Choices made here (where the paper is silent):

* Alias accuracy is containment, not exact match: MemoryAgentBench's own ``substring_exact_match``
  (SQuAD-normalised gold contained in the normalised prediction, best over aliases) scores RULER QA,
  EventQA and FactConsolidation, and a short answer often carries a few extra words. Containment is
  on whole tokens, so label ``"3"`` is not found in ``"13"`` (in-context classification labels are
  numbers). An alias that normalises to nothing (``"A"``, an option letter) is compared with articles
  kept, on both sides.
* LongMemEval abstention questions (question id ending ``_abs``, LongMemEval's convention; whether the
  snapshot's ``longmemeval_s*`` rows hold any is unconfirmed) expect the explicit abstention the prompt
  asks for: their answer becomes ``[ABSTAIN]``, the dataset's explanation stays in ``meta["reference"]``.
* Recall@5 matches titles by key (parenthesised parts such as years dropped, SQuAD-normalised); unlike
  MemoryAgentBench's scorer it does not snap predicted titles to the nearest catalogue title by edit
  distance, so a misspelt title misses.
* Detective QA is scored by alias accuracy like the other QA sources (MemoryAgentBench uses exact match
  after extracting the answer); its gold strings restate the chosen option, e.g. ``"C. <text>"``.
* History text is ``"Context:\n" + context``; the question prompt is the source's instruction (the
  shared short-answer one with the abstention rule, except where a source needs other output: numeric
  label, ranked movie list, summary; FactConsolidation adds its rule that a larger serial number marks
  the newer fact), then the question, then an answer cue.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ..data import hub_dataset_folder, read_file
from .protocol import Benchmark, History, Question, question_weighted
from .text import squad_normalize, token_f1

FAMILIES = ("AR", "TTL", "LRU", "SF")
SPLITS = {
    "Accurate_Retrieval": "AR",
    "Test_Time_Learning": "TTL",
    "Long_Range_Understanding": "LRU",
    "Conflict_Resolution": "SF",
}
PAPER_QUESTIONS = {"AR": 2000, "TTL": 700, "LRU": 171, "SF": 800}  # the full benchmark: 3,671 questions
ABSTAIN = "unanswerable"
ENTITY_FILE = "entity2id.json"
COLUMNS = ("context", "questions", "answers", "metadata")

_ABSTAIN_RULE = f'If the context does not support an answer, reply "{ABSTAIN}".'
_SHORT_ANSWER = f"Answer using only the context above. Give a short answer and nothing else. {_ABSTAIN_RULE}"


@dataclass(frozen=True)
class SourceSpec:
    """How one family of MemoryAgentBench sources is prompted and scored.

    Attributes:
        family: ``"AR"``, ``"TTL"``, ``"LRU"`` or ``"SF"``.
        metric: ``"alias"``, ``"f1"`` or ``"recall@5"`` (a key of :data:`SCORERS`).
        max_new_tokens: generation limit.
        display: human-readable name.
        instruction: the text between the context and the question.
        label: what the question is called in the prompt.
        cue: the answer cue ending the prompt.
    """

    family: str
    metric: str
    max_new_tokens: int
    display: str
    instruction: str = _SHORT_ANSWER
    label: str = "Question"
    cue: str = "Answer:"


SOURCES: dict[str, SourceSpec] = {
    "eventqa": SourceSpec("AR", "alias", 40, "EventQA"),
    "longmemeval": SourceSpec("AR", "alias", 50, "LongMemEval"),
    "ruler_qa": SourceSpec("AR", "alias", 50, "RULER QA"),
    "icl_": SourceSpec(
        "TTL",
        "alias",
        20,
        "In-context classification",
        label="Text",
        cue="Label:",
        instruction="The context above gives example texts with their numerical labels. Reply with the label "
        f"of the text below and nothing else. {_ABSTAIN_RULE}",
    ),
    "recsys_redial": SourceSpec(
        "TTL",
        "recall@5",
        300,
        "Movie recommendation",
        label="Conversation",
        cue="Recommendations:",
        instruction="The context above holds conversations between users and a movie recommender. Recommend "
        "20 movies for the user in the conversation below, best first, as a numbered list with one title "
        "per line and nothing else.",
    ),
    "infbench_sum": SourceSpec(
        "LRU",
        "f1",
        1200,
        "InfiniteBench summarisation",
        label="Task",
        cue="Summary:",
        instruction="Summarise the book above, using only the context. Write the summary and nothing else.",
    ),
    "detective_qa": SourceSpec("LRU", "alias", 2000, "Detective QA"),
    "factconsolidation": SourceSpec(
        "SF",
        "alias",
        10,
        "FactConsolidation",
        instruction="Each fact in the context starts with a serial number; when facts conflict, the one with "
        f"the larger serial number is newer and holds. {_SHORT_ANSWER}",
    ),
}


def source_spec(source: str) -> SourceSpec:
    """The :data:`SOURCES` entry whose prefix starts ``source`` (the longest one)."""
    prefixes = [p for p in SOURCES if source.startswith(p)]
    if not prefixes:
        known = ", ".join(SOURCES)
        raise ValueError(f"unknown MemoryAgentBench source {source!r}; known source prefixes: {known}")
    return SOURCES[max(prefixes, key=len)]


# ---------------------------------------------------------------------- scorers
def _strings(answers: Any) -> list[str]:
    """Flatten a gold answer given as a string, a list of strings or a list of lists of strings."""
    if isinstance(answers, (list, tuple)):
        return [s for item in answers for s in _strings(item)]
    return [] if answers is None else [str(answers)]


def alias_accuracy(prediction: str, aliases: Any) -> float:
    """1.0 when some alias, SQuAD-normalised, occurs in the normalised prediction as whole tokens, else 0.0.

    Normalisation lower-cases and drops punctuation, the articles a/an/the and extra whitespace; an alias
    that normalises to nothing keeps its articles (on both sides). ``aliases``: str, list[str] or
    list[list[str]]. Raises ValueError when there is no alias at all.
    """
    golds = _strings(aliases)
    if not golds:
        raise ValueError("alias_accuracy needs at least one gold alias")
    for alias in golds:
        articles = ("a", "an", "the") if squad_normalize(alias) else ()
        gold = squad_normalize(alias, articles)
        if gold and f" {gold} " in f" {squad_normalize(prediction, articles)} ":
            return 1.0
    return 0.0


def summary_f1(prediction: str, reference: Any) -> float:
    """Token F1 of the SQuAD-normalised prediction against the reference summary (best over several)."""
    references = _strings(reference)
    if not references:
        raise ValueError("summary_f1 needs a reference summary")
    predicted = squad_normalize(prediction).split()
    return max(token_f1(predicted, squad_normalize(ref).split()) for ref in references)


_LIST_ITEM = re.compile(r"^[ \t]*(?:\d+[.)]|[-*•])[ \t]*(.*\S)", re.MULTILINE)
_PARENTHESISED = re.compile(r"\([^()]*\)")


def _item_key(title: str) -> str:
    """A title's matching key: parenthesised parts (years, "film") dropped, then SQuAD-normalised."""
    return squad_normalize(_PARENTHESISED.sub(" ", title))


def ranked_items(prediction: str) -> list[str]:
    """The model's ranked list as matching keys, duplicates dropped (first occurrence kept).

    Lines starting with a list marker (``1.``, ``2)``, ``-``, ``*``) are the items, one per line, and any
    other line is ignored; a reply without such lines is split on commas and line breaks instead.
    """
    items = _LIST_ITEM.findall(prediction) or re.split(r"[,\n]", prediction)
    return list(dict.fromkeys(key for key in map(_item_key, items) if key))


def recall_at_5(prediction: str, gold_items: Any) -> float:
    """Fraction of the gold titles found among the first 5 of :func:`ranked_items` (keys compared)."""
    gold = {key for key in map(_item_key, _strings(gold_items)) if key}
    if not gold:
        raise ValueError("recall_at_5 needs at least one gold item")
    return len(gold & set(ranked_items(prediction)[:5])) / len(gold)


SCORERS: dict[str, Callable[[str, Any], float]] = {
    "alias": alias_accuracy,
    "f1": summary_f1,
    "recall@5": recall_at_5,
}


def entity_title(uri: str) -> str:
    """Title of a ReDial entity: ``'<http://dbpedia.org/resource/Up_(2009_film)>'`` -> ``'Up'``."""
    name = unquote(uri.strip().strip("<>").rsplit("/", 1)[-1]).replace("_", " ")
    return " ".join(_PARENTHESISED.sub(" ", name).split())


# ---------------------------------------------------------------------- data
def _split_of(path: str) -> str | None:
    """The split a file name starts with (``Accurate_Retrieval-00000-of-00001.parquet``), if any."""
    name = os.path.basename(path).lower()
    return next((split for split in SPLITS if name.startswith(split.lower())), None)


def _read_file(path: str) -> list[dict[str, Any]]:
    """Rows of one ``.parquet``, ``.jsonl`` or ``.json`` file."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        missing = [c for c in COLUMNS if c not in pq.read_schema(path).names]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)} of {', '.join(COLUMNS)}")
    elif not path.endswith((".jsonl", ".json")):
        raise ValueError(f"{path}: not a .parquet, .jsonl or .json file")
    return list(read_file(path))


def _as_list(value: Any) -> list[Any]:
    return [value] if isinstance(value, str) else list(value)


def _check_row(row: Any, where: str) -> tuple[str, list[str], list[Any], dict[str, Any]]:
    """``(context, questions, answers, metadata)`` of one row; raises an error saying what is wrong."""
    if not isinstance(row, dict):
        raise TypeError(f"{where}: expected an object with {', '.join(COLUMNS)}, got {type(row).__name__}")
    missing = [c for c in COLUMNS if row.get(c) is None]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)} (a row has {', '.join(COLUMNS)})")
    meta = row["metadata"]
    if not isinstance(meta, dict) or not meta.get("source"):
        raise ValueError(f"{where}: metadata has no 'source'")
    questions, answers = _as_list(row["questions"]), _as_list(row["answers"])
    if len(questions) != len(answers):
        raise ValueError(f"{where}: {len(questions)} questions but {len(answers)} answers")
    return str(row["context"]), questions, answers, meta


def _prompt(spec: SourceSpec, question: str) -> str:
    """Text following the history: instruction, the question (when there is one), the answer cue."""
    body = f"{spec.label}: {question.strip()}\n\n" if question.strip() else ""
    return f"\n\n{spec.instruction}\n\n{body}{spec.cue}"


class MemoryAgentBench(Benchmark):
    """MemoryAgentBench histories (one per dataset row), per-source scoring, family aggregation.

    Args:
        source: a folder holding the snapshot's data files (``.parquet``/``.jsonl``/``.json`` named after
            their split, searched recursively), one such file, or a Hub dataset id (its snapshot is
            downloaded once; offline it is read from the Hub cache).
        families: evaluate only these families (subset of :data:`FAMILIES`).
        limit: at most this many histories per family (smoke runs).
        max_questions: at most this many questions per history.
        entity_map: path of ``entity2id.json`` for ReDial; by default looked up next to the data.
        max_new_tokens: cap on every source's generation limit (smoke runs); ``None`` keeps the
            paper's per-source limits.
    """

    name = "mab"
    metrics = ("score",)

    def __init__(
        self,
        source: str,
        families: Iterable[str] | None = None,
        limit: int | None = None,
        max_questions: int | None = None,
        entity_map: str | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        chosen = set(FAMILIES if families is None else families)
        if unknown := sorted(chosen - set(FAMILIES)):
            raise ValueError(f"unknown MemoryAgentBench families {unknown}; known families: {FAMILIES}")
        if not os.path.exists(source):  # a Hub dataset id: its snapshot folder (the Hub cache offline)
            source = hub_dataset_folder(source)
        self.source, self.limit, self.max_questions = source, limit, max_questions
        self.families = tuple(f for f in FAMILIES if f in chosen)
        self.entity_map = entity_map
        self.max_new_tokens = max_new_tokens
        self._titles: dict[str, str] | None = None
        self._histories = self._load()
        loaded = Counter(q.meta["family"] for h in self._histories for q in h.questions)
        full_run = families is None and limit is None and max_questions is None and max_new_tokens is None
        if full_run and loaded != Counter(PAPER_QUESTIONS):
            counts = ", ".join(f"{f} {loaded[f]}/{PAPER_QUESTIONS[f]}" for f in FAMILIES)
            message = f"{source}: not the full MemoryAgentBench (questions loaded/paper: {counts})"
            warnings.warn(message, stacklevel=2)

    def _files(self) -> Iterator[tuple[str, str | None, Iterable[dict[str, Any]]]]:
        """``(where, split or None, rows)`` per data file (or Hub split), in split order."""
        src, order = self.source, list(SPLITS)
        if os.path.isdir(src):
            paths = [
                os.path.join(d, f)
                for d, _, files in os.walk(src)
                for f in files
                if f.endswith((".parquet", ".jsonl", ".json")) and _split_of(f)
            ]
            if not paths:
                splits = ", ".join(SPLITS)
                raise FileNotFoundError(f"{src}: no .parquet/.jsonl/.json file named after a split: {splits}")
            for path in sorted(paths, key=lambda p: (order.index(_split_of(p)), p)):
                if SPLITS[_split_of(path)] in self.families:
                    yield path, _split_of(path), _read_file(path)
        elif os.path.isfile(src):
            yield src, _split_of(src), _read_file(src)
        else:
            raise FileNotFoundError(f"{src!r} is neither a local folder or file nor a Hub dataset id")

    def _load(self) -> list[History]:
        histories: list[History] = []
        per_family = dict.fromkeys(self.families, 0)
        per_source: dict[str, int] = {}
        for where, split, rows in self._files():
            for n, row in enumerate(rows):
                at = f"{where}: row {n}"
                context, questions, answers, meta = _check_row(row, at)
                source = str(meta["source"])
                try:
                    spec = source_spec(source)
                except ValueError as err:
                    raise ValueError(f"{at}: {err}") from None
                if split is not None and SPLITS[split] != spec.family:
                    raise ValueError(f"{at}: source {source!r} is {spec.family}, not {split}")
                index = per_source[source] = per_source.get(source, -1) + 1
                if spec.family not in per_family or per_family[spec.family] == self.limit:
                    continue
                per_family[spec.family] += 1
                history_id = f"{source}/{index}"
                items = list(zip(questions, answers, strict=True))[: self.max_questions]
                asked = [self._question(history_id, j, *qa, spec, meta, at) for j, qa in enumerate(items)]
                histories.append(History(history_id, f"Context:\n{context}", asked))
        return histories

    def _question(
        self, history_id: str, j: int, question: Any, answer: Any, spec: SourceSpec, meta: dict, at: str
    ) -> Question:
        """Question ``j`` of a row: prompt, gold (ReDial ids as titles, abstention), metadata."""
        source = str(meta["source"])
        gold = _strings(answer)
        if not gold:
            raise ValueError(f"{at}: question {j} has no gold answer")
        if spec.metric == "recall@5" and all(g.strip().isdigit() for g in gold):
            gold = self._entity_titles(gold, at)
        info: dict[str, Any] = {"family": spec.family, "source": source, "metric": spec.metric}
        for key in ("qa_pair_ids", "question_ids", "question_types"):
            values = meta.get(key) or []
            if j < len(values) and values[j] is not None:
                info[key[:-1]] = values[j]
        if str(info.get("question_id", "")).endswith("_abs"):
            info.update(abstention=True, reference=gold)
            gold = [ABSTAIN]
        prompt = _prompt(spec, str(question))
        limit = (
            spec.max_new_tokens
            if self.max_new_tokens is None
            else min(spec.max_new_tokens, self.max_new_tokens)
        )
        return Question(f"{history_id}/q{j}", prompt, gold, limit, source, info)

    def _entity_titles(self, ids: list[str], at: str) -> list[str]:
        """ReDial entity ids -> movie titles through ``entity2id.json``."""
        if self._titles is None:
            path = self._entity_path()
            with open(path, encoding="utf-8") as fh:
                table = json.load(fh)
            if not isinstance(table, dict):
                raise ValueError(f"{path}: expected an object mapping entity URIs to ids")
            self._titles = {str(i): entity_title(uri) for uri, i in table.items()}
        unknown = [i for i in ids if i.strip() not in self._titles]
        if unknown:
            raise ValueError(f"{at}: ReDial entity id(s) {unknown} are not in {ENTITY_FILE}")
        return [self._titles[i.strip()] for i in ids]

    def _entity_path(self) -> str:
        if self.entity_map is not None:
            return self.entity_map
        src = os.path.abspath(self.source)  # a local path (Hub ids were resolved to their snapshot folder)
        folder = src if os.path.isdir(src) else os.path.dirname(src)
        candidates = [os.path.join(d, ENTITY_FILE) for d in (folder, os.path.dirname(folder))]
        found = next((c for c in candidates if os.path.isfile(c)), None)
        if found is None:
            raise FileNotFoundError(
                f"ReDial answers are entity ids: put the snapshot's {ENTITY_FILE} at "
                f"{' or '.join(candidates)}, or pass entity_map="
            )
        return found

    def histories(self) -> Iterator[History]:
        return iter(self._histories)

    def __len__(self) -> int:
        return len(self._histories)

    def score(self, question: Question, prediction: str) -> dict[str, float]:
        return {"score": SCORERS[source_spec(question.group).metric](prediction, question.answer)}

    def summarize(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Question-weighted means per source (``"groups"``), per family (``"families"``, in
        :data:`FAMILIES` order, ``{family: {"score", "questions"}}``) and overall."""
        summary = question_weighted(records, self.metrics)
        scores: dict[str, list[float]] = {}
        for record in records:
            scores.setdefault(source_spec(record["group"]).family, []).append(record["scores"]["score"])
        summary["families"] = {
            f: {"score": sum(v) / len(v), "questions": len(v)} for f in FAMILIES if (v := scores.get(f))
        }
        return summary
