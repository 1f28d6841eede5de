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
import json
import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from lstmem_peft.tuner.gguf_convert import file_sha256
from lstmem_peft.utils.errors import DataFormatError, MissingDataError, describe, looks_local


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
        turns: optionally, the history's turns as plain text, oldest first (LoCoMo): what the
            ``window`` row keeps the newest of and the ``bm25`` row retrieves from
            (:mod:`lstmem_peft.eval.rows`). ``None``: the history has no turns.
        select: with ``turns``, the segments of the history holding only the turns whose indices
            (into ``turns``) are given, in the protocol's own format and order.
    """

    id: str
    text: str
    questions: list[Question]
    segments: list[str] | None = None
    system: str | None = None
    turns: list[str] | None = None
    select: Callable[[Collection[int]], list[str]] | None = field(default=None, repr=False, compare=False)


class Benchmark:
    """Base class of a benchmark protocol: data, scoring and aggregation.

    Attributes:
        name: short name used in file names and tables (``"locomo"``, ``"hotpotqa"``, ``"mab"``).
        metrics: the metric names :meth:`score` returns, primary first (the markdown table shows
            all of them).
    """

    name: str = "benchmark"
    metrics: tuple[str, ...] = ("score",)
    #: SHA-256 of each official data file this benchmark's authors released, and which release it is:
    #: a record names the file it was measured on (:func:`data_identity`).
    official_files: dict[str, str] = {}

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
    """Raise a :class:`~lstmem_peft.utils.errors.DataFormatError` (a ValueError) naming the file, row and
    field when a row is not an object or lacks one of ``fields``."""
    for n, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataFormatError(source, schema, f"record {n} is {describe(row)}")
        missing = [key for key in fields if key not in row]
        if missing:
            raise DataFormatError(source, schema, f"record {n} has no {missing[0]!r} field")


# ---------------------------------------------------------------------- reading a benchmark's data
DATA_SUFFIXES = (".json", ".jsonl", ".parquet")


@dataclass(frozen=True)
class DataSpec:
    """What a benchmark's data must be, for errors that say what to do.

    Attributes:
        expected: the format in words (``the LoCoMo JSON list of samples (...)``).
        fix: where the official file comes from, or what to pass instead.
        fields: what every record must hold.
        check: a record's problem in words (``None``: none), checked after ``fields``.
    """

    expected: str
    fix: str
    fields: tuple[str, ...] = ()
    check: Callable[[dict[str, Any]], str | None] | None = None


def hub_folder(source: str, spec: DataSpec) -> str:
    """The local snapshot folder of the Hub dataset ``source``; a missing or unreachable one raises
    :class:`~lstmem_peft.utils.errors.MissingDataError`."""
    from lstmem_peft.training.data import hub_dataset_folder

    try:
        from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:  # older huggingface_hub
        from huggingface_hub.utils import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return hub_dataset_folder(source)
    except RepositoryNotFoundError:
        got = "no such Hub dataset (or it is private or gated)"
    except LocalEntryNotFoundError:
        got = "not in the Hub cache, and the Hub cannot be reached (offline)"
    except FileNotFoundError as err:
        got = str(err).replace(f"{source!r} ", "").replace(source, "").strip(": ")
    raise MissingDataError(source, spec.expected, got, spec.fix)


def data_paths(source: str, split: str, spec: DataSpec) -> list[str]:
    """The data files ``source`` (a file, a folder, or a Hub dataset id) stands for, for ``split``."""
    from lstmem_peft.training.data import data_files

    source = os.path.expanduser(os.fspath(source))
    if os.path.isfile(source):
        return [source]
    if os.path.isdir(source):
        folder = source
    elif looks_local(source):
        raise MissingDataError(source, spec.expected, "no such file or folder", spec.fix)
    else:
        folder = hub_folder(source, spec)
    try:
        return data_files(folder, split)
    except FileNotFoundError as err:
        got = str(err).replace(folder, "").strip(": ")
        if "(data files: none)" in got:
            got = "no .json, .jsonl or .parquet file in it"
        raise MissingDataError(folder, f"a folder holding {spec.expected}", got, spec.fix) from None


def read_rows(path: str, spec: DataSpec) -> list[Any]:
    """The records of one data file (``.json``: a list of records, or an object mapping ids to records;
    ``.jsonl``: one record a line; ``.parquet``: one a row). A file that cannot be read so raises
    :class:`~lstmem_peft.utils.errors.DataFormatError` naming it; the records themselves are not checked."""
    lower = path.lower()
    try:
        if lower.endswith(".parquet"):
            return _parquet_rows(path, spec)
        with open(path, encoding="utf-8") as fh:
            if lower.endswith(".jsonl"):
                rows = []
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as err:
                            got = f"line {n} is not JSON ({err.msg} at column {err.colno})"
                            raise DataFormatError(path, spec.expected, got, spec.fix) from None
                if not rows:
                    raise DataFormatError(path, spec.expected, "the file is empty", spec.fix)
                return rows
            text = fh.read()
    except UnicodeDecodeError:
        raise DataFormatError(path, spec.expected, "not UTF-8 text", spec.fix) from None
    except PermissionError:
        raise DataFormatError(
            path, "a file you can read", "permission denied", "Fix its permissions"
        ) from None
    if not text.strip():
        raise DataFormatError(path, spec.expected, "the file is empty", spec.fix)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        got = f"not JSON ({err.msg} at line {err.lineno} column {err.colno})"
        if not lower.endswith(".json"):
            got += "; a data file is .json, .jsonl or .parquet"
        raise DataFormatError(path, spec.expected, got, spec.fix) from None
    if isinstance(data, list):
        return data
    if isinstance(data, dict) and data and all(isinstance(v, dict) for v in data.values()):
        if not (spec.fields and all(f in data for f in spec.fields)):  # an object mapping ids to records
            return [{"id": key, **value} for key, value in data.items()]
    if isinstance(data, dict) and spec.fields and all(f in data for f in spec.fields):
        got = f"the file holds one record ({describe(data)}), not a list of them"
        raise DataFormatError(path, spec.expected, got, spec.fix + " (or put the record inside [ ])")
    raise DataFormatError(path, spec.expected, f"the file holds {describe(data)}", spec.fix)


def _parquet_rows(path: str, spec: DataSpec) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError as err:
        from lstmem_peft.utils.extras import missing_extra

        raise missing_extra(err, "eval", f"Reading {path}") from err
    import pyarrow as pa

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        got = f"not a Parquet file pyarrow can read ({message})"
        raise DataFormatError(path, spec.expected, got, spec.fix) from None
    if not rows:
        raise DataFormatError(path, spec.expected, "the table has no rows", spec.fix)
    return rows


def record_name(row: Any, n: int) -> str:
    """``record 3`` with the record's id when it has one (``record 3 (sample_id 'conv-30')``)."""
    if isinstance(row, dict):
        for key in ("sample_id", "_id", "id"):
            if isinstance(row.get(key), (str, int)):
                return f"record {n} ({key} {row[key]!r})"
    return f"record {n}"


def check_records(rows: list[Any], path: str, spec: DataSpec) -> None:
    """Every row an object with ``spec.fields`` and no ``spec.check`` problem, or a
    :class:`~lstmem_peft.utils.errors.DataFormatError` naming the file, the record and what is wrong."""
    if not rows:
        raise DataFormatError(path, spec.expected, "it holds no records (an empty list)", spec.fix)
    if not any(isinstance(row, dict) for row in rows):
        raise DataFormatError(path, spec.expected, f"the file holds {describe(rows)}", spec.fix)
    for n, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataFormatError(path, spec.expected, f"record {n} is {describe(row)}", spec.fix)
        missing = [key for key in spec.fields if key not in row]
        if missing:
            got = f"{record_name(row, n)} has no {missing[0]!r} field ({describe(row)})"
            raise DataFormatError(path, spec.expected, got, spec.fix)
        problem = spec.check(row) if spec.check is not None else None
        if problem:
            raise DataFormatError(path, spec.expected, f"{record_name(row, n)}: {problem}", spec.fix)


def read_benchmark(source: str, split: str, spec: DataSpec) -> list[dict[str, Any]]:
    """Every record of a benchmark's data (a file, a folder, or a Hub dataset id), checked against
    ``spec``: what cannot be used raises a :class:`~lstmem_peft.utils.errors.DataFormatError` (a ValueError)
    that names the file, what it holds, what was expected and where the right file comes from."""
    records: list[dict[str, Any]] = []
    for path in data_paths(source, split, spec):
        rows = read_rows(path, spec)
        check_records(rows, path, spec)
        records.extend(rows)
    return records


def data_identity(benchmark: Benchmark, data: str) -> dict[str, Any]:
    """What identifies ``data`` (the DATA a run read) in its record: for a local file, ``data_sha256``
    and ``data_release``, which official release it is (``None``: not one the benchmark knows, e.g. a
    converted or edited copy); nothing for a folder or a Hub dataset id (its revision names it)."""
    if not os.path.isfile(data):
        return {}
    sha = file_sha256(data)
    return {"data_sha256": sha, "data_release": benchmark.official_files.get(sha)}
