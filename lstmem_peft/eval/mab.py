"""MemoryAgentBench (Hu et al., 2025): data, the ``official`` and ``paper`` protocols, family aggregation.

Data. The official snapshot (Hub dataset ``ai-hyz/MemoryAgentBench``) holds one parquet file per split,
``data/<Split>-00000-of-00001.parquet``, for the splits Accurate_Retrieval, Test_Time_Learning,
Long_Range_Understanding and Conflict_Resolution. A row is one context with its questions: ``context``
(str), ``questions`` (list[str]), ``answers`` (list[list[str]], the accepted strings per question) and
``metadata`` (a struct: ``source`` names the sub-dataset, e.g. ``eventqa_full`` or
``factconsolidation_mh_32k``; ``qa_pair_ids`` per question; LongMemEval rows also carry ``question_ids``
and ``question_types``). ReDial answers are movie entity ids; the snapshot's ``entity2id.json`` (entity
URI -> id) names the movies. The full benchmark has 146 rows and 3,671 questions
(:data:`PAPER_QUESTIONS`). Each row is one :class:`History`; :data:`SOURCES` (keyed by source prefix)
decides family and generation limit, and a file named after a split may hold only that split's sources.

Protocols (one ``"score"`` in [0, 1] per question; the rules are in :mod:`lstmem_peft.eval.scorers`):

* ``official`` -- MemoryAgentBench's long-context agent: the system message, each context chunk
  (sentences packed into 4,096 ``gpt-4o-mini`` tiktoken tokens) wrapped in the source's ``memorize``
  template, the chunks joined by line breaks, then a line break and the source's ``query`` template;
  the per-source metric field of ``utils/eval_other_utils.py`` (substring match, exact match, F1,
  ReDial recall@5).
* ``paper`` -- δ-Mem's ``benchmark_compare.py`` as the paper's suite script runs it
  (``--no-memory-agent-bench-use-official-prompt``): one user turn, ``MEMORY_CONTEXT_QA_PROMPT_TEMPLATE``
  with the raw context, pre-clipped as the suite does (``--memory-agent-bench-max-context-chars 120000``;
  :func:`paper_clip`), δ-Mem's alias accuracy / F1 and the official ReDial recall@5.

The templates and the cutting of contexts (chunks, pre-clip) are in :mod:`.mab_templates`. Family
and overall scores are means over questions, so families weigh by their question counts. Deviations
from the released code are listed in docs/evaluation.md ("Deviations from the named code").
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from lstmem_peft.utils.errors import (
    DataFormatError,
    MissingDataError,
    describe,
    looks_local,
    read_json_object,
)

from . import scorers
from .mab_templates import (
    CHUNK_TOKENS,
    OFFICIAL_MEMORIZE,
    OFFICIAL_QUERY,
    OFFICIAL_SYSTEM,
    PAPER_HEAD,
    PAPER_MAX_CONTEXT_CHARS,
    PAPER_QUESTION,
    TIME_STAMP,
    paper_clip,
    sentence_chunks,
)
from .protocol import Benchmark, DataSpec, History, Question, hub_folder, question_weighted, read_rows

FAMILIES = ("AR", "TTL", "LRU", "SF")
SPLITS = {
    "Accurate_Retrieval": "AR",
    "Test_Time_Learning": "TTL",
    "Long_Range_Understanding": "LRU",
    "Conflict_Resolution": "SF",
}
PAPER_QUESTIONS = {"AR": 2000, "TTL": 700, "LRU": 171, "SF": 800}  # the full benchmark: 3,671 questions
ENTITY_FILE = "entity2id.json"
COLUMNS = ("context", "questions", "answers", "metadata")


@dataclass(frozen=True)
class SourceSpec:
    """One family of MemoryAgentBench sources.

    Attributes:
        family: ``"AR"``, ``"TTL"``, ``"LRU"`` or ``"SF"``.
        metric: the reported metric's name (``"accuracy"``, ``"f1"`` or ``"recall@5"``).
        max_new_tokens: generation limit (the official data configs' ``generation_max_length``).
        display: human-readable name.
    """

    family: str
    metric: str
    max_new_tokens: int
    display: str


SOURCES: dict[str, SourceSpec] = {
    "eventqa": SourceSpec("AR", "accuracy", 40, "EventQA"),
    "longmemeval": SourceSpec("AR", "accuracy", 50, "LongMemEval"),
    "ruler_qa": SourceSpec("AR", "accuracy", 50, "RULER QA"),
    "icl_": SourceSpec("TTL", "accuracy", 20, "In-context classification"),
    "recsys_redial": SourceSpec("TTL", "recall@5", 300, "Movie recommendation"),
    "infbench_sum": SourceSpec("LRU", "f1", 1200, "InfiniteBench summarisation"),
    "detective_qa": SourceSpec("LRU", "accuracy", 2000, "Detective QA"),
    "factconsolidation": SourceSpec("SF", "accuracy", 10, "FactConsolidation"),
}


def _prefix(source: str) -> str:
    prefixes = [p for p in SOURCES if source.startswith(p)]
    if not prefixes:
        known = ", ".join(SOURCES)
        raise ValueError(f"unknown MemoryAgentBench source {source!r}; known source prefixes: {known}")
    return max(prefixes, key=len)


def source_spec(source: str) -> SourceSpec:
    """The :data:`SOURCES` entry whose prefix starts ``source`` (the longest one)."""
    return SOURCES[_prefix(source)]


# ---------------------------------------------------------------------- the official prompt per source
def official_history(source: str, chunks: list[str], time_stamp: str = TIME_STAMP) -> str:
    """The official long-context agent's memory text: each chunk in the ``memorize`` template, joined
    by line breaks, stripped."""
    template = OFFICIAL_MEMORIZE[_prefix(source)]
    parts = [template.replace("{time_stamp}", time_stamp).replace("{context}", chunk) for chunk in chunks]
    return "\n".join(parts).strip()


def official_query(source: str, question: str) -> str:
    """The source's official ``query`` template with the question filled in (``{{label}}`` stays literal)."""
    return OFFICIAL_QUERY[_prefix(source)].format(question=question)


def redial_catalogue(table: dict[str, Any]) -> dict[str, str]:
    """``entity2id.json`` (URI -> id) as ``{id: official title}``."""
    return {str(i): scorers.redial_entity_title(uri) for uri, i in table.items()}


# ---------------------------------------------------------------------- data
def _split_of(path: str) -> str | None:
    """The split a file name starts with (``Accurate_Retrieval-00000-of-00001.parquet``), if any."""
    name = os.path.basename(path).lower()
    return next((split for split in SPLITS if name.startswith(split.lower())), None)


DATA = DataSpec(
    expected="MemoryAgentBench rows with context, questions, answers and metadata.source (the "
    "ai-hyz/MemoryAgentBench snapshot: data/<Split>-00000-of-00001.parquet for the splits "
    + ", ".join(SPLITS)
    + ")",
    fix="Pass the Hub id ai-hyz/MemoryAgentBench, or the folder of its downloaded snapshot",
    fields=COLUMNS,
)


def _read_file(path: str) -> list[dict[str, Any]]:
    """Rows of one ``.parquet``, ``.jsonl`` or ``.json`` file."""
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
        except (pa.ArrowException, OSError):
            names = COLUMNS  # read_rows names what is wrong with the file
        missing = [c for c in COLUMNS if c not in names]
        if missing:
            got = f"missing column(s) {', '.join(missing)} of {', '.join(COLUMNS)}"
            raise DataFormatError(path, DATA.expected, got, DATA.fix)
    elif not path.endswith((".jsonl", ".json")):
        raise DataFormatError(path, DATA.expected, "not a .parquet, .jsonl or .json file", DATA.fix)
    return read_rows(path, DATA)


def _as_list(value: Any) -> list[Any]:
    return [value] if isinstance(value, str) else list(value)


def _check_row(row: Any, path: str, n: int) -> tuple[str, list[str], list[Any], dict[str, Any]]:
    """``(context, questions, answers, metadata)`` of row ``n`` of ``path``; a
    :class:`~lstmem_peft.utils.errors.DataFormatError` saying what is wrong otherwise."""

    def bad(problem: str) -> DataFormatError:
        return DataFormatError(path, DATA.expected, f"row {n}: {problem}", DATA.fix)

    if not isinstance(row, dict):
        raise bad(f"{describe(row)}, not an object with {', '.join(COLUMNS)}")
    missing = [c for c in COLUMNS if row.get(c) is None]
    if missing:
        raise bad(f"missing {', '.join(missing)} (a row has {', '.join(COLUMNS)})")
    meta = row["metadata"]
    if not isinstance(meta, dict) or not meta.get("source"):
        raise bad("metadata has no 'source'")
    if not isinstance(row["questions"], (str, list, tuple)) or not isinstance(
        row["answers"], (str, list, tuple)
    ):
        raise bad("questions and answers must be lists")
    questions, answers = _as_list(row["questions"]), _as_list(row["answers"])
    if len(questions) != len(answers):
        raise bad(f"{len(questions)} questions but {len(answers)} answers")
    return str(row["context"]), questions, answers, meta


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
            official per-source limits (the paper's).
        protocol: ``"official"`` or ``"paper"`` (prompts and scoring; see the module docstring).
        max_context_chars: ``paper`` protocol only: contexts longer than this many characters are
            pre-clipped as δ-Mem's suite does (:func:`paper_clip`); ``None``: the suite's 120,000
            (:data:`PAPER_MAX_CONTEXT_CHARS`); ``0``: contexts written whole.
        count_tokens, split_sentences: the official protocol's chunking (:func:`sentence_chunks`);
            defaults: tiktoken's ``gpt-4o-mini`` encoding and ``nltk.sent_tokenize``.
        time_stamp: fills the official ``memorize`` templates' ``{time_stamp}``.
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
        protocol: str = "official",
        count_tokens: Callable[[str], int] | None = None,
        split_sentences: Callable[[str], list[str]] | None = None,
        time_stamp: str = TIME_STAMP,
        max_context_chars: int | None = None,
    ) -> None:
        self.protocol = scorers.check_protocol(protocol)
        if max_context_chars is not None and self.protocol != "paper":
            raise ValueError("max_context_chars applies to the paper protocol only (δ-Mem's pre-clip)")
        if max_context_chars is not None and max_context_chars < 0:
            raise ValueError(f"max_context_chars must be >= 0 (0: no clipping), got {max_context_chars}")
        self.max_context_chars = PAPER_MAX_CONTEXT_CHARS if max_context_chars is None else max_context_chars
        self.count_tokens, self.split_sentences, self.time_stamp = count_tokens, split_sentences, time_stamp
        chosen = set(FAMILIES if families is None else families)
        if unknown := sorted(chosen - set(FAMILIES)):
            raise ValueError(f"unknown MemoryAgentBench families {unknown}; known families: {FAMILIES}")
        if not os.path.exists(source):  # a Hub dataset id: its snapshot folder (the Hub cache offline)
            if looks_local(source):
                raise MissingDataError(source, DATA.expected, "no such file or folder", DATA.fix)
            source = hub_folder(source, DATA)
        self.source, self.limit, self.max_questions = source, limit, max_questions
        self.families = tuple(f for f in FAMILIES if f in chosen)
        self.entity_map = entity_map
        self.max_new_tokens = max_new_tokens
        self._titles: dict[str, str] | None = None
        self._catalogue: list[str] | None = None
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
                got = "no .parquet/.jsonl/.json file named after a split in it"
                raise MissingDataError(src, f"a folder holding {DATA.expected}", got, DATA.fix)
            for path in sorted(paths, key=lambda p: (order.index(_split_of(p)), p)):
                if SPLITS[_split_of(path)] in self.families:
                    yield path, _split_of(path), _read_file(path)
        elif os.path.isfile(src):
            yield src, _split_of(src), _read_file(src)
        else:
            raise MissingDataError(src, DATA.expected, "no such file or folder", DATA.fix)

    def _load(self) -> list[History]:
        histories: list[History] = []
        per_family = dict.fromkeys(self.families, 0)
        per_source: dict[str, int] = {}
        for where, split, rows in self._files():
            for n, row in enumerate(rows):
                at = f"{where}: row {n}"
                context, questions, answers, meta = _check_row(row, where, n)
                source = str(meta["source"])
                try:
                    spec = source_spec(source)
                except ValueError as err:
                    raise DataFormatError(where, DATA.expected, f"row {n}: {err}", DATA.fix) from None
                if split is not None and SPLITS[split] != spec.family:
                    got = f"row {n}: source {source!r} is {spec.family}, not {split}"
                    raise DataFormatError(where, DATA.expected, got, DATA.fix)
                index = per_source[source] = per_source.get(source, -1) + 1
                if spec.family not in per_family or per_family[spec.family] == self.limit:
                    continue
                per_family[spec.family] += 1
                history_id = f"{source}/{index}"
                items = list(zip(questions, answers, strict=True))[: self.max_questions]
                asked = [self._question(history_id, j, *qa, spec, meta, at) for j, qa in enumerate(items)]
                histories.append(History(history_id, context, asked, system=source))
        return histories

    def _history(self, row: History) -> History:
        """A loaded row (raw context; its source in ``system``) as the protocol's history: the paper's
        template head and the raw context pre-clipped as δ-Mem's suite does, or the official chunks in
        ``memorize`` templates and the official system message. Built when iterated, so scoring alone
        never chunks."""
        if self.protocol == "paper":
            return History(row.id, PAPER_HEAD + paper_clip(row.text, self.max_context_chars), row.questions)
        chunks = sentence_chunks(row.text, CHUNK_TOKENS, self.count_tokens, self.split_sentences)
        text = official_history(row.system, chunks, self.time_stamp)
        return History(row.id, text, row.questions, system=OFFICIAL_SYSTEM)

    def _question(
        self, history_id: str, j: int, question: Any, answer: Any, spec: SourceSpec, meta: dict, at: str
    ) -> Question:
        """Question ``j`` of a row: the protocol's prompt, the gold strings as given, metadata."""
        source = str(meta["source"])
        gold = scorers.flatten_golds(answer)
        if not gold:
            where, _, row = at.rpartition(": ")
            raise DataFormatError(where, DATA.expected, f"{row}: question {j} has no gold answer", DATA.fix)
        info: dict[str, Any] = {"family": spec.family, "source": source, "metric": spec.metric}
        if spec.metric == "recall@5":
            info["gold_titles"] = self._entity_titles(gold, at)
        for key in ("qa_pair_ids", "question_ids", "question_types"):
            values = meta.get(key) or []
            if j < len(values) and values[j] is not None:
                info[key[:-1]] = values[j]
        if self.protocol == "paper":
            prompt = PAPER_QUESTION.format(question=str(question).strip())
        else:
            prompt = "\n" + official_query(source, str(question))
        limit = (
            spec.max_new_tokens
            if self.max_new_tokens is None
            else min(spec.max_new_tokens, self.max_new_tokens)
        )
        return Question(f"{history_id}/q{j}", prompt, gold, limit, source, info)

    def _entity_table(self) -> dict[str, str]:
        """``{entity id: official title}`` from ``entity2id.json`` (read once)."""
        if self._titles is None:
            path = self._entity_path()
            expected = f"the snapshot's {ENTITY_FILE}: an object mapping entity URIs to ids"
            fix = f"Pass the {ENTITY_FILE} of the ai-hyz/MemoryAgentBench snapshot with --entity-map"
            table = read_json_object(path, expected, fix)
            if not table:
                raise DataFormatError(path, expected, f"the file holds {describe(table)}", fix)
            self._titles = redial_catalogue(table)
        return self._titles

    def _entity_titles(self, ids: list[str], at: str) -> list[str]:
        """ReDial gold entity ids -> official titles (one per id, repeats kept)."""
        table = self._entity_table()
        unknown = [i for i in ids if i.strip() not in table]
        if unknown:
            where, _, row = at.rpartition(": ")
            got = f"{row}: ReDial entity id(s) {unknown} are not in {self._entity_path()}"
            fix = f"Pass the {ENTITY_FILE} of the same snapshot with --entity-map"
            raise DataFormatError(where, f"rows whose ReDial ids {ENTITY_FILE} names", got, fix)
        return [table[i.strip()] for i in ids]

    def catalogue(self) -> list[str]:
        """Every movie title of ``entity2id.json``: the targets ReDial replies are snapped to."""
        if self._catalogue is None:
            self._catalogue = list(self._entity_table().values())
        return self._catalogue

    def _entity_path(self) -> str:
        if self.entity_map is not None:
            return self.entity_map
        src = os.path.abspath(self.source)  # a local path (Hub ids were resolved to their snapshot folder)
        folder = src if os.path.isdir(src) else os.path.dirname(src)
        candidates = [os.path.join(d, ENTITY_FILE) for d in (folder, os.path.dirname(folder))]
        found = next((c for c in candidates if os.path.isfile(c)), None)
        if found is None:
            raise MissingDataError(
                candidates[0],
                f"the snapshot's {ENTITY_FILE} (ReDial answers are entity ids)",
                "no such file",
                f"Put it at {' or '.join(candidates)}, or pass its path with --entity-map (entity_map=)",
            )
        return found

    def histories(self) -> Iterator[History]:
        return (self._history(row) for row in self._histories)

    def __len__(self) -> int:
        return len(self._histories)

    def settings(self) -> dict[str, Any]:
        options = {"families": list(self.families), "limit": self.limit, "max_questions": self.max_questions}
        options.update(max_new_tokens=self.max_new_tokens, time_stamp=self.time_stamp)
        if self.protocol == "official":  # how chunk tokens were counted
            options["chunk_tokens"] = "gpt-4o-mini" if self.count_tokens is None else "custom"
        else:  # δ-Mem's pre-clip (0: off)
            options["max_context_chars"] = self.max_context_chars
        return {**super().settings(), **options, "histories": len(self._histories)}

    def score(self, question: Question, prediction: str) -> dict[str, float]:
        """``{"score": ...}`` under this benchmark's protocol (only ``answer``, ``group`` and ``meta``
        of the question are read, so a question rebuilt from a predictions file scores the same)."""
        source, gold = question.group, question.answer
        if source_spec(source).metric == "recall@5":
            titles = question.meta["gold_titles"]
            if self.protocol == "paper":  # δ-Mem de-duplicates the gold ids first (paper_aliases)
                seen: set[str] = set()
                kept = []
                for entity_id, title in zip(gold, titles, strict=True):
                    if entity_id.strip() and entity_id.strip() not in seen:
                        seen.add(entity_id.strip())
                        kept.append(title)
                titles = kept
            return {"score": scorers.redial_recall_at_5(prediction, titles, self.catalogue())}
        if self.protocol == "official":
            return {"score": scorers.mab_official_score(source, prediction, gold)}
        if source_spec(source).metric == "f1":
            return {"score": scorers.mab_paper_f1(prediction, gold)}
        return {"score": scorers.mab_paper_correct(prediction, gold)}

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
