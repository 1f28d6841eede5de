"""Turns cut while they really are in flight leave the session as it was.

A test of a cut turn proves nothing if the turn had already finished when it was cut: the demo
adapters end most answers within three tokens, and a short write can commit before a kill lands.
So each test first makes sure its turn is running, and asserts it:

* a client that disconnects mid-stream: the served model is the demo's with no end-of-sequence
  token (its answers run to ``max_tokens``), and the client leaves after two tokens of a
  3,000-token answer, having seen no ``finish_reason``;
* a server killed with SIGKILL mid-write: the write is timed first on another session (it must take
  several times the delay before the kill), and the killed request must have got no response.

Servers listen on 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve,test]'")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

import torch  # noqa: E402
from test_serve import HISTORY, MODEL, TIMEOUT, Server, free_port, load_bytes  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SID = {"X-Session-Id": "cut"}


@pytest.fixture(scope="module")
def endless():
    """The demo model, answering until ``max_tokens``: no end-of-sequence ids, the end-of-sequence
    token never generated (the demo adapters end an answer with it and then repeat it), and a window
    of 4,096 positions (past the 64 it was trained for: the answers are noise, which is all a cut
    stream needs)."""
    from lstmem_peft.serve.loading import load_model

    loaded = load_model(device="cpu")
    config = loaded.model.get_base_model().generation_config
    config.suppress_tokens = [loaded.tokenizer.eos_token_id]
    return dataclasses.replace(loaded, eos_ids=frozenset(), trained_positions=None)


@contextlib.contextmanager
def serving(app):
    """``app`` under uvicorn in a thread on 127.0.0.1; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise TimeoutError("uvicorn did not start in 60 s")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def stream_until_tokens(http, body: dict, tokens: int) -> list[dict]:
    """Open a streamed chat turn and leave once ``tokens`` content deltas came; the chunks seen."""
    seen, content = [], 0
    with http.stream("POST", "/v1/chat/completions", json=body, headers=SID) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            seen.append(chunk)
            content += sum(bool(c["delta"].get("content")) for c in chunk["choices"])
            if content >= tokens:
                break  # leaving the block closes the connection mid-stream
    return seen


def test_a_client_that_leaves_mid_stream_leaves_the_session_as_it_was(endless, tmp_path):
    from lstmem_peft.serve import create_app

    app = create_app(endless, str(tmp_path / "store"), context_window=4096)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "? k07"}],
        "max_tokens": 3000,
        "temperature": 0,
        "stream": True,
    }
    with serving(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        http.post("/v1/memory/cut/write", json={"text": HISTORY}).raise_for_status()
        before = http.get("/v1/memory/cut").json()
        memory = http.get("/v1/memory/cut/export").content
        seen = stream_until_tokens(http, body, tokens=2)
        # in flight when the client left: tokens came, and no choice had finished
        assert seen and all(c["finish_reason"] is None for chunk in seen for c in chunk["choices"])
        # the next request of the session runs after the cut turn: it sees the memory as it was
        http.post("/v1/memory/cut/write", json={"text": "k05 v06"}).raise_for_status()
        after = http.get("/v1/memory/cut").json()
        assert after["commit"] == before["commit"] + 1
        assert [t["kind"] for t in after["turns"]] == ["write", "write"]
        assert after["tokens_written"] == before["tokens_written"] + 2
        # and the second write started from the memory as it was: the same write on a copy of it
        http.put("/v1/memory/replay/import", content=memory).raise_for_status()
        http.post("/v1/memory/replay/write", json={"text": "k05 v06"}).raise_for_status()
        got = load_bytes(http.get("/v1/memory/cut/export").content, tmp_path, "cut.safetensors")
        want = load_bytes(http.get("/v1/memory/replay/export").content, tmp_path, "replay.safetensors")
        assert torch.equal(got.tokens_written, want.tokens_written)
        for a, b in zip(got.layers, want.layers, strict=True):
            assert torch.equal(a.cell, b.cell) and torch.equal(a.hidden, b.hidden)


def facts(n: int) -> str:
    return " ".join(f"k{i % 32:02d} v{(7 * i) % 32:02d} ;" for i in range(n))


def test_a_server_killed_mid_write_restarts_with_the_session_as_it_was(tmp_path):
    srv = Server(tmp_path / "store", tmp_path / "server.log").start()
    try:
        with srv.http() as http:
            http.post("/v1/memory/cut/write", json={"text": HISTORY}).raise_for_status()
            before = http.get("/v1/memory/cut/export").content
            text, delay = facts(4000), 0.5
            # how long the write takes here, on another session: it must outlast the delay by far
            start = time.monotonic()
            http.post("/v1/memory/timing/write", json={"text": text}).raise_for_status()
            duration = time.monotonic() - start
            if duration < 6 * delay:
                text = facts(int(4000 * 6 * delay / duration) + 1)  # long enough on this machine
            outcome = {}

            def write() -> None:
                try:
                    outcome["response"] = httpx.post(
                        srv.url + "/v1/memory/cut/write", json={"text": text}, timeout=TIMEOUT
                    )
                except httpx.HTTPError as err:
                    outcome["error"] = err

            thread = threading.Thread(target=write)
            thread.start()
            time.sleep(delay)
            srv.kill9()
            thread.join(timeout=TIMEOUT)
            # in flight when killed: the server never answered the write
            assert "response" not in outcome and isinstance(outcome.get("error"), httpx.HTTPError)
        srv.start()
        with srv.http() as http:
            assert http.get("/v1/memory/cut/export").content == before
            info = http.get("/v1/memory/cut").json()
            assert [t["kind"] for t in info["turns"]] == ["write"]
    finally:
        srv.stop()
