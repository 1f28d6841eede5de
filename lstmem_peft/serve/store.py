"""Sessions on disk: one folder per session, a memory file per kept version plus one record.

Layout of a store::

    STORE/<namespace>/<session>/memory-<version>.safetensors   exactly what MemoryCache.save writes
    STORE/<namespace>/<session>/record.json                    what was taken in, turns, kept versions

``namespace`` is ``public`` without API keys, else a hash of the caller's key, so one key never
reaches another key's sessions.

**Versions.** Every commit (a chat or completions turn, a write, an import) makes a new *version*
of its session, numbered by the session's commit counter (1, 2, ...; numbers are never reused, so a
number always names the same state until it is pruned). A session is one *line* of versions: the
record's messages, text chain and turns are the newest version's, and each kept version is a prefix
of them (``record["versions"]``: its number, memory file and SHA-256, how many of the record's
messages and turns it holds, its completions text chain, tokens written, bytes, time). A turn that
rolls back (:func:`.planning.plan_chat`: an edited or regenerated conversation) continues the line
from an older version: the versions after that one are dropped, their files removed. An import
starts a new line (it replaces the session; the versions before it are dropped). A turn that wrote
nothing (``lstmem_write`` ``none``) shares its parent version's memory file, untouched.

**Retention.** At each commit the oldest versions are pruned while more than ``max_versions`` are
kept or their memory files (each file counted once) take more than ``max_version_bytes``; the newest
version is never pruned. The empty session before a line's first version (``version 0``) is a
rollback target as long as that first version is kept and is not an import.

**Crash consistency.** The record is written last:

1. a new memory goes to a new file ``memory-<version>.safetensors`` (temporary name, fsync,
   rename, fsync of the folder);
2. ``record.json``, which names every kept version's file and its SHA-256, is replaced atomically
   the same way;
3. only then are the files no kept version names (pruned or dropped versions) removed.

A crash before step 2 leaves the old record naming the old, intact files (a new file is an orphan,
removed at the next load); a crash after it leaves the new record, whose files are all in place
(leftovers are removed at the next load). Either way the session is its last complete version, and
every version it keeps is intact, byte for byte. Pruning a version by hand
(:meth:`SessionStore.prune`) and forking one (:meth:`SessionStore.fork`) follow the same order.

**Engines that work on files** (``lstmem serve --engine vllm``: the store's root is vLLM's session
directory). :meth:`SessionStore.row` names a session's memory by its file
(:class:`~.engine.MemoryRow`), so the engine reads the version's own file; a memory the engine
writes is a pending file of the session's folder (``pending-...``, complete and fsynced when the
engine returns it), which step 1 of the commit renames into ``memory-<version>.safetensors`` (then
fsyncs the folder) instead of writing the memory again. Pending files no commit took are removed
after their batch (:meth:`SessionStore.discard`), or, after a crash, at the next load (they are
orphans). Requests without a session use the root's :data:`~.engine.SCRATCH_FOLDER`, which is never
a namespace.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lstmem_peft.memory.cache import MemoryCache, MemoryLayout

# session ids are checked by one rule wherever a name becomes a file (here and in vLLM's session
# directory), and files are written by one atomic, fsynced writer
from lstmem_peft.memory.sessions import (
    SESSION_ID,
    SESSION_SUFFIX,
    check_session_id,
    fsync_directory,
    fsync_file,
    session_file,
    write_atomically,
)

from .engine import PENDING_PREFIX, MemoryRow
from .protocol import ServeError
from .protocol_memory import TurnRecord

log = logging.getLogger("lstmem.serve")

RECORD = "record.json"
RECORD_VERSION = 2  # the record's format (2: with its kept versions)
#: Versions kept per session by default (``lstmem serve --session-versions``).
DEFAULT_VERSIONS = 16
#: Bytes of memory files kept per session by default (``lstmem serve --session-version-bytes``).
DEFAULT_VERSION_BYTES = 64 << 20


def namespace_for(api_key: str | None) -> str:
    """The store folder of a caller: ``public`` without keys, else a hash of the key."""
    if api_key is None:
        return "public"
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:24]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _empty_chain() -> dict:
    return {"length": 0, "sha256": hashlib.sha256().hexdigest()}


@dataclass
class Session:
    """One session in RAM: its memory and its record, at one version.

    Attributes:
        namespace, session: where it lives.
        memory: one-row :class:`MemoryCache`, or ``None`` before anything was written.
        messages: ``[{"hash", "role", "tokens", "written"}]``, the chat messages taken in so far, in
            order: written into memory, or (``written`` false) only read by a turn with
            ``lstmem_write`` ``none``; an entry without ``written`` (an older record) was written.
        completion_text: ``{"length", "sha256"}`` of the completions text taken in so far (written,
            or read by a turn with ``lstmem_write`` ``none``).
        turns: the turn history of the line (what the page plots): one :class:`~.protocol_memory.TurnRecord`
            per commit.
        version: this state's version number (0: nothing committed).
        memory_file: the file in the session folder that holds ``memory`` as it is, or ``None``
            (nothing written, or a memory not stored yet: :meth:`SessionStore.commit` writes it).
        versions: the kept versions of the line up to this one, oldest first (see the module
            docstring): ``[{"version", "memory_file", "memory_sha256", "bytes", "messages", "turns",
            "completion_text", "tokens_written", "time"}]``.
    """

    namespace: str
    session: str
    memory: MemoryCache | None = None
    messages: list[dict] = field(default_factory=list)
    completion_text: dict = field(default_factory=_empty_chain)
    turns: list[TurnRecord] = field(default_factory=list)
    version: int = 0
    memory_file: str | None = None
    created: float = field(default_factory=time.time)
    versions: list[dict] = field(default_factory=list)

    @property
    def tokens_written(self) -> int:
        return (
            0
            if self.memory is None or self.memory.tokens_written is None
            else int(self.memory.tokens_written[0])
        )

    def entry(self, number: int) -> dict | None:
        """The kept version ``number``'s entry, or ``None``."""
        return next((v for v in self.versions if v["version"] == number), None)

    def base_kept(self) -> bool:
        """Whether the empty session before the line's first version (version 0) is a rollback
        target: the line's first version is kept and is not an import."""
        if not self.versions or self.versions[0]["turns"] != 1:
            return False
        return bool(self.turns) and self.turns[0].kind != "import"

    def targets(self) -> list[dict]:
        """The versions a turn may roll back to, oldest first: version 0 (when :meth:`base_kept`)
        and every kept version, each ``{"version", "messages", "completion_text"}``."""
        base = [{"version": 0, "messages": 0, "completion_text": _empty_chain()}] if self.base_kept() else []
        return base + self.versions

    def record(self) -> dict:
        current = self.versions[-1] if self.versions else {}
        return {
            "format": "lstmem-serve-session",
            "version": RECORD_VERSION,
            "session": self.session,
            "commit": self.version,
            "memory_file": self.memory_file,
            "memory_sha256": current.get("memory_sha256"),
            "tokens_written": self.tokens_written,
            "messages": self.messages,
            "completion_text": self.completion_text,
            "turns": [turn.stored() for turn in self.turns],
            "versions": self.versions,
            "created": self.created,
            "updated": time.time(),
        }


def _version_bytes(versions: list[dict]) -> int:
    """Bytes of the memory files the versions name, each file counted once."""
    return sum({v["memory_file"]: v["bytes"] for v in versions if v["memory_file"]}.values())


class SessionStore:
    """Sessions of every namespace under one folder; loads lazily, commits durably, keeps versions.

    Thread safety: one lock guards the in-RAM table; commits, prunes and forks are run by the
    scheduler's one worker thread, reads take a snapshot under the lock.

    Args:
        root: the store folder (created if missing).
        layout: the served adapter's layout; a memory file of another layout is refused on load.
        max_versions: most versions kept per session (at least 1: the newest is always kept).
        max_version_bytes: most bytes of memory files kept per session; the newest version is kept
            even when it alone is larger.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        layout: MemoryLayout,
        max_versions: int = DEFAULT_VERSIONS,
        max_version_bytes: int = DEFAULT_VERSION_BYTES,
    ) -> None:
        if max_versions < 1 or max_version_bytes < 0:
            raise ValueError(
                f"a session keeps at least its newest version: expected max_versions >= 1 and "
                f"max_version_bytes >= 0, got {max_versions} and {max_version_bytes}"
            )
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        self.max_versions = max_versions
        self.max_version_bytes = max_version_bytes
        self._sessions: dict[tuple[str, str], Session] = {}
        self._lock = threading.Lock()

    def folder(self, namespace: str, session: str) -> Path:
        check_session_id(session)
        return self.root / namespace / session

    def row(self, session: Session, fresh: MemoryCache) -> MemoryRow:
        """``session``'s memory as an engine takes it (``fresh`` when it has none yet): with the
        name of the file that holds it (``NAMESPACE/SESSION/memory-...``, under the root) when it is
        a stored version's, and the session's folder for the new memories an engine writes; a
        request without a session (``session.session == ""``) writes under :data:`SCRATCH_FOLDER`."""
        if not session.session:
            return MemoryRow(fresh if session.memory is None else session.memory)
        folder = f"{session.namespace}/{check_session_id(session.session)}"
        if session.memory is None:
            return MemoryRow(fresh, None, folder)
        stored = session.memory_file
        name = None if stored is None else f"{folder}/{stored.removesuffix(SESSION_SUFFIX)}"
        return MemoryRow(session.memory, name, folder)

    def discard(self, rows: list[MemoryRow]) -> None:
        """Remove the pending files of ``rows`` that no commit took (an engine's writes of a turn
        that failed, was cancelled, wrote under policy ``none``, or was superseded by a later write
        of the same turn). Other files are never touched."""
        for row in rows:
            if row.file is None or not row.file.rpartition("/")[2].startswith(PENDING_PREFIX):
                continue
            path = Path(session_file(str(self.root), row.file))
            try:
                path.unlink(missing_ok=True)
            except OSError:
                log.warning("could not remove %s; it is removed when its session is next loaded", path)

    # ------------------------------------------------------------------ reading
    def get(self, namespace: str, session: str) -> Session:
        """The session (loaded from disk on first use; a new empty one when it does not exist)."""
        key = (namespace, check_session_id(session))
        with self._lock:
            found = self._sessions.get(key)
            if found is None:
                found = self._load(namespace, session)
                self._sessions[key] = found
            return found

    def exists(self, namespace: str, session: str) -> bool:
        key = (namespace, check_session_id(session))
        with self._lock:
            if key in self._sessions:
                return self._sessions[key].version > 0
        return (self.folder(namespace, session) / RECORD).exists()

    def list(self, namespace: str) -> list[dict]:
        """Summaries of the committed sessions of a namespace."""
        folder = self.root / namespace
        names = sorted(p.name for p in folder.iterdir() if (p / RECORD).exists()) if folder.exists() else []
        out = []
        for name in names:
            if not SESSION_ID.match(name):
                continue
            s = self.get(namespace, name)
            out.append(
                {"id": name, "tokens_written": s.tokens_written, "turns": len(s.turns), "commit": s.version}
            )
        return out

    def _load(self, namespace: str, session: str) -> Session:
        folder = self.folder(namespace, session)
        path = folder / RECORD
        if not path.exists():
            return Session(namespace, session)
        record = json.loads(path.read_text())
        if record.get("format") != "lstmem-serve-session":
            raise ValueError(f"{path} is not a session record of lstmem serve")
        if record.get("version") != RECORD_VERSION:
            raise ValueError(
                f"{path} is a session record of format {record.get('version')!r}, written by another version of "
                f"lstmem serve (this one reads format {RECORD_VERSION}); export what you need with that version, "
                "or serve a new --store"
            )
        versions = record["versions"]
        memory = None
        if record["memory_file"] is not None:
            memory = self._read_memory(folder, record["memory_file"], record["memory_sha256"])
        named = {RECORD} | {v["memory_file"] for v in versions if v["memory_file"]}
        for stale in folder.iterdir():  # orphans of a commit interrupted before or after its record
            if stale.name not in named and stale.is_file():
                stale.unlink()
        return Session(
            namespace,
            session,
            memory=memory,
            messages=record["messages"],
            completion_text=record["completion_text"],
            turns=[TurnRecord.model_validate(turn) for turn in record["turns"]],
            version=record["commit"],
            memory_file=record["memory_file"],
            created=record.get("created", time.time()),
            versions=versions,
        )

    def _read_memory(self, folder: Path, name: str, sha256: str) -> MemoryCache:
        memory_path = folder / name
        if _sha256(memory_path) != sha256:
            raise ValueError(f"{memory_path}: its SHA-256 differs from the record's; the store is damaged")
        return MemoryCache.load(memory_path, layout=self.layout)

    def at_version(self, current: Session, number: int) -> Session:
        """``current`` as it was at its kept version ``number`` (0: the empty session before the
        line, when :meth:`Session.base_kept`): that version's memory (read from its file, SHA-256
        checked), the record's prefix it holds, and the kept versions up to it. Nothing changes on
        disk; committing a turn on it continues the line from there.

        Raises:
            ServeError: 404 when the version is not kept.
        """
        if number == 0 and current.base_kept():
            return Session(current.namespace, current.session, created=current.created)
        entry = current.entry(number)
        if entry is None:
            raise ServeError(404, self._not_kept(current, number), code="version_not_found", param="version")
        folder = self.folder(current.namespace, current.session)
        memory = None
        if entry["memory_file"] is not None:
            memory = (
                current.memory
                if entry["memory_file"] == current.memory_file
                else self._read_memory(folder, entry["memory_file"], entry["memory_sha256"])
            )
        return Session(
            current.namespace,
            current.session,
            memory=memory,
            messages=current.messages[: entry["messages"]],
            completion_text=dict(entry["completion_text"]),
            turns=current.turns[: entry["turns"]],
            version=number,
            memory_file=entry["memory_file"],
            created=current.created,
            versions=[v for v in current.versions if v["version"] <= number],
        )

    @staticmethod
    def _not_kept(current: Session, number: int) -> str:
        if current.version == 0:
            return f"session {current.session!r} does not exist (nothing committed)"
        kept = ", ".join(str(v["version"]) for v in current.versions)
        return (
            f"version {number} of session {current.session!r} is not kept (kept: {kept}); "
            f"GET /v1/memory/{current.session}/versions lists them"
        )

    # ------------------------------------------------------------------ writing
    def _retain(self, versions: list[dict]) -> list[dict]:
        """``versions`` less the oldest ones over the count and byte bounds (never the newest)."""
        kept = list(versions)
        while len(kept) > 1 and (
            len(kept) > self.max_versions or _version_bytes(kept) > self.max_version_bytes
        ):
            kept.pop(0)
        return kept

    def _write_record(self, folder: Path, session: Session) -> None:
        text = json.dumps(session.record(), indent=1)
        write_atomically(folder / RECORD, lambda tmp: Path(tmp).write_text(text))

    @staticmethod
    def _remove_unnamed(folder: Path, before: list[dict], after: list[dict]) -> None:
        """Remove the memory files that ``before`` named and ``after`` does not (after the record is
        written, so the commit already holds: a file that cannot be removed now is removed at the
        next load)."""
        keep = {v["memory_file"] for v in after}
        for name in {v["memory_file"] for v in before if v["memory_file"]} - keep:
            try:
                (folder / name).unlink(missing_ok=True)
            except OSError:
                log.warning(
                    "could not remove %s; it is removed when the session is next loaded", folder / name
                )

    def commit(self, new: Session, written: str | None = None) -> None:
        """Make ``new`` the next version of its session: durable, then current in RAM.

        ``new`` is the state the turn made from the session at some version (the current one, or an
        older one a turn rolled back to: :meth:`at_version`); its ``versions`` are the kept versions
        up to that one. The new version is numbered after the current one; its memory is written to
        a new file unless ``new.memory_file`` already holds it (a turn that wrote nothing), or
        ``written`` names the pending file an engine wrote it to (then that file is renamed into
        place); then the bounds prune the oldest versions, the record is written, and the files that
        no kept version names any more (pruned, or dropped by a rollback) are removed.

        Raises:
            ValueError: ``written`` is not a pending file of the session's own folder.
        """
        folder = self.folder(new.namespace, new.session)
        folder.mkdir(parents=True, exist_ok=True)
        with self._lock:
            old = self._sessions.get((new.namespace, new.session))
        before = [] if old is None else list(old.versions)
        new.version = (0 if old is None else old.version) + 1
        if new.memory is None:
            new.memory_file, sha, size = None, None, 0
        elif new.memory_file is not None:  # the parent's memory, unchanged: its file is shared
            sha = next(
                (v["memory_sha256"] for v in new.versions if v["memory_file"] == new.memory_file), None
            ) or _sha256(folder / new.memory_file)
            size = (folder / new.memory_file).stat().st_size
        else:
            target = folder / f"memory-{new.version:08d}{SESSION_SUFFIX}"
            if written is None:
                write_atomically(target, new.memory.save)
            else:
                self._adopt(folder, written, target)
            new.memory_file = target.name
            sha, size = _sha256(target), target.stat().st_size
        entry = {
            "version": new.version,
            "memory_file": new.memory_file,
            "memory_sha256": sha,
            "bytes": size,
            "messages": len(new.messages),
            "turns": len(new.turns),
            "completion_text": dict(new.completion_text),
            "tokens_written": new.tokens_written,
            "time": time.time(),
        }
        new.versions = self._retain(list(new.versions) + [entry])
        self._write_record(folder, new)
        self._remove_unnamed(folder, before, new.versions)
        with self._lock:
            self._sessions[(new.namespace, new.session)] = new

    def _adopt(self, folder: Path, written: str, target: Path) -> None:
        """Rename the pending file ``written`` (a session name under the root) of ``folder`` to
        ``target``, durably: the file's bytes fsynced, renamed, the folder fsynced."""
        pending = Path(session_file(str(self.root), written))
        if pending.parent != folder.resolve() or not pending.name.startswith(PENDING_PREFIX):
            raise ValueError(f"{written!r} is not a pending memory file of the session's folder {folder}")
        fsync_file(pending)
        os.replace(pending, target)
        fsync_directory(folder)

    def prune(self, namespace: str, session: str, number: int) -> Session:
        """Drop the kept version ``number`` of a session (not the newest): the record first, then
        its memory file if no other kept version shares it.

        Raises:
            ServeError: 404 when the version is not kept; 409 for the newest version.
        """
        current = self.get(namespace, session)
        if current.entry(number) is None:
            raise ServeError(404, self._not_kept(current, number), code="version_not_found", param="version")
        if number == current.version:
            raise ServeError(
                409,
                f"version {number} is the newest version of session {session!r}, which is always kept; "
                f"DELETE /v1/memory/{session} resets the whole session",
                code="newest_version",
                param="version",
            )
        folder = self.folder(namespace, session)
        before = current.versions
        pruned = Session(**{**current.__dict__, "versions": [v for v in before if v["version"] != number]})
        self._write_record(folder, pruned)
        self._remove_unnamed(folder, before, pruned.versions)
        with self._lock:
            self._sessions[(namespace, session)] = pruned
        return pruned

    def fork(self, namespace: str, source: str, number: int, target: str) -> Session:
        """A new session ``target`` whose one version is the kept version ``number`` of ``source``
        (the same number, memory bytes, record prefix and text chain): the memory file is copied
        (temporary name, fsync, rename), then the record is written.

        Raises:
            ServeError: 404 when the version is not kept; 409 when ``target`` exists.
        """
        if self.exists(namespace, target):
            raise ServeError(
                409,
                f"session {target!r} exists; fork into a new session id, or DELETE /v1/memory/{target} first",
                code="session_exists",
                param="to",
            )
        current = self.get(namespace, source)
        if number < 1 or current.entry(number) is None:
            raise ServeError(404, self._not_kept(current, number), code="version_not_found", param="version")
        state = self.at_version(current, number)
        entry = state.versions[-1]
        folder = self.folder(namespace, target)
        folder.mkdir(parents=True, exist_ok=True)
        for leftover in folder.iterdir():  # of an interrupted fork or delete: no record, nothing committed
            if leftover.is_file():
                leftover.unlink()
        if entry["memory_file"] is not None:
            data = (self.folder(namespace, source) / entry["memory_file"]).read_bytes()
            write_atomically(folder / entry["memory_file"], lambda tmp: Path(tmp).write_bytes(data))
        forked = Session(
            namespace,
            target,
            memory=None if state.memory is None else state.memory.clone(),
            messages=list(state.messages),
            completion_text=dict(state.completion_text),
            turns=list(state.turns),
            version=number,
            memory_file=entry["memory_file"],
            versions=[dict(entry)],
        )
        self._write_record(folder, forked)
        with self._lock:
            self._sessions[(namespace, target)] = forked
        return forked

    def delete(self, namespace: str, session: str) -> bool:
        """Forget a session (every version and the record); ``True`` if it existed."""
        folder = self.folder(namespace, session)
        existed = self.exists(namespace, session)
        with self._lock:
            self._sessions.pop((namespace, session), None)
        if folder.exists():
            # the record goes first, so an interrupted delete never leaves a record without its memory
            (folder / RECORD).unlink(missing_ok=True)
            fsync_directory(folder)
            shutil.rmtree(folder)
        return existed

    def memory_path(self, namespace: str, session: str) -> Path | None:
        """The current memory file of a session, or ``None`` when nothing was written."""
        s = self.get(namespace, session)
        return None if s.memory_file is None else self.folder(namespace, session) / s.memory_file
