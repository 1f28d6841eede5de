"""Edits are edits (issue 48, item 3): a client names the session version its conversation continues
(``lstmem_version``, the ``lstmem.version`` of the response it continues), so an edited message, the
first one included, rolls the session back to the version before it and the rest is written as new.

The oracle is the versions tests' (tests/test_serve_versions.py): after an edit, the session's memory
(every cell and hidden state, ``torch.equal``) and its record of messages equal a fresh session's that
was sent only the kept turns and the edited one. Without the field the prefix rule stays, and the
response says which messages were taken in as new. Bad versions are refused and leave the session's
files as they were, byte for byte. The server runs in process (httpx's ASGI transport) on the
embedded demo model, whose word-level vocabulary the messages are written in.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve,test]'")
httpx = pytest.importorskip("httpx")

from test_serve import in_process  # noqa: E402  (the in-process client)
from test_serve_versions import (  # noqa: E402
    HISTORY,
    MODEL,
    QUESTIONS,
    assert_same_session,
    chat,
    memory_files,
    replay,
    sid,
    stored,
    turn,
    user,
)

from lstmem_peft.serve import create_app  # noqa: E402

pytestmark = pytest.mark.timeout(300)

EDITED_HISTORY = "k07 v20 ; k12 v03 ; k01 v05 ; k02 v11 ; k30 v08"


async def versioned(
    client, name: str, questions: list[str]
) -> tuple[list[dict], list[dict], list[list[dict]]]:
    """A chat client that sends ``lstmem_version`` back: the history with the first question, then
    each question with the whole conversation, each request naming the version of the response
    before (none on the first). Returns (the conversation with the last answer, the replies, the
    requests' messages)."""
    messages, replies, requests = [user(HISTORY)], [], []
    for q in questions:
        messages.append(user(q))
        more = {"lstmem_version": replies[-1]["lstmem"]["version"]} if replies else {}
        reply = await turn(client, name, messages, **more)
        replies.append(reply)
        requests.append(list(messages))
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    return messages, replies, requests


# each edit: the conversation the client sends, the requests a fresh session is sent instead (the kept
# turns: indices into the three requests of the conversation), the version rolled back to, the new messages
EDITS = {
    # the case: the whole conversation re-sent with its first message changed
    "first": (lambda m: [user(EDITED_HISTORY)] + m[1:-1], [], 0, [0, 1, 2, 3, 4, 5]),
    # a chat UI that cuts the conversation after the edited message: one message, never a newest-only client's
    "first, cut after it": (lambda m: [user(EDITED_HISTORY)], [], 0, [0]),
    "middle": (lambda m: m[:3] + [user("? k30")], [0], 1, [2, 3]),
    "last": (lambda m: m[:5] + [user("? k30")], [0, 1], 2, [4, 5]),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edit_with_the_version_rolls_back_and_equals_replaying_the_kept_turns(loaded, tmp_path, edit):
    """Three turns sent with ``lstmem_version``, then one message edited (the first, a middle or the
    last user message), sent with the version of the last response: the turn rolls back to the version
    before the edited message and answers, and the session (memory bit for bit, record) equals a fresh
    one that was sent only the kept turns and the edited conversation. The next turn, sent with the
    edit's version, continues it."""
    app = create_app(loaded, str(tmp_path / "store"))
    change, kept, rolled_back_to, new_messages = EDITS[edit]

    async def scenario(client):
        messages, replies, requests = await versioned(client, "s", QUESTIONS[:3])
        edited = change(messages)
        reply = await turn(client, "s", edited, lstmem_version=replies[-1]["lstmem"]["version"])
        fresh = await replay(client, "r", [requests[i] for i in kept] + [edited])
        after = {"s": stored(app, "s"), "r": stored(app, "r")}
        following = edited + [reply["choices"][0]["message"], user("? k12")]
        nxt = await turn(client, "s", following, lstmem_version=reply["lstmem"]["version"])
        fresh_next = (await replay(client, "r", [following]))[0]
        info = (await client.get("/v1/memory/s")).json()
        return replies, reply, fresh[-1], after, nxt, fresh_next, info

    replies, reply, fresh, after, nxt, fresh_next, info = in_process(app, scenario)
    assert [r["lstmem"]["version"] for r in replies] == [1, 2, 3]
    assert [r["lstmem"]["new_messages"] for r in replies] == [[0, 1], [2, 3], [4, 5]]
    assert reply["lstmem"]["rolled_back_to"] == rolled_back_to and reply["lstmem"]["version"] == 4
    assert reply["lstmem"]["new_messages"] == new_messages and reply["lstmem"]["note"] is None
    assert reply["choices"][0]["message"] == fresh["choices"][0]["message"]
    assert reply["lstmem"]["memory_tokens_written"] == fresh["lstmem"]["memory_tokens_written"]
    assert reply["lstmem"]["session_tokens_written"] == fresh["lstmem"]["session_tokens_written"]
    assert_same_session(after["s"], after["r"])
    assert [v["version"] for v in after["s"].versions] == list(range(1, rolled_back_to + 1)) + [4]
    # the page's record of the edit says it rolled back and which messages were new
    assert info["turns"][-2]["rolled_back_to"] == rolled_back_to
    assert info["turns"][-2]["new_messages"] == new_messages
    # the conversation goes on from the edit
    assert nxt["lstmem"]["rolled_back_to"] is None and nxt["lstmem"]["version"] == 5
    sent = len(new_messages) + (0 if rolled_back_to == 0 else 2 * rolled_back_to)  # messages of the edit
    assert nxt["lstmem"]["new_messages"] == [sent, sent + 1]
    assert nxt["choices"][0]["message"] == fresh_next["choices"][0]["message"]
    assert_same_session(stored(app, "s"), stored(app, "r"))


def test_without_the_version_the_prefix_rule_stays_and_the_response_says_what_was_new(loaded, tmp_path):
    """No ``lstmem_version``: the conversation re-sent with its first message changed is taken as new
    messages on top of the newest version (today's rule: no rollback, old and new facts both in
    memory), and the response says so: every index in ``new_messages`` and a ``note`` naming
    ``lstmem_version``. A usual turn names only its new messages, with no note; so does a client
    that sends only its newest message."""
    app = create_app(loaded, str(tmp_path / "store"))

    async def scenario(client):
        messages, replies = [user(HISTORY)], []
        for q in QUESTIONS[:2]:
            messages.append(user(q))
            replies.append(await turn(client, "s", messages))
            messages.append({"role": "assistant", "content": replies[-1]["choices"][0]["message"]["content"]})
        before = stored(app, "s")
        edited = [user(EDITED_HISTORY)] + messages[1:-1]
        reply = await turn(client, "s", edited)
        after_edit = stored(app, "s")
        newest_only = [await turn(client, "n", [user(text)]) for text in (HISTORY, QUESTIONS[0])]
        # the record now holds both conversations, in order: sent as they are, only the question is new
        none = await turn(client, "s", messages[:-1] + edited + [user("? k01")], lstmem_write="none")
        info = (await client.get("/v1/memory/s")).json()
        return replies, (before, after_edit), reply, newest_only, none, info

    replies, (before, s), reply, newest_only, none, info = in_process(app, scenario)
    assert [r["lstmem"]["new_messages"] for r in replies] == [[0, 1], [2, 3]]
    assert all(r["lstmem"]["note"] is None and r["lstmem"]["rolled_back_to"] is None for r in replies)
    usage = reply["lstmem"]
    assert usage["rolled_back_to"] is None and usage["version"] == 3
    assert usage["new_messages"] == [0, 1, 2, 3]
    assert "every message was taken in as new, on top of version 2" in usage["note"]
    assert "lstmem_version" in usage["note"]
    assert len(s.messages) == len(before.messages) + 4  # the old conversation and the new one
    assert s.tokens_written == before.tokens_written + usage["memory_tokens_written"]
    assert [r["lstmem"]["new_messages"] for r in newest_only] == [[0], [0]]
    assert all(r["lstmem"]["note"] is None for r in newest_only)
    # read-only: the new message is taken in (read), and named as new all the same
    assert none["lstmem"]["new_messages"] == [8] and none["lstmem"]["memory_tokens_written"] == 0
    assert info["turns"][2]["rolled_back_to"] is None and info["turns"][2]["new_messages"] == [0, 1, 2, 3]


def test_a_streamed_turn_carries_the_version_to_send_back(loaded, tmp_path):
    """A streaming client gets ``lstmem`` (the version, the new messages) in the chunk that ends the
    last choice, and only there; sent back, it makes an edited first message roll back as in a
    plain request."""
    app = create_app(loaded, str(tmp_path / "store"))

    async def stream(client, messages, **more):
        body = chat(messages, stream=True, n=2, **more)
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=sid("s")) as reply:
            assert reply.status_code == 200
            return [
                json.loads(line.removeprefix("data: "))
                async for line in reply.aiter_lines()
                if line.startswith("data: {")
            ]

    async def scenario(client):
        first = await stream(client, [user(HISTORY), user(QUESTIONS[0])])
        version = first[-1]["lstmem"]["version"]
        edited = await stream(client, [user(EDITED_HISTORY), user(QUESTIONS[0])], lstmem_version=version)
        return first, edited

    first, edited = in_process(app, scenario)
    assert [("lstmem" in chunk) for chunk in first] == [False] * (len(first) - 1) + [True]
    assert first[-1]["choices"] == [
        {"index": 1, "delta": {}, "finish_reason": first[-1]["choices"][0]["finish_reason"]}
    ]
    assert first[-1]["lstmem"]["version"] == 1 and first[-1]["lstmem"]["new_messages"] == [0, 1]
    assert edited[-1]["lstmem"]["version"] == 2 and edited[-1]["lstmem"]["rolled_back_to"] == 0
    assert edited[-1]["lstmem"]["new_messages"] == [0, 1]


def test_completions_with_the_version_roll_an_edited_prompt_back(loaded, tmp_path):
    """Completions: a prompt that no longer extends the text of the version it names continues the
    newest version up to it whose text it extends, the empty session included; the session equals a
    fresh one that got only the kept prompts. Without the version such a prompt is new, with a note."""
    app = create_app(loaded, str(tmp_path / "store"))
    prompts = [HISTORY, HISTORY + " ; ? k07"]

    async def send(client, name, prompt, **more):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, **more}
        r = await client.post("/v1/completions", json=body, headers=sid(name))
        assert r.status_code == 200, r.text
        return r.json()["lstmem"]

    async def scenario(client):
        for name in ("s", "t"):
            for p in prompts:
                await send(client, name, p)
        edited = await send(client, "s", EDITED_HISTORY, lstmem_version=2)
        fresh = await send(client, "r", EDITED_HISTORY)
        same = (stored(app, "s"), stored(app, "r"))
        last = await send(client, "s", EDITED_HISTORY + " ; ? k12", lstmem_version=edited["version"])
        plain = await send(client, "t", EDITED_HISTORY)
        return edited, fresh, same, last, plain

    edited, fresh, (s, r), last, plain = in_process(app, scenario)
    assert edited["rolled_back_to"] == 0 and edited["new_text_from"] == 0 and edited["note"] is None
    assert (
        edited["new_messages"] is None and edited["memory_tokens_written"] == fresh["memory_tokens_written"]
    )
    assert_same_session(s, r)
    assert last["rolled_back_to"] is None and last["new_text_from"] == len(EDITED_HISTORY)
    assert plain["rolled_back_to"] is None and plain["new_text_from"] == 0
    assert "the whole prompt was taken in as new, on top of version 2" in plain["note"]


def test_bad_versions_are_refused_and_leave_the_session_as_it_was(loaded, tmp_path):
    """A version that is not kept (never committed, pruned, or of a session that does not exist) is
    404 naming ``lstmem_version`` and the fixes; without a session, or on a completion that only
    scores, 400; a negative or non-integer one 400; an edit whose version before the change was
    pruned is 409. Every refusal leaves the session's files (memory and record) byte for byte and its
    versions as they were. Version 0 of a session that does not exist yet starts it."""
    app = create_app(loaded, str(tmp_path / "store"), session_versions=2)
    folder = tmp_path / "store" / "public" / "s"

    async def post(client, body, name="s", path="/v1/chat/completions"):
        headers = sid(name) if name else {}
        return await client.post(path, json=body, headers=headers)

    async def scenario(client):
        messages, replies, _ = await versioned(client, "s", QUESTIONS[:3])  # versions 2 and 3 kept
        files, versions = memory_files(folder), stored(app, "s").versions
        edited = messages[:-1]
        refused = {
            "unknown": await post(client, chat(edited, lstmem_version=9)),
            "pruned": await post(client, chat(edited, lstmem_version=1)),
            "no such session": await post(client, chat(edited, lstmem_version=3), name="nobody"),
            "no session header": await post(client, chat(edited, lstmem_version=3), name=None),
            "negative": await post(client, chat(edited, lstmem_version=-1)),
            "not an integer": await post(client, chat(edited, lstmem_version="three")),
            "too large": await post(client, chat(edited, lstmem_version=2**60)),
            "scoring": await post(
                client,
                {"model": MODEL, "prompt": HISTORY, "max_tokens": 0, "echo": True, "lstmem_version": 3},
                path="/v1/completions",
            ),
            # the first message edited: it needs version 0, gone with version 1
            "diverged": await post(client, chat([user(EDITED_HISTORY)] + edited[1:], lstmem_version=3)),
        }
        after = (memory_files(folder), stored(app, "s").versions)
        started = await turn(client, "new", [user(HISTORY)], lstmem_version=0)
        return (files, versions), refused, after, started

    before, refused, after, started = in_process(app, scenario)
    statuses = {name: r.status_code for name, r in refused.items()}
    assert statuses == {
        "unknown": 404,
        "pruned": 404,
        "no such session": 404,
        "no session header": 400,
        "negative": 400,
        "not an integer": 400,
        "too large": 400,
        "scoring": 400,
        "diverged": 409,
    }, {name: r.text for name, r in refused.items()}
    for name in ("unknown", "pruned", "no such session", "no session header", "scoring"):
        error = refused[name].json()["error"]
        assert error["param"] == "lstmem_version", (name, error)
        assert "lstmem_version" in error["message"], (name, error)
    for name in ("unknown", "pruned"):
        error = refused[name].json()["error"]
        assert error["code"] == "version_not_found"
        assert "(kept: 2, 3)" in error["message"] and "GET /v1/memory/s/versions" in error["message"]
        assert "latest response on this session (now 3)" in error["message"]
        assert "leave lstmem_version out" in error["message"]
    assert "does not exist" in refused["no such session"].json()["error"]["message"]
    assert "X-Session-Id" in refused["no session header"].json()["error"]["message"]
    diverged = refused["diverged"].json()["error"]
    assert diverged["code"] == "conversation_diverged" and "oldest kept version, 2" in diverged["message"]
    assert after == before  # every refusal: the same files, bytes and versions
    assert started["lstmem"]["version"] == 1 and started["lstmem"]["rolled_back_to"] is None
    assert not (tmp_path / "store" / "public" / "nobody").exists()


def test_the_schema_documents_the_field_and_the_report(loaded, tmp_path):
    """``/openapi.json`` documents ``lstmem_version`` on both requests and ``new_messages``,
    ``new_text_from`` and ``note`` in the ``lstmem`` field."""
    schemas = create_app(loaded, str(tmp_path / "store")).openapi()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        field = schemas[name]["properties"]["lstmem_version"]
        assert "lstmem.version" in field["description"] and "rolls back" in field["description"]
    usage = schemas["MemoryUsage"]["properties"]
    for name in ("new_messages", "new_text_from", "note"):
        assert usage[name]["description"], name


PAGE_HARNESS = r"""
const vm = require('vm');
const [script, info] = [process.argv[1], JSON.parse(process.argv[2])];  // node -e CODE SCRIPT BODY
const elements = {};
const element = id => elements[id] = elements[id] || {id, value: '', textContent: '', innerHTML: '',
  classList: {toggle() {}}, dataset: {}, appendChild() {}, tBodies: [{insertAdjacentHTML() {}}]};
const json = (status, body) => ({ok: status < 400, status, statusText: '', json: async () => body});
const context = {
  console, URLSearchParams, JSON, Math, String, Object, Array, Error,
  location: {search: ''}, localStorage: {getItem: () => null, setItem() {}},
  document: {getElementById: element, querySelectorAll: () => [], createElement: () => element('new')},
  fetch: async (url) => url === '/v1/memory/s' ? json(200, info)
    : url === '/v1/models' ? json(200, {data: [{id: 'lstmem-demo'}]}) : json(200, {data: []}),
};
vm.createContext(context);
vm.runInContext(script, context);
(async () => {
  await new Promise(r => setTimeout(r, 50));
  await vm.runInContext("show('s')", context);
  console.log(JSON.stringify(element('conv').innerHTML));
})();
"""


def test_the_page_shows_an_edit_as_a_rollback_and_names_the_new_messages(loaded, tmp_path):
    """The page's conversation view of a session whose second question was edited (with
    ``lstmem_version``): the edit's turn shows the version it rolled back to and its new messages,
    the first turn its own new messages and no rollback; the page's own requests (one message, no version) still
    work as before (tests/test_demo_page.py)."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on PATH to run the page's script")
    from lstmem_peft.serve.page import PAGE

    app = create_app(loaded, str(tmp_path / "store"))

    async def scenario(client):
        messages, replies, _ = await versioned(client, "s", QUESTIONS[:2])
        edited = messages[:3] + [user("? k30")]
        await turn(client, "s", edited, lstmem_version=replies[-1]["lstmem"]["version"])
        return (await client.get("/v1/memory/s")).json()

    info = in_process(app, scenario)
    script = PAGE.split("<script>")[1].split("</script>")[0]
    done = subprocess.run(
        [node, "-e", PAGE_HARNESS, script, json.dumps(info)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    shown = json.loads(done.stdout.strip().splitlines()[-1])
    turns = shown.split('<div class="turn"><div class="who">')[1:]
    assert len(turns) == 2, shown
    assert "tokens written (lstmem_write messages), new messages 0-1 of the request<" in turns[0], shown
    assert "rolled back to version 1, new messages 2-3 of the request<" in turns[1], shown
