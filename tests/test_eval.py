"""The evaluation harness end to end on a tiny random model: protocols, snapshots, outputs, CLI."""

import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from eval_fixtures import write_hotpot, write_hotpot_hf_jsonl, write_locomo
from peft import get_peft_model

import lstmem_peft.engine
from lstmem_peft import LSTMemConfig
from lstmem_peft.eval import (
    Benchmark,
    Decoding,
    History,
    HotpotQA,
    LoCoMo,
    PromptBuilder,
    Question,
    evaluate,
)
from lstmem_peft.offline import char_tokenizer, tiny_qwen3

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return get_peft_model(tiny_qwen3(len(tok), hidden_size=64), LSTMemConfig()).eval()


@pytest.fixture
def locomo(tmp_path):
    return LoCoMo(write_locomo(tmp_path / "locomo10.json"), max_new_tokens=5)


class Reordered(Benchmark):
    """A benchmark with its questions (and optionally its histories) in another order."""

    def __init__(self, inner, reverse_histories=False, keep=None):
        self.inner, self.reverse_histories, self.keep = inner, reverse_histories, keep
        self.name, self.metrics = inner.name, inner.metrics

    def histories(self):
        items = [h for h in self.inner.histories() if self.keep is None or h.id in self.keep]
        for h in reversed(items) if self.reverse_histories else items:
            yield History(h.id, h.text, list(reversed(h.questions)), h.segments)

    def __len__(self):
        return len(self.inner)

    def score(self, question, prediction):
        return self.inner.score(question, prediction)

    def summarize(self, records):
        return self.inner.summarize(records)


def predictions(path):
    rows = [json.loads(line) for line in open(path / "predictions.jsonl")]
    return {(r["system"], r["id"]): r["prediction"] for r in rows}, rows


# ---------------------------------------------------------------------- LoCoMo and HotpotQA protocols
def test_locomo_official_protocol_replays_sessions_in_order_with_the_official_prompt(locomo):
    first, second = list(locomo.histories())
    assert len(first.segments) == 2 and "".join(first.segments) == first.text and first.system is None
    assert first.segments[0].startswith("Below is a conversation between two people: Ann and Bo.")
    assert first.text.index("DATE: 1:56 pm on 8 May, 2023") < first.text.index("DATE: 4:10 pm on 9 May, 2023")
    assert 'Ann said, "Well done!"\n' in first.text and "shared" not in first.text  # no img_file field
    assert first.text.endswith('"\n' + "\n\n" * 2)  # the code's per-session "\n\n", all at the end
    categories = [q.meta["category"] for q in first.questions]
    assert categories == [1, 2, 3, 4]  # category 5 excluded
    temporal = first.questions[1]
    assert temporal.prompt.startswith("\n\n\nBased on the above context, write an answer")
    assert temporal.prompt.endswith(
        "Question: When did Bo run a race? Use DATE of CONVERSATION to answer with an approximate date. "
        "Short answer:\n"
    )
    assert "Use DATE" not in first.questions[3].prompt
    assert all(q.max_new_tokens == 5 for q in first.questions)
    assert second.questions[1].answer == "2020"  # integer answers scored as text


def test_locomo_paper_protocol_has_its_system_prompt_and_question_prompt(tmp_path):
    first = next(LoCoMo(write_locomo(tmp_path / "l.json"), protocol="paper").histories())
    assert first.system.startswith("You are a helpful, respectful and honest assistant")
    assert first.segments[1].startswith("\nDATE: 4:10 pm on 9 May, 2023\nCONVERSATION:\n")  # oldest first
    assert 'Ann said, "Well done!"\n and shared a photo of a medal.\n' in first.text
    assert first.questions[0].prompt.startswith("\n\nBased on the above conversations, write a short answer")


def test_locomo_default_answer_limits_are_the_protocols(tmp_path):
    data = write_locomo(tmp_path / "l.json")
    for protocol, tokens in (("official", 32), ("paper", 50)):
        bench = LoCoMo(data, limit=1, protocol=protocol)
        assert len(bench) == 1 and {q.max_new_tokens for h in bench.histories() for q in h.questions} == {
            tokens
        }


def test_locomo_rejects_files_in_another_schema(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps([{"sample_id": "x", "qa": []}]))
    with pytest.raises(ValueError, match="conversation"):
        LoCoMo(str(tmp_path / "bad.json"))


def test_hotpotqa_reads_both_layouts_and_can_keep_only_supporting_passages(tmp_path):
    official = list(HotpotQA(write_hotpot(tmp_path / "dev.json")).histories())
    hub_layout = list(HotpotQA(write_hotpot_hf_jsonl(tmp_path / "dev.jsonl")).histories())
    assert [(h.id, h.text, h.questions[0].prompt) for h in official] == [
        (h.id, h.text, h.questions[0].prompt) for h in hub_layout
    ]
    first = official[0]
    assert first.text.startswith("Ada Lind: Ada Lind founded the Lind Museum. She was a painter.\n\n")
    assert "River Po" in first.text and first.questions[0].max_new_tokens == 32
    assert first.questions[0].group == "bridge" and first.questions[0].answer == "Turin"
    supporting = next(HotpotQA(write_hotpot(tmp_path / "d2.json"), passages="supporting").histories())
    assert "River Po" not in supporting.text and "Lind Museum:" in supporting.text


# ---------------------------------------------------------------------- prompts
@pytest.mark.parametrize("template", [TEMPLATE, TEMPLATE.replace("m['content']", "m['content'] | trim")])
def test_prompt_builder_splits_the_chat_prompt_into_history_and_question(locomo, template):
    tok = char_tokenizer()
    tok.chat_template = template
    history = next(locomo.histories())
    question = history.questions[0]
    builder = PromptBuilder(tok)
    pieces = builder.history_ids(history)
    full = tok.apply_chat_template(
        [{"role": "user", "content": history.text + question.prompt}],
        tokenize=False,
        add_generation_prompt=True,
    )
    joined = sum(pieces, []) + builder.question_ids(history, question)
    assert joined == tok(full, add_special_tokens=False)["input_ids"]
    assert len(pieces) == 2 and tok.decode(pieces[1]) == history.segments[1]
    alone = builder.question_ids(history, question, in_prompt=False)  # memory-only: the question alone
    assert tok.decode(alone).startswith("[user] Based on the above context") and tok.decode(alone).endswith(
        "[assistant] "
    )


def test_prompt_builder_refuses_a_template_that_rewrites_the_history(locomo):
    tok = char_tokenizer()
    tok.chat_template = TEMPLATE.replace("m['content']", "m['content'] | upper")
    with pytest.raises(ValueError, match="chat_template=False"):
        PromptBuilder(tok).history_ids(next(locomo.histories()))
    with pytest.raises(ValueError, match="no chat template"):
        PromptBuilder(char_tokenizer(), chat_template=True)


def test_decoding_defaults_are_the_papers():
    assert Decoding().generate_kwargs() == {"do_sample": True, "temperature": 0.4, "top_p": 0.9, "top_k": 10}
    assert Decoding().seed == 42
    assert Decoding(greedy=True).generate_kwargs()["do_sample"] is False


# ---------------------------------------------------------------------- the runner's memory protocol
def test_every_question_starts_from_the_same_snapshot_written_in_blocks_with_feedback(
    model, tok, locomo, monkeypatch
):
    calls, feedbacks = [], []
    real_feedback = lstmem_peft.engine.block_feedback

    def counting_feedback(*args, **kwargs):
        feedbacks.append(1)
        return real_feedback(*args, **kwargs)

    real_generate = model.generate

    def spy(**kwargs):
        memory = kwargs.get("memory_cache")
        kv = kwargs.get("past_key_values")
        calls.append(
            {
                "memory": None
                if memory is None
                else [(s.cell.clone(), s.hidden.clone()) for s in memory.layers],
                "memory_object": memory,  # kept alive, so ids below are distinct objects
                "written": None if memory is None else int(memory.tokens_written.sum()),
                "kv": None if kv is None else kv.get_seq_length(),
                "input": kwargs["input_ids"].shape[1],
            }
        )
        return real_generate(**kwargs)

    monkeypatch.setattr(lstmem_peft.engine, "block_feedback", counting_feedback)
    monkeypatch.setattr(model, "generate", spy)
    block = 64
    history = next(locomo.histories())
    pieces = PromptBuilder(tok).history_ids(history)
    history_tokens = sum(map(len, pieces))
    single = Reordered(locomo, keep={history.id})
    evaluate(model, tok, single, None, block_size=block, progress=False)

    n = len(history.questions)
    lstmem, base = calls[n:], calls[:n]  # the backbone runs first
    # history written block by block, sessions one after another, feedback after every block
    assert len(feedbacks) == sum(math.ceil(len(p) / block) for p in pieces)
    assert all(c["kv"] == history_tokens and c["input"] > history_tokens for c in calls)
    assert all(c["memory"] is None for c in base)
    assert len({id(c["memory_object"]) for c in lstmem}) == n  # a fresh copy per question
    assert all(c["written"] == history_tokens for c in lstmem)
    reference = lstmem[0]["memory"]
    assert any(h.abs().sum() > 0 for _, h in reference)
    for c in lstmem[1:]:
        for (cell, hidden), (cell0, hidden0) in zip(c["memory"], reference, strict=True):
            assert torch.equal(cell, cell0) and torch.equal(hidden, hidden0)


def test_scores_do_not_depend_on_question_or_history_order(model, tok, locomo, tmp_path):
    evaluate(model, tok, locomo, tmp_path / "a", block_size=64, progress=False)
    evaluate(
        model, tok, Reordered(locomo, reverse_histories=True), tmp_path / "b", block_size=64, progress=False
    )
    evaluate(model, tok, Reordered(locomo, keep={"conv-b"}), tmp_path / "c", block_size=64, progress=False)
    a, rows = predictions(tmp_path / "a")
    b, _ = predictions(tmp_path / "b")
    c, _ = predictions(tmp_path / "c")
    assert a == b
    assert {k: v for k, v in a.items() if k[1].startswith("conv-b")} == c  # memory reset per history
    assert len(rows) == 2 * 6 and {r["system"] for r in rows} == {"base", "lstmem"}


def test_memory_only_mode_keeps_the_history_out_of_the_prompt(model, tok, tmp_path, monkeypatch):
    bench = HotpotQA(write_hotpot(tmp_path / "dev.json"), max_new_tokens=4)
    seen = []
    real_generate = model.generate

    def spy(**kwargs):
        seen.append((kwargs["input_ids"].shape[1], "past_key_values" in kwargs, kwargs.get("memory_cache")))
        return real_generate(**kwargs)

    monkeypatch.setattr(model, "generate", spy)
    summary = evaluate(
        model, tok, bench, tmp_path / "out", memory_only=True, decoding=Decoding(greedy=True), progress=False
    )
    assert summary["mode"] == "memory-only"
    question_len = len(tok(next(bench.histories()).questions[0].prompt.lstrip())["input_ids"])
    base, lstmem = seen[0], seen[1]
    assert base[0] == question_len and not base[1] and base[2] is None
    assert lstmem[0] == question_len and not lstmem[1] and lstmem[2].tokens_written is not None


def test_outputs_put_the_backbone_and_the_adapter_side_by_side(model, tok, tmp_path):
    bench = HotpotQA(write_hotpot(tmp_path / "dev.json"), max_new_tokens=3)
    summary = evaluate(model, tok, bench, tmp_path / "out", progress=False, run_info={"model": "tiny"})
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert saved["systems"].keys() == {"base", "lstmem"} and saved["model"] == "tiny"
    assert saved["decoding"] == {"greedy": False, "temperature": 0.4, "top_p": 0.9, "top_k": 10, "seed": 42}
    assert saved["questions"] == 2 and saved["block_size"] == 2048
    assert summary["systems"]["lstmem"]["overall"]["questions"] == 2
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| backbone em | LSTMem em | Δ em | backbone f1 | LSTMem f1 | Δ f1 |" in table
    assert "| bridge | 1 |" in table and "**overall**" in table
    _, rows = predictions(tmp_path / "out")
    record = rows[0]
    assert set(record) >= {"system", "history", "id", "group", "prediction", "gold", "scores"}
    assert record["scores"] == bench.score(next(bench.histories()).questions[0], record["prediction"])


def test_a_plain_model_is_evaluated_as_the_backbone_only(tok, tmp_path):
    plain = tiny_qwen3(len(tok), hidden_size=64)
    bench = HotpotQA(write_hotpot(tmp_path / "dev.json"), max_new_tokens=2, limit=1)
    summary = evaluate(plain, tok, bench, None, progress=False)
    assert list(summary["systems"]) == ["base"]


# ---------------------------------------------------------------------- command line
@pytest.mark.slow
def test_lstmem_eval_cli_runs_offline_on_local_files(model, tok, tmp_path):
    model.get_base_model().save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    model.save_pretrained(tmp_path / "adapter")
    data = write_locomo(tmp_path / "locomo10.json")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lstmem_peft.cli",
            "eval",
            "locomo",
            data,
            "--model",
            str(tmp_path / "base"),
            "--adapter",
            str(tmp_path / "adapter"),
            "--out",
            str(tmp_path / "out"),
            "--max-new-tokens",
            "3",
            "--block-size",
            "128",
            "--greedy",
            "--limit",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| **overall** | 4 |" in result.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["adapter"] == str(tmp_path / "adapter") and summary["decoding"]["greedy"] is True
    assert list(summary["systems"]["lstmem"]["groups"]) == [
        "multi-hop",
        "temporal",
        "open-domain",
        "single-hop",
    ]
    assert len((tmp_path / "out" / "predictions.jsonl").read_text().splitlines()) == 8


def test_lstmem_eval_mab_end_to_end_with_family_scores(model, tok, tmp_path, monkeypatch):
    import nltk
    from eval_fixtures import ROWS, write_snapshot

    # the official sentence splitter needs nltk's punkt data, which offline test machines may lack
    monkeypatch.setattr(nltk, "sent_tokenize", lambda text: [s + "." for s in text.split(". ")])

    from lstmem_peft import cli

    model.get_base_model().save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    model.save_pretrained(tmp_path / "adapter")
    snapshot = write_snapshot(tmp_path / "mab", ROWS)
    out = tmp_path / "out"
    code = cli.main(
        [
            "eval",
            "mab",
            str(snapshot),
            "--model",
            str(tmp_path / "base"),
            "--adapter",
            str(tmp_path / "adapter"),
            "--out",
            str(out),
            "--max-new-tokens",
            "3",
            "--limit",
            "1",
            "--chunk-tokenizer",
            "model",
        ]
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["protocol"] == "official" and summary["settings"]["chunk_tokens"] == "custom"
    families = summary["systems"]["lstmem"]["families"]
    assert list(families) == ["AR", "TTL", "LRU", "SF"]
    assert sum(f["questions"] for f in families.values()) == summary["questions"] == 2 + 2 + 1 + 2
    table = (out / "results.md").read_text()
    assert "| *AR* | 2 |" in table and "| ruler_qa1_197K | 2 |" in table
    assert "LSTMem score (official)" in table and "backbone score (paper)" in table
    assert "LSTMem score (paper)" in table and (out / "scores.png").stat().st_size > 0
    assert summary["by_protocol"]["official"] == summary["systems"]

    # re-scored under the paper protocol without generating: the paper column of the same run
    rescored = tmp_path / "rescored"
    code = cli.main(
        ["eval", "mab", str(snapshot), "--rescore", str(out / "predictions.jsonl")]
        + ["--protocol", "paper", "--out", str(rescored)]
    )
    assert code == 0
    again = json.loads((rescored / "summary.json").read_text())
    assert again["protocol"] == "paper" and again["generated"]["protocol"] == "official"
    assert again["systems"] == summary["by_protocol"]["paper"]
    before = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    after = [json.loads(line) for line in (rescored / "predictions.jsonl").read_text().splitlines()]
    assert [r["prediction"] for r in after] == [r["prediction"] for r in before]
    with pytest.raises(SystemExit, match="--split does not apply"):
        cli.main(["eval", "mab", str(snapshot), "--model", "x", "--split", "test"])


def test_lstmem_eval_mab_paper_writes_the_pre_clipped_context(model, tok, tmp_path, monkeypatch):
    from eval_fixtures import mab_row, write_snapshot

    from lstmem_peft import cli
    from lstmem_peft.eval import mab, runner

    written = []
    real_history_ids = runner.PromptBuilder.history_ids

    def spy(self, history, in_prompt=True):
        pieces = real_history_ids(self, history, in_prompt)
        written.append((history.text, self.tokenizer.decode(sum(pieces, []), skip_special_tokens=True)))
        return pieces

    monkeypatch.setattr(runner.PromptBuilder, "history_ids", spy)
    model.get_base_model().save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    model.save_pretrained(tmp_path / "adapter")
    context = "".join(str(i % 10) for i in range(150))  # 150 characters, no whitespace
    rows = {"Accurate_Retrieval": [mab_row("ruler_qa1_197K", context, ["Which digit?"], [["7"]])]}
    snapshot = write_snapshot(tmp_path / "mab", rows)
    out = tmp_path / "out"
    argv = ["eval", "mab", str(snapshot), "--model", str(tmp_path / "base"), "--adapter"]
    argv += [str(tmp_path / "adapter"), "--out", str(out), "--protocol", "paper", "--max-context-chars"]
    argv += ["100", "--max-new-tokens", "2", "--no-base", "--no-plot", "--block-size", "64"]
    assert cli.main(argv) == 0
    # limit 100: room 100 - 31 = 69, head 69 // 3 = 23, tail 46, from 150 - 46 = 104
    clipped = context[:23] + "\n\n[... context truncated ...]\n\n" + context[104:]
    assert written == [(mab.PAPER_HEAD + clipped, mab.PAPER_HEAD + clipped)]  # no chat template here
    summary = json.loads((out / "summary.json").read_text())
    assert summary["protocol"] == "paper" and summary["settings"]["max_context_chars"] == 100
    with pytest.raises(SystemExit, match="--protocol paper only"):
        cli.main(["eval", "mab", str(snapshot), "--model", "x", "--max-context-chars", "100"])
    with pytest.raises(SystemExit, match="expected 0"):
        cli.main(argv[:3] + ["--model", "x", "--protocol", "paper", "--max-context-chars", "-1"])


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["demo", "--episodes", "0"], 2, "expected a positive integer, got 0"),
        (["demo", "--episodes", "-1"], 2, "expected a positive integer, got -1"),
        (["demo", "--model", "/nonexistent/model"], 1, "--model /nonexistent/model: no such file or folder"),
        (
            ["eval", "locomo", "/no/such/locomo10.json", "--model", "x/y"],
            1,
            "DATA /no/such/locomo10.json: no such",
        ),
        (["eval", "hotpotqa", "{data}", "--model", "/nonexistent"], 1, "--model /nonexistent: no such"),
        (["eval", "locomo", "{bad}", "--model", "x/y"], 1, "error: "),
        (["bench", "generate", "--reps", "0"], 2, "expected a positive integer"),
    ],
)
def test_cli_user_errors_are_one_line_and_nonzero(argv, code, message, tmp_path, capsys):
    from lstmem_peft import cli

    data = write_hotpot(tmp_path / "dev.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2, 3")
    argv = [a.format(data=data, bad=bad) for a in argv]
    try:
        result = cli.main(argv)
    except SystemExit as exit_:  # argparse's usage errors
        result = exit_.code
    err = capsys.readouterr().err
    assert result == code and message in err.strip().splitlines()[-1]  # one line says what is wrong
    assert "Traceback" not in err


def test_a_failed_eval_run_leaves_the_previous_outputs_intact(model, tok, tmp_path, monkeypatch):
    from lstmem_peft.eval import runner

    bench = HotpotQA(write_hotpot(tmp_path / "dev.json"), max_new_tokens=2)
    out = tmp_path / "out"
    evaluate(model, tok, bench, out, progress=False, decoding=Decoding(greedy=True))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"predictions.jsonl", "summary.json", "results.md", "scores.png"}
    calls = []
    original = runner._answer

    def failing(run, history, system):
        calls.append(system)
        if len(calls) > 1:
            raise RuntimeError("out of memory")
        yield from original(run, history, system)

    monkeypatch.setattr(runner, "_answer", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        evaluate(model, tok, bench, out, progress=False, decoding=Decoding(greedy=True))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing truncated or mixed


# ---------------------------------------------------------------------- Hub dataset ids (offline cache)
@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_benchmarks_load_hub_dataset_ids_through_the_offline_cache(offline_hub, tmp_path):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from eval_fixtures import ENTITIES, ROWS, hotpot_examples, hub_dataset, locomo_samples

    from lstmem_peft.eval import MemoryAgentBench

    def parquet(rows):
        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buffer)
        return buffer.getvalue()

    hub_dataset(
        offline_hub, "snap/locomo", {"data/locomo10.json": json.dumps(locomo_samples()), "README.md": "card"}
    )
    assert [h.id for h in LoCoMo("snap/locomo").histories()] == ["conv-a", "conv-b"]

    hf_rows = [json.loads(line) for line in open(write_hotpot_hf_jsonl(tmp_path / "h.jsonl"))]
    hub_dataset(
        offline_hub,
        "hotpotqa/hotpot_qa",
        {
            "distractor/validation-00000-of-00001.parquet": parquet(hf_rows),
            "distractor/train-00000-of-00001.parquet": parquet(hf_rows[:1]),
            "fullwiki/validation-00000-of-00001.parquet": parquet(hf_rows[:1]),
        },
    )
    bench = HotpotQA("hotpotqa/hotpot_qa/distractor")  # split "validation" by default
    assert [h.id for h in bench.histories()] == [e["_id"] for e in hotpot_examples()]
    with pytest.raises(FileNotFoundError, match="no data file named after split 'test'"):
        HotpotQA("hotpotqa/hotpot_qa/distractor", split="test")

    files = {f"data/{split}-00000-of-00001.parquet": parquet(rows) for split, rows in ROWS.items()}
    hub_dataset(offline_hub, "ai-hyz/MemoryAgentBench", {**files, "entity2id.json": json.dumps(ENTITIES)})
    mab = MemoryAgentBench(
        "ai-hyz/MemoryAgentBench", families=("TTL",), count_tokens=len, split_sentences=str.splitlines
    )
    redial = [q for h in mab.histories() for q in h.questions if q.group == "recsys_redial_full"]
    assert redial and redial[0].meta["gold_titles"] == [
        "Spider Man",
        "Up",
    ]  # ids named through entity2id.json


def test_a_hub_id_missing_from_the_offline_cache_fails_clearly(offline_hub):
    from huggingface_hub.errors import LocalEntryNotFoundError

    with pytest.raises(LocalEntryNotFoundError):
        LoCoMo("nobody/nothing")


def test_a_ten_conversation_file_is_checked_against_locomo10s_question_count(tmp_path):
    from eval_fixtures import locomo_samples

    samples = [dict(s, sample_id=f"c{i}") for i in range(5) for s in locomo_samples()]
    (tmp_path / "l.json").write_text(json.dumps(samples))
    with pytest.warns(UserWarning, match="30 category 1-4 questions, not LoCoMo-10's 1540"):
        LoCoMo(str(tmp_path / "l.json"))


# ---------------------------------------------------------------------- system prompts, resume
def test_prompt_builder_puts_the_protocols_system_message_first(tok):
    tok = copy.deepcopy(tok)
    tok.chat_template = TEMPLATE
    history = History("h", "HISTORY TEXT. ", [], system="SYSTEM TEXT")
    question = Question("q", "QUESTION?", "a", 1, "g")
    builder = PromptBuilder(tok)
    ids = [i for part in builder.history_ids(history) for i in part] + builder.question_ids(history, question)
    assert tok.decode(ids) == "[system] SYSTEM TEXT\n[user] HISTORY TEXT. QUESTION?\n[assistant] "
    plain = PromptBuilder(tok, chat_template=False)
    ids = [i for part in plain.history_ids(history) for i in part] + plain.question_ids(history, question)
    assert tok.decode(ids, skip_special_tokens=True) == "SYSTEM TEXT\n\nHISTORY TEXT. QUESTION?"


def test_an_interrupted_run_resumes_to_the_outputs_of_an_uninterrupted_run(model, tok, tmp_path, monkeypatch):
    from lstmem_peft.eval import runner

    bench = LoCoMo(write_locomo(tmp_path / "locomo10.json"), max_new_tokens=3)
    settings = dict(progress=False, block_size=64, run_info={"model": "tiny"})
    evaluate(model, tok, bench, tmp_path / "whole", **settings)

    original, answered = runner._answer, []

    def interrupted(run, history, system):  # fails on the second history's LSTMem pass
        answered.append((history.id, system))
        if len(answered) == 4:
            raise KeyboardInterrupt
        yield from original(run, history, system)

    monkeypatch.setattr(runner, "_answer", interrupted)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        evaluate(model, tok, bench, out, **settings)
    partial = (tmp_path / "resumed.partial" / "predictions.jsonl").read_text().splitlines()
    first, second = (len(h.questions) for h in bench.histories())
    assert len(partial) == 2 * first + second  # conversation 1 for both systems, 2 for the backbone

    calls = []

    def counting(run, history, system):
        calls.append((history.id, system))
        yield from original(run, history, system)

    monkeypatch.setattr(runner, "_answer", counting)
    with pytest.raises(ValueError, match="other settings.*block_size: 64 then, 32 now"):
        evaluate(model, tok, bench, out, **{**settings, "block_size": 32}, resume=True)
    assert calls == []
    evaluate(model, tok, bench, out, **settings, resume=True)
    assert calls == [("conv-b", "base"), ("conv-b", "lstmem")]  # the finished conversation is kept
    assert (out / "predictions.jsonl").read_text() == (tmp_path / "whole" / "predictions.jsonl").read_text()
    whole, resumed = (json.loads((d / "summary.json").read_text()) for d in (tmp_path / "whole", out))
    assert {k: v for k, v in resumed.items() if k != "date"} == {
        k: v for k, v in whole.items() if k != "date"
    }
    assert (out / "results.md").read_text() == (tmp_path / "whole" / "results.md").read_text()
    assert not (tmp_path / "resumed.partial").exists() and not (out / "settings.json").exists()
