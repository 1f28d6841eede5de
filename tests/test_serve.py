"""`lstmem serve` through the real thing: uvicorn in a subprocess on 127.0.0.1, the `openai` client
and httpx, a real `kill -9` and restart, and in-process `generate(memory_cache=...)` as the oracle.

One server (the embedded demo model) is shared by most tests; a second one, with API keys, is
killed with SIGKILL and restarted on its store. Every client and process wait has a timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve,test]'")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import torch  # noqa: E402

from lstmem_peft import MemoryCache, write_history  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MODEL = "lstmem-demo"
HISTORY = "<s> k07 v19 ; k12 v03 ; k01 v05 ; k02 v11 ; k30 v08 ; k21 v27 ; k09 v14 ; k16 v00"
TIMEOUT = 60.0
KEY, OTHER_KEY = "key-a", "key-b"  # the shared server's API keys


# ---------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m lstmem_cli serve` in a subprocess, with its log in a file."""

    def __init__(self, store: Path, log: Path, *extra: str) -> None:
        self.store, self.log, self.extra = store, log, extra
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        cmd = [
            sys.executable,
            "-m",
            "lstmem_cli",
            "serve",
            "--store",
            str(self.store),
            "--port",
            str(self.port),
        ]
        cmd += [
            "--batch-wait-ms",
            "20",
            "--threads",
            "1",
        ]  # one thread: far faster for a tiny model on a busy CPU
        cmd += list(self.extra)
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"server did not answer /health in 180 s:\n{self.log.read_text()[-3000:]}")

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, timeout=TIMEOUT, max_retries=0)

    def http(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, timeout=TIMEOUT, headers=headers)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    keys = root / "keys.txt"
    keys.write_text(f"{KEY}\n{OTHER_KEY}\n")
    srv = Server(root / "store", root / "server.log", "--api-keys-file", str(keys)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.http(KEY) as client:
        yield client


def session(sid: str) -> dict:
    return {"X-Session-Id": sid}


def load_bytes(data: bytes, tmp_path: Path, name: str = "m.safetensors") -> MemoryCache:
    path = tmp_path / name
    path.write_bytes(data)
    return MemoryCache.load(path)


def file_contents(path: Path) -> tuple[dict, dict]:
    """Metadata and tensors of a safetensors file (its header's key order is not fixed)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return fh.metadata(), {k: fh.get_tensor(k).numpy().tobytes() for k in fh.keys()}


def same_memory(a: MemoryCache, b: MemoryCache, atol: float = 0.0) -> bool:
    if not torch.equal(a.tokens_written, b.tokens_written):
        return False
    for x, y in zip(a.layers, b.layers, strict=True):
        for s, t in ((x.cell, y.cell), (x.hidden, y.hidden)):
            if not (torch.equal(s, t) if atol == 0 else torch.allclose(s, t, atol=atol, rtol=0)):
                return False
    return True


# ---------------------------------------------------------------------- OpenAI surface
def reference_turn(
    loaded, memory: MemoryCache, prompt: list[int], after: list[int], max_new_tokens: int, before=()
) -> list[int]:
    """What a served greedy chat turn does, computed in process (the scheduler's turn rule): the new
    message tokens that are not in the prompt (``before``) are written into ``memory``; ``prompt`` is
    decoded greedily with memory read-only (``memory_write=False``); then the new message tokens that
    are in the prompt (``after``) are written (the answer is written when the client sends it back).
    ``memory`` is updated in place as the server's is. Returns the answer's token ids, cut at EOS."""
    tok, ids = loaded.tokenizer, torch.tensor([prompt])
    with torch.no_grad():
        if before:
            write_history(loaded.model, torch.tensor([list(before)]), memory, progress=False)
        out = loaded.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            memory_cache=memory,
            memory_write=False,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
        answer = out[0, ids.shape[1] :].tolist()
        answer = answer[: answer.index(tok.eos_token_id)] if tok.eos_token_id in answer else answer
        if after:
            write_history(loaded.model, torch.tensor([list(after)]), memory, progress=False)
    return answer


def test_models_health_and_metrics(server, http):
    client = server.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    assert http.get("/health").json()["status"] == "ok"
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "? k01"}], max_tokens=2)
    metrics = http.get("/metrics").text
    for name in (
        "lstmem_requests_total",
        "lstmem_tokens_total",
        "lstmem_sessions",
        "lstmem_batch_size_bucket",
        "lstmem_request_seconds_bucket",
    ):
        assert name in metrics, name
    assert 'route="/v1/chat/completions"' in metrics


def test_greedy_answer_and_memory_equal_in_process_generate(server, http, loaded, tmp_path):
    """The server's greedy answer is model.generate(memory_cache=..., memory_write=False) in process
    from the memory before the turn (the question is read, not yet written), and its memory after the
    turn is that memory plus the question, written once after answering, bit for bit (the answer is
    written when the client sends it back)."""
    from lstmem_peft.utils.chat import ChatFormat

    sid = "exact"
    assert http.post(f"/v1/memory/{sid}/write", json={"text": HISTORY}).status_code == 200
    before = load_bytes(http.get(f"/v1/memory/{sid}/export").content, tmp_path, "before.safetensors")
    question = "? k12"
    reply = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=4,
        temperature=0,
        extra_headers=session(sid),
    )
    after = load_bytes(http.get(f"/v1/memory/{sid}/export").content, tmp_path, "after.safetensors")

    fmt, tok = ChatFormat(loaded.tokenizer), loaded.tokenizer
    ids = fmt.message("user", question)
    memory = before.clone()
    new = reference_turn(loaded, memory, ids, ids, max_new_tokens=4)
    expected = tok.decode(new, skip_special_tokens=True)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == len(new)
    assert reply.model_extra["lstmem"]["memory_tokens_written"] == len(
        ids
    )  # the question; the answer when sent back
    assert same_memory(after, memory)


def test_resent_conversation_is_written_once_and_an_edited_one_rolls_back(server, http):
    client, sid = server.client(), "prefix"
    messages = [{"role": "user", "content": HISTORY}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, extra_headers=session(sid)
    )
    written = first.model_extra["lstmem"]["session_tokens_written"]
    answer = first.choices[0].message.content
    assert written == first.model_extra["lstmem"]["memory_tokens_written"] > 0
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "? k07"}]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, extra_headers=session(sid)
    )
    # the first answer (sent back now) and "<s> ? k07" were written, the history was not repeated, and
    # the new answer waits until it is sent back
    expected = 1 + len(answer.split()) + 3  # "<s>" + answer words + "<s> ? k07" (word-level tokenizer)
    assert second.model_extra["lstmem"]["memory_tokens_written"] == expected
    assert second.model_extra["lstmem"]["session_tokens_written"] == written + expected
    info = http.get(f"/v1/memory/{sid}").json()
    assert info["messages_written"] == 3 and info["commit"] == 2
    # an edited answer: the turn rolls back to version 1, from before the answer was taken in
    # (tests/test_serve_versions.py checks rollbacks bit for bit)
    edited = [messages[0], {"role": "assistant", "content": "v00"}, messages[2]]
    third = client.chat.completions.create(
        model=MODEL, messages=edited, max_tokens=3, extra_headers=session(sid)
    )
    assert (third.model_extra["lstmem"]["rolled_back_to"], third.model_extra["lstmem"]["version"]) == (1, 3)
    assert http.get(f"/v1/memory/{sid}").json()["commit"] == 3
    assert [v["version"] for v in http.get(f"/v1/memory/{sid}/versions").json()["data"]] == [1, 3]


def test_request_without_session_stores_nothing(server, http):
    before = http.get("/v1/sessions").json()["data"]
    reply = server.client().completions.create(model=MODEL, prompt="<s> ? k07", max_tokens=2, temperature=0)
    assert reply.choices[0].text and reply.model_extra["lstmem"]["session"] is None
    assert http.get("/v1/sessions").json()["data"] == before


def test_stream_equals_non_stream_and_commits_the_same_memory(server, http, tmp_path):
    client = server.client()
    assert http.post("/v1/memory/twin-a/write", json={"text": HISTORY}).status_code == 200
    exported = http.get("/v1/memory/twin-a/export").content
    assert http.put("/v1/memory/twin-b/import", content=exported).status_code == 200
    messages = [{"role": "user", "content": "? k30"}]
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, extra_headers=session("twin-a")
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=session("twin-b"),
    )
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == plain.choices[0].message.content
    assert finish == plain.choices[0].finish_reason
    assert usage.completion_tokens == plain.usage.completion_tokens
    a = load_bytes(http.get("/v1/memory/twin-a/export").content, tmp_path, "a.safetensors")
    b = load_bytes(http.get("/v1/memory/twin-b/export").content, tmp_path, "b.safetensors")
    assert same_memory(a, b)
    # completions stream too
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="<s> ? k30", max_tokens=3, temperature=0, stream=True
        )
        if c.choices
    )
    assert (
        text
        == client.completions.create(model=MODEL, prompt="<s> ? k30", max_tokens=3, temperature=0)
        .choices[0]
        .text
    )


#: A prompt the demo model continues to ``max_tokens`` (no question: it answers no value and no end
#: of sequence), for the stop-string test.
RUNS_ON = "<s> k07 v19 ; k01"


def test_sampling_parameters_n_seed_and_stop(server):
    client = server.client()
    kwargs = dict(
        model=MODEL, prompt="<s> ? k09", max_tokens=6, temperature=1.5, top_p=0.95, n=3, seed=7, logprobs=0
    )
    one, two = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert len(one.choices) == 3 and [c.text for c in one.choices] == [c.text for c in two.choices]
    # every token generated counts (a special token sampled at this temperature has no text)
    assert one.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in one.choices)
    greedy = client.completions.create(model=MODEL, prompt=RUNS_ON, max_tokens=6, temperature=0).choices[0]
    words = greedy.text.split()
    assert len(words) >= 2 and greedy.finish_reason == "length"
    cut = client.completions.create(model=MODEL, prompt=RUNS_ON, max_tokens=6, temperature=0, stop=[words[1]])
    assert cut.choices[0].text == greedy.text[: greedy.text.index(words[1])]
    assert cut.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------- memory endpoints
def test_memory_endpoints_write_info_export_import_reset(server, http, tmp_path):
    sid = "mem"
    reply = http.post(f"/v1/memory/{sid}/write", json={"text": HISTORY}).json()
    assert reply["tokens_written"] == len(HISTORY.split()) == reply["session_tokens_written"]
    msgs = http.post(
        f"/v1/memory/{sid}/write", json={"messages": [{"role": "user", "content": "k03 v04"}]}
    ).json()
    assert msgs["tokens_written"] == 3  # "<s> k03 v04"
    info = http.get(f"/v1/memory/{sid}").json()
    assert info["tokens_written"] == len(HISTORY.split()) + 3 and info["messages_written"] == 1
    assert len(info["layers"]) == len(info["layout"]["layer_indices"]) == 2
    for layer in info["layers"]:
        assert layer["cell_norm"] > 0 and layer["hidden_norm"] > 0
        assert 0 < layer["out_gate_mean"] < 1 and 0 < layer["depth_gate_mean"] < 1
    assert (
        info["fingerprint"] and info["adapter_fingerprint"] and info["state_bytes"] == 2 * 2 * 4 * 8 * 8 * 4
    )
    # export is the file MemoryCache.save wrote: the same tensors and metadata as saving what it loads
    data = http.get(f"/v1/memory/{sid}/export").content
    memory = load_bytes(data, tmp_path)
    memory.save(tmp_path / "again.safetensors")
    assert file_contents(tmp_path / "m.safetensors") == file_contents(tmp_path / "again.safetensors")
    assert int(memory.tokens_written[0]) == info["tokens_written"]
    # import into another session, then reset
    assert (
        http.put("/v1/memory/mem-copy/import", content=data).json()["tokens_written"]
        == info["tokens_written"]
    )
    (tmp_path / "copy.safetensors").write_bytes(http.get("/v1/memory/mem-copy/export").content)
    assert file_contents(tmp_path / "copy.safetensors") == file_contents(tmp_path / "m.safetensors")
    assert http.delete("/v1/memory/mem-copy").json()["deleted"] is True
    assert http.get("/v1/memory/mem-copy").json()["exists"] is False
    assert http.get("/v1/memory/mem-copy/export").status_code == 404


def test_gate_means_of_a_padded_row_equal_those_of_the_row_written_alone():
    """The write record's gate means leave padding out: in a batch with a long and a short history
    (three blocks and one, left-padded), the short row's means equal its history written alone."""
    from tiny_models import make

    from lstmem_peft.serve.engine_library import GateProbe

    model = make("qwen3", r=4, num_heads=2, block_size=4)
    g = torch.Generator().manual_seed(0)
    long, short = torch.randint(3, 90, (11,), generator=g), torch.randint(3, 90, (3,), generator=g)
    ids = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros(2, 11, dtype=torch.long)
    ids[0], mask[0] = long, 1
    ids[1, 8:], mask[1, 8:] = short, 1
    with torch.no_grad(), GateProbe(model, [11, 3], 4) as both:
        write_history(model, ids, MemoryCache(), attention_mask=mask, block_size=4, progress=False)
    with torch.no_grad(), GateProbe(model, [3], 4) as alone:
        write_history(model, short[None], MemoryCache(), block_size=4, progress=False)
    for name in ("out_gate", "depth_gate"):
        torch.testing.assert_close(torch.tensor(both.row(1)[name]), torch.tensor(alone.row(0)[name]))
    assert both.row(0) is not None


def test_import_refuses_another_layout_or_adapter_and_garbage(http, tmp_path):
    from tiny_models import make

    other = make("qwen3", r=8, num_heads=4)
    cache = MemoryCache()
    with torch.no_grad():
        write_history(other, torch.randint(3, 90, (1, 12)), cache, progress=False)
    cache.save(tmp_path / "other.safetensors")
    before = http.get("/v1/memory/mem").json()
    r = http.put("/v1/memory/mem/import", content=(tmp_path / "other.safetensors").read_bytes())
    assert r.status_code == 409 and r.json()["error"]["code"] == "incompatible_memory"
    r = http.put("/v1/memory/mem/import", content=b"not a safetensors file")
    assert r.status_code == 400 and "error" in r.json()
    after = http.get("/v1/memory/mem").json()
    assert after["commit"] == before["commit"] and after["tokens_written"] == before["tokens_written"]


# ---------------------------------------------------------------------- bad input
def test_bad_input_gets_openai_errors_and_touches_nothing(server, http):
    sid = "guarded"
    http.post(f"/v1/memory/{sid}/write", json={"text": HISTORY})
    state = http.get(f"/v1/memory/{sid}").json()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "? k07"}]}
    cases = [
        (dict(content=b"{not json", headers={"Content-Type": "application/json"}), 400),
        (dict(json={**chat, "model": "gpt-unknown"}), 404),
        (dict(json={**chat, "messages": "hello"}), 400),
        (dict(json={**chat, "n": 100}), 400),
        (dict(json={**chat, "temperature": 9}), 400),
        (dict(json={**chat, "top_p": -0.5}), 400),
        (dict(json={**chat, "max_tokens": 0}), 400),
        (dict(json={**chat, "max_tokens": 10**6}), 400),
        (dict(json={**chat, "messages": [{"role": "user", "content": "k01 " * 5000}]}), 400),
        (dict(json={**chat, "messages": [{"role": "wizard", "content": "x"}]}), 400),
        (dict(content=b"x" * (2 << 20), headers={"Content-Type": "application/json"}), 413),
    ]
    for kwargs, status in cases:
        r = http.post("/v1/chat/completions", headers={**session(sid), **kwargs.pop("headers", {})}, **kwargs)
        assert r.status_code == status, (kwargs, r.text[:300])
        body = r.json()["error"]
        assert body["message"] and "type" in body
    for bad in ("../../etc", ".hidden", "a" * 200, "x/y"):
        r = http.post("/v1/chat/completions", json=chat, headers=session(bad))
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id"
    assert http.get("/v1/memory/..%2F..%2Fetc").status_code in (400, 404)
    assert http.post("/v1/memory/.x/write", json={"text": "k01"}).status_code == 400
    assert not any(p.name == "etc" for p in server.store.rglob("*"))
    after = http.get(f"/v1/memory/{sid}").json()
    assert (after["commit"], after["tokens_written"]) == (state["commit"], state["tokens_written"])


def test_openapi_schema_fuzz(server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures = []

    def fuzz(op) -> None:
        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy())
        def check(case):
            response = case.call(timeout=TIMEOUT, headers={"Authorization": f"Bearer {KEY}"})
            if response.status_code >= 500:
                failures.append((op.label, response.status_code, response.text[:200]))
            if op.path.startswith("/v1/") and response.status_code >= 400:
                assert "error" in response.json(), (op.label, response.text[:200])

        check()

    operations = [operation.ok() for operation in schema.get_all_operations()]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/memory/{session}/write"} <= {
        op.path for op in operations
    }
    for op in operations:
        fuzz(op)
    assert not failures, failures[:5]


def in_process(app, scenario):
    """``scenario(client)`` against ``app`` on httpx's ASGI transport, its worker running meanwhile."""

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve", timeout=TIMEOUT) as client:
            return await scenario(client)

    app.state.scheduler.start()
    try:
        return asyncio.run(main())
    finally:
        app.state.scheduler.stop()


def test_the_openapi_schema_declares_each_response_and_the_answers_conform(loaded, tmp_path):
    """Every /v1 route documents its 200 body (a response model, or the memory file's bytes for
    export) and its errors (one ErrorResponse for 4XX and 5XX, no FastAPI 422, which this server never
    sends); and a real answer of every route conforms to what ``/openapi.json`` declares (schemathesis'
    response checks: status, content type, body schema), errors included."""
    schemathesis = pytest.importorskip("schemathesis")
    from lstmem_peft.serve import app as app_module

    app = app_module.create_app(loaded, str(tmp_path / "store"))
    spec = app.openapi()
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    routes = [
        (path, method) for path, item in spec["paths"].items() if path.startswith("/v1/") for method in item
    ]
    assert len(routes) == 13
    for path, method in routes:
        responses = spec["paths"][path][method]["responses"]
        assert "422" not in responses and responses["4XX"]["content"] == responses["5XX"]["content"] == error
        ok = responses["200"]["content"]
        if path.endswith("/export"):
            assert list(ok) == ["application/octet-stream"], (path, method)
        else:
            assert ok["application/json"]["schema"]["$ref"].startswith("#/components/schemas/"), (
                path,
                method,
            )
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "? k07"}],
        "max_tokens": 3,
        "temperature": 0,
    }
    scoring = {
        "model": MODEL,
        "prompt": ["<s> k01 v05 ; ? k01", "<s> ? k02"],
        "max_tokens": 2,
        "temperature": 0,
    }

    async def every_route(client):
        calls = [
            ("POST", "/v1/memory/{session}/write", client.post("/v1/memory/s/write", json={"text": HISTORY})),
            (
                "POST",
                "/v1/chat/completions",
                client.post("/v1/chat/completions", json=chat, headers=session("s")),
            ),
            (
                "POST",
                "/v1/chat/completions",
                client.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2}),
            ),
            (
                "POST",
                "/v1/completions",
                client.post("/v1/completions", json={**scoring, "echo": True, "logprobs": 2}),
            ),
            ("GET", "/v1/memory/{session}", client.get("/v1/memory/s")),
            ("GET", "/v1/memory/{session}/versions", client.get("/v1/memory/s/versions")),
            (
                "POST",
                "/v1/memory/{session}/fork",
                client.post("/v1/memory/s/fork", json={"version": 1, "to": "f"}),
            ),
            ("DELETE", "/v1/memory/{session}/versions/{version}", client.delete("/v1/memory/s/versions/1")),
            ("GET", "/v1/sessions", client.get("/v1/sessions")),
            ("GET", "/v1/models", client.get("/v1/models")),
            ("GET", "/v1/models/{model_id}", client.get(f"/v1/models/{MODEL}")),
            ("GET", "/v1/memory/{session}/export", client.get("/v1/memory/s/export")),
            ("DELETE", "/v1/memory/{session}", client.delete("/v1/memory/s")),
            (
                "POST",
                "/v1/chat/completions",
                client.post("/v1/chat/completions", json={**chat, "model": "gpt-4"}),
            ),
            ("POST", "/v1/completions", client.post("/v1/completions", json={**scoring, "top_k": 3})),
            ("GET", "/v1/memory/{session}/export", client.get("/v1/memory/s/export")),
        ]
        answers = []
        for method, path, call in calls:
            answers.append((method, path, await call))
            if path.endswith("/export") and answers[-1][2].status_code == 200:
                imported = await client.put("/v1/memory/t/import", content=answers[-1][2].content)
                answers.append(("PUT", "/v1/memory/{session}/import", imported))
        return answers

    answers = in_process(app, every_route)
    statuses = [response.status_code for _, _, response in answers]
    assert statuses == [200] * 14 + [404, 400, 404], statuses
    assert {(path, method.lower()) for method, path, _ in answers} == set(routes)
    info = answers[4][2].json()
    assert [t["kind"] for t in info["turns"]] == ["write", "chat"] and len(info["layers"]) == len(
        loaded.layout.layer_indices
    )
    schema = schemathesis.openapi.from_dict(spec)
    for method, path, response in answers:
        schema[path][method].validate_response(response)  # raises, naming the mismatch


def sse_events(response) -> list:
    """The ``data:`` payloads of a server-sent event stream: JSON objects, then the final ``[DONE]``."""
    payloads = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    return [json.loads(p) for p in payloads[:-1]] + payloads[-1:]


def test_streams_send_openai_chunks_with_usage_last_then_done(loaded, tmp_path):
    """The raw events of a chat stream (greedy, ``n=2``, ``include_usage``) and a completions stream
    with ``echo``, as OpenAI sends them: a chat stream opens each choice with ``{"role": "assistant",
    "content": ""}``, text deltas carry only ``content``, each choice ends with an empty delta and its
    ``finish_reason``; ``usage`` appears only in the last chunk (no choices), which counts the tokens
    of the plain answer; ``[DONE]`` ends the stream; the streamed text equals the plain answer's."""
    from lstmem_peft.serve import app as app_module

    app = app_module.create_app(loaded, str(tmp_path / "store"))
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "? k07"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    text = {"model": MODEL, "prompt": "<s> ? k07", "max_tokens": 3, "temperature": 0, "echo": True}

    async def both(client):
        plain = (await client.post("/v1/chat/completions", json={**chat, "n": 2})).json()
        stream = {**chat, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
        streamed = await client.post("/v1/chat/completions", json=stream)
        plain_text = (await client.post("/v1/completions", json=text)).json()
        streamed_text = await client.post("/v1/completions", json={**text, "stream": True})
        return plain, streamed, plain_text, streamed_text

    plain, streamed, plain_text, streamed_text = in_process(app, both)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    *chunks, done = sse_events(streamed)
    assert done == "[DONE]" and len(chunks) >= 5  # opening, a delta per choice at least, two endings, usage
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert [c["choices"] for c in chunks[:1]] == [
        [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for i in range(2)]
    ]
    *body, usage = chunks[1:]
    assert (
        all("usage" not in c for c in chunks[:-1])
        and usage["choices"] == []
        and usage["usage"] == plain["usage"]
    )
    texts, endings = ["", ""], {}
    for chunk in body:
        (choice,) = chunk["choices"]
        if choice["finish_reason"] is None:
            assert list(choice["delta"]) == ["content"] and choice["index"] not in endings
            texts[choice["index"]] += choice["delta"]["content"]
        else:
            assert choice["delta"] == {}
            endings[choice["index"]] = choice["finish_reason"]
    assert texts == [c["message"]["content"] for c in plain["choices"]] and texts[0] != ""
    assert endings == {c["index"]: c["finish_reason"] for c in plain["choices"]}

    *chunks, done = sse_events(streamed_text)
    assert done == "[DONE]" and all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"] == [{"index": 0, "text": "<s> ? k07", "finish_reason": None}]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain_text["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == plain_text["choices"][0]["finish_reason"]


# ---------------------------------------------------------------------- cancellation
# (a client that leaves mid-stream, and a server killed mid-write: tests/test_serve_in_flight.py, where
# each turn is made to be in flight when it is cut, and asserted to be)


# ---------------------------------------------------------------------- concurrency
def test_concurrent_sessions_are_batched_and_equal_running_alone(server, http, loaded, tmp_path):
    """32 sessions x 3 turns at once through AsyncOpenAI: batches form, nothing is lost, and every
    session ends with the answers and memory of its turns run alone in process (generate reading the
    memory before the turn, then write_history of the new messages: the answer sent back, the question)."""
    from lstmem_peft.utils.chat import ChatFormat

    sessions, facts = 32, HISTORY.split(" ; ")
    histories = [" ; ".join(facts[i % 5 : i % 5 + 3]) for i in range(sessions)]
    questions = [["? k07", "? k12", "? k20"], ["? k01", "? k30", "? k05"]]
    batches: list[int] = []

    async def conversation(client, i: int) -> list[str]:
        messages, answers = [{"role": "user", "content": histories[i]}], []
        for turn in range(3):
            messages.append({"role": "user", "content": questions[i % 2][turn]})
            reply = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=2,
                temperature=0,
                extra_headers=session(f"many-{i}"),
            )
            answers.append(reply.choices[0].message.content)
            batches.append(reply.model_extra["lstmem"]["batch_size"])
            messages.append({"role": "assistant", "content": answers[-1]})
        return answers

    async def together():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0
        ) as c:
            return await asyncio.gather(*(conversation(c, i) for i in range(sessions)))

    concurrent = asyncio.run(together())
    assert max(batches) > 1, "no batch formed"

    fmt, tok = ChatFormat(loaded.tokenizer), loaded.tokenizer
    for i in range(sessions):
        memory, context, answers = MemoryCache(), [], []
        new = [fmt.message("user", histories[i])]
        for turn in range(3):
            new.append(fmt.message("user", questions[i % 2][turn]))
            written = [t for ids in new for t in ids]
            context += written  # every message fits the window: all new ones are in the prompt
            ids = reference_turn(loaded, memory, context, written, max_new_tokens=2)
            answers.append(tok.decode(ids, skip_special_tokens=True))
            new = [fmt.message("assistant", answers[-1])]  # sent back with the next question
        assert concurrent[i] == answers, i
        served = load_bytes(http.get(f"/v1/memory/many-{i}/export").content, tmp_path, f"m{i}.safetensors")
        assert same_memory(served, memory, atol=1e-5), i
        assert http.get(f"/v1/memory/many-{i}").json()["commit"] == 3


# ---------------------------------------------------------------------- keys, kill -9, restart
def test_api_keys_namespace_sessions(server, http):
    other = server.http(OTHER_KEY)
    assert server.http().get("/v1/models").status_code == 401
    assert server.http("nope").post("/v1/memory/mine/write", json={"text": "k01"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        server.client("nope").models.list()
    assert http.post("/v1/memory/mine/write", json={"text": HISTORY}).status_code == 200
    assert other.get("/v1/memory/mine").json()["exists"] is False
    assert other.get("/v1/memory/mine/export").status_code == 404
    assert other.delete("/v1/memory/mine").json()["deleted"] is False
    assert "mine" not in [s["id"] for s in other.get("/v1/sessions").json()["data"]]
    reply = server.client(OTHER_KEY).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "? k07"}],
        max_tokens=2,
        extra_headers=session("mine"),
    )
    assert reply.model_extra["lstmem"]["session_tokens_written"] < len(
        HISTORY.split()
    )  # its own, new session
    assert http.get("/v1/memory/mine").json()["tokens_written"] == len(HISTORY.split())
    assert "mine" in [s["id"] for s in http.get("/v1/sessions").json()["data"]]


def test_kill9_and_restart_keep_every_session_bit_exact(server, http, loaded, tmp_path):
    """SIGKILL the server: after a restart on the same store every session's memory file is the same
    bytes, and continuing a conversation gives what in-process generate gives from that memory (the
    greedy-exactness test shows that is what a server that never stopped answers)."""
    from lstmem_peft.utils.chat import ChatFormat

    conversation = [{"role": "user", "content": "? k21"}]
    http.post("/v1/memory/durable/write", json={"text": HISTORY})
    first = server.client().chat.completions.create(
        model=MODEL, messages=conversation, max_tokens=3, temperature=0, extra_headers=session("durable")
    )
    conversation += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "? k16"},
    ]
    names = [s["id"] for s in http.get("/v1/sessions").json()["data"]]
    assert "durable" in names
    before = {name: http.get(f"/v1/memory/{name}/export").content for name in names}
    server.kill9()
    server.start()
    after = {name: http.get(f"/v1/memory/{name}/export").content for name in names}
    assert after == before  # every session, byte for byte
    reply = server.client().chat.completions.create(
        model=MODEL, messages=conversation, max_tokens=3, temperature=0, extra_headers=session("durable")
    )
    fmt, tok = ChatFormat(loaded.tokenizer), loaded.tokenizer
    memory = load_bytes(before["durable"], tmp_path)
    prompt = [t for m in conversation for t in fmt.message(m["role"], m["content"])]
    sent_back = fmt.message("assistant", conversation[1]["content"]) + fmt.message("user", "? k16")
    ids = reference_turn(loaded, memory, prompt, sent_back, max_new_tokens=3)
    assert reply.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)


def test_an_interrupted_commit_leaves_the_previous_version(tmp_path, loaded):
    """A crash between writing the new memory file and the record: the record still names the old,
    intact file, and the orphan is removed on load."""
    from lstmem_peft.serve.engine import MemoryRow
    from lstmem_peft.serve.memories import fresh_memory, write_rows
    from lstmem_peft.serve.store import SessionStore

    store = SessionStore(tmp_path, loaded.layout)
    session = store.get("public", "s")
    fresh = [MemoryRow(fresh_memory(loaded.layout, loaded.device))]
    (row,), _ = write_rows(loaded.engine, fresh, [[1, 5, 6, 7]], loaded.device)
    session.memory = row.memory
    store.commit(session)
    folder = tmp_path / "public" / "s"
    record = json.loads((folder / "record.json").read_text())
    shutil.copy(folder / record["memory_file"], folder / "memory-00000002.safetensors")  # the "crash"
    reopened = SessionStore(tmp_path, loaded.layout).get("public", "s")
    assert reopened.version == 1 and same_memory(reopened.memory, row.memory)
    assert sorted(p.name for p in folder.iterdir()) == ["memory-00000001.safetensors", "record.json"]


def test_a_failing_turn_or_commit_leaves_the_session_as_it_was(tmp_path, loaded, monkeypatch):
    """In process (the app on httpx's ASGI transport): a turn whose generate raises gets a 500 error
    JSON, and a commit that dies before its record is written leaves the previous version, in RAM
    and on disk."""
    from lstmem_peft.serve import app as app_module
    from lstmem_peft.serve import runner as runner_module
    from lstmem_peft.serve import store as store_module

    app = app_module.create_app(loaded, str(tmp_path / "store"))
    app.state.scheduler.start()
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "? k07"}],
        "max_tokens": 2,
        "temperature": 0,
    }

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve", timeout=TIMEOUT) as client:
            assert (await client.post("/v1/memory/s/write", json={"text": HISTORY})).status_code == 200
            before = (await client.get("/v1/memory/s")).json()
            exported = (await client.get("/v1/memory/s/export")).content

            def broken_generate(*args, **kwargs):
                raise RuntimeError("injected failure")

            with monkeypatch.context() as patch:
                patch.setattr(runner_module, "generate_rows", broken_generate)
                r = await client.post("/v1/chat/completions", json=chat, headers=session("s"))
            assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]

            real_write = store_module.write_atomically

            def dies_at_the_record(path, write):
                if path.name == "record.json":
                    raise OSError("disk gone")
                real_write(path, write)

            with monkeypatch.context() as patch:
                patch.setattr(store_module, "write_atomically", dies_at_the_record)
                r = await client.post("/v1/chat/completions", json=chat, headers=session("s"))
            assert r.status_code == 500 and "disk gone" in r.json()["error"]["message"]
            after = (await client.get("/v1/memory/s")).json()
            assert (after["commit"], after["tokens_written"]) == (before["commit"], before["tokens_written"])
            assert (await client.get("/v1/memory/s/export")).content == exported
            ok = await client.post("/v1/chat/completions", json=chat, headers=session("s"))
            assert (
                ok.status_code == 200
                and (await client.get("/v1/memory/s")).json()["commit"] == before["commit"] + 1
            )

    try:
        asyncio.run(scenario())
    finally:
        app.state.scheduler.stop()
    reopened = store_module.SessionStore(tmp_path / "store", loaded.layout).get("public", "s")
    assert reopened.version == 2  # the write and the last turn; the failed ones left nothing behind
    assert sorted(p.name for p in (tmp_path / "store" / "public" / "s").iterdir()) == [
        "memory-00000001.safetensors",  # version 1, kept (tests/test_serve_versions.py)
        "memory-00000002.safetensors",
        "record.json",
    ]


# ---------------------------------------------------------------------- the page
def test_page_renders_sessions_and_charts_in_headless_chromium(server, http, tmp_path):
    page = http.get("/")
    assert page.status_code == 200 and "<svg" in page.text or "chart(" in page.text
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install -y chromium) for the page screenshot")
    sid = "page"
    http.post(f"/v1/memory/{sid}/write", json={"text": HISTORY})
    client = server.client()
    messages = [{"role": "user", "content": "? k07"}]
    for q in ("? k12", "? k02"):
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, temperature=0, extra_headers=session(sid)
        )
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": q},
        ]
    shot = tmp_path / "page.png"
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000"]
    url = f"{server.url}/?session={sid}&key={KEY}"
    dom = subprocess.run(common + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert f"Session {sid}" in dom.stdout and "polyline" in dom.stdout and "? k07" in dom.stdout
    done = subprocess.run(
        common + [f"--screenshot={shot}", "--window-size=1200,900", url], capture_output=True, timeout=120
    )
    assert done.returncode == 0 and shot.stat().st_size > 10_000
    out = os.environ.get("LSTMEM_SERVE_SCREENSHOT")
    if out:
        shutil.copy(shot, out)


def test_the_prompt_is_the_latest_turns_that_fit_the_window_and_only_new_ones_are_written(loaded):
    """The chat policy (``plan_chat``): the prompt holds the latest whole messages that fit
    ``window - max_tokens`` (older turns live only in memory), and only messages the session has not
    written are written."""
    from lstmem_peft.serve.conversation import message_hash
    from lstmem_peft.serve.planning import plan_chat
    from lstmem_peft.serve.protocol import ServeError
    from lstmem_peft.serve.store import Session
    from lstmem_peft.utils.chat import ChatFormat

    fmt = ChatFormat(loaded.tokenizer)
    messages = [
        {"role": "user", "content": "k01 v02 ; k03 v04 ; k05 v06"},
        {"role": "assistant", "content": "v02"},
        {"role": "user", "content": "? k03"},
    ]
    encoded = [fmt.message(m["role"], m["content"]) for m in messages]
    opening = fmt.generation_prompt()
    session = Session("public", "window")
    session.messages = [
        {"hash": message_hash(m["role"], m["content"]), "role": m["role"], "tokens": len(e)}
        for m, e in zip(messages[:2], encoded[:2], strict=True)
    ]
    max_tokens = 4
    # room for the last two messages, not the first
    window = max_tokens + len(opening) + len(encoded[1]) + len(encoded[2])
    plan = plan_chat(fmt, session, messages, window, max_tokens)
    assert plan.prompt == encoded[1] + encoded[2] + opening
    assert plan.new_tokens == encoded[2] and [m["role"] for m in plan.new_messages] == ["user"]
    # one token less: only the latest message fits
    plan = plan_chat(fmt, session, messages, window - 1, max_tokens)
    assert plan.prompt == encoded[2] + opening
    # not even the latest message fits: refused, naming the fix
    with pytest.raises(ServeError, match="context window") as refused:
        plan_chat(fmt, session, messages, max_tokens + len(opening) + len(encoded[2]) - 1, max_tokens)
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"


def test_a_real_backbone_and_adapter_load_from_local_folders(tmp_path):
    """`lstmem serve --model DIR --adapter DIR` (its loader, in process): the backbone, its tokenizer
    and the adapter load, the served model answers as the saved PeftModel, and an adapter saved
    without a memory_id is refused (its stored sessions could not be reloaded after a restart)."""
    from peft import PeftModel, get_peft_model

    from lstmem_peft import LSTMemConfig
    from lstmem_peft.serve.loading import load_model
    from lstmem_peft.utils.offline import char_tokenizer, tiny_qwen3

    tok = char_tokenizer()
    backbone = tiny_qwen3(vocab_size=len(tok), hidden_size=48, seed=2)
    backbone.save_pretrained(tmp_path / "backbone")
    tok.save_pretrained(tmp_path / "backbone")
    adapter = get_peft_model(backbone, LSTMemConfig())
    adapter.save_pretrained(tmp_path / "my-adapter")

    served = load_model(str(tmp_path / "backbone"), str(tmp_path / "my-adapter"), device="cpu")
    assert served.name == "my-adapter"
    ids = torch.tensor([tok.encode("hello")])
    reference = PeftModel.from_pretrained(tiny_qwen3(vocab_size=len(tok), hidden_size=48, seed=2),
                                          tmp_path / "my-adapter").eval()  # fmt: skip
    with torch.no_grad():
        got = served.model(input_ids=ids, memory_cache=MemoryCache()).logits
        want = reference(input_ids=ids, memory_cache=MemoryCache()).logits
    assert torch.equal(got, want)
    assert served.tokenizer.encode("hello") == tok.encode("hello")

    config_file = tmp_path / "my-adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    del config["memory_id"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no memory_id"):
        load_model(str(tmp_path / "backbone"), str(tmp_path / "my-adapter"), device="cpu")


def test_a_backbone_and_adapter_load_by_hub_id_from_the_offline_hub_cache(tmp_path):
    """`--model user/backbone --adapter user/adapter`: Hub ids resolve through the Hub cache, offline
    (the repos are placed in the cache's own layout: snapshots/<commit>/..., refs/main)."""
    from peft import get_peft_model

    from lstmem_peft import LSTMemConfig
    from lstmem_peft.utils.offline import char_tokenizer, tiny_qwen3

    tok = char_tokenizer()
    backbone = tiny_qwen3(vocab_size=len(tok), hidden_size=48, seed=2)
    hub = tmp_path / "hub"

    def place(repo: str, save) -> None:
        root = hub / ("models--" + repo.replace("/", "--"))
        save(root / "snapshots" / ("0" * 40))
        (root / "refs").mkdir(parents=True)
        (root / "refs" / "main").write_text("0" * 40)

    place("user/backbone", lambda d: (backbone.save_pretrained(d), tok.save_pretrained(d)))
    place("user/adapter", lambda d: get_peft_model(backbone, LSTMemConfig()).save_pretrained(d))
    code = (
        "from lstmem_peft.serve.loading import load_model\n"
        "served = load_model('user/backbone', 'user/adapter', device='cpu')\n"
        "print(served.name, type(served.model).__name__)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub), "HF_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["adapter", "PeftModelForCausalLM"]


# ---------------------------------------------------------------------- what a turn writes, and when
def test_a_turn_writes_new_messages_outside_the_window_before_answering_and_the_rest_after(loaded):
    """``plan_chat`` / ``plan_completion`` split the new tokens: those older than the prompt are
    written before answering (``before``), those in the prompt after it (``after``), in order."""
    from lstmem_peft.serve.conversation import message_hash
    from lstmem_peft.serve.planning import plan_chat, plan_completion
    from lstmem_peft.serve.store import Session
    from lstmem_peft.utils.chat import ChatFormat

    fmt = ChatFormat(loaded.tokenizer)
    messages = [
        {"role": "user", "content": "k01 v02 ; k03 v04 ; k05 v06"},
        {"role": "assistant", "content": "v02"},
        {"role": "user", "content": "k07 v08 ; k09 v10"},
        {"role": "user", "content": "? k03"},
    ]
    encoded = [fmt.message(m["role"], m["content"]) for m in messages]
    session = Session("public", "split")
    session.messages = [
        {"hash": message_hash(m["role"], m["content"]), "role": m["role"], "tokens": len(e)}
        for m, e in zip(messages[:2], encoded[:2], strict=True)
    ]
    max_tokens = 2
    # the whole conversation fits: the new messages are read in the prompt and written after
    plan = plan_chat(fmt, session, messages, 1000, max_tokens)
    assert plan.before == [] and plan.after == encoded[2] + encoded[3]
    assert plan.prompt == [t for e in encoded for t in e]
    # only the question fits: the new message before it is written before answering
    plan = plan_chat(fmt, session, messages, max_tokens + len(encoded[3]), max_tokens)
    assert plan.prompt == encoded[3] and plan.before == encoded[2] and plan.after == encoded[3]
    assert [m["hash"] for m in plan.new_messages] == [
        message_hash(m["role"], m["content"]) for m in messages[2:]
    ]
    # a fresh session, everything new, the last two in the window
    plan = plan_chat(
        fmt, Session("public", "fresh"), messages, max_tokens + len(encoded[2]) + len(encoded[3]), 2
    )
    assert plan.before == encoded[0] + encoded[1] and plan.after == encoded[2] + encoded[3]

    text = "k01 v02 ; k03 v04 ; k05 v06 ; ? k03"
    ids = fmt.encode_text(text)
    plan = plan_completion(fmt, Session("public", "text"), text, 1000, max_tokens)
    assert (plan.before, plan.prompt, plan.after) == ([], ids, ids)
    plan = plan_completion(fmt, Session("public", "text"), text, max_tokens + 3, max_tokens)
    assert (plan.before, plan.prompt, plan.after) == (ids[:-3], ids[-3:], ids[-3:])


def test_messages_beyond_the_window_are_written_before_the_answer_reads_memory(loaded, tmp_path):
    """In process, a window that holds only the question: a turn sending history and question
    writes the history first, answers the question reading that memory, then writes question and
    answer; answer and memory equal the in-process turn (``reference_turn``), and the question's
    answer is the one memory-only recall gives."""
    from lstmem_peft.serve import app as app_module
    from lstmem_peft.utils.chat import ChatFormat

    fmt, tok = ChatFormat(loaded.tokenizer), loaded.tokenizer
    history, question = HISTORY.removeprefix("<s> "), "? k21"
    app = app_module.create_app(loaded, str(tmp_path / "store"), context_window=6)
    app.state.scheduler.start()
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": history}, {"role": "user", "content": question}],
        "max_tokens": 2,
        "temperature": 0,
    }

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve", timeout=TIMEOUT) as client:
            reply = (await client.post("/v1/chat/completions", json=chat, headers=session("w"))).json()
            exported = (await client.get("/v1/memory/w/export")).content
            return reply, exported

    try:
        reply, exported = asyncio.run(scenario())
    finally:
        app.state.scheduler.stop()
    memory = MemoryCache()
    h, q = fmt.message("user", history), fmt.message("user", question)
    answer = reference_turn(loaded, memory, q, q, max_new_tokens=2, before=h)
    assert reply["choices"][0]["message"]["content"] == tok.decode(answer, skip_special_tokens=True)
    assert reply["lstmem"]["memory_tokens_written"] == len(h) + len(q)
    assert same_memory(load_bytes(exported, tmp_path), memory)


def test_n_choices_at_temperature_zero_are_n_equal_answers_in_chat(server, http):
    """``n=3, temperature=0`` (chat): three equal choices, each the ``n=1`` greedy answer; as with
    ``n=1`` no answer is written (the client's chosen one is, when sent back) but the question is, once."""
    client = server.client()
    http.post("/v1/memory/greedy-n/write", json={"text": HISTORY})
    http.post("/v1/memory/greedy-1/write", json={"text": HISTORY})
    messages = [{"role": "user", "content": "? k12"}]
    three = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, n=3, extra_headers=session("greedy-n")
    )
    one = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, extra_headers=session("greedy-1")
    )
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.message.content for c in three.choices] == [one.choices[0].message.content] * 3
    assert {c.finish_reason for c in three.choices} == {one.choices[0].finish_reason}
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.model_extra["lstmem"]["memory_tokens_written"] == 3  # "<s> ? k12"
    info = http.get("/v1/memory/greedy-n").json()
    assert info["messages_written"] == 1 and info["tokens_written"] == len(HISTORY.split()) + 3


def test_n_choices_at_temperature_zero_are_n_equal_answers_in_completions(server):
    client = server.client()
    kwargs = dict(model=MODEL, prompt="<s> ? k09", max_tokens=4, temperature=0)
    two = client.completions.create(n=2, **kwargs)
    one = client.completions.create(**kwargs)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [one.choices[0].text] * 2
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens


def test_n_choices_at_temperature_zero_stream_n_equal_answers(server):
    """Streaming chat and completions with ``n=2, temperature=0``: each choice streams the greedy answer."""
    client = server.client()
    messages = [{"role": "user", "content": "? k07"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    parts, finish = {0: [], 1: []}, {}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, n=2, stream=True
    ):
        for choice in chunk.choices:
            parts[choice.index].append(choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert {i: "".join(p) for i, p in parts.items()} == {i: plain.choices[0].message.content for i in (0, 1)}
    assert finish == {0: plain.choices[0].finish_reason, 1: plain.choices[0].finish_reason}
    kwargs = dict(model=MODEL, prompt="<s> ? k07", max_tokens=4, temperature=0)
    text = client.completions.create(**kwargs).choices[0].text
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(n=2, stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == {0: text, 1: text}


@pytest.mark.slow
def test_recall_through_the_server_equals_in_process_memory_recall(server, loaded):
    """The demo's recall task through the live server: the history of each episode reaches a session
    through ``/write`` or as a first chat turn, then the question alone is a later turn (greedy, one
    token). Recall is within 0.05 of in-process memory-only recall (``demo.evaluate``: history
    written, question read) on the same episodes; with no history it is near chance. The first turn's
    answer is not in memory: the client did not send it back."""
    from lstmem_peft.cli.demo.recall import evaluate
    from lstmem_peft.training.data import synthetic_recall_episodes

    num, seed = 50, 4242
    episodes = synthetic_recall_episodes(num, 8, seed=seed)
    with torch.no_grad():
        reference = evaluate(loaded.model, loaded.tokenizer, num_episodes=num, seed=seed)["recall_memory"]

    async def episode(client, web, route: str, i: int, e: dict) -> bool:
        sid = f"recall-{route}-{i}"
        user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
        if route == "write":
            r = await web.post(f"/v1/memory/{sid}/write", json={"messages": user(e["history"])})
            assert r.status_code == 200, r.text
        elif route == "turn":
            await client.chat.completions.create(
                model=MODEL,
                messages=user(e["history"]),
                max_tokens=2,
                temperature=0,
                extra_headers=session(sid),
            )
        reply = await client.chat.completions.create(
            model=MODEL, messages=user(e["prompt"]), max_tokens=1, temperature=0, extra_headers=session(sid)
        )
        return reply.choices[0].message.content == e["answer"].strip()

    async def run(route: str) -> list[bool]:
        async with (
            openai.AsyncOpenAI(
                base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0
            ) as client,
            httpx.AsyncClient(
                base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}
            ) as web,
        ):
            return await asyncio.gather(*(episode(client, web, route, i, e) for i, e in enumerate(episodes)))

    recall = {route: sum(asyncio.run(run(route))) / num for route in ("write", "turn", "none")}
    figures = f"recall over {num} episodes: in process (memory only) {reference:.2f}, served {recall}"
    print(figures)
    assert reference > 0.5, figures
    assert abs(recall["write"] - reference) <= 0.05, figures
    assert abs(recall["turn"] - reference) <= 0.05, figures
    assert recall["none"] < 0.2, figures


# ---------------------------------------------------------------------- OpenAI compatibility
def reference_logprobs(loaded, memory: MemoryCache, ids: list[int]) -> list[float]:
    """``log p(ids[t] | ids[:t])`` for ``t >= 1``, from ``memory`` read only, computed in process:
    one forward with ``memory_write=False`` (what a served answer reads)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = loaded.model(
            input_ids=x, attention_mask=torch.ones_like(x), memory_cache=memory.clone(), memory_write=False
        ).logits
    lp = logits[0, :-1].float().log_softmax(-1)
    return lp.gather(-1, x[0, 1:, None])[:, 0].tolist()


def test_models_retrieve_names_the_served_model(server):
    client = server.client()
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-unknown")
    assert err.value.body["param"] == "model"


def test_completions_take_prompt_lists_and_token_id_prompts(server, loaded):
    client = server.client()
    texts = ["<s> ? k09", "<s> k03 v04 ; ? k03", "<s> ? k30"]
    one = [
        client.completions.create(model=MODEL, prompt=t, max_tokens=3, temperature=0).choices[0].text
        for t in texts
    ]
    ids = [loaded.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    for prompt in (texts, ids):
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, n=2)
        assert [c.index for c in reply.choices] == list(range(6))
        assert [c.text for c in reply.choices] == [t for t in one for _ in range(2)]
        assert reply.usage.prompt_tokens == sum(len(i) for i in ids)
        assert reply.model_extra["lstmem"]["batch_size"] > 1  # the prompts ran as one batch
    single = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=3, temperature=0)
    assert single.choices[0].text == one[1]
    # a session takes one prompt; token ids must be in the vocabulary
    with server.http(KEY) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": texts[:2]}, headers=session("lists"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": [[1, 10**6]]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": texts[:2], "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_completions_echo_and_logprobs_equal_in_process_scoring(server, http, loaded, tmp_path):
    """``echo`` + ``logprobs`` (what lm-eval's loglikelihood requests send) report every prompt token's
    log-probability as a read-only forward from the same memory computes it, and the answer's; with
    ``max_tokens=0`` a request only scores: a session's memory is read and left as it was."""
    client = server.client()
    text = "<s> k12 v03 ; k01 v05 ; ? k01"
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    reply = client.completions.create(
        model=MODEL, prompt=[ids, ids[:-2]], max_tokens=1, temperature=0, echo=True, logprobs=2, seed=1234
    )
    first = reply.choices[0]
    lp = first.logprobs
    assert first.text.startswith(text) and len(lp.tokens) == len(ids) + 1 == len(lp.token_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[: len(ids)]) == text and lp.text_offset[0] == 0
    expected = reference_logprobs(loaded, MemoryCache(), ids)
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert len(top) == 2 and max(top.values()) >= value
    # the greedy answer token is the most likely one, and its log-probability the reference's
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
    answer = loaded.tokenizer(first.text[len(text) :], add_special_tokens=False)["input_ids"]
    assert lp.token_logprobs[-1] == pytest.approx(
        reference_logprobs(loaded, MemoryCache(), ids + answer)[-1], abs=1e-4
    )
    assert len(reply.choices[1].logprobs.tokens) == len(ids) - 2 + 1  # each prompt its own choice
    # without echo: the answer's tokens only, offsets after the prompt
    plain = client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0, logprobs=0)
    assert len(plain.choices[0].logprobs.tokens) >= 1 and plain.choices[0].logprobs.text_offset[0] == len(
        text
    )
    assert plain.choices[0].logprobs.top_logprobs[0] == {}

    # max_tokens=0 + echo: scoring only, from the session's memory, which stays as it was
    sid = "scored"
    http.post(f"/v1/memory/{sid}/write", json={"text": HISTORY})
    before = http.get(f"/v1/memory/{sid}").json()
    memory = load_bytes(http.get(f"/v1/memory/{sid}/export").content, tmp_path)
    question = loaded.tokenizer("<s> ? k21 v27", add_special_tokens=False)["input_ids"]
    scored = client.completions.create(
        model=MODEL,
        prompt=question,
        max_tokens=0,
        echo=True,
        logprobs=1,
        temperature=0,
        extra_headers=session(sid),
    )
    choice = scored.choices[0]
    assert choice.text == "<s> ? k21 v27" and scored.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(question)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        reference_logprobs(loaded, memory, question), abs=1e-4
    )
    assert scored.model_extra["lstmem"]["memory_tokens_written"] == 0
    after = http.get(f"/v1/memory/{sid}").json()
    assert (after["commit"], after["tokens_written"]) == (before["commit"], before["tokens_written"])
    # without echo, max_tokens=0 is refused; echo streams the prompt first
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=text, max_tokens=2, temperature=0, echo=True, stream=True
        )
        if c.choices
    )
    assert (
        streamed
        == client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0, echo=True)
        .choices[0]
        .text
    )
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": text, "logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_chat_logprobs_and_top_logprobs(server, http):
    client = server.client()
    messages = [{"role": "user", "content": "? k01"}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens >= 1
    assert "".join(t.token for t in content).strip() == reply.choices[0].message.content.strip()
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy: the best token
        assert t.logprob == t.top_logprobs[0].logprob <= 0 and t.bytes == list(t.token.encode())
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == reply.choices[0].message.content
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "logprobs": True, "top_logprobs": 21},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_unsupported_parameters_are_refused_by_name_and_supported_ones_accepted(server, http):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "? k07"}], "max_tokens": 2}
    completion = {"model": MODEL, "prompt": "<s> ? k07", "max_tokens": 2}
    refused = [
        (
            "/v1/chat/completions",
            {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools",
        ),
        ("/v1/chat/completions", {**chat, "tool_choice": "auto"}, "tool_choice"),
        ("/v1/chat/completions", {**chat, "functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {**chat, "logit_bias": {"x": 10}}, "logit_bias"),
        ("/v1/chat/completions", {**chat, "frequency_penalty": 0.5}, "frequency_penalty"),
        ("/v1/chat/completions", {**chat, "presence_penalty": -1}, "presence_penalty"),
        ("/v1/chat/completions", {**chat, "top_k": 5}, "top_k"),
        ("/v1/chat/completions", {**chat, "reasoning_effort": "high"}, "reasoning_effort"),
        ("/v1/chat/completions", {**chat, "stop": [f"s{i}" for i in range(17)]}, "stop"),
        ("/v1/chat/completions", {**chat, "stop": 5}, "stop"),
        ("/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {**completion, "best_of": 3}, "best_of"),
        ("/v1/completions", {**completion, "suffix": " end"}, "suffix"),
        ("/v1/completions", {**completion, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {**completion, "prompt": [["x"]]}, "prompt"),
        ("/v1/completions", {**completion, "prompt": [[1, -2]]}, "prompt"),
        ("/v1/completions", {**completion, "prompt": ["<s>"] * 65, "n": 2}, "n"),
    ]
    for path, body, param in refused:
        r = http.post(path, json=body)
        assert r.status_code == 400, (param, r.text[:300])
        error = r.json()["error"]
        assert error["param"] == param and error["message"], error
        assert ".str" not in error["message"] and "list[" not in error["message"], error  # no union noise
    five = http.post("/v1/chat/completions", json={**chat, "stop": ["a", "b", "c", "d", "e"]})
    assert five.status_code == 200, five.text[:300]  # more than OpenAI's 4 (lm-eval sends its own + EOS)
    for extra in (
        {"response_format": {"type": "text"}},
        {"tool_choice": "none"},
        {"user": "u-1", "metadata": {"k": "v"}},
        {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}},
        {"logit_bias": {"5": 10}, "min_tokens": 1, "ignore_eos": True},  # tests/test_serve_sampling.py
    ):
        assert http.post("/v1/chat/completions", json={**chat, **extra}).status_code == 200, extra
    assert http.post("/v1/completions", json={**completion, "best_of": 2, "n": 2}).status_code == 200
    # top_p=0 is the nucleus of the one most likely token: greedy, whatever the temperature
    greedy = http.post("/v1/completions", json={**completion, "temperature": 0}).json()["choices"][0]["text"]
    for _ in range(2):
        r = http.post("/v1/completions", json={**completion, "temperature": 1.5, "top_p": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy


def test_a_json_body_without_a_json_content_type_is_read_as_json(server, http):
    body = json.dumps({"model": MODEL, "prompt": "<s> ? k07", "max_tokens": 1, "temperature": 0}).encode()
    expected = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert expected.status_code == 200
    for headers in (
        {},
        {"Content-Type": "application/x-www-form-urlencoded"},
        {"Content-Type": "text/plain"},
    ):
        request = http.build_request("POST", "/v1/completions", content=body, headers=headers)
        if not headers:
            request.headers.pop("Content-Type", None)
        r = http.send(request)
        assert r.status_code == 200, (headers, r.text[:300])
        assert r.json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]
    r = http.post(
        "/v1/completions",
        content=b"model=x&prompt=y",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]
    r = http.post("/v1/completions", content=b"[1, 2]", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_seeded_greedy_requests_batch_and_seeded_sampling_runs_alone(server):
    async def together(**kwargs):
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
        async with client:
            replies = await asyncio.gather(
                *(
                    client.completions.create(model=MODEL, prompt=f"<s> ? k0{i}", max_tokens=2, **kwargs)
                    for i in range(6)
                )
            )
        return [r.model_extra["lstmem"]["batch_size"] for r in replies]

    assert max(asyncio.run(together(temperature=0, seed=1234))) > 1
    assert max(asyncio.run(together(temperature=1.0, seed=7))) == 1


LM_EVAL_DOCS = [
    {"question": "<s> k07 v19 ; k12 v03 ; ? k12", "choices": ["v03", "v19"], "label": 0, "answer": "v03"},
    {"question": "<s> k01 v05 ; ? k01", "choices": ["v11", "v05"], "label": 1, "answer": "v05"},
    {"question": "<s> k02 v11 ; k30 v08 ; ? k30", "choices": ["v08", "v11"], "label": 0, "answer": "v08"},
    {"question": "<s> k21 v27 ; k09 v14 ; ? k21", "choices": ["v14", "v27"], "label": 1, "answer": "v27"},
    {"question": "<s> k16 v00 ; ? k16", "choices": ["v00", "v03"], "label": 0, "answer": "v00"},
]

LM_EVAL_TASKS = {
    "lstmem_serve_mc": """task: lstmem_serve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "lstmem_serve_gen": """task: lstmem_serve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  do_sample: false
  max_gen_toks: 3
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
}


def batches_over_one(http) -> int:
    """Batches of more than one turn the server ran so far (its Prometheus histogram)."""
    count = one = 0.0
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('lstmem_batch_size_count{kind="turn"}'):
            count = float(line.split()[-1])
        elif line.startswith('lstmem_batch_size_bucket{kind="turn",le="1.0"}'):
            one = float(line.split()[-1])
    return int(count - one)


@pytest.mark.timeout(600)
def test_lm_eval_local_completions_runs_loglikelihood_and_generation_tasks(
    server, http, loaded, tmp_path, monkeypatch
):
    """lm-eval's ``local-completions`` model against the live server, batch size 4: a multiple-choice
    task (loglikelihood: token-id prompts, echo, logprobs, max_tokens 1) and a generation task (prompt
    lists with a seed and stop strings), with token-id and text requests. Every loglikelihood equals
    the in-process read-only forward from a fresh memory, and every generation the server's own
    answer to that prompt."""
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip(
        "tenacity", reason="lm-eval's API models need its api extra: pip install 'lm-eval[api]'"
    )
    from lm_eval.tasks import TaskManager

    from lstmem_peft.utils.offline import demo_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    tokenizer_dir = tmp_path / "tokenizer"
    demo_tokenizer().save_pretrained(tokenizer_dir)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in LM_EVAL_DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, text in LM_EVAL_TASKS.items():
        (tasks / f"{name}.yaml").write_text(text.format(data=data))

    def evaluate(tokenized: bool) -> dict:
        return lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                "model": MODEL,
                "base_url": server.url + "/v1/completions",
                "tokenizer_backend": "huggingface",
                "tokenizer": str(tokenizer_dir),
                "tokenized_requests": tokenized,
                "batch_size": 4,
                "max_length": 256,
                "max_retries": 1,
                "timeout": 120,
            },
            tasks=list(LM_EVAL_TASKS),
            task_manager=TaskManager(include_path=str(tasks)),
            log_samples=True,
            random_seed=0,
            numpy_random_seed=0,
            torch_random_seed=0,
            fewshot_random_seed=0,
        )

    batched = batches_over_one(http)
    tok = loaded.tokenizer
    client = server.client()
    outcomes = []
    for tokenized in (True, False):
        results = evaluate(tokenized)
        assert 0.0 <= results["results"]["lstmem_serve_mc"]["acc,none"] <= 1.0
        assert len(results["samples"]["lstmem_serve_mc"]) == len(results["samples"]["lstmem_serve_gen"]) == 5
        assert "exact_match,none" in results["results"]["lstmem_serve_gen"]
        scores = {}
        for sample in results["samples"]["lstmem_serve_mc"]:
            doc = LM_EVAL_DOCS[sample["doc_id"]]
            context = tok(doc["question"], add_special_tokens=False)["input_ids"]
            for choice, resp in zip(doc["choices"], sample["resps"], strict=True):
                loglikelihood = float(resp[0][0])
                ids = context + tok(" " + choice, add_special_tokens=False)["input_ids"]
                expected = sum(reference_logprobs(loaded, MemoryCache(), ids)[len(context) - 1 :])
                assert loglikelihood == pytest.approx(expected, abs=1e-4), (doc, choice)
                scores[(sample["doc_id"], choice)] = loglikelihood
        generations = {}
        for sample in results["samples"]["lstmem_serve_gen"]:
            doc = LM_EVAL_DOCS[sample["doc_id"]]
            own = client.completions.create(
                model=MODEL, prompt=doc["question"], max_tokens=3, temperature=0, stop=["\n", "</s>"]
            )
            assert sample["resps"][0][0] == own.choices[0].text, doc
            generations[sample["doc_id"]] = sample["resps"][0][0]
        outcomes.append((scores, generations))
    (scores, generations), (text_scores, text_generations) = outcomes
    assert generations == text_generations and len(generations) == len(LM_EVAL_DOCS)
    assert scores.keys() == text_scores.keys()
    for key, value in scores.items():
        assert text_scores[key] == pytest.approx(value, abs=1e-4)
    assert batches_over_one(http) > batched  # lm-eval's batches of 4 ran as batches on the server


def test_a_token_id_prompt_is_planned_as_it_is_and_extends_the_text_chain(loaded):
    """``plan_completion`` takes token ids as they are (never re-tokenized) and, like a text prompt,
    writes only the part after the text the session's completions wrote before."""
    import hashlib

    from lstmem_peft.serve.planning import plan_completion
    from lstmem_peft.serve.store import Session
    from lstmem_peft.utils.chat import ChatFormat

    fmt, tok = ChatFormat(loaded.tokenizer), loaded.tokenizer
    ids = tok("<s> k07 v19 ; ? k07 v19", add_special_tokens=False)["input_ids"]
    odd = [ids[0], ids[0], *ids[1:]]  # not what the text would tokenize to: kept as it is
    fresh = Session("public", "chain")
    plan = plan_completion(fmt, fresh, odd, window=64, max_tokens=4)
    assert plan.prompt == odd and plan.new_tokens == odd
    written = "<s> k07 v19 ;"
    fresh.completion_text = {"length": len(written), "sha256": hashlib.sha256(written.encode()).hexdigest()}
    plan = plan_completion(fmt, fresh, ids, window=64, max_tokens=4)
    assert plan.prompt == ids and plan.new_tokens == ids[4:]  # "? k07 v19"
    assert plan.text_chain == tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("name", ["s\n", "../s", "/tmp/s", ".s", "a/../b", "", "x" * 129])
def test_the_store_refuses_session_ids_that_are_not_plain_names(name, tmp_path):
    """One rule for names that become files (the store's and vLLM's session directory): the whole id
    must match, so a trailing newline (which ``$`` would let through) is refused too. (A store session
    id is one plain name; a vLLM session may join up to three: tests/test_session_files.py.)"""
    from lstmem_peft.memory.cache import MemoryLayout
    from lstmem_peft.memory.sessions import SessionIdError, session_file
    from lstmem_peft.serve.store import SessionStore

    store = SessionStore(tmp_path / "store", MemoryLayout(layer_indices=(0,), num_heads=1, head_dim=1))
    with pytest.raises(SessionIdError, match="invalid session id"):
        store.get("public", name)
    with pytest.raises(SessionIdError, match="invalid session id"):
        session_file(str(tmp_path / "vllm"), name)
    assert not any((tmp_path / "store").iterdir())  # nothing reached the disk
