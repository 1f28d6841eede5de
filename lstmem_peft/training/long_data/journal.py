"""The two files that make a Long build resumable, read so that damage names its file and the fix.

``build.json`` records the generation settings. It is written only once the build has shown they work:
the tokenizer loaded and the endpoint gave a usable reply (so a mistyped ``--model`` or ``--tokenizer``
leaves nothing that blocks the corrected rerun). While no candidate is finished, a rerun may change any
setting; once one is, a rerun with other generation settings is refused.

``candidates.jsonl`` is the journal: one JSON line per finished candidate, appended and fsynced as it
finishes, each with a digest of the generation settings it was made with. The digest lets a rerun
rebuild a lost or damaged ``build.json`` from its own settings when they are the journal's.
"""

from __future__ import annotations

import hashlib
import json
import os

from lstmem_peft.utils.errors import DataFormatError, UsageError, describe

from .config import FORMAT, JOURNAL, SETTINGS, LongDataConfig, candidate_id

DIGEST = "settings_digest"  # the journal field holding settings_digest() of the record's build


def settings_digest(settings: dict) -> str:
    """A short digest of the generation settings (``LongDataConfig.generation()``)."""
    text = json.dumps(settings, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------- the journal
def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_KINDS = {
    "id": str, "index": int, "topic": str, "context": str, "chunk_starts": list, "context_tokens": int,
    "target_tokens": int, "qas": list, "usage": dict,
}  # fmt: skip
_NAMES = {str: "a string", int: "a count (an integer >= 0)", list: "a list", dict: "an object"}


def _record_problem(record, fields) -> str | None:
    """What is wrong with one journal record (a missing field, a value of the wrong type), or None."""
    if not isinstance(record, dict):
        return f"the line holds {describe(record)}"
    missing = [f for f in fields if f not in record]
    if missing:
        return f"missing {missing}"
    for name, kind in _KINDS.items():
        value = record[name]
        if not (_count(value) if kind is int else isinstance(value, kind)):
            return f"{name} is {describe(value)}, expected {_NAMES[kind]}"
    starts = record["chunk_starts"]
    if not starts or not all(_count(s) for s in starts):
        return f"chunk_starts is {describe(starts)}, expected a non-empty list of character offsets"
    for k, qa in enumerate(record["qas"]):
        if not (
            isinstance(qa, dict)
            and isinstance(qa.get("question"), str)
            and isinstance(qa.get("answer"), str)
            and _count(qa.get("answer_tokens"))
            and _count(qa.get("chunk", 0))
        ):
            return f'qas[{k}] is {describe(qa)}, expected {{"question", "answer", "answer_tokens", "chunk"}}'
    usage = record["usage"]
    if not all(_count(usage.get(k)) for k in ("requests", "prompt_tokens", "completion_tokens")):
        return f"usage is {describe(usage)}, expected counts of requests, prompt_tokens and completion_tokens"
    return None


class Journal:
    """``candidates.jsonl``: one JSON line per finished candidate, appended and fsynced as it finishes.

    ``digest``: :func:`settings_digest` of this build's generation settings; a record carrying
    another one was made with other settings and is refused.
    """

    FIELDS = ("id", "index", "topic", "context", "chunk_starts", "context_tokens", "target_tokens", "qas",
              "usage")  # fmt: skip

    def __init__(self, path: str, seed: int, digest: str | None = None):
        self.path, self.seed, self.digest = path, seed, digest

    def holds_candidates(self) -> bool:
        """Whether the file holds at least one whole line (a finished candidate, or damage)."""
        if not os.path.isfile(self.path):
            return False
        with open(self.path, "rb") as fh:
            return any(line.endswith(b"\n") and line.strip() for line in fh)

    def load(self) -> dict[int, dict]:
        """Finished candidates by index. A last line cut short by a crash (no newline, or not JSON) is
        dropped and the file truncated before it; damage anywhere else is a :class:`DataFormatError`
        naming the file and line."""
        if not os.path.exists(self.path):
            return {}
        with open(self.path, "rb") as fh:
            data = fh.read()
        records, offset, n = {}, 0, 0
        while (end := data.find(b"\n", offset)) >= 0:  # a line without its newline was cut short
            line, n = data[offset:end], n + 1
            try:
                record = json.loads(line) if line.strip() else None
            except (ValueError, RecursionError):  # not JSON, or not UTF-8
                if not data[end + 1 :].strip():
                    break  # the last line, half-written: dropped, its candidate is generated again
                raise DataFormatError(
                    f"{self.path}:{n}", "one finished candidate per line (JSON)", "the line is not JSON",
                    "Delete that line; its candidate will be generated again",
                ) from None  # fmt: skip
            if record is not None:
                self._check(record, n)
                records.setdefault(record["index"], record)
            offset = end + 1
        if offset < len(data):
            with open(self.path, "r+b") as fh:
                fh.truncate(offset)
        return records

    def _check(self, record, n: int) -> None:
        where = f"{self.path}:{n}"
        problem = _record_problem(record, self.FIELDS)
        if problem:
            raise DataFormatError(
                where, f"a finished candidate with fields {list(self.FIELDS)}", problem,
                "Delete that line (its candidate will be generated again), or build into a new --out folder",
            )  # fmt: skip
        digest = record.get(DIGEST)
        if self.digest is not None and digest is not None and digest != self.digest:
            raise DataFormatError(
                where, "a candidate made with this build's generation settings",
                f"candidate {record['id']} was made with other settings ({DIGEST} {digest!r}, these give "
                f"{self.digest!r})",
                "Rerun with the settings this build was started with, or build into a new --out folder",
            )  # fmt: skip
        if record["id"] != candidate_id(self.seed, record["index"]):
            raise DataFormatError(
                where, f"a candidate of this build (seed {self.seed}) with fields {list(self.FIELDS)}",
                f"id {record['id']!r} of another build", "Build into a new --out folder, or delete that line",
            )  # fmt: skip

    def append(self, record: dict) -> None:
        line = json.dumps({**record, DIGEST: self.digest}, ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())


# ---------------------------------------------------------------------- build.json
def read_settings(path: str, journal: Journal) -> dict | None:
    """The settings ``build.json`` records, None when there is no such file; a damaged file is a
    :class:`DataFormatError` naming it, what is wrong and the fix."""
    if not os.path.exists(path):
        return None
    expected = f'the settings of the Long build in this folder, {{"format": "{FORMAT}", "settings": {{...}}}}'
    if journal.holds_candidates():
        fix = (
            "Delete it and rerun the command this build was started with: its settings are checked against "
            f"the finished candidates in {journal.path} and recorded again. Or build into a new --out folder"
        )
    else:
        fix = "Delete it and rerun: no candidate is finished yet, so nothing is lost"
    try:
        with open(path, "rb") as fh:
            value = json.loads(fh.read())
    except OSError as err:
        raise DataFormatError(path, expected, f"unreadable ({err.strerror})", fix) from None
    except json.JSONDecodeError as err:
        got = f"not JSON ({err}; cut short or edited?)"
        raise DataFormatError(path, expected, got, fix) from None
    except (ValueError, RecursionError) as err:
        raise DataFormatError(path, expected, f"not JSON ({type(err).__name__})", fix) from None
    if not isinstance(value, dict):
        raise DataFormatError(path, expected, f"the file holds {describe(value)}", fix)
    if value.get("format") != FORMAT:
        raise DataFormatError(path, expected, f"format is {describe(value.get('format'))}", fix)
    if not isinstance(value.get("settings"), dict):
        raise DataFormatError(path, expected, f"settings is {describe(value.get('settings'))}", fix)
    return value["settings"]


def write_settings(out_dir: str, config: LongDataConfig) -> None:
    """Record the generation settings of the build in ``out_dir`` (``build.json``)."""
    write_json(os.path.join(out_dir, SETTINGS), {"format": FORMAT, "settings": config.generation()})


def open_build(out_dir: str, config: LongDataConfig) -> tuple[Journal, dict[int, dict], bool]:
    """The journal of ``out_dir``, its finished candidates, and whether ``build.json`` has yet to record
    ``config``'s settings (the caller writes it at the first usable reply).

    Raises :class:`UsageError` when finished candidates were made with other generation settings, and
    :class:`DataFormatError` for a damaged ``build.json`` or journal line.
    """
    path, settings = os.path.join(out_dir, SETTINGS), config.generation()
    journal = Journal(os.path.join(out_dir, JOURNAL), config.seed, settings_digest(settings))
    recorded = read_settings(path, journal)
    if recorded is not None and recorded != settings and journal.holds_candidates():
        changed = [k for k in settings if recorded.get(k) != settings[k]]
        changed += [k for k in recorded if k not in settings]
        k = changed[0]
        raise UsageError(
            f"{out_dir} holds a build with {k}={recorded.get(k)!r}, not {settings.get(k)!r}"
            + (f" (and {len(changed) - 1} more changed settings)" if len(changed) > 1 else "")
            + ": rerun with the same settings to resume it, or pass a new output folder"
        )
    records = journal.load()
    if recorded is None and records:
        unmarked = sum(DIGEST not in r for r in records.values())
        if unmarked:
            raise DataFormatError(
                path, "the settings of the build in this folder",
                f"missing, while {journal.path} holds {len(records)} finished candidates, {unmarked} of them "
                "without a record of their settings (written by an older lstmem)",
                "Put build.json back, or build into a new --out folder",
            )  # fmt: skip
        write_settings(out_dir, config)  # every finished candidate was made with these settings
        recorded = settings
    return journal, records, recorded != settings


def write_json(path: str, value, lines: bool = False) -> None:
    """Write ``value`` (JSON, or JSON lines) to ``path`` atomically: a crash leaves the old file or the new."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        if lines:
            fh.writelines(json.dumps(v, ensure_ascii=False) + "\n" for v in value)
        else:
            json.dump(value, fh, ensure_ascii=False, indent=1)
            fh.write("\n")
    os.replace(tmp, path)
