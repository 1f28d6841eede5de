"""`lstmem data long` against a faulty endpoint and a damaged output folder (issue 48, item 1).

The fake endpoint is test_long_data's (a threaded http.server on 127.0.0.1); here its faults are
functions that turn the good reply into a malformed one. Every reply shape is either used or retried
as unusable, with the endpoint and the reason in the log; settings are recorded only once the
tokenizer loaded and the endpoint answered, so a failed start blocks no corrected rerun; a damaged
``build.json`` or journal line is named with its path and the fix.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_long_data import FakeLLM, cid, config, read_jsonl  # noqa: E402  (the same fake endpoint)

from lstmem_cli import main  # noqa: E402
from lstmem_peft.training import long_data as L  # noqa: E402
from lstmem_peft.utils.errors import DataFormatError, MissingDataError, UsageError  # noqa: E402
from lstmem_peft.utils.offline import char_tokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake():
    server = FakeLLM()
    yield server
    server.server.shutdown()
    server.server.server_close()


@pytest.fixture(scope="module")
def char(tmp_path_factory) -> str:
    """An offline tokenizer folder: one id per character."""
    folder = tmp_path_factory.mktemp("char-tokenizer")
    char_tokenizer().save_pretrained(folder)
    return str(folder)


def small(fake, tokenizer: str, **changes) -> L.LongDataConfig:
    """One candidate of 300 tokens (two chunks, two questions), one request at a time."""
    return config(
        fake, tokenizer, **{"num_candidates": 1, "target_tokens": (300,), "concurrency": 1, **changes}
    )


def message(reply: dict) -> dict:
    return reply["choices"][0]["message"]


def _set(path: str, value):
    """A fault: the good reply with the field at ``path`` (``a.0.b``) set to ``value``."""

    def fault(reply):
        *parents, last = path.split(".")
        target = reply
        for key in parents:
            target = target[int(key) if key.isdigit() else key]
        target[int(last) if last.isdigit() else last] = value
        return reply

    return fault


def _drop(key: str):
    def fault(reply):
        if key == "message":
            del reply["choices"][0]["message"]
        else:
            del reply[key]
        return reply

    return fault


def _raw(data: bytes, kind: str = "application/json", status: int = 200):
    return lambda reply: (status, data, kind)


def _content_null(**extra):
    def fault(reply):
        message(reply).update(content=None, **extra)
        return reply

    return fault


# (id, fault, the reason the log and the final error give)
UNUSABLE = [
    ("content-a-number", _set("choices.0.message.content", 7),
     "choices[0].message.content is a number (7), expected a string"),
    ("choices-a-string", _set("choices", "x"), "choices is a string ('x'), expected a list of objects"),
    ("choices-empty", _set("choices", []), "choices is an empty list"),
    ("choice-a-string", _set("choices", ["x"]), "choices[0] is a string ('x'), expected an object"),
    ("no-choices", _drop("choices"), "no 'choices' in the reply, which is an object with keys"),
    ("no-message", _drop("message"), "choices[0] has no message, expected an object"),
    ("message-a-string", _set("choices.0.message", "hi"), "choices[0] has a message that is a string ('hi')"),
    ("content-null", _content_null(), "empty reply (content is null)"),
    ("content-null-reasoning", _content_null(reasoning_content="I think..."),
     "empty reply (content is null; the reply holds only reasoning)"),
    ("refusal", _content_null(refusal="I cannot help."), "the model refused: 'I cannot help.'"),
    ("content-bad-parts", _set("choices.0.message.content", [3]),
     "choices[0].message.content[0] is a number (3), expected a text part"),
    ("content-blank", _set("choices.0.message.content", "  \n"), "empty reply"),
    ("finish-a-number", _set("choices.0.finish_reason", 1),
     "choices[0].finish_reason is a number (1), expected a string or null"),
    ("finish-filtered", _set("choices.0.finish_reason", "content_filter"),
     "reply ended with finish_reason 'content_filter'"),
    ("body-a-list", lambda reply: [reply], "the body is a list of 1 item(s) (objects), expected a JSON object"),
    ("body-html", _raw(b"<html><body>502 Bad Gateway</body></html>", "text/html"),
     "the body is not JSON (text/html, 41 bytes: '<html><body>502 Bad Gateway</body></html>')"),
    ("body-empty", _raw(b""), "the body is not JSON (application/json, 0 bytes: empty)"),
    ("body-cut-short", _raw(b'{"choices": [{"index": 0, "mess'), "the body is not JSON (application/json"),
    ("error-with-200", lambda reply: {"error": {"message": "engine  overloaded"}},
     "the endpoint sent an error with HTTP 200: engine overloaded"),
]  # fmt: skip


@pytest.mark.parametrize(("fault", "reason"), [c[1:] for c in UNUSABLE], ids=[c[0] for c in UNUSABLE])
def test_an_unusable_reply_is_retried_and_logged_with_the_endpoint_and_the_reason(
    fake, char, tmp_path, caplog, fault, reason
):
    fake.faults = {(cid(0), "chunk-000"): [fault]}
    with caplog.at_level(logging.WARNING, logger="lstmem.data"):
        result = L.build_long_dataset(small(fake, char), tmp_path, progress=False)
    assert result.accepted == 1
    attempts = {(c, s): a for c, s, a, outcome in fake.log if outcome == "ok"}
    assert attempts[(cid(0), "chunk-000")] == 2  # the fault, then the good reply
    [line] = [r.getMessage() for r in caplog.records if r.name == "lstmem.data"]
    assert line.startswith(f"{fake.url} (model 'fake-writer'), request {cid(0)}/chunk-000, attempt 1 of 3: ")
    assert f"unusable reply: {reason}" in line and "retrying in" in line


def test_question_replies_of_any_shape_are_used_or_retried(fake, char, tmp_path, caplog):
    def qas(value):
        return _set("choices.0.message.content", json.dumps({"qas": value}))

    fake.faults = {(cid(0), "qa-000"): [qas(5), qas("x"), lambda r: r], (cid(0), "qa-001"): [qas([7, None])]}
    with caplog.at_level(logging.WARNING, logger="lstmem.data"):
        assert L.build_long_dataset(small(fake, char), tmp_path, progress=False).accepted == 1
    assert sum("question reply holds no" in r.getMessage() for r in caplog.records) == 3


def test_usable_replies_of_other_shapes_are_used(fake, char, tmp_path, caplog):
    """Content as text parts, a missing finish_reason, usage that is not counts: used at once."""

    def parts(reply):
        text = message(reply)["content"]
        message(reply)["content"] = [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}]
        return reply

    clean = L.build_long_dataset(small(fake, char), tmp_path / "clean", progress=False)
    fake.faults = {
        (cid(0), "chunk-000"): [parts],
        (cid(0), "chunk-001"): [_set("choices.0.finish_reason", None)],
        (cid(0), "qa-000"): [_set("usage", "lots")],
        (cid(0), "qa-001"): [_set("usage.prompt_tokens", "ten")],
    }
    with caplog.at_level(logging.WARNING, logger="lstmem.data"):
        faulty = L.build_long_dataset(small(fake, char), tmp_path / "faulty", progress=False)
    assert not caplog.records
    assert (tmp_path / "faulty/train.jsonl").read_bytes() == (tmp_path / "clean/train.jsonl").read_bytes()
    assert faulty.report["requests"] == clean.report["requests"] == 4


@pytest.mark.parametrize(
    ("fault", "reason"),
    [UNUSABLE[0][1:], UNUSABLE[1][1:]],  # the two shapes that crashed before (issue 48)
    ids=[UNUSABLE[0][0], UNUSABLE[1][0]],
)
def test_a_lasting_unusable_reply_fails_in_one_line_naming_the_endpoint(
    fake, char, tmp_path, capsys, fault, reason
):
    fake.faults = {(cid(0), "chunk-000"): [fault] * 3}
    argv = ["data", "long", "--out", str(tmp_path), "--model", "fake-writer", "--tokenizer", char, "--base-url",
            fake.url, "--candidates", "1", "--target-tokens", "300", "--chunk-tokens", "200", "--max-attempts", "3",
            "--backoff", "0.01", "--max-backoff", "0.05", "--no-progress"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert err.startswith(
        f"lstmem data: error: {fake.url} (model 'fake-writer'), request {cid(0)}/chunk-000: "
    )
    assert f"failed 3 times in a row; last: unusable reply: {reason}" in err
    assert "--base-url is the API root" in err and "(EndpointError;" in err
    assert not (tmp_path / "build.json").exists()  # the endpoint never answered: nothing recorded

    fake.faults.clear()  # the endpoint is fixed: the same command builds
    assert main(argv) == 0
    assert len(read_jsonl(tmp_path / "train.jsonl")) == 1


# ---------------------------------------------------------------------- failed starts
def test_a_mistyped_model_records_nothing_and_the_corrected_rerun_builds(fake, char, tmp_path):
    fake.models = {"fake-writer"}
    with pytest.raises(
        L.EndpointError, match=r"refused with HTTP 404 \(The model `fake-wirter` does not exist"
    ) as e:
        L.build_long_dataset(small(fake, char, model="fake-wirter"), tmp_path, progress=False)
    assert fake.url in str(e.value) and "--model" in str(e.value)
    assert sorted(os.listdir(tmp_path)) == []

    seen = []  # whether build.json exists when each request arrives
    fake.faults = {
        (cid(0), step): [lambda reply: seen.append((tmp_path / "build.json").exists()) or reply]
        for step in ("chunk-000", "chunk-001")
    }
    assert L.build_long_dataset(small(fake, char), tmp_path, progress=False).accepted == 1
    assert seen == [False, True]  # recorded at the first usable reply, not before
    settings = json.loads((tmp_path / "build.json").read_text())["settings"]
    assert settings["model"] == "fake-writer"


def test_a_missing_tokenizer_records_nothing_and_the_corrected_rerun_builds(fake, char, tmp_path):
    with pytest.raises(MissingDataError, match=r"no-such-tokenizer.*Pass --tokenizer"):
        L.build_long_dataset(small(fake, str(tmp_path / "no-such-tokenizer")), tmp_path / "out",
                             progress=False)  # fmt: skip
    assert not fake.log and os.listdir(tmp_path / "out") == []
    assert L.build_long_dataset(small(fake, char), tmp_path / "out", progress=False).accepted == 1


def test_settings_left_by_a_start_that_finished_nothing_do_not_lock_the_folder(fake, char, tmp_path):
    """A folder holding build.json but no finished candidate (a run stopped early, or an older lstmem
    that wrote build.json first): any settings may build into it, and they are recorded."""
    (tmp_path / "build.json").write_text(
        json.dumps(
            {"format": "lstmem-long-data/1", "settings": {**small(fake, char).generation(), "model": "typo"}}
        )
    )
    assert L.build_long_dataset(small(fake, char), tmp_path, progress=False).accepted == 1
    assert json.loads((tmp_path / "build.json").read_text())["settings"]["model"] == "fake-writer"
    with pytest.raises(UsageError, match=r"temperature=0.8, not 0.5.*same settings to resume"):
        L.build_long_dataset(small(fake, char, temperature=0.5), tmp_path, progress=False)


# ---------------------------------------------------------------------- damaged files
def test_a_damaged_build_json_is_named_with_the_fix(fake, char, tmp_path, capsys):
    cfg, path = small(fake, char), tmp_path / "build.json"
    good = {"format": "lstmem-long-data/1", "settings": cfg.generation()}
    text = json.dumps(good, indent=1)
    path.write_text(text[: text.index('"fake-writer"') + 5])  # cut short
    with pytest.raises(DataFormatError) as caught:
        L.build_long_dataset(cfg, tmp_path, progress=False)
    text = str(caught.value)
    assert text.startswith(f"{path}: not JSON (Unterminated string starting at: line ")
    assert text.endswith("Delete it and rerun: no candidate is finished yet, so nothing is lost")
    for value, got in [([], "the file holds an empty list"), ({**good, "format": "x/9"}, "format is a string ('x/9')"),
                       ({**good, "settings": "x"}, "settings is a string ('x')")]:  # fmt: skip
        path.write_text(json.dumps(value))
        with pytest.raises(
            DataFormatError, match=rf"^{path}: {re.escape(got)}; expected the settings of the Long"
        ):
            L.build_long_dataset(cfg, tmp_path, progress=False)
    assert not fake.log

    path.unlink()  # the fix
    L.build_long_dataset(cfg, tmp_path, progress=False)
    assert json.loads(path.read_text()) == good


def test_a_damaged_build_json_beside_finished_candidates_is_rebuilt_from_the_same_settings(
    fake, char, tmp_path, capsys
):
    cfg, path = small(fake, char, num_candidates=2), tmp_path / "build.json"
    L.build_long_dataset(cfg, tmp_path, progress=False)
    good, data = path.read_text(), (tmp_path / "train.jsonl").read_bytes()
    path.write_text(good[: len(good) // 2])

    argv = ["data", "long", "--out", str(tmp_path), "--model", "fake-writer", "--tokenizer", char,
            "--base-url", fake.url, "--candidates", "2", "--target-tokens", "300", "--chunk-tokens", "200",
            "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lstmem data long: error: {path}: not JSON (") and "Traceback" not in err
    assert "Delete it and rerun the command this build was started with" in err and "candidates.jsonl" in err

    path.unlink()  # the fix, with other generation settings: the journal's digest refuses them
    with pytest.raises(
        DataFormatError, match=r"candidates.jsonl:1: candidate s42-c00000 was made with other"
    ):
        L.build_long_dataset(small(fake, char, num_candidates=2, temperature=0.5), tmp_path, progress=False)
    assert not path.exists()
    fake.log.clear()  # and with the same settings: build.json is written again, nothing is requested
    assert main(argv) == 0
    assert path.read_text() == good and (tmp_path / "train.jsonl").read_bytes() == data and not fake.log


def test_a_lost_build_json_beside_a_journal_of_an_older_lstmem_names_the_fix(fake, char, tmp_path):
    cfg = small(fake, char)
    L.build_long_dataset(cfg, tmp_path, progress=False)
    journal = tmp_path / "candidates.jsonl"
    records = read_jsonl(journal)
    journal.write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k != "settings_digest"}) + "\n" for r in records)
    )
    L.build_long_dataset(cfg, tmp_path, progress=False)  # build.json is there: an older journal resumes
    (tmp_path / "build.json").unlink()
    with pytest.raises(DataFormatError, match=r"build.json: missing, while .*candidates.jsonl holds 1 finished "
                       r"candidates, 1 of them without a record.*Put build.json back"):  # fmt: skip
        L.build_long_dataset(cfg, tmp_path, progress=False)


def _damage(record: dict, key: str, value) -> dict:
    damaged = dict(record)
    if value is _MISSING:
        del damaged[key]
    else:
        damaged[key] = value
    return damaged


_MISSING = object()
JOURNAL_DAMAGE = [  # (id, field, value, what the error says)
    ("qas-a-string", "qas", "x", "qas is a string ('x'), expected a list"),
    ("index-a-string", "index", "0", "index is a string ('0'), expected a count"),
    ("context-a-number", "context", 5, "context is a number (5), expected a string"),
    ("chunk-starts-empty", "chunk_starts", [], "chunk_starts is an empty list, expected a non-empty list"),
    ("qa-not-an-object", "qas", [1], "qas[0] is a number (1), expected"),
    (
        "usage-without-counts",
        "usage",
        {"requests": "2"},
        "usage is an object with keys ['requests'], expected",
    ),
    ("topic-missing", "topic", _MISSING, "missing ['topic']"),
]


@pytest.mark.parametrize(
    ("key", "value", "got"), [c[1:] for c in JOURNAL_DAMAGE], ids=[c[0] for c in JOURNAL_DAMAGE]
)
def test_a_damaged_journal_line_is_named_with_the_fix(fake, char, tmp_path, key, value, got):
    cfg = small(fake, char, num_candidates=2)
    L.build_long_dataset(cfg, tmp_path, progress=False)
    journal = tmp_path / "candidates.jsonl"
    first, second = read_jsonl(journal)
    journal.write_text(json.dumps(first) + "\n" + json.dumps(_damage(second, key, value)) + "\n")
    with pytest.raises(DataFormatError) as caught:
        L.build_long_dataset(cfg, tmp_path, progress=False)
    assert str(caught.value).startswith(f"{journal}:2: {got}")
    assert str(caught.value).endswith("Delete that line (its candidate will be generated again), or build into a "
                                      "new --out folder")  # fmt: skip

    journal.write_text(json.dumps(first) + "\n")  # the fix: only that candidate is generated again
    fake.log.clear()
    assert L.build_long_dataset(cfg, tmp_path, progress=False).accepted == 2
    assert {c for c, _ in fake.served()} == {second["id"]}


def test_a_journal_line_that_is_not_an_object_is_named(fake, char, tmp_path):
    cfg = small(fake, char)
    L.build_long_dataset(cfg, tmp_path, progress=False)
    journal = tmp_path / "candidates.jsonl"
    journal.write_text("[1, 2]\n" + journal.read_text())
    with pytest.raises(DataFormatError, match=r"candidates.jsonl:1: the line holds a list of 2 item\(s\)"):
        L.build_long_dataset(cfg, tmp_path, progress=False)
