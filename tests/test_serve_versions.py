"""`lstmem serve`'s session versions (issue 36): rollback on edit and regenerate, fork, retention,
listing and pruning, durability and isolation of every version.

Each commit of a session is a version. The oracle of a rollback or a fork is the issue's: the
session afterwards equals, bit for bit (``torch.equal`` of every cell and hidden state), the record
included, a fresh session that got only the kept turns (and the new one) replayed through the same
server. The server runs in process (httpx's ASGI transport) on the embedded demo model.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve,test]'")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from test_serve import in_process  # noqa: E402  (the same in-process client)

from lstmem_peft import MemoryCache  # noqa: E402
from lstmem_peft.serve import create_app  # noqa: E402
from lstmem_peft.serve.store import SessionStore  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MODEL = "lstmem-demo"
HISTORY = "k07 v19 ; k12 v03 ; k01 v05 ; k02 v11 ; k30 v08"
QUESTIONS = ["? k07", "? k12", "? k01", "? k02", "? k30"]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def chat(messages: list[dict], **more) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, **more}


def sid(name: str, key: str | None = None) -> dict:
    headers = {"X-Session-Id": name}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return headers


async def turn(client, name: str, messages: list[dict], **more) -> dict:
    """One chat turn on session ``name``; its JSON (asserting 200)."""
    r = await client.post("/v1/chat/completions", json=chat(messages, **more), headers=sid(name))
    assert r.status_code == 200, r.text
    return r.json()


async def conversation(client, name: str, questions: list[str]) -> tuple[list[dict], list[dict]]:
    """The usual chat client on session ``name``: the history, then each question with the whole
    conversation sent again (the answers kept). Returns (the conversation with the last answer, the
    replies)."""
    messages, replies = [user(HISTORY)], []
    for q in questions:
        messages.append(user(q))
        reply = await turn(client, name, messages)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    return messages, replies


async def replay(client, name: str, requests: list[list[dict]]) -> list[dict]:
    """Send each request, in order, to a fresh session ``name``."""
    return [await turn(client, name, messages) for messages in requests]


def stored(app, name: str, namespace: str = "public"):
    return app.state.scheduler.store.get(namespace, name)


def assert_same_session(a, b) -> None:
    """Equal memory bit for bit, and equal records: messages taken in and the text chain."""
    assert (a.memory is None) == (b.memory is None)
    if a.memory is not None:
        assert torch.equal(a.memory.tokens_written, b.memory.tokens_written)
        for x, y in zip(a.memory.layers, b.memory.layers, strict=True):
            assert torch.equal(x.cell, y.cell) and torch.equal(x.hidden, y.hidden)
    assert a.messages == b.messages and a.completion_text == b.completion_text


def memory_files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def requests_of(messages: list[dict], turns: int) -> list[list[dict]]:
    """The requests the usual client sent for its first ``turns`` questions: the history, question,
    answer, question, ... cut after each question."""
    return [messages[: 2 + 2 * i] for i in range(turns)]


# ---------------------------------------------------------------------- (1) edit
def test_an_edited_message_rolls_back_and_equals_replaying_the_kept_turns(loaded, tmp_path):
    """Three turns, then the last question edited: the turn rolls back to version 2 (the version
    before the edited question was taken in) instead of 409, answers, and the session equals a fresh
    one that got the first two requests and the edited one. Editing an earlier question rolls back
    further. The dropped versions are gone from the list and the folder."""
    app = create_app(loaded, str(tmp_path / "store"))

    async def scenario(client):
        messages, _ = await conversation(client, "s", QUESTIONS[:3])
        edited = messages[:-2] + [user("? k30")]
        reply = await turn(client, "s", edited)
        fresh = await replay(client, "r", requests_of(messages, 2) + [edited])
        versions = (await client.get("/v1/memory/s/versions")).json()
        earlier = messages[:3] + [user("? k02")]  # the second question edited
        again = await turn(client, "s", earlier)
        fresh_again = await replay(client, "r2", requests_of(messages, 1) + [earlier])
        return reply, fresh, versions, again, fresh_again

    reply, fresh, versions, again, fresh_again = in_process(app, scenario)
    assert reply["lstmem"]["rolled_back_to"] == 2 and reply["lstmem"]["version"] == 4
    assert reply["choices"][0]["message"] == fresh[-1]["choices"][0]["message"]
    assert reply["lstmem"]["memory_tokens_written"] == fresh[-1]["lstmem"]["memory_tokens_written"]
    assert [v["version"] for v in versions["data"]] == [1, 2, 4] and versions["current"] == 4
    assert again["lstmem"]["rolled_back_to"] == 1 and again["lstmem"]["version"] == 5
    assert again["choices"][0]["message"] == fresh_again[-1]["choices"][0]["message"]
    assert_same_session(stored(app, "s"), stored(app, "r2"))
    assert [t.kind for t in stored(app, "s").turns] == ["chat", "chat"]  # the line: turns 1 and 5
    folder = tmp_path / "store" / "public" / "s"
    assert sorted(memory_files(folder)) == [
        "memory-00000001.safetensors",
        "memory-00000005.safetensors",
        "record.json",
    ]


def test_an_edited_completions_prompt_rolls_back_to_the_version_whose_text_it_extends(loaded, tmp_path):
    """Completions: a prompt that no longer extends the newest text but extends an older version's
    continues from that version; the session equals a fresh one that got the kept prompts."""
    app = create_app(loaded, str(tmp_path / "store"))
    prompts = [HISTORY, HISTORY + " ; ? k07", HISTORY + " ; ? k12"]

    async def send(client, name, prompt):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        r = await client.post("/v1/completions", json=body, headers=sid(name))
        assert r.status_code == 200, r.text
        return r.json()

    async def scenario(client):
        for p in prompts:
            last = await send(client, "s", p)
        for p in (prompts[0], prompts[2]):
            fresh = await send(client, "r", p)
        return last, fresh

    last, fresh = in_process(app, scenario)
    assert last["lstmem"]["rolled_back_to"] == 1 and last["lstmem"]["version"] == 3
    assert last["choices"][0]["text"] == fresh["choices"][0]["text"]
    assert_same_session(stored(app, "s"), stored(app, "r"))


# ---------------------------------------------------------------------- (2) regenerate
def test_regenerating_an_answer_rolls_back_to_before_its_question(loaded, tmp_path):
    """The conversation sent again without its last answer (a regenerate): the turn rolls back to
    the version before the last question was taken in, so it answers as the first time did and
    leaves the session as the first time did (bit for bit); regenerating the first answer rolls back
    to the empty session (version 0)."""
    app = create_app(loaded, str(tmp_path / "store"))

    async def scenario(client):
        messages, replies = await conversation(client, "s", QUESTIONS[:2])
        first_time = stored(app, "s")
        regenerated = await turn(client, "s", messages[:-1])
        again = await turn(client, "s", messages[:2])  # the first question's answer regenerated
        fresh = await replay(client, "r", [messages[:2]])
        return replies, first_time, regenerated, again, fresh

    replies, first_time, regenerated, again, fresh = in_process(app, scenario)
    assert regenerated["lstmem"]["rolled_back_to"] == 1 and regenerated["lstmem"]["version"] == 3
    assert regenerated["choices"][0]["message"] == replies[-1]["choices"][0]["message"]
    assert again["lstmem"]["rolled_back_to"] == 0 and again["lstmem"]["version"] == 4
    assert again["choices"][0]["message"] == replies[0]["choices"][0]["message"]
    assert_same_session(stored(app, "s"), stored(app, "r"))
    assert [v["version"] for v in stored(app, "s").versions] == [4]
    assert first_time.version == 2 and [v["version"] for v in first_time.versions] == [1, 2]


def test_a_regenerated_turn_leaves_the_session_as_the_first_time(loaded, tmp_path):
    """Bit for bit: the session after a regenerate equals the session after the original turn."""
    app = create_app(loaded, str(tmp_path / "store"))

    async def scenario(client):
        messages, _ = await conversation(client, "s", QUESTIONS[:2])
        before = stored(app, "s")
        await turn(client, "s", messages[:-1])
        return before, stored(app, "s")

    before, after = in_process(app, scenario)
    assert after.version == before.version + 1
    assert_same_session(after, before)


def test_a_client_that_sends_only_its_newest_message_never_rolls_back(loaded, tmp_path):
    """Such a client repeating its first message verbatim asks it again: the message is new, no
    version is dropped, and the memory grows by it (never a rollback to the empty session)."""
    app = create_app(loaded, str(tmp_path / "store"))

    async def scenario(client):
        replies = [await turn(client, "s", [user(text)]) for text in (HISTORY, QUESTIONS[0], HISTORY)]
        return replies, stored(app, "s")

    replies, session = in_process(app, scenario)
    assert [r["lstmem"]["rolled_back_to"] for r in replies] == [None, None, None]
    assert [r["lstmem"]["version"] for r in replies] == [1, 2, 3]
    assert [v["version"] for v in session.versions] == [1, 2, 3]
    assert len(session.messages) == 3
    written = [r["lstmem"]["session_tokens_written"] for r in replies]
    assert written[0] < written[1] < written[2]


# ---------------------------------------------------------------------- (3) fork
def test_a_fork_of_version_v_equals_replaying_the_first_v_turns(loaded, tmp_path):
    """Fork version 2 of a three-turn session: the new session equals a fresh one that got the first
    two turns, bit for bit, and continues as it does; the source is unchanged. Forking into an
    existing session is 409, a version that is not kept 404, a bad target id 400."""
    app = create_app(loaded, str(tmp_path / "store"))

    async def scenario(client):
        messages, _ = await conversation(client, "s", QUESTIONS[:3])
        source = stored(app, "s")
        forked = await client.post("/v1/memory/s/fork", json={"version": 2, "to": "f"})
        await replay(client, "r", requests_of(messages, 2))
        same = (stored(app, "f"), stored(app, "r"))
        nxt = messages[:4] + [user("? k30")]
        cont = (await turn(client, "f", nxt), (await replay(client, "r", [nxt]))[0])
        errors = [
            await client.post("/v1/memory/s/fork", json={"version": 2, "to": "r"}),
            await client.post("/v1/memory/s/fork", json={"version": 9, "to": "g"}),
            await client.post("/v1/memory/nobody/fork", json={"version": 1, "to": "g"}),
            await client.post("/v1/memory/s/fork", json={"version": 1, "to": "../g"}),
            await client.post("/v1/memory/s/fork", json={"version": 1, "to": "g", "path": "/tmp"}),
        ]
        return source, forked, same, cont, errors, (await client.get("/v1/memory/f/versions")).json()

    source, forked, (f, r), (cf, cr), errors, versions = in_process(app, scenario)
    assert forked.status_code == 200, forked.text
    assert forked.json() == {
        "session": "f",
        "source": "s",
        "version": 2,
        "tokens_written": r.tokens_written,
    }
    assert_same_session(f, r)
    assert cf["choices"][0]["message"] == cr["choices"][0]["message"]
    assert_same_session(stored(app, "f"), stored(app, "r"))
    assert stored(app, "s") is source and source.version == 3  # the source is untouched
    assert [e.status_code for e in errors] == [409, 404, 404, 400, 400]
    assert errors[0].json()["error"]["code"] == "session_exists"
    assert errors[3].json()["error"]["param"] == "to"
    assert [v["version"] for v in versions["data"]] == [2, 3]


# ---------------------------------------------------------------------- (4) retention
def test_retention_prunes_the_oldest_versions_within_both_bounds(loaded, tmp_path):
    """With 3 versions kept, five turns keep versions 3-5 (three memory files); a rollback that
    needs a pruned version is 409 naming the oldest kept version and the fixes. With a byte bound of
    two memory files, two versions are kept; a bound under one file still keeps the newest."""
    app = create_app(loaded, str(tmp_path / "store"), session_versions=3)

    async def scenario(client):
        messages, _ = await conversation(client, "s", QUESTIONS)
        edited = messages[:3] + [user("? k16")]  # needs version 1, pruned
        refused = await client.post("/v1/chat/completions", json=chat(edited), headers=sid("s"))
        return refused, (await client.get("/v1/memory/s/versions")).json()

    refused, versions = in_process(app, scenario)
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert error["code"] == "conversation_diverged"
    assert "oldest kept version, 3" in error["message"] and "/fork" in error["message"]
    assert "DELETE /v1/memory/{session}" in error["message"]
    assert [v["version"] for v in versions["data"]] == [3, 4, 5] and versions["max_versions"] == 3
    folder = tmp_path / "store" / "public" / "s"
    assert len(list(folder.glob("memory-*"))) == 3
    size = versions["data"][0]["bytes"]
    assert size == (folder / "memory-00000005.safetensors").stat().st_size > 0

    for bound, kept in ((2 * size, [4, 5]), (1, [5])):
        app = create_app(loaded, str(tmp_path / f"store-{bound}"), session_version_bytes=bound)
        listed = in_process(app, lambda client: _five_turns_then_versions(client))
        assert [v["version"] for v in listed["data"]] == kept
        assert sum(v["bytes"] for v in listed["data"]) <= max(bound, size)


async def _five_turns_then_versions(client) -> dict:
    await conversation(client, "s", QUESTIONS)
    return (await client.get("/v1/memory/s/versions")).json()


# ---------------------------------------------------------------------- (5) listing and pruning
def test_versions_are_listed_and_pruned_but_never_the_newest(loaded, tmp_path):
    """The list gives each kept version's number, messages, turns, tokens, bytes (its file's size)
    and time; a read-only turn's version shares its parent's file, which pruning the parent keeps.
    Pruning a version removes it and its file; the newest is 409, an unknown one 404, a number that
    is not a positive integer 400."""
    app = create_app(loaded, str(tmp_path / "store"))
    folder = tmp_path / "store" / "public" / "s"

    async def scenario(client):
        messages, _ = await conversation(client, "s", QUESTIONS[:2])
        await turn(client, "s", messages + [user("? k01")], lstmem_write="none")  # version 3
        await turn(client, "s", messages + [user("? k01"), user("? k02")])  # version 4
        listed = (await client.get("/v1/memory/s/versions")).json()
        files = sorted(p.name for p in folder.glob("memory-*"))
        pruned = [(await client.delete(f"/v1/memory/s/versions/{v}")) for v in (2, 1, 4, 7)]
        bad = [await client.delete(f"/v1/memory/s/versions/{v}") for v in ("0", "-1", "x", "1.5", str(2**60))]
        return listed, files, pruned, bad, (await client.get("/v1/memory/s/versions")).json()

    listed, files, pruned, bad, after = in_process(app, scenario)
    s = stored(app, "s")
    assert [v["version"] for v in listed["data"]] == [1, 2, 3, 4] and listed["current"] == 4
    assert [v["current"] for v in listed["data"]] == [False, False, False, True]
    assert [v["messages"] for v in listed["data"]] == [2, 4, 6, 7]
    assert [v["turns"] for v in listed["data"]] == [1, 2, 3, 4]
    tokens = [v["tokens_written"] for v in listed["data"]]
    assert tokens[1] == tokens[2] < tokens[3] and tokens[3] == s.tokens_written
    assert all(v["bytes"] == (folder / "memory-00000004.safetensors").stat().st_size for v in listed["data"])
    assert all(v["time"] > 0 for v in listed["data"])
    assert files == [
        "memory-00000001.safetensors",
        "memory-00000002.safetensors",
        "memory-00000004.safetensors",
    ]
    assert [r.status_code for r in pruned] == [200, 200, 409, 404]
    assert pruned[0].json() == {"session": "s", "version": 2, "deleted": True, "versions": [1, 3, 4]}
    assert pruned[2].json()["error"]["code"] == "newest_version"
    assert [r.status_code for r in bad] == [400] * 5
    assert [v["version"] for v in after["data"]] == [3, 4]
    # version 2's file is still named by version 3 (the read-only turn); version 1's is gone
    assert sorted(p.name for p in folder.glob("memory-*")) == [
        "memory-00000002.safetensors",
        "memory-00000004.safetensors",
    ]


# ---------------------------------------------------------------------- (6) durability
def test_versions_survive_a_restart_byte_for_byte_and_roll_back_after_it(loaded, tmp_path):
    """A new app on the same store (a restart) lists the same versions, keeps every file byte for
    byte, and a rollback after it equals the one the first app made."""
    store = str(tmp_path / "store")
    folder = tmp_path / "store" / "public" / "s"
    app = create_app(loaded, store)

    async def first(client):
        messages, _ = await conversation(client, "s", QUESTIONS[:3])
        return messages, (await client.get("/v1/memory/s/versions")).json()

    messages, versions = in_process(app, first)
    files = memory_files(folder)
    edited = messages[:-2] + [user("? k30")]

    restarted = create_app(loaded, store)

    async def second(client):
        listed = (await client.get("/v1/memory/s/versions")).json()
        return listed, await turn(client, "s", edited)

    listed, reply = in_process(restarted, second)
    assert listed == versions
    assert reply["lstmem"]["rolled_back_to"] == 2

    reference = create_app(loaded, str(tmp_path / "reference"))
    in_process(reference, lambda client: replay(client, "r", requests_of(messages, 2) + [edited]))
    assert_same_session(stored(restarted, "s"), stored(reference, "r"))
    # the kept versions' files are the same bytes as before the restart
    now = memory_files(folder)
    for name in ("memory-00000001.safetensors", "memory-00000002.safetensors"):
        assert now[name] == files[name]


def test_a_restart_keeps_every_file_byte_for_byte(loaded, tmp_path):
    """Restart without any request: every memory file and the record are the same bytes, and the
    reloaded versions load the same memory as the files."""
    store = str(tmp_path / "store")
    folder = tmp_path / "store" / "public" / "s"
    in_process(create_app(loaded, store), lambda client: conversation(client, "s", QUESTIONS[:3]))
    files = memory_files(folder)
    restarted = create_app(loaded, store)
    s = stored(restarted, "s")
    assert memory_files(folder) == files
    assert [v["version"] for v in s.versions] == [1, 2, 3]
    for v in s.versions:
        at = restarted.state.store.at_version(s, v["version"])
        on_disk = MemoryCache.load(folder / v["memory_file"], layout=loaded.layout)
        assert torch.equal(at.memory.layers[0].cell, on_disk.layers[0].cell)


def test_a_crash_mid_commit_leaves_the_last_complete_version(loaded, tmp_path, monkeypatch):
    """A rollback turn whose commit dies before its record: a 500, and the session (every version,
    every file) as it was, in RAM and after a restart. A crash after the record but before the
    dropped versions' files were removed: the next load removes them and keeps the new version."""
    from lstmem_peft.serve import store as store_module

    store = str(tmp_path / "store")
    folder = tmp_path / "store" / "public" / "s"
    app = create_app(loaded, store)
    real_write = store_module.write_atomically

    def dies_at_the_record(path, write):
        if path.name == "record.json":
            raise OSError("disk gone")
        real_write(path, write)

    async def scenario(client):
        messages, _ = await conversation(client, "s", QUESTIONS[:3])
        versions = (await client.get("/v1/memory/s/versions")).json()
        files = memory_files(folder)
        edited = messages[:-2] + [user("? k30")]
        with monkeypatch.context() as patch:
            patch.setattr(store_module, "write_atomically", dies_at_the_record)
            r = await client.post("/v1/chat/completions", json=chat(edited), headers=sid("s"))
        assert r.status_code == 500 and "disk gone" in r.json()["error"]["message"]
        return versions, files, (await client.get("/v1/memory/s/versions")).json()

    versions, files, after = in_process(app, scenario)
    assert after == versions
    assert set(memory_files(folder)) == set(files) | {"memory-00000004.safetensors"}  # the orphan
    reopened = SessionStore(store, loaded.layout).get("public", "s")
    assert memory_files(folder) == files  # the orphan removed, every kept file the same bytes
    assert [v["version"] for v in reopened.versions] == [1, 2, 3] and reopened.version == 3

    # a crash after the record: the files the new record no longer names are still there
    shutil.copy(folder / "memory-00000003.safetensors", folder / "memory-00000009.safetensors")
    (folder / ".tmp-crash.json").write_text("{}")
    record = json.loads((folder / "record.json").read_text())
    again = SessionStore(store, loaded.layout).get("public", "s")
    assert again.versions == record["versions"]
    assert memory_files(folder) == files


# ---------------------------------------------------------------------- (7) isolation and bad input
def test_another_key_cannot_see_fork_or_prune_the_versions(loaded, tmp_path):
    """With API keys, another key sees no versions of the session, and cannot fork or prune them;
    a fork lands in the caller's own namespace. Bad session ids and bodies are 400."""
    app = create_app(loaded, str(tmp_path / "store"), api_keys=["key-a", "key-b"])
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}

    async def scenario(client):
        for q in QUESTIONS[:2]:
            r = await client.post("/v1/chat/completions", json=chat([user(q)]), headers=sid("s", "key-a"))
            assert r.status_code == 200, r.text
        out = {
            "theirs": (await client.get("/v1/memory/s/versions", headers=b)).json(),
            "fork": await client.post("/v1/memory/s/fork", json={"version": 1, "to": "f"}, headers=b),
            "prune": await client.delete("/v1/memory/s/versions/1", headers=b),
            "anonymous": await client.get("/v1/memory/s/versions"),
            "mine": await client.post("/v1/memory/s/fork", json={"version": 1, "to": "f"}, headers=a),
            "bad_id": await client.get("/v1/memory/a%20b/versions", headers=a),
            "bad_version": await client.post(
                "/v1/memory/s/fork", json={"version": "one", "to": "g"}, headers=a
            ),
            "zero": await client.post("/v1/memory/s/fork", json={"version": 0, "to": "g"}, headers=a),
            "huge": await client.post("/v1/memory/s/fork", json={"version": 2**60, "to": "g"}, headers=a),
            "no_to": await client.post("/v1/memory/s/fork", json={"version": 1}, headers=a),
        }
        out["theirs_after"] = (await client.get("/v1/sessions", headers=b)).json()
        out["mine_after"] = (await client.get("/v1/memory/f/versions", headers=a)).json()
        return out

    out = in_process(app, scenario)
    assert out["theirs"]["data"] == [] and out["theirs"]["current"] == 0
    assert out["fork"].status_code == 404 and out["prune"].status_code == 404
    assert out["anonymous"].status_code == 401
    assert out["mine"].status_code == 200, out["mine"].text
    assert [v["version"] for v in out["mine_after"]["data"]] == [1]
    assert out["theirs_after"]["data"] == []
    for name in ("bad_id", "bad_version", "zero", "huge", "no_to"):
        assert out[name].status_code == 400, (name, out[name].text)
    assert not (tmp_path / "store" / "public").exists()  # nothing landed outside the keys' namespaces


def test_a_record_of_another_format_is_refused_naming_it(loaded, tmp_path):
    """A record without versions (written before this feature, format 1) is refused with the format
    and the fix, never read as something else."""
    from lstmem_peft.serve.engine import MemoryRow
    from lstmem_peft.serve.memories import fresh_memory, write_rows

    store = SessionStore(tmp_path, loaded.layout)
    session = store.get("public", "old")
    fresh = [MemoryRow(fresh_memory(loaded.layout, loaded.device))]
    (row,), _ = write_rows(loaded.engine, fresh, [[1, 5, 6, 7]], loaded.device)
    session.memory = row.memory
    store.commit(session)
    path = tmp_path / "public" / "old" / "record.json"
    record = json.loads(path.read_text())
    del record["versions"]
    path.write_text(json.dumps({**record, "version": 1}))
    with pytest.raises(ValueError, match=r"record of format 1, written by another version.*reads format 2"):
        SessionStore(tmp_path, loaded.layout).get("public", "old")
