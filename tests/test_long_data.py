"""`lstmem data long` (lstmem_peft.training.long_data) against a fake OpenAI-compatible endpoint.

The fake (a threaded http.server on 127.0.0.1) answers chat completions deterministically from the
request's ``X-Request-Id`` (candidate and step): a chunk request gets ~160 characters of prose with
one fact ("The code of ledger <id> is <word> <word>."), a question request gets a question about
the fact in the chunk it was shown. It can misbehave per request (timeouts, 5xx, 429, malformed
bodies, truncated replies, non-JSON questions, 404, or any reply a function makes of the good one),
die for good, serve only some model names, write content the rules must reject, or press Ctrl-C in
the client's process. The tokenizers are offline: one id per character
or one per word.
"""

from __future__ import annotations

import _thread
import argparse
import hashlib
import json
import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from huggingface_hub import DatasetCard, HfApi
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lstmem_cli import data_long as cli_options
from lstmem_peft.training import long_data as L
from lstmem_peft.training.data import load_episodes
from lstmem_peft.training.long_data import rules as R
from lstmem_peft.utils.errors import DataFormatError, MissingDataError, UsageError
from lstmem_peft.utils.extras import install_command
from lstmem_peft.utils.offline import char_tokenizer

pytestmark = pytest.mark.timeout(60)
WORDS = (
    "amber",
    "birch",
    "cedar",
    "delta",
    "ember",
    "fjord",
    "grove",
    "heron",
    "iris",
    "jade",
    "kelp",
    "lotus",
)


def _pick(key: str, n: int) -> list[str]:
    digest = hashlib.sha256(key.encode()).digest()
    return [WORDS[b % len(WORDS)] for b in digest[:n]]


class FakeLLM:
    """The fake endpoint. ``faults[(cid, step)]``: fault kinds for its successive attempts (a kind,
    or a function of the good reply's JSON returning the JSON or bytes to send, or ``(status, body,
    content type)``); ``dead_from``: candidate index from which every request gets 503; ``models``:
    the model names served (None: any; others get 404); ``bad[cid]``: content the rules reject;
    ``ctrl_c_at``: a ``(cid, step)`` whose reply first presses Ctrl-C in the client."""

    def __init__(self):
        self.faults: dict[tuple[str, str], list] = {}
        self.models: set[str] | None = None
        self.bad: dict[str, str] = {}
        self.dead_from: int | None = None
        self.ctrl_c_at: tuple[str, str] | None = None
        self.log: list[tuple[str, str, int, str]] = []  # (cid, step, attempt, outcome)
        self.auth: set[str] = set()
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def served(self) -> list[tuple[str, str]]:
        """``(cid, step)`` of every request answered with a usable reply, in order."""
        return [(c, s) for c, s, _, outcome in self.log if outcome == "ok"]

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                cid, step, attempt = self.headers["X-Request-Id"].rsplit("/", 2)
                with fake.lock:
                    fake.auth.add(self.headers.get("Authorization", ""))
                    queue = fake.faults.get((cid, step), [])
                    fault = queue.pop(0) if queue else None
                    if fake.dead_from is not None and int(cid.rpartition("c")[2]) >= fake.dead_from:
                        fault = "dead"
                    fake.log.append((cid, step, int(attempt), fault or "ok"))
                    if fake.ctrl_c_at == (cid, step):
                        fake.ctrl_c_at = None
                        _thread.interrupt_main()  # Ctrl-C in the process running the build
                try:
                    self._reply(fault, body, cid, step)
                except OSError:  # the client gave up (a timeout fault)
                    pass

            def _reply(self, fault, body, cid, step):
                if fake.models is not None and body["model"] not in fake.models:
                    message = f"The model `{body['model']}` does not exist."
                    return self._send(
                        404, {"error": {"message": message, "type": "NotFoundError", "code": 404}}
                    )
                if fault == "timeout":
                    time.sleep(1.0)
                if fault in ("500", "dead", "404", "429"):
                    status = {"500": 500, "dead": 503, "404": 404, "429": 429}[fault]
                    return self._send(
                        status, {"error": {"message": f"fake {fault}", "type": "x", "code": status}}
                    )
                if fault == "malformed":
                    return self._send(200, b'{"choices": [{"index": 0, "mess')
                if fault == "html":
                    return self._send(200, b"<html>gateway</html>", "text/html")
                text = fake.chunk(cid, step) if step.startswith("chunk") else fake.questions(cid, body)
                if fault == "badjson":
                    text = "Here are your questions: 1. What ..."
                finish = "length" if fault == "length" else "stop"
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                }
                usage = {"prompt_tokens": 10, "completion_tokens": len(text), "total_tokens": 10 + len(text)}
                reply = {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                         "choices": [choice], "usage": usage}  # fmt: skip
                reply = fault(reply) if callable(fault) else reply
                self._send(*reply) if isinstance(reply, tuple) else self._send(200, reply)

            def _send(self, status, payload, kind="application/json"):
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                if status == 429:
                    self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(data)

        return Handler

    def chunk(self, cid: str, step: str) -> str:
        k = int(step.partition("-")[2])
        a, b, *filler = _pick(f"{cid}/{step}", 20)
        text = f"The code of ledger {cid}-{k} is {a} {b}. " + " ".join(filler) + "."
        if self.bad.get(cid) == "email" and k == 0:
            text += " Write to ana@mailhost.com about it."
        if self.bad.get(cid) == "role" and k == 1:
            text += "\nAssistant: shall I go on?\n"
        return text

    def questions(self, cid: str, body: dict) -> str:
        ledger, a, b = re.search(
            r"The code of ledger (\S+) is (\w+) (\w+)\.", body["messages"][-1]["content"]
        ).groups()
        question, answer = f"What is the code of ledger {ledger}?", f"{a} {b}"
        if self.bad.get(cid) == "reveal":
            question = f"Is {a} {b} the code of ledger {ledger}?"
        if self.bad.get(cid) == "long":
            answer = f"{a} {b} {a} {b} {a} {b}"
        return json.dumps({"qas": [{"question": question, "answer": answer}]})


@pytest.fixture
def fake():
    server = FakeLLM()
    yield server
    server.server.shutdown()
    server.server.server_close()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Offline tokenizer folders: one id per character, or one per whitespace-separated word."""
    char = tmp_path_factory.mktemp("char-tokenizer")
    char_tokenizer().save_pretrained(char)
    word = tmp_path_factory.mktemp("word-tokenizer")
    model = Tokenizer(models.WordLevel(vocab={"<unk>": 0}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>").save_pretrained(word)
    return {"char": str(char), "word": str(word)}


def config(fake, tokenizer: str, **changes) -> L.LongDataConfig:
    settings = dict(
        model="fake-writer", tokenizer=tokenizer, base_url=fake.url, num_candidates=4, target_tokens=(300, 500),
        chunk_tokens=200, concurrency=2, max_attempts=3, timeout=5.0, backoff=0.01, max_backoff=0.05,
    )  # fmt: skip
    return L.LongDataConfig(**{**settings, **changes})


def cid(i: int) -> str:
    return L.candidate_id(42, i)


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


# ---------------------------------------------------------------------- building
def test_build_loads_as_long_qa_and_reports_every_rejection(fake, tokenizers, tmp_path, capsys):
    fake.bad = {cid(1): "email", cid(2): "role", cid(3): "reveal", cid(4): "long"}
    result = L.build_long_dataset(
        config(fake, tokenizers["char"], num_candidates=6), tmp_path, progress=False
    )

    records = read_jsonl(tmp_path / "train.jsonl")
    assert [r["id"] for r in records] == [cid(0), cid(5)]
    for source in (tmp_path, tmp_path / "train.jsonl"):  # the folder, as after a Hub download, or the file
        episodes = load_episodes(str(source), "long_qa")
        assert len(episodes) == sum(len(r["qas"]) for r in records) == result.questions
    assert all(e["prompt"].startswith("Question: ") and e["history"] in (records[0]["context"], records[1]["context"])
               for e in episodes)  # fmt: skip
    # a question per chunk, its answer stated in the context and 6-15 characters (tokens) long with its space
    for r in records:
        assert len(r["qas"]) == r["context"].count("The code of ledger") >= 2
        for qa in r["qas"]:
            assert qa["answer"] in r["context"] and 6 <= len(" " + qa["answer"]) == qa["answer_tokens"] <= 15

    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["candidates"], report["accepted"], report["rejected"]) == (6, 2, 4)
    rejected = {c["id"]: c["rules"] for c in report["rejected_candidates"]}
    assert rejected == {
        cid(1): ["email_outside_example_domains"],
        cid(2): ["role_marker"],
        cid(3): ["question_reveals_answer"],
        cid(4): ["answer_length"],
    }
    assert "ana@mailhost.com" in json.dumps(report["rejected_candidates"])
    assert report["rules"]["role_marker"]["rejected"] == 1 and report["rules"]["role_marker"]["reason"]
    assert report["by_target"]["300"]["count"] == 1 and report["by_target"]["500"]["count"] == 1

    card = DatasetCard.load(tmp_path / "README.md")
    assert card.data.configs == [
        {"config_name": "default", "data_files": [{"split": "train", "path": "train.jsonl"}]}
    ]
    assert "| email_outside_example_domains | 1 |" in card.text and "2 / 6" in card.text
    assert "fake-writer" in card.text and fake.url not in card.text  # the endpoint's address stays private


@pytest.mark.parametrize("kind", ["char", "word"])
def test_contexts_reach_their_targets_in_the_given_tokenizer(fake, tokenizers, tmp_path, kind):
    """Chunks are requested until the context holds its target under the TARGET tokenizer, and not
    one more: without its last chunk every context is below target."""
    target = {"char": (300, 500), "word": (40, 70)}[kind]
    cfg = config(fake, tokenizers[kind], target_tokens=target, answer_tokens=(1, 15))
    L.build_long_dataset(cfg, tmp_path, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(tokenizers[kind])
    journal = read_jsonl(tmp_path / "candidates.jsonl")
    assert len(journal) == 4
    for r in journal:
        count = len(tokenizer(r["context"], add_special_tokens=False)["input_ids"])
        without_last = r["context"][: r["chunk_starts"][-1]].rstrip()
        assert count == r["context_tokens"] >= r["target_tokens"] == target[r["index"] % 2]
        assert len(tokenizer(without_last, add_special_tokens=False)["input_ids"]) < r["target_tokens"]


def test_transient_faults_are_retried_and_change_nothing(fake, tokenizers, tmp_path):
    clean = FakeLLM()
    try:
        L.build_long_dataset(config(clean, tokenizers["char"]), tmp_path / "clean", progress=False)
    finally:
        clean.server.shutdown()
    fake.faults = {
        (cid(0), "chunk-000"): ["timeout", "500"],
        (cid(0), "qa-001"): ["malformed", "badjson"],
        (cid(1), "chunk-001"): ["length", "429"],
        (cid(2), "qa-000"): ["html"],
    }
    cfg = config(fake, tokenizers["char"], timeout=0.3)
    result = L.build_long_dataset(cfg, tmp_path / "faulty", progress=False)

    assert (tmp_path / "faulty/train.jsonl").read_bytes() == (tmp_path / "clean/train.jsonl").read_bytes()
    attempts = {(c, s): a for c, s, a, outcome in fake.log if outcome == "ok"}
    assert (
        attempts[(cid(0), "chunk-000")]
        == attempts[(cid(0), "qa-001")]
        == attempts[(cid(1), "chunk-001")]
        == 3
    )
    assert attempts[(cid(2), "qa-000")] == 2
    assert result.report["requests"] == len(fake.log) == len(clean.log) + 7


def test_a_dead_endpoint_names_itself_and_a_rerun_resumes(fake, tokenizers, tmp_path):
    reference = tmp_path / "reference"
    L.build_long_dataset(config(fake, tokenizers["char"], concurrency=1), reference, progress=False)
    fake.log.clear()

    fake.dead_from = 2
    cfg = config(fake, tokenizers["char"], concurrency=1)
    with pytest.raises(L.EndpointError) as caught:
        L.build_long_dataset(cfg, tmp_path / "run", progress=False)
    message = str(caught.value)
    assert fake.url in message and "'fake-writer'" in message and "HTTP 503" in message
    assert "failed 3 times" in message and "rerun the same command" in message
    assert [r["id"] for r in read_jsonl(tmp_path / "run/candidates.jsonl")] == [cid(0), cid(1)]

    fake.dead_from, first = None, fake.served()
    fake.log.clear()
    L.build_long_dataset(cfg, tmp_path / "run", progress=False)
    assert (tmp_path / "run/train.jsonl").read_bytes() == (reference / "train.jsonl").read_bytes()
    again = fake.served()
    assert {c for c, _ in again} == {cid(2), cid(3)}  # finished candidates were not requested again
    assert len(set(first + again)) == len(first + again)  # no request was answered twice


def test_ctrl_c_keeps_finished_candidates_and_a_rerun_completes_them(fake, tokenizers, tmp_path, capsys):
    reference = tmp_path / "reference"
    cfg = config(fake, tokenizers["char"], concurrency=1)
    L.build_long_dataset(cfg, reference, progress=False)
    fake.log.clear()

    fake.ctrl_c_at = (cid(2), "chunk-001")
    with pytest.raises(KeyboardInterrupt):
        L.build_long_dataset(cfg, tmp_path / "run", progress=False)
    assert "rerun the same command" in capsys.readouterr().err
    assert [r["id"] for r in read_jsonl(tmp_path / "run/candidates.jsonl")] == [cid(0), cid(1)]

    fake.log.clear()
    L.build_long_dataset(cfg, tmp_path / "run", progress=False)
    assert (tmp_path / "run/train.jsonl").read_bytes() == (reference / "train.jsonl").read_bytes()
    assert {c for c, _ in fake.served()} == {cid(2), cid(3)}


def test_a_half_written_last_line_is_dropped_and_regenerated(fake, tokenizers, tmp_path):
    cfg = config(fake, tokenizers["char"])
    L.build_long_dataset(cfg, tmp_path, progress=False)
    data = (tmp_path / "train.jsonl").read_bytes()
    journal = tmp_path / "candidates.jsonl"
    lines = journal.read_bytes().splitlines(keepends=True)
    last = json.loads(lines[-1])["id"]
    journal.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # the crash, mid-write

    fake.log.clear()
    L.build_long_dataset(cfg, tmp_path, progress=False)
    assert {c for c, _ in fake.served()} == {last}
    assert (tmp_path / "train.jsonl").read_bytes() == data
    assert sorted(r["id"] for r in read_jsonl(journal)) == [cid(i) for i in range(4)]  # valid JSONL again

    lines = journal.read_bytes().splitlines(keepends=True)
    journal.write_bytes(lines[0] + b"{broken\n" + b"".join(lines[1:]))  # damage that is not a crash
    with pytest.raises(DataFormatError, match=r"candidates.jsonl:2: the line is not JSON.*Delete that line"):
        L.build_long_dataset(cfg, tmp_path, progress=False)


def test_a_rerun_with_other_settings_is_refused_but_rule_settings_may_change(fake, tokenizers, tmp_path):
    L.build_long_dataset(config(fake, tokenizers["char"]), tmp_path, progress=False)
    with pytest.raises(UsageError, match=r"seed=42, not 7.*same settings to resume.*new output folder"):
        L.build_long_dataset(config(fake, tokenizers["char"], seed=7), tmp_path, progress=False)

    fake.log.clear()  # the rules rerun on the journal without a request
    strict = config(fake, tokenizers["char"], min_questions=5)
    assert L.build_long_dataset(strict, tmp_path, progress=False).accepted == 0 and not fake.log
    assert L.build_long_dataset(config(fake, tokenizers["char"]), tmp_path, progress=False).accepted == 4


def test_refusals_that_retrying_cannot_fix_fail_at_once(fake, tokenizers, tmp_path):
    fake.faults = {(cid(0), "chunk-000"): ["404"]}
    with pytest.raises(L.EndpointError, match=r"refused with HTTP 404.*Check --base-url"):
        L.build_long_dataset(config(fake, tokenizers["char"], concurrency=1), tmp_path, progress=False)
    assert len(fake.log) == 1


def test_a_tokenizer_that_cannot_load_names_the_option(tmp_path):
    with pytest.raises(MissingDataError, match=r"expected the target model's tokenizer.*Pass --tokenizer"):
        L.load_tokenizer(str(tmp_path / "no-such-tokenizer"))


def test_the_openai_client_is_an_extra(fake, tokenizers, monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)
    with pytest.raises(ImportError, match=re.escape(install_command("data"))):
        L.Endpoint(config(fake, tokenizers["char"]))


# ---------------------------------------------------------------------- command line and Hub
def test_the_command_s_options_are_the_config_s_fields_with_its_help_and_defaults():
    """lstmem_cli/data_long.py writes the options out (``lstmem data long --help`` loads no library):
    one per LongDataConfig field, with the field's help and its default, and the rules' names."""
    from dataclasses import MISSING, fields

    from lstmem_peft.training.long_data.config import TOPICS

    by_field = {dest: (default, help) for _, dest, default, _, help in cli_options.OPTIONS}
    assert list(by_field) == [f.name for f in fields(L.LongDataConfig)]
    for f in fields(L.LongDataConfig):
        default, help = by_field[f.name]
        assert help == f.metadata["help"], f.name
        if f.default is MISSING or f.default in (None, False, ()):
            assert default is None, f.name  # nothing to show
        elif f.name == "topics":
            assert f.default == TOPICS and default == "the built-in list"
        else:
            assert default == f.default, f.name
    assert cli_options.RULE_NAMES == tuple(R.RULES)
    parser = argparse.ArgumentParser()
    cli_options.add_arguments(parser)
    args = parser.parse_args(["--out", "x", "--model", "m", "--tokenizer", "t"])
    assert L.config_from_args(args) == L.LongDataConfig(model="m", tokenizer="t")
    given = ["--skip-rule", "role_marker", "--allow-email-domain", "a.org", "--target-tokens", "100", "200"]
    args = parser.parse_args(["--out", "x", "--model", "m", "--tokenizer", "t", *given, "--json-mode"])
    config = L.config_from_args(args)
    assert (config.skip_rules, config.email_domains, config.target_tokens, config.json_mode) == (
        ("role_marker",),
        ("a.org",),
        (100, 200),
        True,
    )


def test_command_line_reads_the_key_from_the_environment(fake, tokenizers, tmp_path, monkeypatch, capsys):
    parser = argparse.ArgumentParser()
    cli_options.add_arguments(parser)
    argv = ["--out", str(tmp_path), "--model", "fake-writer", "--tokenizer", tokenizers["char"]]
    argv += ["--base-url", fake.url, "--candidates", "2", "--target-tokens", "300", "--chunk-tokens", "200"]
    argv += ["--api-key-env", "LONG_DATA_TEST_KEY", "--no-progress"]
    monkeypatch.setenv("LONG_DATA_TEST_KEY", "sk-test")
    assert L.run(parser.parse_args(argv)) == 0
    assert fake.auth == {"Bearer sk-test"}
    out = capsys.readouterr().out
    assert "| question_reveals_answer | 0 | 0 |" in out and "2 of 2 candidates accepted" in out
    assert len(load_episodes(str(tmp_path), "long_qa")) == 4

    monkeypatch.delenv("LONG_DATA_TEST_KEY")
    with pytest.raises(UsageError, match="LONG_DATA_TEST_KEY"):
        L.run(parser.parse_args([*argv, "--candidates", "3"]))  # one candidate left to request
    with pytest.raises(UsageError, match="answer token range 9-6 is empty"):
        L.run(parser.parse_args([*argv, "--answer-tokens", "9", "6"]))


def test_lstmem_data_long_builds_through_the_command_and_names_a_missing_key(
    fake, tokenizers, tmp_path, monkeypatch, capsys
):
    """``lstmem data long ...`` end to end through the ``lstmem`` command; what the user got wrong
    is one line naming the fix (exit status 2), no traceback."""
    from lstmem_cli import main

    argv = [
        "data",
        "long",
        "--out",
        str(tmp_path),
        "--model",
        "fake-writer",
        "--tokenizer",
        tokenizers["char"],
    ]
    argv += ["--base-url", fake.url, "--candidates", "2", "--target-tokens", "300", "--chunk-tokens", "200"]
    argv += ["--api-key-env", "LONG_DATA_TEST_KEY", "--no-progress"]
    monkeypatch.setenv("LONG_DATA_TEST_KEY", "sk-test")
    assert main(argv) == 0
    assert len(load_episodes(str(tmp_path), "long_qa")) == 4
    monkeypatch.delenv("LONG_DATA_TEST_KEY")
    capsys.readouterr()
    assert main([*argv, "--candidates", "3"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("lstmem data long: error: ") and "LONG_DATA_TEST_KEY" in err and "Traceback" not in err
    )


def test_push_to_hub_uploads_a_dataset_repository(fake, tokenizers, tmp_path, monkeypatch):
    out = tmp_path / "built"
    L.build_long_dataset(config(fake, tokenizers["char"]), out, progress=False)
    calls, hub = {}, tmp_path / "hub"

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"] = {"repo_id": repo_id, **kwargs}
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, *, repo_id, folder_path, allow_patterns, **kwargs):
        calls["upload_folder"] = {"repo_id": repo_id, "allow_patterns": allow_patterns, **kwargs}
        hub.mkdir()
        for name in allow_patterns:  # what the Hub would hold
            (hub / name).write_bytes((folder_path / name).read_bytes())
        return "commit"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    assert L.push_to_hub(out, "user/long", private=True) == "commit"
    assert calls["create_repo"]["repo_type"] == calls["upload_folder"]["repo_type"] == "dataset"
    assert calls["create_repo"]["private"] is True and calls["upload_folder"]["repo_id"] == "user/long"
    assert sorted(p.name for p in hub.iterdir()) == ["README.md", "report.json", "train.jsonl"]  # no journal
    assert load_episodes(str(hub), "long_qa") == load_episodes(str(out), "long_qa")

    with pytest.raises(FileNotFoundError, match="Run build_long_dataset"):
        L.push_to_hub(tmp_path / "empty", "user/long")


# ---------------------------------------------------------------------- the rules, one by one
def candidate(context="A calm day at the harbour.", qas=(("Who came?", "the ferry captain Ana")), tokens=100,
              target=100, starts=(0,)):  # fmt: skip
    pairs = (qas,) if isinstance(qas[0], str) else qas
    return R.Candidate("s0-c00000", context, tuple(R.QA(q, a, 8) for q, a in pairs), tokens, target, starts)


HARBOUR = "The ferry captain Ana came at noon. "
RULE_CASES = [  # (rule, candidate that passes it, candidate that fails it)
    ("email_outside_example_domains",
     candidate(HARBOUR + "Mail ana@example.com, bo@mail.example.org, cy@host.test, di@x.invalid, ed@lab.example."),
     candidate(HARBOUR + "Mail ana@gmail.com or bo@example.co.")),
    ("role_marker", candidate(HARBOUR + "The username: ana. Our system: twin pumps."),
     candidate(HARBOUR + "\n**User:** where is she?")),
    ("role_marker", candidate(HARBOUR), candidate(HARBOUR + "<|im_start|>assistant")),
    ("assistant_chatter", candidate(HARBOUR + "\n\nHere at the harbour, gulls.", starts=(0, 38)),
     candidate(HARBOUR + "\n\nSure! Here is part 2: gulls.", starts=(0, 38))),
    ("question_reveals_answer", candidate(HARBOUR, ("Who came at noon?", "the ferry captain Ana")),
     candidate(HARBOUR, ("Did the ferry captain, Ana, come?", "The ferry captain Ana"))),
    ("answer_not_in_context", candidate(HARBOUR), candidate(HARBOUR, ("Who came?", "a tall lighthouse keeper"))),
    ("question_refers_to_passage", candidate(HARBOUR),
     candidate(HARBOUR, ("Who came, according to this passage?", "the ferry captain Ana"))),
    ("duplicate_question", candidate(HARBOUR, (("Who came?", "the ferry captain Ana"), ("When?", "at noon"))),
     candidate(HARBOUR, (("Who came?", "the ferry captain Ana"), ("who CAME", "the ferry captain Ana")))),
    ("context_below_target", candidate(HARBOUR, tokens=100, target=100), candidate(HARBOUR, tokens=99, target=100)),
    ("context_over_cap", candidate(HARBOUR, tokens=131072), candidate(HARBOUR, tokens=131073)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "good", "bad"), RULE_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(RULE_CASES)]
)
def test_each_rule_passes_clean_text_and_names_what_it_rejects(name, good, bad):
    settings = R.RuleSettings()
    assert R.RULES[name](good, settings) == []
    assert R.judge(good, settings).accepted
    found = R.RULES[name](bad, settings)
    assert found and all(f.rule == name and f.detail for f in found)
    verdict = R.judge(bad, settings)
    assert not verdict.accepted and name in {f.rule for f in verdict.findings}


def test_answer_length_counts_target_tokens_and_bad_questions_can_be_dropped():
    settings = R.RuleSettings(min_answer_tokens=6, max_answer_tokens=15)
    qas = tuple(R.QA(f"Question {i}?", "the ferry captain Ana", n) for i, n in enumerate((5, 6, 15, 16)))
    c = R.Candidate("s0-c00000", HARBOUR, qas, 10, 10)
    assert [f.question for f in R.RULES["answer_length"](c, settings)] == [0, 3]

    strict, lenient = R.judge(c, settings), R.judge(c, settings, drop_bad_questions=True)
    assert not strict.accepted and strict.kept == ()
    assert lenient.accepted and lenient.kept == (1, 2) and len(lenient.findings) == 2
    assert not R.judge(c, R.RuleSettings(min_questions=3), drop_bad_questions=True).accepted
    assert R.judge(c, settings, skip=["answer_length"]).accepted
    with pytest.raises(ValueError, match="unknown rule"):
        R.judge(c, settings, skip=["no_such_rule"])


@pytest.mark.slow
def test_the_two_stage_recipe_trains_from_a_built_long_dataset(fake, tokenizers, tmp_path):
    """From raw sources to a trained adapter: the Long dataset built through an endpoint is what
    examples/train_two_stage.py reads for stage 2 (the offline tiny model; QASPER from its fixture)."""
    import subprocess
    from pathlib import Path

    from eval_fixtures import QASPER_OFFICIAL

    root = Path(__file__).resolve().parents[1]
    L.build_long_dataset(config(fake, tokenizers["char"]), tmp_path / "long", progress=False)
    (tmp_path / "qasper.json").write_text(json.dumps(QASPER_OFFICIAL))
    argv = [
        sys.executable,
        str(root / "examples" / "train_two_stage.py"),
        "--tiny",
        "--qasper",
        "qasper.json",
    ]
    argv += [
        "--long",
        "long",
        "--output-dir",
        "run",
        "--stage1-steps",
        "1",
        "--stage2-steps",
        "2",
        "--global-batch",
        "2",
    ]
    result = subprocess.run(
        argv,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").exists()
    record = json.loads((tmp_path / "run" / "adapter" / "training.json").read_text())
    assert record["long"] == "long" and record["stage2_updates"] == 2
