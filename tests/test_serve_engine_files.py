"""An engine that works on the store's own files (issue 38 item 2: how ``--engine vllm`` gets memory).

``lstmem serve --engine vllm`` makes the session store vLLM's session directory: the engine reads a
session's memory from the version file the store keeps it in, writes new memories as pending files
of the session's folder, and the store renames the pending file into the next version at commit.
vLLM itself runs in the vLLM tier (tests/test_vllm.py); here a :class:`FileEngine` does what it does
with files around the library engine, on the CPU: it reads every memory from the file a row names
(never the row's RAM copy, unless the memory is empty) and writes every new memory to a pending
file. Through the server (in process), over turns of every write policy, a write, a request without
a session, a rollback and a failed commit:

* answers and stored memory equal the library engine's bit for bit (the files are the memory);
* the store writes no memory file itself: each version is the file the engine wrote, renamed;
* no pending or scratch file is left behind, also when a commit fails (the session stays as it was)
  or the server stops between the write and the commit (the orphan goes at the next load).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve,test]'")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from test_serve import in_process  # noqa: E402

from lstmem_peft import MemoryCache  # noqa: E402
from lstmem_peft.memory.sessions import session_file, write_atomically  # noqa: E402
from lstmem_peft.serve import create_app  # noqa: E402
from lstmem_peft.serve import store as store_module  # noqa: E402
from lstmem_peft.serve.engine import PENDING_PREFIX, Engine, MemoryRow  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MODEL = "lstmem-demo"
HISTORY = "k07 v19 ; k12 v03 ; k01 v05 ; k02 v11"


class FileEngine:
    """The library engine behind files, as the vLLM engine uses them: a row's memory is read from
    the file it names under ``session_root`` (an empty memory from no file), and each new memory is
    saved as a pending file of the row's folder (``MemoryCache.save``, fsynced and renamed into place
    as vLLM's worker saves it). Records every file it read and wrote."""

    name = "files"
    request_limit = None

    def __init__(self, library, session_root: str) -> None:
        self.library = library
        self.session_root = os.path.realpath(session_root)
        self.read: list[str | None] = []
        self.wrote: list[str] = []
        self.count = 0

    def _from_files(self, rows: list[MemoryRow]) -> list[MemoryRow]:
        out = []
        for row in rows:
            self.read.append(row.file)
            if row.file is None:
                assert not row.memory.tokens_written.any(), "a written memory reached the engine in no file"
                out.append(row)
                continue
            memory = MemoryCache.load(session_file(self.session_root, row.file), row.memory.layout)
            out.append(MemoryRow(memory, row.file, row.folder))
        return out

    def generate(self, rows, prompts, sampling, stops, on_token=None, cancelled=None):
        return self.library.generate(self._from_files(rows), prompts, sampling, stops, on_token, cancelled)

    def score(self, rows, sequences, starts, top):
        return self.library.score(self._from_files(rows), sequences, starts, top)

    def write(self, rows, tokens):
        written, gates = self.library.write(self._from_files(rows), tokens)
        out = []
        for row in written:
            self.count += 1
            name = f"{row.folder}/{PENDING_PREFIX}{self.count}"
            path = session_file(self.session_root, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_atomically(path, row.memory.save)
            self.wrote.append(name)
            out.append(MemoryRow(row.memory, name, row.folder))
        return out, gates

    def close(self) -> None:
        pass


def chat(messages: list[dict], write: str = "messages", max_tokens: int = 3) -> dict:
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "lstmem_write": write,
    }


def user(text: str) -> dict:
    return {"role": "user", "content": text}


async def conversation(client) -> dict:
    """Turns of every policy on session ``a``, a write and an edit (a rollback) on it, a chat on
    session ``b``, and a chat without a session; returns the answers and both sessions' exports."""
    a, b = {"X-Session-Id": "a"}, {"X-Session-Id": "b"}
    answers = []

    async def turn(body, headers):
        r = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["message"]["content"])
        return answers[-1]

    messages = [user(HISTORY), {"role": "assistant", "content": "v19"}, user("? k12")]
    first = await turn(chat(messages), a)
    messages += [{"role": "assistant", "content": first}, user("? k07")]
    second = await turn(chat(messages, write="messages_and_answer"), a)
    messages += [{"role": "assistant", "content": second}, user("? k01")]
    await turn(chat(messages, write="none"), a)
    r = await client.post("/v1/memory/a/write", json={"text": " k05 v22 ;"}, headers=a)
    assert r.status_code == 200, r.text
    await turn(chat(messages[:3] + [user("? k02")]), a)  # an edited conversation: rolls back to version 1
    await turn(chat([user(HISTORY + " ; ? k01")], write="messages_and_answer"), b)
    await turn(chat([user(HISTORY + " ; ? k07")]), {})  # no session: a fresh memory, not stored
    exports = {}
    for sid in ("a", "b"):
        r = await client.get(f"/v1/memory/{sid}/export", headers={"X-Session-Id": sid})
        assert r.status_code == 200, r.text
        exports[sid] = r.content
    return {"answers": answers, "exports": exports}


def same_bits(one: bytes, two: bytes, layout, tmp_path) -> bool:
    (tmp_path / "one.safetensors").write_bytes(one)
    (tmp_path / "two.safetensors").write_bytes(two)
    x = MemoryCache.load(tmp_path / "one.safetensors", layout)
    y = MemoryCache.load(tmp_path / "two.safetensors", layout)
    return torch.equal(x.tokens_written, y.tokens_written) and all(
        torch.equal(p.cell, q.cell) and torch.equal(p.hidden, q.hidden)
        for p, q in zip(x.layers, y.layers, strict=True)
    )


def leftovers(root) -> list[str]:
    """Files under a store that are neither a version nor a record (nor the hidden layout record)."""
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and not p.name.startswith(("memory-", ".")) and p.name != "record.json"
    )


def test_memory_through_the_stores_own_files_equals_the_library_engine(loaded, tmp_path, monkeypatch):
    library = in_process(create_app(loaded, str(tmp_path / "library")), conversation)
    stored_by_server = []
    real_write = store_module.write_atomically

    def spy(path, write):
        stored_by_server.append(path.name)
        return real_write(path, write)

    monkeypatch.setattr(store_module, "write_atomically", spy)
    engine = FileEngine(loaded.engine, str(tmp_path / "files"))
    assert isinstance(engine, Engine)
    files = in_process(create_app(loaded.with_engine(engine), str(tmp_path / "files")), conversation)

    assert files["answers"] == library["answers"] and all(library["answers"])
    for sid in ("a", "b"):
        assert same_bits(files["exports"][sid], library["exports"][sid], loaded.layout, tmp_path), sid
    # every written memory reached the engine as a version's file or a pending file it wrote
    assert any(name is not None and "/memory-" in name for name in engine.read)
    assert all(
        name is None or name.split("/")[-1].startswith(("memory-", PENDING_PREFIX)) for name in engine.read
    )
    # the store wrote records only: each version is a file the engine wrote, renamed
    assert stored_by_server and all(name == "record.json" for name in stored_by_server), stored_by_server
    assert leftovers(tmp_path / "files") == []
    assert len(engine.wrote) > len(list((tmp_path / "files").rglob("memory-*")))  # some were discarded


def test_a_failed_commit_and_a_stop_before_the_commit_leave_no_pending_file(loaded, tmp_path, monkeypatch):
    """A commit that fails answers 500, keeps the session at its version and removes the engine's
    pending file; a pending file left by a stop between the write and the commit is an orphan that
    the next load of the session removes."""
    root = tmp_path / "files"
    engine = FileEngine(loaded.engine, str(root))
    app = create_app(loaded.with_engine(engine), str(root))
    sid = {"X-Session-Id": "a"}

    async def first(client):
        r = await client.post("/v1/chat/completions", json=chat([user(HISTORY)]), headers=sid)
        assert r.status_code == 200, r.text

    in_process(app, first)
    before = sorted(p.name for p in (root / "public" / "a").iterdir())

    def broken(self, folder, written, target):
        raise OSError("disk full")

    monkeypatch.setattr(store_module.SessionStore, "_adopt", broken)  # the version cannot be stored

    async def second(client):
        r = await client.post("/v1/chat/completions", json=chat([user(HISTORY), user("? k12")]), headers=sid)
        assert r.status_code == 500 and "could not store the session" in r.text

    in_process(create_app(loaded.with_engine(engine), str(root)), second)
    monkeypatch.undo()
    assert sorted(p.name for p in (root / "public" / "a").iterdir()) == before
    assert leftovers(root) == []
    orphan = root / "public" / "a" / f"{PENDING_PREFIX}stopped.safetensors"
    orphan.write_bytes(b"a memory the server wrote before it stopped")
    reopened = store_module.SessionStore(root, loaded.layout).get("public", "a")
    assert reopened.version == 1 and not orphan.exists()


def test_the_store_adopts_only_a_pending_file_of_the_sessions_own_folder(loaded, tmp_path):
    """A pending file of another session, or a version file, is refused as the new version's file
    (a wrong name from an engine never moves another session's memory)."""
    store = store_module.SessionStore(tmp_path, loaded.layout)
    memory = MemoryCache(loaded.layout)
    memory.ensure(1, torch.device("cpu"))
    (tmp_path / "public" / "b").mkdir(parents=True)
    memory.save(tmp_path / "public" / "b" / f"{PENDING_PREFIX}1.safetensors")
    session = store.get("public", "a")
    session.memory = memory
    for name in (f"public/b/{PENDING_PREFIX}1", "public/a/memory-00000001"):
        with pytest.raises(ValueError, match="is not a pending memory file of the session's folder"):
            store.commit(session, written=name)
    assert (tmp_path / "public" / "b" / f"{PENDING_PREFIX}1.safetensors").exists()
