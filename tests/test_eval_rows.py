"""The named rows of one evaluation run (lstmem_peft/eval/rows.py) on the LoCoMo fixture and a tiny
random model: each row against the runner it restates, the window's cut, BM25, memory-only's prompt,
costs, resume, bootstrap intervals and the command line."""

import hashlib
import json

import pytest
import torch
from eval_fixtures import write_hotpot, write_locomo
from peft import get_peft_model

from lstmem_peft import LSTMemConfig
from lstmem_peft.eval import Decoding, LoCoMo, evaluate, row_report, rows
from lstmem_peft.eval.retrieval import TurnIndex
from lstmem_peft.eval.runner import _setup
from lstmem_peft.tuner.kv_argument import kv_cache_in
from lstmem_peft.utils.offline import char_tokenizer, tiny_qwen3

GREEDY = dict(decoding=Decoding(greedy=True), block_size=256, progress=False)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return get_peft_model(tiny_qwen3(len(tok), hidden_size=64), LSTMemConfig()).eval()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_locomo(tmp_path_factory.mktemp("locomo") / "locomo10.json")


@pytest.fixture(scope="module")
def every_row(model, tok, data, tmp_path_factory):
    """Every row on the fixture with a window that holds each whole conversation."""
    out = tmp_path_factory.mktemp("rows") / "out"
    summary = rows.evaluate_rows(model, tok, LoCoMo(data, max_new_tokens=4), out, rows=["all"], **GREEDY)
    return out, summary


def plan_of(model, tok, history, window, top_k=10):
    run, _ = _setup(
        model,
        tok,
        Decoding(greedy=True),
        256,
        memory_only=False,
        compare_base=True,
        chat_template=None,
        template_kwargs=None,
        progress=False,
    )
    return rows._Plan(run, history, window, top_k)


def needed(plan):
    """Positions the whole history, the longest question and its answer take."""
    builder = plan.run.builder
    longest = max(
        len(builder.question_ids(plan.history, q, True)) + q.max_new_tokens for q in plan.history.questions
    )
    return plan.history_tokens + longest


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------- each row
def test_parse_rows_keeps_the_report_order_and_names_the_known_rows():
    assert rows.parse_rows("bm25,no-context") == ["no-context", "bm25"]
    assert rows.parse_rows(["all"]) == list(rows.ROWS)
    with pytest.raises(ValueError, match="unknown row 'full'.*no-context, window, memory-only, paper, bm25"):
        rows.parse_rows("full")


@pytest.mark.slow
def test_each_row_is_the_runner_it_restates_when_the_history_fits(model, tok, data, every_row, tmp_path):
    """With the whole conversation inside the window: window = the backbone with the history in the
    prompt, paper = LSTMem with history in memory and KV, memory-only and no-context = the runner's
    memory-only mode for LSTMem and the backbone; answers and scores agree question for question."""
    out, summary = every_row
    bench = LoCoMo(data, max_new_tokens=4)
    evaluate(model, tok, bench, tmp_path / "full", **GREEDY)
    evaluate(model, tok, bench, tmp_path / "memory", memory_only=True, **GREEDY)

    def answers(path, system):
        return [
            (r["id"], r["prediction"]) for r in lines(path / "predictions.jsonl") if r["system"] == system
        ]

    assert answers(out, "window") == answers(tmp_path / "full", "base")
    assert answers(out, "paper") == answers(tmp_path / "full", "lstmem")
    assert answers(out, "no-context") == answers(tmp_path / "memory", "base")
    assert answers(out, "memory-only") == answers(tmp_path / "memory", "lstmem")
    assert summary["rows"] == list(rows.ROWS) and summary["window"] == model.config.max_position_embeddings
    assert list(summary["results"]["paper"]["groups"]) == [
        "multi-hop",
        "temporal",
        "open-domain",
        "single-hop",
    ]
    assert summary["results"]["paper"]["overall"]["questions"] == 6
    assert set(summary["by_protocol"]) == {"official", "paper"}
    table = (out / "results.md").read_text()
    assert (
        "| row | multi-hop (n=1) | temporal (n=2) | open-domain (n=1) | single-hop (n=2) | overall (n=6) |"
        in table
    )
    assert "## f1 (%), paper scoring" in table and "## Costs" in table
    assert (
        row_report.render(json.loads((out / "summary.json").read_text())) == table
    )  # the record alone draws it


@pytest.mark.slow
def test_the_record_holds_each_rows_costs(every_row, model):
    out, summary = every_row
    costs = summary["costs"]
    per_token = rows.kv_bytes_per_token(model)
    assert (
        summary["kv_bytes_per_token"] == per_token == 2 * 2 * 2 * 16 * 4
    )  # K and V, layers, heads, dim, fp32
    for row in rows.ROWS:
        c = costs[row]
        assert c["histories"] == 2 and c["questions"] == 6
        assert c["full_history_kv_bytes"] == c["history_tokens"] * per_token > 0
        assert c["answer_s_per_question"] > 0 and c["write_s_per_history"] >= 0
        assert (c["state_bytes_per_history"] > 0) == (row in rows.ADAPTER_ROWS)
    # the window and the paper rows keep the whole history's KV here; the others keep none
    assert costs["window"]["kv_bytes_per_history"] == costs["paper"]["kv_bytes_per_history"]
    assert costs["window"]["kv_bytes_per_history"] == costs["window"]["full_history_kv_bytes"]
    assert costs["memory-only"]["kv_bytes_per_history"] == costs["no-context"]["kv_bytes_per_history"] == 0
    assert costs["memory-only"]["context_tokens_per_question"] == 0
    for record in lines(out / "predictions.jsonl"):
        assert {"write_s", "answer_s", "state_bytes", "kv_bytes", "prompt_tokens"} <= set(record["cost"])


# ---------------------------------------------------------------------- the window
def test_the_window_keeps_the_newest_turns_that_fit(model, tok, data):
    history = next(LoCoMo(data, max_new_tokens=4).histories())  # official: newest session listed first
    whole = plan_of(model, tok, history, 100_000)
    assert whole.window_turns == list(range(len(history.turns)))
    assert whole.window_history.text == history.text  # nothing dropped: the protocol's own text
    window = needed(whole) - 60
    plan = plan_of(model, tok, history, window)
    kept = plan.window_turns
    assert 0 < len(kept) < len(history.turns)
    assert kept == list(range(len(history.turns) - len(kept), len(history.turns)))  # the newest, whole turns
    text = plan.window_history.text
    assert "Well done!" in text and "I adopted a cat named Tom." not in text  # the newest and the oldest turn
    assert text.startswith("Below is a conversation between two people: Ann and Bo.")
    for question in history.questions:
        prompt = plan.length(plan.window_history) + len(
            plan.run.builder.question_ids(plan.window_history, question, True)
        )
        assert prompt + question.max_new_tokens <= window
    with pytest.raises(ValueError, match="cannot hold even a question"):
        _ = plan_of(model, tok, history, 50).window_turns


def test_the_window_row_prompt_fits_the_window(model, tok, data, monkeypatch, tmp_path):
    bench = LoCoMo(data, max_new_tokens=4, limit=1)
    history = next(bench.histories())
    window = needed(plan_of(model, tok, history, 100_000)) - 60
    seen = []
    real = model.generate

    def spy(**kwargs):
        kv = kv_cache_in((), kwargs)
        seen.append((kwargs["input_ids"].shape[1], kv.get_seq_length()))
        return real(**kwargs)

    monkeypatch.setattr(model, "generate", spy)
    summary = rows.evaluate_rows(model, tok, bench, None, rows=["window"], window=window, **GREEDY)
    assert len(seen) == 4 and all(n + 4 <= window and kv < n for n, kv in seen)
    assert (
        summary["costs"]["window"]["kv_bytes_per_history"]
        < summary["costs"]["window"]["full_history_kv_bytes"]
    )


def test_the_paper_row_writes_what_the_window_drops_into_memory_only(model, tok, data, monkeypatch):
    bench = LoCoMo(data, max_new_tokens=4, limit=1)
    history = next(bench.histories())
    plan = plan_of(model, tok, history, 100_000)
    plan = plan_of(model, tok, history, needed(plan) - 60)
    kept = set(plan.window_turns)
    outside = rows.subset(history, [i for i in range(len(history.turns)) if i not in kept])
    assert "I adopted a cat named Tom." in outside.text and "Well done!" not in outside.text
    written = sum(map(len, plan.ids(outside, False))) + plan.length(plan.window_history)
    seen = []
    real = model.generate

    def spy(**kwargs):
        kv, memory = kv_cache_in((), kwargs), kwargs["memory_cache"]
        seen.append((kv.get_seq_length(), int(memory.tokens_written.sum())))
        return real(**kwargs)

    monkeypatch.setattr(model, "generate", spy)
    rows.evaluate_rows(model, tok, bench, None, rows=["paper"], window=plan.window, **GREEDY)
    assert seen == [(plan.length(plan.window_history), written)] * len(history.questions)


# ---------------------------------------------------------------------- BM25
def test_bm25_retrieves_the_turn_that_holds_the_answer():
    turns = [
        "Ann: I adopted a cat named Tom last spring.",
        "Bo: I paint and I hike on weekends.",
        "Bo: The weather in Oslo was cold.",
        "Ann: My brother studies chemistry in Lyon.",
        "Bo: I ran my first marathon in Oslo.",
    ]
    index = TurnIndex(turns)
    assert index.top("Where does Ann's brother study?", 1)[0][0] == 3
    assert [i for i, _ in index.top("Which race did Bo run in Oslo? A marathon?", 2)] == [4, 2]
    assert index.top("quantum", 3) == [] and index.top("the of", 3) == []  # nothing shared: nothing returned


def test_bm25_row_puts_the_top_turns_in_their_original_order_within_the_window(model, tok, data):
    history = next(LoCoMo(data, max_new_tokens=4).histories())
    question = next(q for q in history.questions if q.meta["question"] == "What is Ann's cat called?")
    plan = plan_of(model, tok, history, 100_000, top_k=2)
    retrieved, kept = plan.retrieved(question)
    assert any(history.turns[i].startswith("Ann: I adopted a cat named Tom.") for i in kept)
    assert kept == sorted(kept) and len(kept) <= 2
    assert 'Ann said, "I adopted a cat named Tom."' in retrieved.text
    tight = plan_of(model, tok, history, plan.length(retrieved) + 1, top_k=2)
    _, fewer = tight.retrieved(question)
    assert len(fewer) < len(kept)  # the lowest-ranked turn goes first when the window cannot hold both


# ---------------------------------------------------------------------- memory only
def test_memory_only_puts_no_history_token_in_the_prompt_or_kv_cache(model, tok, data, monkeypatch):
    bench = LoCoMo(data, max_new_tokens=3, limit=1)
    history = next(bench.histories())
    builder = plan_of(model, tok, history, 100_000).run.builder
    written = sum(map(len, builder.history_ids(history, False)))
    seen = []
    real = model.generate

    def spy(**kwargs):
        memory = kwargs["memory_cache"]
        seen.append(
            (kwargs["input_ids"][0].tolist(), kv_cache_in((), kwargs), int(memory.tokens_written.sum()))
        )
        return real(**kwargs)

    monkeypatch.setattr(model, "generate", spy)
    rows.evaluate_rows(model, tok, bench, None, rows=["memory-only"], **GREEDY)
    assert len(seen) == len(history.questions)
    for question, (ids, kv, tokens) in zip(history.questions, seen, strict=True):
        assert ids == builder.question_ids(history, question, False)  # the question alone
        text = tok.decode(ids)
        assert "DATE: " not in text and "said," not in text and "Below is" not in text and kv is None
        assert tokens == written  # the whole history is in memory


# ---------------------------------------------------------------------- resume, intervals, the CLI
def test_an_interrupted_row_run_resumes_without_answering_finished_histories(
    model, tok, data, tmp_path, monkeypatch
):
    bench = LoCoMo(data, max_new_tokens=3)
    settings = dict(rows=["no-context", "bm25"], window=4000, **GREEDY)
    rows.evaluate_rows(model, tok, bench, tmp_path / "whole", **settings)
    original, calls = rows.answer_row, []

    def interrupted(plan, row):
        calls.append((plan.history.id, row))
        if len(calls) == 4:  # the second conversation's bm25 row
            raise KeyboardInterrupt
        yield from original(plan, row)

    monkeypatch.setattr(rows, "answer_row", interrupted)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        rows.evaluate_rows(model, tok, bench, out, **settings)
    calls.clear()

    def counting(plan, row):
        calls.append((plan.history.id, row))
        yield from original(plan, row)

    monkeypatch.setattr(rows, "answer_row", counting)
    with pytest.raises(ValueError, match="other settings.*window: 4000 then, 3000 now"):
        rows.evaluate_rows(model, tok, bench, out, **{**settings, "window": 3000}, resume=True)
    rows.evaluate_rows(model, tok, bench, out, **settings, resume=True)
    assert calls == [("conv-b", "no-context"), ("conv-b", "bm25")]  # the finished conversation is kept

    def answers(path):
        return [
            (r["system"], r["id"], r["prediction"], r["scores"]) for r in lines(path / "predictions.jsonl")
        ]

    assert answers(out) == answers(tmp_path / "whole")
    resumed, whole = (json.loads((d / "summary.json").read_text()) for d in (out, tmp_path / "whole"))
    assert resumed["results"] == whole["results"] and resumed["costs"].keys() == whole["costs"].keys()
    assert not (tmp_path / "resumed.partial").exists()


def test_bootstrap_intervals_hold_the_point_estimate_and_depend_only_on_the_seed():
    generator = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 40, 300):
        values = torch.rand(n, generator=generator).round(decimals=1).tolist()
        low, high = row_report.bootstrap_interval(values, 500, seed=3)
        mean = sum(values) / n
        assert low <= mean <= high
        assert row_report.bootstrap_interval(values, 500, seed=3) == [low, high]
    values = torch.rand(40, generator=generator).tolist()
    assert row_report.bootstrap_interval(values, 500, seed=1) != row_report.bootstrap_interval(
        values, 500, seed=2
    )
    assert row_report.bootstrap_interval([], 500) == [] and row_report.bootstrap_interval([0.5] * 3) == [
        0.5,
        0.5,
    ]
    records = [{"group": "a", "scores": {"f1": v}} for v in (0.0, 1.0, 1.0)] + [
        {"group": "b", "scores": {"f1": 0.5}}
    ]
    summary = {
        "groups": {"a": {"f1": 2 / 3, "questions": 3}, "b": {"f1": 0.5, "questions": 1}},
        "overall": {},
    }
    summary["overall"] = {"f1": 0.625, "questions": 4}
    out = row_report.with_intervals(summary, records, ("f1",), 200, 0)
    assert out["groups"]["b"]["ci"] == {"f1": [0.5, 0.5]} and len(out["overall"]["ci"]["f1"]) == 2


def test_lstmem_eval_rows_from_the_command_line(model, tok, data, tmp_path, capsys):
    import lstmem_cli as cli

    model.get_base_model().save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    model.save_pretrained(tmp_path / "adapter")
    common = ["--model", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter"), "--greedy"]
    out = tmp_path / "out"
    code = cli.main(
        ["eval", "locomo", data, *common, "--out", str(out), "--rows", "no-context,bm25", "--window", "3000"]
        + ["--top-k", "2", "--bootstrap", "200", "--max-new-tokens", "2", "--limit", "1"]
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kind"] == "eval-rows" and summary["rows"] == ["no-context", "bm25"]
    assert summary["window"] == 3000 and summary["top_k"] == 2 and summary["bootstrap"]["resamples"] == 200
    assert summary["settings"]["adapter"] == str(tmp_path / "adapter")
    # the record names the file it was measured on: its SHA-256, and no official release for a fixture
    assert summary["settings"]["data_sha256"] == hashlib.sha256(open(data, "rb").read()).hexdigest()
    assert summary["settings"]["data_release"] is None
    assert "not an official release this harness knows" in (out / "results.md").read_text()
    costs = summary["costs"]["bm25"]
    assert costs["answer_s_per_question"] > 0 and costs["state_bytes_per_history"] == 0
    assert costs["full_history_kv_bytes"] > costs["context_kv_bytes_per_question"] > 0
    assert "| bm25 |" in capsys.readouterr().out
    hotpot = write_hotpot(tmp_path / "dev.json")
    for argv, message in [
        (["eval", "locomo", data, *common, "--rows", "full"], "--rows: unknown row 'full'"),
        (["eval", "locomo", data, *common, "--rows", "paper", "--memory-only"], "expected no --memory-only"),
        (["eval", "hotpotqa", hotpot, *common, "--rows", "window"], "only locomo has"),
        (["eval", "locomo", data, *common, "--window", "8192"], "go with --rows"),
    ]:
        assert cli.main(argv) == 2
        assert message in capsys.readouterr().err


def test_the_record_names_an_official_release_by_its_sha256(data, tmp_path, monkeypatch):
    from lstmem_peft.eval import locomo
    from lstmem_peft.eval.protocol import data_identity

    benchmark = LoCoMo(data, limit=1)
    fixture_sha = hashlib.sha256(open(data, "rb").read()).hexdigest()
    assert data_identity(benchmark, data) == {"data_sha256": fixture_sha, "data_release": None}
    assert data_identity(benchmark, str(tmp_path)) == {}  # a folder (or a Hub id): its revision names it
    assert len(locomo.OFFICIAL_DATA_SHA256) == 64 and locomo.OFFICIAL_DATA_SHA256 in LoCoMo.official_files
    monkeypatch.setattr(LoCoMo, "official_files", {fixture_sha: "the fixture as if released"})
    identity = data_identity(benchmark, data)
    assert identity["data_release"] == "the fixture as if released"
    line = row_report._release(identity)
    assert line == f" (SHA-256 {fixture_sha[:16]}..., the fixture as if released)"
