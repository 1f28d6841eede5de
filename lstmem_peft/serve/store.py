"""Sessions on disk: one folder per session, the memory file ``MemoryCache.save`` writes plus a record.

Layout of a store::

    STORE/<namespace>/<session>/memory-<version>.safetensors   exactly what MemoryCache.save writes
    STORE/<namespace>/<session>/record.json                    what was written, turn history

``namespace`` is ``public`` without API keys, else a hash of the caller's key, so one key never
reaches another key's sessions. A commit is crash-consistent because the record is written last:

1. the new memory goes to a new file ``memory-<version+1>.safetensors`` (temporary name, fsync,
   rename, fsync of the folder);
2. ``record.json``, which names that file and its SHA-256, is replaced atomically the same way;
3. only then is the previous memory file removed.

A commit that wrote nothing (a turn with ``lstmem_write`` ``none``) skips step 1 and 3: the record
names the same memory file, which stays as it was, byte for byte.

A crash before step 2 leaves the old record naming the old, intact memory file (the new file is an
orphan, removed at the next load); a crash after it leaves the new pair. Either way the session is
one committed version, never a mix.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# session ids are checked by one rule wherever a name becomes a file (here and in vLLM's session directory)
from lstmem_peft.integrations.vllm import SESSION_ID, check_session_id
from lstmem_peft.memory.cache import MemoryCache, MemoryLayout

RECORD = "record.json"
RECORD_VERSION = 1


def namespace_for(api_key: str | None) -> str:
    """The store folder of a caller: ``public`` without keys, else a hash of the key."""
    if api_key is None:
        return "public"
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:24]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write) -> None:
    """Write a file through ``write(tmp_path)``, fsync it, rename it over ``path``, fsync the folder."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Session:
    """One session in RAM: its memory and its record.

    Attributes:
        namespace, session: where it lives.
        memory: one-row :class:`MemoryCache`, or ``None`` before anything was written.
        messages: ``[{"hash", "role", "tokens", "written"}]``, the chat messages taken in so far, in
            order: written into memory, or (``written`` false) only read by a turn with
            ``lstmem_write`` ``none``; an entry without ``written`` (an older record) was written.
        completion_text: ``{"length", "sha256"}`` of the completions text taken in so far (written,
            or read by a turn with ``lstmem_write`` ``none``).
        turns: the turn history (what the page plots): one dict per commit.
        version: commit counter (names the memory file).
        memory_file: the memory file's name in the session folder, or ``None``.
    """

    namespace: str
    session: str
    memory: MemoryCache | None = None
    messages: list[dict] = field(default_factory=list)
    completion_text: dict = field(
        default_factory=lambda: {"length": 0, "sha256": hashlib.sha256().hexdigest()}
    )
    turns: list[dict] = field(default_factory=list)
    version: int = 0
    memory_file: str | None = None
    created: float = field(default_factory=time.time)

    @property
    def tokens_written(self) -> int:
        return (
            0
            if self.memory is None or self.memory.tokens_written is None
            else int(self.memory.tokens_written[0])
        )

    def record(self) -> dict:
        return {
            "format": "lstmem-serve-session",
            "version": RECORD_VERSION,
            "session": self.session,
            "commit": self.version,
            "memory_file": self.memory_file,
            "memory_sha256": None,
            "tokens_written": self.tokens_written,
            "messages": self.messages,
            "completion_text": self.completion_text,
            "turns": self.turns,
            "created": self.created,
            "updated": time.time(),
        }


class SessionStore:
    """Sessions of every namespace under one folder; loads lazily, commits durably.

    Thread safety: one lock guards the in-RAM table; commits of one session are serialised by the
    scheduler (one worker thread), reads take a snapshot under the lock.

    Args:
        root: the store folder (created if missing).
        layout: the served adapter's layout; a memory file of another layout is refused on load.
    """

    def __init__(self, root: str | os.PathLike, layout: MemoryLayout) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        self._sessions: dict[tuple[str, str], Session] = {}
        self._lock = threading.Lock()

    def folder(self, namespace: str, session: str) -> Path:
        check_session_id(session)
        return self.root / namespace / session

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
        memory = None
        if record["memory_file"] is not None:
            memory_path = folder / record["memory_file"]
            if _sha256(memory_path) != record["memory_sha256"]:
                raise ValueError(
                    f"{memory_path}: its SHA-256 differs from the record's; the store is damaged"
                )
            memory = MemoryCache.load(memory_path, layout=self.layout)
        for stale in folder.iterdir():  # orphans of a commit interrupted before its record was written
            if stale.name != RECORD and stale.name != record["memory_file"]:
                stale.unlink()
        return Session(
            namespace,
            session,
            memory=memory,
            messages=record["messages"],
            completion_text=record["completion_text"],
            turns=record["turns"],
            version=record["commit"],
            memory_file=record["memory_file"],
            created=record.get("created", time.time()),
        )

    # ------------------------------------------------------------------ writing
    def commit(self, new: Session) -> None:
        """Make ``new`` (the next version of its session) durable, then current in RAM.

        A version whose memory is the current version's own object (a turn that wrote nothing:
        ``lstmem_write`` ``none``) keeps the current memory file, untouched: only the record is
        replaced."""
        folder = self.folder(new.namespace, new.session)
        folder.mkdir(parents=True, exist_ok=True)
        with self._lock:
            old = self._sessions.get((new.namespace, new.session))
        previous_file = None if old is None else old.memory_file
        new.version = (0 if old is None else old.version) + 1
        record = new.record()
        if new.memory is not None and old is not None and new.memory is old.memory and previous_file:
            new.memory_file = previous_file
            record["memory_file"] = previous_file
            record["memory_sha256"] = _sha256(folder / previous_file)
        elif new.memory is not None:
            new.memory_file = f"memory-{new.version:08d}.safetensors"
            target = folder / new.memory_file
            _atomic_write(target, new.memory.save)
            record["memory_file"] = new.memory_file
            record["memory_sha256"] = _sha256(target)
        else:
            new.memory_file = None
        text = json.dumps(record, indent=1)
        _atomic_write(folder / RECORD, lambda tmp: Path(tmp).write_text(text))
        if previous_file is not None and previous_file != new.memory_file:
            (folder / previous_file).unlink(missing_ok=True)
        with self._lock:
            self._sessions[(new.namespace, new.session)] = new

    def delete(self, namespace: str, session: str) -> bool:
        """Forget a session (memory and record); ``True`` if it existed."""
        folder = self.folder(namespace, session)
        existed = self.exists(namespace, session)
        with self._lock:
            self._sessions.pop((namespace, session), None)
        if folder.exists():
            # the record goes first, so an interrupted delete never leaves a record without its memory
            (folder / RECORD).unlink(missing_ok=True)
            _fsync_dir(folder)
            shutil.rmtree(folder)
        return existed

    def memory_path(self, namespace: str, session: str) -> Path | None:
        """The current memory file of a session, or ``None`` when nothing was written."""
        s = self.get(namespace, session)
        return None if s.memory_file is None else self.folder(namespace, session) / s.memory_file
