"""Recall by question position in a conversation through ``lstmem serve`` (issue 45 item 3).

A user states a fact in one turn of a session and asks about it ``k`` turns later, with turns of
English chatter in between; the same conversation without the fact turn is the floor (what the
model answers from the chatter alone). Everything goes through a running server process over HTTP,
as a client would send it, so what is measured is the server's turn rule (what goes into the prompt,
what only into memory, and when it is written: docs/serving.md, :mod:`lstmem_peft.serve.planning`)
together with the adapter.

Two clients, one per endpoint:

* ``"completions"`` (``POST /v1/completions``, the text layout the English adapters were trained on):
  the fact as one request, each chatter line as one request, then ``"Question: ...\\nAnswer:"``, each
  prompt starting with the tokenizer's BOS text (``text_prefix``), as training wrote notes and read
  questions. A prompt that does not extend the session's text is new as a whole, so every request
  is its own prompt and the earlier ones are in memory only: from ``k = 1`` on, the fact is **not in
  the prompt**, only in memory.
* ``"chat"`` (``POST /v1/chat/completions``, the chat template, on which these adapters are
  untrained): a client that re-sends the whole conversation, its answers included, each turn. The
  prompt is the latest messages that fit the context window; the fact turn stays in the prompt
  until enough chatter pushes it out, and it is in memory from the turn after it was sent.

Each question is asked in a fork of the session (``POST /v1/memory/{session}/fork``) taken just
before it, with the default write policy, so the session itself goes on without the question and
one session per episode serves every ``k``. Per question the record says where the fact was:
``fact_in_prompt`` (the fact's own turn was in the prompt), ``value_in_prompt`` (any message of the
prompt states the value: in chat the assistant may have repeated it), computed with the server's own
rule (:meth:`~lstmem_peft.utils.chat.ChatFormat.fit`) and checked against the prompt's token count the
server reports (``placement_checked``).

Scores: :func:`~.english_recall.recall_hit` (the normalised answer starts with the value),
:func:`~.english_recall.leading_digit` (numbers only) and, looser, :func:`mentions` (the value
appears anywhere in the answer: a chat answer may say the number after a few words).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .english_recall import leading_digit, normalise, recall_hit
from .row_report import bootstrap_interval

ENDPOINTS = ("completions", "chat")
CONDITIONS = ("fact", "floor")
POSITIONS = (1, 2, 4, 8)
#: What each endpoint's client sends, for tables and records.
ENDPOINT_TITLES = {
    "completions": "POST /v1/completions, one request per turn (the text layout the adapter was trained on)",
    "chat": "POST /v1/chat/completions, the whole conversation re-sent each turn (the chat template: untrained)",
}


def mentions(answer: str, gold: str) -> bool:
    """Whether the :func:`normalise`\\ d value appears in the normalised answer as whole words."""
    a, g = normalise(answer), normalise(gold)
    return bool(g) and f" {g} " in f" {a} "


def position_episodes(
    num_episodes: int, seed: int, relations: Sequence[str] | None, max_position: int = max(POSITIONS)
) -> list[dict[str, Any]]:
    """Held-out English episodes (:func:`~lstmem_peft.training.english.english_episodes`,
    ``split="heldout"``, one fact, notes) cut into turns: ``{"fact", "chatter", "prompt", "question",
    "gold", "relation", "subject"}`` with ``max_position - 1`` chatter lines, in the episode's order."""
    from lstmem_peft.training.english import english_episodes

    out = []
    raw = english_episodes(
        num_episodes,
        "heldout",
        seed=seed,
        num_facts=1,
        chatter=float(max_position - 1),
        same_relation=1.0,
        style="notes",
        relations=list(relations) if relations else None,
    )
    for episode in raw:
        lines = episode["history"].split("\n")
        facts = [line for line in lines if mentions(line, episode["gold"])]
        if len(facts) != 1 or len(lines) != max_position:
            raise ValueError(f"expected one fact line among {max_position} lines: {lines!r}")
        out.append(
            {
                "fact": facts[0],
                "chatter": [line for line in lines if line != facts[0]],
                "prompt": episode["prompt"],
                "question": episode["question"],
                "gold": episode["gold"],
                "relation": episode["relation"],
                "subject": episode["subject"],
            }
        )
    return out


# ---------------------------------------------------------------------- the server and its client
def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``lstmem serve`` in a child process on ``127.0.0.1`` and a free port, its output in ``log``;
    a context manager that waits for ``/health`` (at most ``startup_s``) and stops it on exit."""

    def __init__(
        self, args: Sequence[str], store: str | os.PathLike, log: str | os.PathLike, startup_s: float = 300
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log, self.startup_s = Path(log), startup_s
        self.command = [sys.executable, "-m", "lstmem_cli", "serve", "--host", "127.0.0.1"]
        self.command += ["--port", str(self.port), "--store", str(store), *args]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(self.command, stdout=fh, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lstmem serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"lstmem serve did not answer /health in {self.startup_s:.0f} s:\n{self.tail()}")

    def __exit__(self, *exc) -> None:
        self.stop()

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


class Client:
    """JSON over HTTP to a server at ``url`` (the standard library only), each call bounded by
    ``timeout`` seconds; a non-2xx answer raises ``RuntimeError`` with its body."""

    def __init__(self, url: str, timeout: float = 300):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.model = self.get("/v1/models")["data"][0]["id"]

    def get(self, path: str) -> dict:
        return self._send(urllib.request.Request(self.url + path))

    def post(self, path: str, body: dict, session: str | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if session is not None:
            headers["X-Session-Id"] = session
        data = json.dumps(body).encode()
        return self._send(urllib.request.Request(self.url + path, data=data, headers=headers, method="POST"))

    def _send(self, request: urllib.request.Request) -> dict:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as err:
            raise RuntimeError(
                f"{request.get_method()} {request.full_url}: {err.code} {err.read()[:2000]!r}"
            ) from err

    def turn(
        self, endpoint: str, session: str, content: str | list[dict], max_tokens: int
    ) -> tuple[str, dict]:
        """One greedy turn: the answer's text and the whole response."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": 0}
        if endpoint == "chat":
            reply = self.post("/v1/chat/completions", {**body, "messages": content}, session)
            return reply["choices"][0]["message"]["content"] or "", reply
        reply = self.post("/v1/completions", {**body, "prompt": content}, session)
        return reply["choices"][0]["text"], reply

    def fork(self, session: str, version: int, target: str) -> dict:
        return self.post(f"/v1/memory/{session}/fork", {"version": version, "to": target})


# ---------------------------------------------------------------------- one session
@dataclass
class Settings:
    """How the conversations are sent.

    Attributes:
        positions: the question positions ``k`` (turns after the fact turn; ``k - 1`` chatter turns between).
        window: the server's ``--context-window`` (where the fact is, for chat).
        chatter_tokens: ``max_tokens`` of the fact and chatter turns (completions: their answers are
            never written, so 1 will do; chat: the answers the client re-sends).
        question_tokens: ``max_tokens`` of the question.
        text_prefix: what each completions prompt starts with (the tokenizer's BOS text, as training).
        tag: the start of every session id.
        fmt: the served tokenizer's :class:`~lstmem_peft.utils.chat.ChatFormat`, to say where the fact
            is (``None``: not said).
    """

    positions: Sequence[int] = POSITIONS
    window: int = 256
    chatter_tokens: dict | None = None
    question_tokens: int = 8
    text_prefix: str = ""
    tag: str = "pos"
    fmt: Any = None

    def chatter_max_tokens(self, endpoint: str) -> int:
        return (self.chatter_tokens or {"completions": 1, "chat": 8})[endpoint]


def _placement(settings: Settings, endpoint: str, content, condition: str, gold: str, reported: int) -> dict:
    """Where the fact and its value are in the question's prompt, by the server's rule, and whether
    the prompt's token count the server reported agrees."""
    fmt = settings.fmt
    if fmt is None:
        return {"fact_in_prompt": None, "value_in_prompt": None, "placement_checked": None}
    if endpoint == "completions":  # one prompt per request: the question alone
        expected = len(fmt.encode_text(content)[-(settings.window - settings.question_tokens) :])
        return {
            "fact_in_prompt": False,
            "value_in_prompt": mentions(content, gold),
            "placement_checked": expected == reported,
        }
    laid = fmt.fit(content, settings.window - settings.question_tokens)
    first, expected = laid.first, len(laid.tokens)
    return {
        "fact_in_prompt": condition == "fact" and first == 0,
        "value_in_prompt": any(mentions(m["content"], gold) for m in content[first:]),
        "placement_checked": expected == reported,
        "messages_in_prompt": len(content) - first,
    }


def converse(
    client: Client, episode: dict, index: int, endpoint: str, condition: str, settings: Settings
) -> list[dict]:
    """One session: the fact turn (``condition == "fact"``), then chatter turns; before the turn at
    each position ``k`` a fork of the session is asked the question. One record per position."""
    if endpoint not in ENDPOINTS or condition not in CONDITIONS:
        raise ValueError(
            f"endpoint in {ENDPOINTS} and condition in {CONDITIONS}, got {endpoint!r}, {condition!r}"
        )
    session = f"{settings.tag}-{endpoint}-{condition}-{index}"
    turns = ([episode["fact"]] if condition == "fact" else []) + list(episode["chatter"])
    offset = 1 if condition == "fact" else 0
    held: list[dict] = []  # the chat client's conversation, its answers included
    version, sent, echo, records = None, 0, None, []

    def content_for(text: str):
        if endpoint == "chat":
            return [*held, {"role": "user", "content": text}]
        return settings.text_prefix + text

    for k in sorted(settings.positions):
        if offset + k - 1 > len(turns):
            raise ValueError(
                f"position {k} needs {k - 1} chatter turns; the episode has {len(episode['chatter'])}"
            )
        while sent < offset + k - 1:
            content = content_for(turns[sent])
            answer, reply = client.turn(endpoint, session, content, settings.chatter_max_tokens(endpoint))
            if endpoint == "chat":
                held = [*content, {"role": "assistant", "content": answer}]
            if sent == 0 and condition == "fact":
                echo = answer
            version, sent = reply["lstmem"]["version"], sent + 1
        asked = f"{session}-k{k}"
        if version is not None:
            client.fork(session, version, asked)
        content = content_for(episode["question"] if endpoint == "chat" else episode["prompt"])
        start = time.perf_counter()
        answer, reply = client.turn(endpoint, asked, content, settings.question_tokens)
        gold = episode["gold"]
        records.append(
            {
                "episode": index,
                "endpoint": endpoint,
                "condition": condition,
                "position": k,
                "question": episode["question"],
                "gold": gold,
                "relation": episode["relation"],
                "answer": answer.strip(),
                "exact": recall_hit(answer, gold),
                "leading_digit": leading_digit(answer.strip(), gold) if gold[:1].isdigit() else None,
                "mentions": mentions(answer, gold),
                "fact_turn_answer": echo,
                "prompt_tokens": reply["usage"]["prompt_tokens"],
                "memory_tokens": reply["lstmem"]["session_tokens_written"]
                - reply["lstmem"]["memory_tokens_written"],
                "seconds": round(time.perf_counter() - start, 3),
                **_placement(settings, endpoint, content, condition, gold, reply["usage"]["prompt_tokens"]),
            }
        )
    return records


def measure(
    client: Client,
    episodes: Sequence[dict],
    settings: Settings,
    endpoints: Sequence[str] = ENDPOINTS,
    concurrency: int = 1,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """Every episode as a ``fact`` and a ``floor`` session on each endpoint (``concurrency``
    sessions at a time: the server batches requests of different sessions). Records in a fixed order:
    endpoint, condition, episode, position."""
    jobs = [(e, c, i) for e in endpoints for c in CONDITIONS for i in range(len(episodes))]
    start, done = time.perf_counter(), []

    def run(job):
        endpoint, condition, i = job
        records = converse(client, episodes[i], i, endpoint, condition, settings)
        done.append(job)
        if progress is not None:
            seconds = time.perf_counter() - start
            progress(
                f"{len(done)}/{len(jobs)} sessions ({endpoint}, {condition}, episode {i}), {seconds:.0f} s"
            )
        return records

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        results = list(pool.map(run, jobs))
    return [r for records in results for r in records]


# ---------------------------------------------------------------------- the table
def _rate(values: list[float], seed: int) -> dict:
    return {
        "n": len(values),
        "hits": int(sum(values)),
        "rate": sum(values) / len(values) if values else None,
        "ci": bootstrap_interval(values, seed=seed) if values else [],
    }


def summarise(records: Sequence[dict], seed: int = 0) -> list[dict]:
    """A row per endpoint and position: per condition ``{"exact", "leading_digit", "mentions"}`` as
    ``{"n", "hits", "rate", "ci"}`` (95% bootstrap), the paired fact - floor difference of each score,
    and where the fact was (``fact_in_prompt``, ``value_in_prompt``: how many fact sessions)."""
    rows = []
    keys = sorted(
        {(r["endpoint"], r["position"]) for r in records}, key=lambda x: (ENDPOINTS.index(x[0]), x[1])
    )
    for endpoint, k in keys:
        cell = [r for r in records if r["endpoint"] == endpoint and r["position"] == k]
        by = {c: {r["episode"]: r for r in cell if r["condition"] == c} for c in CONDITIONS}
        row: dict[str, Any] = {"endpoint": endpoint, "position": k, "chatter_turns": k - 1, "conditions": {}}
        for condition in CONDITIONS:
            rs = list(by[condition].values())
            row["conditions"][condition] = {
                score: _rate([float(r[score]) for r in rs if r[score] is not None], seed)
                for score in ("exact", "leading_digit", "mentions")
            }
        paired = sorted(set(by["fact"]) & set(by["floor"]))
        row["difference"] = {}
        for score in ("exact", "leading_digit", "mentions"):
            diffs = [
                float(by["fact"][i][score]) - float(by["floor"][i][score])
                for i in paired
                if by["fact"][i][score] is not None and by["floor"][i][score] is not None
            ]
            row["difference"][score] = {
                "n": len(diffs),
                "mean": sum(diffs) / len(diffs) if diffs else None,
                "ci": bootstrap_interval(diffs, seed=seed) if diffs else [],
            }
        facts = list(by["fact"].values())
        for key in ("fact_in_prompt", "value_in_prompt", "placement_checked"):
            known = [r[key] for r in facts if r.get(key) is not None]
            row[key] = {"n": len(known), "count": int(sum(known))} if known else None
        rows.append(row)
    return rows


def where(row: dict) -> str:
    """Where the fact was at this row's questions, in words."""
    inside = row.get("fact_in_prompt")
    if inside is None:
        return "not computed"
    n, c = inside["n"], inside["count"]
    text = (
        "memory only"
        if c == 0
        else "prompt and memory"
        if c == n
        else f"prompt and memory in {c}/{n}, else memory only"
    )
    value = row.get("value_in_prompt")
    if c == 0 and value and value["count"]:
        text += f" (an answer repeating the value in the prompt in {value['count']}/{value['n']})"
    return text


def markdown_table(rows: Sequence[dict]) -> str:
    """The rows as Markdown: hits / n (rate) with the fact and without it (floor), per score."""

    def cell(c: dict) -> str:
        return f"{c['hits']}/{c['n']} ({c['rate']:.2f})" if c["n"] else "-"

    head = (
        "| endpoint | k | chatter turns | where the fact is | exact: fact | exact: floor | leading digit: fact "
        "| leading digit: floor | value anywhere: fact | value anywhere: floor |"
    )
    lines = [head, "|" + "---|" * 10]
    for row in rows:
        fact, floor = row["conditions"]["fact"], row["conditions"]["floor"]
        scores = [cell(x[s]) for s in ("exact", "leading_digit", "mentions") for x in (fact, floor)]
        lines.append(
            f"| {row['endpoint']} | {row['position']} | {row['chatter_turns']} | {where(row)} | "
            + " | ".join(scores)
            + " |"
        )
    return "\n".join(lines)
