"""`lstmem serve`'s write policy per request (issue 36): ``lstmem_write`` on chat and completions.

``none`` reads memory and leaves it as it was, ``messages`` (the default) writes the request's new
messages, ``messages_and_answer`` writes them and then the answer. Each policy's memory after a turn
is checked bit for bit (``torch.equal`` of every cell and hidden state) against the library's own
calls from the same memory: ``write_history`` of the tokens the policy names. Also: the answer is the
same under every policy, a read-only turn leaves the memory file untouched and its messages are never
written later by a conversation that sends them again, an answer written by its turn is not written
twice, bad values are 400 errors, and the OpenAPI schema documents the field.

The server runs in process (httpx's ASGI transport) on the embedded demo model (a 64-token window).
"""

from __future__ import annotations

import hashlib
import json

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve,test]'")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from test_serve import in_process, reference_turn  # noqa: E402  (the same in-process client and turn)

from lstmem_peft import MemoryCache, write_history  # noqa: E402
from lstmem_peft.serve import create_app  # noqa: E402
from lstmem_peft.utils.chat import ChatFormat  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MODEL = "lstmem-demo"
POLICIES = ("none", "messages", "messages_and_answer")
HISTORY = "k07 v19 ; k12 v03 ; k01 v05 ; k02 v11 ; k30 v08"
SID = {"X-Session-Id": "doc"}


def library_write(loaded, memory: MemoryCache | None, tokens: list[int]) -> MemoryCache:
    """The library's own write: a copy of ``memory`` (a fresh one for ``None``) with ``tokens``
    written by ``write_history`` in one call, as the served adapter writes (its block size)."""
    out = MemoryCache() if memory is None else memory.clone()
    if tokens:
        with torch.no_grad():
            write_history(
                loaded.model, torch.tensor([tokens]), out, block_size=loaded.block_size, progress=False
            )
    return out


def assert_same_bits(served: MemoryCache | None, expected: MemoryCache | None) -> None:
    """Equal bit for bit: tokens written, and every layer's cell and hidden state (``torch.equal``)."""
    assert (served is None) == (expected is None)
    if served is None:
        return
    assert torch.equal(served.tokens_written.cpu(), expected.tokens_written.cpu())
    for a, b in zip(served.layers, expected.layers, strict=True):
        assert torch.equal(a.cell.cpu(), b.cell.cpu()) and torch.equal(a.hidden.cpu(), b.hidden.cpu())


def chat(messages: list[dict], write: str | None = None, max_tokens: int = 2, **more) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **more}
    if write is not None:
        body["lstmem_write"] = write
    return body


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def stored(app, session: str = "doc"):
    """The session as the store holds it (memory and record)."""
    return app.state.scheduler.store.get("public", session)


# ---------------------------------------------------------------------- chat: each policy, bit for bit
@pytest.mark.parametrize("policy", POLICIES)
def test_a_chat_turn_writes_what_its_policy_names_bit_for_bit(loaded, tmp_path, policy):
    """A history written through /write, then the conversation sent again with a question: the
    answer reads the same memory under every policy (it equals in-process greedy generate from the
    memory before the turn), and the memory after it is the library's write of exactly the policy's
    tokens: nothing, the question, or the question and then the answer as the client gets it."""
    app = create_app(loaded, str(tmp_path / "store"))
    fmt = ChatFormat(loaded.tokenizer)
    conversation = [user(HISTORY), user("? k12")]

    async def scenario(client):
        wrote = await client.post("/v1/memory/doc/write", json={"messages": conversation[:1]}, headers=SID)
        assert wrote.status_code == 200, wrote.text
        before = stored(app).memory.clone()
        reply = await client.post("/v1/chat/completions", json=chat(conversation, policy), headers=SID)
        assert reply.status_code == 200, reply.text
        return before, reply.json(), (await client.get("/v1/memory/doc")).json()

    before, reply, info = in_process(app, scenario)
    answer = reply["choices"][0]["message"]["content"]
    question = fmt.message("user", "? k12")
    prompt = fmt.message("user", HISTORY) + question + fmt.generation_prompt()
    expected_answer = reference_turn(loaded, before.clone(), prompt, [], max_new_tokens=2)
    assert answer == loaded.tokenizer.decode(expected_answer, skip_special_tokens=True)

    tokens = {
        "none": [],
        "messages": question,
        "messages_and_answer": question + fmt.message("assistant", answer),
    }[policy]
    expected = before if policy == "none" else library_write(loaded, before, tokens)
    assert_same_bits(stored(app).memory, expected)
    assert reply["lstmem"]["write"] == policy
    assert reply["lstmem"]["memory_tokens_written"] == len(tokens)
    assert reply["lstmem"]["session_tokens_written"] == int(expected.tokens_written[0])
    assert info["turns"][-1]["write"] == policy and info["turns"][-1]["written"] == len(tokens)
    assert info["messages_written"] == {"none": 1, "messages": 2, "messages_and_answer": 3}[policy]


def test_the_default_policy_is_messages(loaded, tmp_path):
    """A request without ``lstmem_write`` writes its new messages, as before the field existed."""
    app = create_app(loaded, str(tmp_path / "store"))
    fmt = ChatFormat(loaded.tokenizer)

    async def scenario(client):
        return (await client.post("/v1/chat/completions", json=chat([user(HISTORY)]), headers=SID)).json()

    reply = in_process(app, scenario)
    assert reply["lstmem"]["write"] == "messages"
    assert_same_bits(stored(app).memory, library_write(loaded, None, fmt.message("user", HISTORY)))


# ---------------------------------------------------------------------- none: nothing changes, nothing later
def test_a_read_only_turn_leaves_the_memory_file_as_it_was_and_its_messages_are_never_written(
    loaded, tmp_path
):
    """``none``: the memory file keeps its name and bytes (only the record gains the turn, its
    question recorded as read, not written). Sending the whole conversation again later with
    ``messages`` skips that question like a written one: the memory then equals the library's writes
    of the answer sent back and the new question only."""
    app = create_app(loaded, str(tmp_path / "store"))
    fmt = ChatFormat(loaded.tokenizer)
    folder = tmp_path / "store" / "public" / "doc"

    def memory_files() -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("memory-*")}

    async def scenario(client):
        await client.post("/v1/memory/doc/write", json={"messages": [user(HISTORY)]}, headers=SID)
        files, before = memory_files(), stored(app).memory.clone()
        first = [user(HISTORY), user("? k07")]
        reply = await client.post("/v1/chat/completions", json=chat(first, "none"), headers=SID)
        after_none = memory_files()
        record = stored(app).messages
        answer = reply.json()["choices"][0]["message"]["content"]
        again = first + [{"role": "assistant", "content": answer}, user("? k30")]
        later = await client.post("/v1/chat/completions", json=chat(again, "messages"), headers=SID)
        return files, before, after_none, record, answer, later.json()

    files, before, after_none, record, answer, later = in_process(app, scenario)
    assert after_none == files and len(files) == 1  # the same file, the same bytes
    assert [m["written"] for m in record] == [True, False] and record[1]["role"] == "user"
    written = fmt.message("assistant", answer) + fmt.message("user", "? k30")
    assert later["lstmem"]["memory_tokens_written"] == len(written)
    assert_same_bits(stored(app).memory, library_write(loaded, before, written))


def test_a_read_only_turn_reads_messages_beyond_the_window_without_writing_them(loaded, tmp_path):
    """A conversation longer than the 64-token window on a new session: under ``none`` its older
    messages are written into a copy the answer reads (the answer equals the ``messages`` turn's),
    and the session's memory stays empty; the same conversation with ``messages`` writes them all."""
    app = create_app(loaded, str(tmp_path / "store"))
    facts = [f"k{i:02d} v{(7 * i) % 32:02d} ; k{i + 8:02d} v{(3 * i) % 32:02d}" for i in range(14)]
    conversation = [user(f) for f in facts] + [user("? k03")]

    async def scenario(client):
        none = await client.post("/v1/chat/completions", json=chat(conversation, "none"), headers=SID)
        other = {"X-Session-Id": "writes"}
        messages = await client.post("/v1/chat/completions", json=chat(conversation), headers=other)
        return none.json(), messages.json()

    none, messages = in_process(app, scenario)
    assert none["choices"][0]["message"] == messages["choices"][0]["message"]
    # the conversation is longer than the prompt: its older messages reach the answer through memory
    assert messages["usage"]["prompt_tokens"] < messages["lstmem"]["memory_tokens_written"]
    assert (none["lstmem"]["memory_tokens_written"], none["lstmem"]["session_tokens_written"]) == (0, 0)
    assert stored(app).memory is None and stored(app).version == 1


# ---------------------------------------------------------------------- messages_and_answer: once
def test_an_answer_written_by_its_turn_is_not_written_again_when_the_client_sends_it_back(loaded, tmp_path):
    """``messages_and_answer`` on a new session, then the conversation sent again with the answer
    and a new question (``messages``): memory equals the library's two writes (question + answer,
    then the new question); the answer is written once."""
    app = create_app(loaded, str(tmp_path / "store"))
    fmt = ChatFormat(loaded.tokenizer)

    async def scenario(client):
        first = [user(HISTORY)]
        reply = await client.post(
            "/v1/chat/completions", json=chat(first, "messages_and_answer"), headers=SID
        )
        answer = reply.json()["choices"][0]["message"]["content"]
        again = first + [{"role": "assistant", "content": answer}, user("? k02")]
        later = await client.post("/v1/chat/completions", json=chat(again), headers=SID)
        return answer, later.json(), (await client.get("/v1/memory/doc")).json()

    answer, later, info = in_process(app, scenario)
    expected = library_write(loaded, None, fmt.message("user", HISTORY) + fmt.message("assistant", answer))
    expected = library_write(loaded, expected, fmt.message("user", "? k02"))
    assert later["lstmem"]["memory_tokens_written"] == len(fmt.message("user", "? k02"))
    assert_same_bits(stored(app).memory, expected)
    assert info["messages_written"] == 3


# ---------------------------------------------------------------------- completions
@pytest.mark.parametrize("policy", POLICIES)
def test_a_completion_writes_what_its_policy_names_bit_for_bit(loaded, tmp_path, policy):
    """Completions: the prompt is the messages, the completion the answer. Then a prompt that
    carries the first prompt and its completion, plus new text, writes only what the session has
    not taken in: never the first prompt (written, or read under ``none``), the completion unless
    ``messages_and_answer`` wrote it already."""
    app = create_app(loaded, str(tmp_path / "store"))
    fmt = ChatFormat(loaded.tokenizer)
    prompt = HISTORY + " ; ? k01 "  # the completion is appended to it: a space keeps its first word apart

    async def scenario(client):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "lstmem_write": policy}
        first = (await client.post("/v1/completions", json=body, headers=SID)).json()
        after_first = stored(app).memory
        text = first["choices"][0]["text"]
        more = {**body, "prompt": prompt + text + " ; ? k30", "lstmem_write": "messages"}
        second = (await client.post("/v1/completions", json=more, headers=SID)).json()
        return first, after_first, second

    first, after_first, second = in_process(app, scenario)
    completion = first["choices"][0]["text"]
    tokens = {
        "none": [],
        "messages": fmt.encode_text(prompt),
        "messages_and_answer": fmt.encode_text(prompt) + fmt.encode_text(completion),
    }[policy]
    assert first["lstmem"]["write"] == policy and first["lstmem"]["memory_tokens_written"] == len(tokens)
    if policy == "none":
        assert after_first is None
    else:
        assert_same_bits(after_first, library_write(loaded, None, tokens))
    # the first prompt is skipped under every policy (written, or read by "none"); its completion is
    # new unless messages_and_answer wrote it
    new_text = ("" if policy == "messages_and_answer" else completion) + " ; ? k30"
    expected = library_write(loaded, after_first, fmt.encode_text(new_text))
    assert second["lstmem"]["memory_tokens_written"] == len(fmt.encode_text(new_text))
    assert_same_bits(stored(app).memory, expected)


def test_a_read_only_turn_takes_several_choices_and_writes_none_of_them(loaded, tmp_path):
    """``none`` records no answer, so ``n > 1`` is served: every choice, nothing written."""
    app = create_app(loaded, str(tmp_path / "store"))

    async def scenario(client):
        body = chat([user(HISTORY)], "none", n=3, temperature=1.0, seed=None)
        return (await client.post("/v1/chat/completions", json=body, headers=SID)).json()

    reply = in_process(app, scenario)
    assert len(reply["choices"]) == 3 and reply["lstmem"]["memory_tokens_written"] == 0
    assert stored(app).memory is None and [m["written"] for m in stored(app).messages] == [False]


# ---------------------------------------------------------------------- refusals and the schema
def test_bad_values_are_refused_and_touch_no_session(loaded, tmp_path):
    """An unknown policy is 400 naming the allowed values; ``messages_and_answer`` (which writes the
    one answer) with ``n > 1`` is 400 naming ``n``; no session is created by either."""
    app = create_app(loaded, str(tmp_path / "store"))

    async def scenario(client):
        replies = [
            await client.post("/v1/chat/completions", json=chat([user("? k01")], "answer"), headers=SID),
            await client.post("/v1/chat/completions", json=chat([user("? k01")], None, lstmem_write=False)),
            await client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "k01", "max_tokens": 1, "lstmem_write": "all"},
                headers=SID,
            ),
            await client.post(
                "/v1/chat/completions", json=chat([user("? k01")], "messages_and_answer", n=2), headers=SID
            ),
            await client.post(
                "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": "k01",
                    "max_tokens": 1,
                    "n": 3,
                    "lstmem_write": "messages_and_answer",
                },
                headers=SID,
            ),
        ]
        return replies, (await client.get("/v1/sessions")).json()["data"]

    replies, sessions = in_process(app, scenario)
    assert [r.status_code for r in replies] == [400] * 5
    for r in replies[:3]:
        error = r.json()["error"]
        assert error["param"] == "lstmem_write", error
        assert all(name in error["message"] for name in POLICIES), error
    for r in replies[3:]:
        error = r.json()["error"]
        assert error["param"] == "n" and "n=1" in error["message"], error
    assert sessions == []


def test_the_openapi_schema_documents_the_field_on_both_requests_and_in_the_response(loaded, tmp_path):
    schemas = create_app(loaded, str(tmp_path / "store")).openapi()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        field = schemas[name]["properties"]["lstmem_write"]
        assert field["enum"] == list(POLICIES) and field["default"] == "messages", field
        assert "none" in field["description"] and "extra_body" in field["description"]
    usage = schemas["MemoryUsage"]
    assert usage["properties"]["write"]["enum"] == list(POLICIES) and "write" in usage["required"]


def test_a_streamed_turn_writes_its_answer_before_the_stream_ends(loaded, tmp_path):
    """``messages_and_answer`` with ``stream``: the streamed text is the answer written, committed
    before the last event (the memory equals the library's write of question and answer)."""
    app = create_app(loaded, str(tmp_path / "store"))
    fmt = ChatFormat(loaded.tokenizer)

    async def scenario(client):
        body = chat([user(HISTORY)], "messages_and_answer", stream=True)
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=SID) as reply:
            events = [line async for line in reply.aiter_lines() if line.startswith("data: {")]
        return events

    events = in_process(app, scenario)
    text = "".join(
        choice["delta"].get("content", "")
        for event in events
        for choice in json.loads(event.removeprefix("data: "))["choices"]
    )
    expected = library_write(loaded, None, fmt.message("user", HISTORY) + fmt.message("assistant", text))
    assert_same_bits(stored(app).memory, expected)


def test_the_page_sends_the_policy_chosen_beside_the_question():
    """The page's control: a select of the three policies beside the question (``messages`` by
    default, as a chat: the shipped adapters are trained for it), sent as ``lstmem_write`` with the
    session."""
    from lstmem_peft.serve.page import PAGE

    control = PAGE[PAGE.index('id="dask"') : PAGE.index("</select>")]
    for policy in POLICIES:
        assert f'<option value="{policy}"' in control
    assert '<option value="messages" selected>' in control
    assert "body.lstmem_write = $('dwritepolicy').value" in PAGE
