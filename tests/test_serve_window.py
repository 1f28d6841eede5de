"""`lstmem serve`'s context window is honest: never more positions than the backbone was trained for.

The embedded demo backbone's config allows 4,096 positions, but it was trained for 64
(``lstmem_trained_positions`` in its config.json, the window ``lstmem demo`` measured it to work in):

* the default window is the trained length, and a default ``--max-tokens`` that would leave no room
  for a prompt in it is lowered rather than refusing every chat;
* an explicit ``--context-window`` above it is refused at start (in process and through the CLI),
  naming the trained length, the request and the fix; one within it is served;
* a message longer than the window is not cut to fit: a chat message that does not fit is refused
  with 400 naming the window, and a completions prompt's head goes into memory, equal to writing it
  in process;
* where the trained length of a Hub backbone comes from (``max_position_embeddings``, a run-time
  rope stretch's ``original_max_position_embeddings``, or the recorded key).

The server runs in process (httpx's ASGI transport) or, for the CLI, on 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import socket
import subprocess
import sys

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve,test]'")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from test_serve import in_process as run_in_app  # noqa: E402  (the same in-process client)
from transformers import LlamaConfig, Qwen3Config  # noqa: E402

from lstmem_peft import MemoryCache, write_history  # noqa: E402
from lstmem_peft.serve import create_app  # noqa: E402
from lstmem_peft.serve.loading import LoadedModel  # noqa: E402
from lstmem_peft.utils.chat import ChatFormat  # noqa: E402
from lstmem_peft.utils.offline import DEMO_ASSETS  # noqa: E402
from lstmem_peft.utils.positions import trained_positions  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MODEL = "lstmem-demo"
TRAINED = 64  # what the demo backbone's config.json records


def facts_text(n: int, seed: int = 0) -> str:
    """``<s> k07 v19 ; k12 v03 ; ...``: ``n`` random demo facts, ``3 n`` tokens."""
    rng = random.Random(seed)
    return "<s> " + " ; ".join(f"k{rng.randrange(32):02d} v{rng.randrange(32):02d}" for _ in range(n))


# ---------------------------------------------------------------------- where the trained length comes from
def test_the_demo_backbone_records_the_positions_it_was_trained_for(loaded):
    """Both engines read the same facts: the demo's 64 trained positions come from its config.json
    (the library model's config and the files an engine such as vLLM reads), and they are the
    window ``lstmem demo`` measured the backbone to work in."""
    from lstmem_peft.cli.demo.recall import WINDOW

    assert (loaded.trained_positions, loaded.trained_from) == (TRAINED, "lstmem_trained_positions")
    assert loaded.max_positions == 4096  # what the architecture allows: not what it was trained for
    assert TRAINED == WINDOW
    files = LoadedModel.of_files(
        str(DEMO_ASSETS / "backbone"), str(DEMO_ASSETS / "adapter_full"), loaded.tokenizer, MODEL
    )
    assert (files.trained_positions, files.trained_from, files.max_positions) == (
        TRAINED,
        "lstmem_trained_positions",
        4096,
    )


def test_the_trained_length_of_hub_backbones_comes_from_their_config():
    """``max_position_embeddings``; a rope stretch applied at run time (yarn, as the Qwen guides add
    it) counts its ``original_max_position_embeddings``; Llama 3.1's trained long-context rope
    (``llama3``) does not; a recorded ``lstmem_trained_positions`` wins, and must be a count."""
    assert trained_positions(Qwen3Config(max_position_embeddings=40960)) == (40960, "max_position_embeddings")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    assert trained_positions(Qwen3Config(max_position_embeddings=131072, rope_parameters=yarn)) == (
        32768,
        "rope_parameters.original_max_position_embeddings",
    )
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "rope_theta": 5e5,
    }
    assert trained_positions(LlamaConfig(max_position_embeddings=131072, rope_parameters=llama3)) == (
        131072,
        "max_position_embeddings",
    )
    recorded = Qwen3Config(max_position_embeddings=4096, lstmem_trained_positions=64)
    assert trained_positions(recorded) == (64, "lstmem_trained_positions")
    assert trained_positions(None) == (None, "")
    with pytest.raises(ValueError, match="lstmem_trained_positions='64'.*positive integer"):
        trained_positions(Qwen3Config(lstmem_trained_positions="64"))


# ---------------------------------------------------------------------- the window at start
def test_the_default_window_is_the_trained_length(loaded, tmp_path, caplog):
    """No ``--context-window``: 64 tokens, not the config's 4,096, logged (INFO: the right window,
    nothing to act on) with why; the default ``max_tokens`` is at most half the window (32), without a
    warning, and a chat that sets none is answered instead of refused. A given ``max_tokens`` that
    leaves no room for a prompt becomes half the window, with a warning."""
    with caplog.at_level(logging.INFO, logger="lstmem_peft.serve.app"):
        app = create_app(loaded, str(tmp_path / "store"))
    assert app.state.scheduler.window == TRAINED
    assert app.state.serving_chat.window == app.state.serving_completions.window == TRAINED
    assert app.state.serving_chat.default_max_tokens == TRAINED // 2
    logged = caplog.text
    assert "context window 64 tokens" in logged and "lstmem_trained_positions" in logged and "4096" in logged
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lstmem_peft.serve.app"):
        given = create_app(loaded, str(tmp_path / "store"), default_max_tokens=64)
    assert given.state.serving_chat.default_max_tokens == TRAINED // 2
    assert "--max-tokens 64 leaves no room" in caplog.text

    async def ask(client):
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "<s> k07 v19 ; k12 v03"}],
            "temperature": 0,
        }
        return await client.post("/v1/chat/completions", json=chat)

    reply = run_in_app(app, ask)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] <= TRAINED // 2


@pytest.mark.parametrize("requested", [4096, TRAINED + 1])
def test_an_explicit_window_over_the_trained_length_is_refused(loaded, tmp_path, requested):
    """Refused, not clamped: the message names the request, the trained length, where it was
    read, and the fix."""
    with pytest.raises(ValueError) as refused:
        create_app(loaded, str(tmp_path / "store"), context_window=requested)
    message = str(refused.value)
    assert f"--context-window {requested} is over the model's position limit {TRAINED}" in message
    assert f"trained for {TRAINED} positions (its config's lstmem_trained_positions)" in message
    assert f"Pass --context-window {TRAINED} or less, or leave it out (default {TRAINED})" in message
    assert "max_model_len" not in message  # the engine's limit (4,096) is not what refuses it


def test_the_engine_limit_binds_when_it_is_the_smaller(loaded, tmp_path):
    """With ``--engine vllm`` the position limit is also the engine's ``max_model_len - 1``
    (``max_positions``): when that is below the trained length, it sets the default and its fix
    is named (the same rule for both engines; vLLM itself runs in tests/test_vllm.py)."""
    engine_bound = dataclasses.replace(loaded, max_positions=31)
    assert create_app(engine_bound, str(tmp_path / "a")).state.scheduler.window == 31
    with pytest.raises(
        ValueError, match=r"--context-window 48 is over the model's position limit 31: .*max_model_len"
    ):
        create_app(engine_bound, str(tmp_path / "b"), context_window=48)


def test_the_cli_refuses_a_window_over_the_trained_length_at_start(tmp_path):
    """``lstmem serve --context-window 4096`` on the demo exits with one line naming the trained
    length and the fix, before it listens on its port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "lstmem_cli", "serve", "--store", str(tmp_path / "store")]
    cmd += ["--port", str(port), "--threads", "1", "--context-window", "4096"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode != 0
    assert "--context-window 4096 is over the model's position limit 64" in done.stderr
    assert "Pass --context-window 64 or less" in done.stderr
    assert "http://127.0.0.1" not in done.stdout  # it never started serving


def test_a_window_within_the_trained_length_is_served(loaded, tmp_path):
    """``--context-window 32`` (and 64, the trained length itself) is accepted; a chat turn is
    answered, its prompt within the window."""
    assert (
        create_app(loaded, str(tmp_path / "full"), context_window=TRAINED).state.scheduler.window == TRAINED
    )
    app = create_app(loaded, str(tmp_path / "store"), context_window=32, default_max_tokens=4)
    assert app.state.scheduler.window == 32

    async def ask(client):
        chat = {"model": MODEL, "messages": [{"role": "user", "content": facts_text(3)}], "temperature": 0}
        return await client.post("/v1/chat/completions", json=chat)

    reply = run_in_app(app, ask)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] <= 32 - 4


# ---------------------------------------------------------------------- input over the window
def test_a_chat_message_over_the_window_is_refused_naming_the_window(loaded, tmp_path):
    """A 3,000-token message on the default (64-token) window: 400 ``context_length_exceeded`` that
    names the window and how to send long text, and the session's memory is unchanged."""
    app = create_app(loaded, str(tmp_path / "store"))
    long_message = "<s> " + "k01 " * 2999
    assert len(ChatFormat(loaded.tokenizer).message("user", long_message)) >= 3000

    async def scenario(client):
        await client.post("/v1/memory/long/write", json={"text": facts_text(4)})
        before = (await client.get("/v1/memory/long")).json()
        chat = {"model": MODEL, "messages": [{"role": "user", "content": long_message}], "max_tokens": 2}
        reply = await client.post("/v1/chat/completions", json=chat, headers={"X-Session-Id": "long"})
        return before, reply, (await client.get("/v1/memory/long")).json()

    before, reply, after = run_in_app(app, scenario)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert (
        "(window 64 - max_tokens 2" in error["message"] and "/v1/memory/{session}/write" in error["message"]
    )
    assert (after["commit"], after["tokens_written"]) == (before["commit"], before["tokens_written"])


def test_a_completions_prompt_over_the_window_goes_into_memory_not_away(loaded, tmp_path):
    """A 3,000-token completions prompt on the 64-token window: the context holds its last
    ``64 - max_tokens`` tokens, everything before them is written into the session's memory first
    and the rest after answering, so the session holds all 3,000; answer and memory equal the same
    turn computed in process (memory-only history, then the tail in context)."""
    max_tokens = 2
    app = create_app(loaded, str(tmp_path / "store"))
    prompt = facts_text(1000)
    ids = ChatFormat(loaded.tokenizer).encode_text(prompt)
    assert len(ids) == 3000
    budget = TRAINED - max_tokens

    async def scenario(client):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        reply = await client.post("/v1/completions", json=body, headers={"X-Session-Id": "tail"})
        return reply, (await client.get("/v1/memory/tail/export")).content

    reply, exported = run_in_app(app, scenario)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["prompt_tokens"] == budget
    assert body["lstmem"]["memory_tokens_written"] == body["lstmem"]["session_tokens_written"] == 3000

    tok, model = loaded.tokenizer, loaded.model
    memory = MemoryCache()
    context = torch.tensor([ids[-budget:]])
    with torch.no_grad():
        write_history(
            model, torch.tensor([ids[:-budget]]), memory, block_size=loaded.block_size, progress=False
        )
        out = model.generate(
            input_ids=context,
            attention_mask=torch.ones_like(context),
            memory_cache=memory,
            memory_write=False,
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
        write_history(model, context, memory, block_size=loaded.block_size, progress=False)
    answer = out[0, context.shape[1] :].tolist()
    answer = answer[: answer.index(tok.eos_token_id)] if tok.eos_token_id in answer else answer
    assert body["choices"][0]["text"].strip() == tok.decode(answer, skip_special_tokens=True).strip()
    path = tmp_path / "tail.safetensors"
    path.write_bytes(exported)
    served = MemoryCache.load(path)
    assert torch.equal(served.tokens_written, memory.tokens_written)
    for a, b in zip(served.layers, memory.layers, strict=True):
        assert torch.allclose(a.cell, b.cell, atol=1e-5, rtol=0)
        assert torch.allclose(a.hidden, b.hidden, atol=1e-5, rtol=0)
