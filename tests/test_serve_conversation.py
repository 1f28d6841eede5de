"""Recall that survives a conversation through ``lstmem serve`` (issue 36).

A chat user writes the demo's 8 facts as the first turn and asks about them in 4 later turns, each
turn written into memory as the server writes it (the default policy, ``messages``: the questions
too; and ``messages_and_answer``). Two kinds of client: one that sends only its newest message, one
that re-sends the whole conversation into a window too short for it. Through the server, on the
shipped demo adapter, recall at every question position must be at least 0.75 and none more than
0.15 below the first (measured here on 128 sessions per client; ``lstmem demo`` reports the same
on 256).

The library's measurement (``lstmem_peft.cli.demo.conversation.evaluate_conversation``, what
``lstmem demo`` prints) runs the server's turn rule through
:class:`~lstmem_peft.training.data.ServedConversation`, which also lays out the training episodes.
It is held to the server: session by session, the same answers and the same memory, bit for bit.

The server runs in process (httpx's ASGI transport) on the embedded demo model.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve,test]'")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from test_serve import in_process  # noqa: E402  (the in-process client)

from lstmem_peft import MemoryCache, write_history  # noqa: E402
from lstmem_peft.cli.demo.conversation import (  # noqa: E402
    CLIENT_WINDOWS,
    MAX_TOKENS,
    evaluate_conversation,
)
from lstmem_peft.serve import create_app  # noqa: E402
from lstmem_peft.training.data import ServedConversation, synthetic_conversation_episodes  # noqa: E402

pytestmark = pytest.mark.timeout(600)

MODEL = "lstmem-demo"
SEED = 2718  # conversations of their own (neither the demo's measurement nor training)


def converse(app, episodes, client: str, write: str | None, concurrent: bool = True) -> list[list[str]]:
    """Each episode as one session through the server: the facts turn, then each question; the
    client ``newest`` sends its newest message, ``resend`` the whole conversation. Returns each
    session's answers, the facts turn's first."""
    import asyncio

    async def session(client_http, n, episode):
        sid = {"X-Session-Id": f"c{n}"}
        held, answers = [], []
        for turn in episode["turns"]:
            held.append({"role": "user", "content": turn["prompt"]})
            body = {
                "model": MODEL,
                "messages": held if client == "resend" else held[-1:],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            }
            if write is not None:
                body["lstmem_write"] = write
            reply = await client_http.post("/v1/chat/completions", json=body, headers=sid)
            assert reply.status_code == 200, reply.text
            text = reply.json()["choices"][0]["message"]["content"]
            held.append({"role": "assistant", "content": text})
            answers.append(text)
        return answers

    async def scenario(client_http):
        if concurrent:  # sessions batch together in the scheduler, as many users' would
            return await asyncio.gather(*(session(client_http, n, e) for n, e in enumerate(episodes)))
        return [await session(client_http, n, e) for n, e in enumerate(episodes)]

    return in_process(app, scenario)


def recall_by_position(answers: list[list[str]], episodes) -> list[float]:
    """Per question position: the share of sessions whose answer's first word is the asked value."""
    gold = [[t["answer"].strip() for t in e["turns"][1:]] for e in episodes]
    return [
        sum(a[1 + q].split()[:1] == [g[q]] for a, g in zip(answers, gold, strict=True)) / len(answers)
        for q in range(len(gold[0]))
    ]


@pytest.mark.parametrize("write", [None, "messages_and_answer"], ids=["default", "messages_and_answer"])
@pytest.mark.parametrize("client", ["newest", "resend"])
def test_recall_survives_a_conversation_through_the_server(loaded, tmp_path, client, write):
    """8 facts, then 4 questions in later turns, every turn written as the policy says: recall at
    every question position >= 0.75, none more than 0.15 below the first (the shipped adapter,
    128 sessions, greedy: here the lowest position is 0.81, so one answer that flips on another
    CPU's arithmetic cannot decide it; 64 sessions left one answer of margin). Before the adapters
    were trained on conversations this was about 0.84, 0.23, 0.05, 0.03: each written question
    erased the facts."""
    episodes = synthetic_conversation_episodes(128, 8, 4, seed=SEED)
    app = create_app(loaded, str(tmp_path / "store"), context_window=CLIENT_WINDOWS[client])
    recall = recall_by_position(converse(app, episodes, client, write), episodes)
    assert min(recall) >= 0.75, recall
    assert recall[0] - min(recall) <= 0.15, recall


@pytest.mark.parametrize("client", ["newest", "resend"])
@pytest.mark.parametrize("write", ["messages", "messages_and_answer"])
def test_the_library_measurement_is_the_servers_turn_rule(loaded, tmp_path, client, write):
    """Session by session, run alone on both sides: ``evaluate_conversation`` gives the server's
    answers, and the writes :class:`ServedConversation` names, written by the library from zero
    memory, are the session's stored memory bit for bit."""
    episodes = synthetic_conversation_episodes(4, 8, 4, seed=SEED + 1)
    window = CLIENT_WINDOWS[client]
    app = create_app(loaded, str(tmp_path / "store"), context_window=window)
    served = converse(app, episodes, client, write, concurrent=False)
    measured = evaluate_conversation(
        loaded.model, client=client, write=write, num_sessions=4, seed=SEED + 1, batch_size=1
    )
    assert measured["answers"] == [answers[1:] for answers in served]
    for n, episode in enumerate(episodes):
        conversation = ServedConversation(loaded.tokenizer, client, write, window, MAX_TOKENS)
        memory = MemoryCache()
        with torch.no_grad():
            for turn, answer in zip(episode["turns"], served[n], strict=True):
                before, _ = conversation.ask(turn["prompt"])
                after = conversation.answered(answer)
                for tokens in (before, after):  # two write calls, as the server makes them
                    if tokens:
                        write_history(loaded.model, torch.tensor([tokens]), memory, progress=False)
        stored = app.state.scheduler.store.get("public", f"c{n}")
        assert torch.equal(memory.tokens_written, stored.memory.tokens_written.cpu())
        for a, b in zip(memory.layers, stored.memory.layers, strict=True):
            assert torch.equal(a.cell, b.cell.cpu()) and torch.equal(a.hidden, b.hidden.cpu())
