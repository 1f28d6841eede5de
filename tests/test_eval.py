"""The evaluation harness end to end on a tiny random model: protocols, snapshots, outputs, CLI."""

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from eval_fixtures import write_hotpot, write_hotpot_hf_jsonl, write_locomo
from peft import get_peft_model

import lstmem_peft.memory.feedback
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
from lstmem_peft.tuner.kv_argument import kv_cache_in
from lstmem_peft.utils.offline import char_tokenizer, tiny_qwen3

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
def test_locomo_official_protocol_replays_sessions_in_prompt_order_with_the_official_prompt(locomo):
    first, second = list(locomo.histories())
    assert len(first.segments) == 2 and "".join(first.segments) == first.text and first.system is None
    assert first.segments[0].startswith("Below is a conversation between two people: Ann and Bo.")
    # the pinned code lists the newest session first; memory reads the sessions in that order
    assert first.text.index("DATE: 4:10 pm on 9 May, 2023") < first.text.index("DATE: 1:56 pm on 8 May, 2023")
    assert first.segments[1].startswith("DATE: 1:56 pm on 8 May, 2023\nCONVERSATION:\n")
    assert 'Ann said, "Well done!"\n and shared a photo of a medal.\n' in first.text  # blip_caption
    assert first.text.endswith('"\n\n' + "\n\n" * 2)  # the code's per-session "\n\n", all at the end
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


def test_locomo_official_prompt_is_the_pinned_official_code_s_exactly(tmp_path):
    """snap-research/locomo @ 3eb6f2c, task_eval/gpt_utils.py (get_input_context, then
    query_conv + "\n\n" + QA_PROMPT), written out by hand: newest session first, a blank line after
    each turn, " and shared <blip_caption>." after an image turn's line, the per-session "\n\n" all at
    the end (three sessions: session_4 has a date but no turns list), no system message."""
    from eval_fixtures import locomo_official_sample

    from lstmem_peft.eval import locomo as locomo_module

    assert locomo_module.OFFICIAL_COMMIT == "3eb6f2c585f5e1699204e3c3bdf7adc5c28cb376"
    assert locomo_module.OFFICIAL_COMMIT in locomo_module.__doc__
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert locomo_module.OFFICIAL_COMMIT in readme  # the README names the pinned commit
    path = tmp_path / "locomo10.json"
    path.write_text(json.dumps([locomo_official_sample()]))
    (history,) = LoCoMo(str(path)).histories()
    opening = (
        "Below is a conversation between two people: Caroline and Melanie. The conversation takes place over "
        "multiple days and the date of each conversation is wriiten at the beginning of the conversation.\n\n"
    )
    session_3 = 'DATE: 7:55 pm on 9 June, 2023\nCONVERSATION:\nCaroline said, "She said "go"."\n\n'
    session_2 = (
        "DATE: 1:14 pm on 25 May, 2023\nCONVERSATION:\n"
        'Melanie said, "I ran a charity race."\n\n'
        'Caroline said, "Look at this."\n and shared a photo of a medal.\n'
    )
    session_1 = (
        "DATE: 1:56 pm on 8 May, 2023\nCONVERSATION:\n"
        'Caroline said, "Hey Mel!"\n\n'
        'Melanie said, "Hi Caroline, how are you?"\n\n'
    )
    assert history.segments == [opening + session_3, session_2, session_1 + "\n\n" * 3]
    assert history.text == opening + session_3 + session_2 + session_1 + "\n\n\n\n\n\n"
    assert history.system is None and history.id == "conv-26"
    (question,) = history.questions  # the category-5 question is not asked
    assert history.text + question.prompt == (
        opening
        + session_3
        + session_2
        + session_1
        + "\n\n" * 3
        + "\n\n"
        + "\nBased on the above context, write an answer in the form of a short phrase for the following "
        "question. Answer with exact words from the context whenever possible.\n\n"
        "Question: What did Melanie run? Short answer:\n"
    )
    assert question.max_new_tokens == 32 and question.answer == "a charity race"


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
    real_feedback = lstmem_peft.memory.feedback.block_feedback

    def counting_feedback(*args, **kwargs):
        feedbacks.append(1)
        return real_feedback(*args, **kwargs)

    real_generate = model.generate

    def spy(**kwargs):
        memory = kwargs.get("memory_cache")
        kv = kv_cache_in((), kwargs)  # under the name the installed transformers uses
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

    monkeypatch.setattr(
        lstmem_peft.memory.feedback, "block_feedback", counting_feedback
    )  # BlockEnds calls it
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
            "lstmem_cli",
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


def test_lstmem_eval_mab_end_to_end_with_family_scores(model, tok, tmp_path, monkeypatch, capsys):
    import nltk
    from eval_fixtures import ROWS, write_snapshot

    # the official sentence splitter needs nltk's punkt data, which offline test machines may lack
    monkeypatch.setattr(nltk, "sent_tokenize", lambda text: [s + "." for s in text.split(". ")])

    import lstmem_cli as cli

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
    capsys.readouterr()
    assert cli.main(["eval", "mab", str(snapshot), "--model", "x", "--split", "test"]) == 2
    assert "--split does not apply" in capsys.readouterr().err


def test_lstmem_eval_mab_paper_writes_the_pre_clipped_context(model, tok, tmp_path, monkeypatch, capsys):
    from eval_fixtures import mab_row, write_snapshot

    import lstmem_cli as cli
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
    capsys.readouterr()
    assert cli.main(["eval", "mab", str(snapshot), "--model", "x", "--max-context-chars", "100"]) == 2
    assert "--protocol paper only" in capsys.readouterr().err
    assert cli.main(argv[:3] + ["--model", "x", "--protocol", "paper", "--max-context-chars", "-1"]) == 2
    assert "expected 0 (no clipping) or more, got -1" in capsys.readouterr().err


# ---------------------------------------------------------------------- bad files, formats and options
def bad_inputs(root: Path) -> dict[str, str]:
    """The files the table below names, written under ``root`` (``{name}`` in an argv)."""
    from eval_fixtures import locomo_samples

    def write(name: str, text: str | bytes) -> str:
        path = root / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(path)

    def folder(name: str, files: dict[str, str] = {}) -> str:  # noqa: B006 (never changed)
        (root / name).mkdir()
        for file, text in files.items():
            (root / name / file).write_text(text)
        return str(root / name)

    sample = locomo_samples()[1]
    no_date = {**sample, "conversation": {k: v for k, v in sample["conversation"].items() if "date" not in k}}
    bad_category = {**sample, "qa": [{"question": "q?", "answer": "a", "category": "temporal"}]}
    return {
        "locomo": write("locomo10.json", json.dumps(locomo_samples())),
        "hotpot": write_hotpot(root / "dev.json"),
        "missing": str(root / "missing.json"),
        "not_json": write("not_json.json", "hello"),
        "empty": write("empty.json", ""),
        "cut": write("cut.json", "[1, 2, 3"),
        "other_shape": write("other_shape.json", json.dumps({"a": 1, "b": [2]})),
        "numbers": write("numbers.json", "[1, 2, 3]"),
        "empty_list": write("empty_list.json", "[]"),
        "one_sample": write("one_sample.json", json.dumps(sample)),
        "no_conversation": write("no_conversation.json", json.dumps([{"sample_id": "x", "qa": []}])),
        "no_dates": write("no_dates.json", json.dumps([no_date])),
        "bad_category": write("bad_category.json", json.dumps([bad_category])),
        "bad_context": write(
            "bad_context.json", json.dumps([{"question": "q", "answer": "a", "context": 3}])
        ),
        "bad_jsonl": write("bad.jsonl", json.dumps(sample) + "\n{not json\n"),
        "csv": write("data.csv", "question,answer\nq,a\n"),
        "not_parquet": write("data.parquet", b"PAR1 not really"),
        "not_utf8": write("latin1.json", b"[\xff\xfe]"),
        "mab_row": write("Accurate_Retrieval.jsonl", json.dumps({"context": "c", "questions": ["q"]}) + "\n"),
        "empty_dir": folder("empty_dir"),
        "file": write("a_file.txt", "x"),
        "model_dir": folder("model_without_config", {"weights.txt": "x"}),
        "adapter_dir": folder("adapter_without_config", {"config.json": "{}"}),
        "predictions": write("predictions.jsonl", json.dumps({"id": "q1", "prediction": "x"}) + "\n"),
        "records": folder("records", {"decode-cpu-1.json": "{not json"}),
        "keys": write("keys.txt", "# no key here\n\n"),
    }


LOCOMO_EXPECTED = "expected the LoCoMo JSON list of samples"
HOTPOT_EXPECTED = "expected HotpotQA distractor examples"
MAB_EXPECTED = "expected MemoryAgentBench rows"
M = ["--model", "x/y"]  # a Hub id: never contacted, the inputs are refused first

# (argv with {file} names from bad_inputs, the file named in the message, words the message must hold)
BAD_INPUTS = [
    # lstmem eval locomo DATA
    (["eval", "locomo", "{missing}", *M], "missing", ["no such file or folder", LOCOMO_EXPECTED]),
    (["eval", "locomo", "{not_json}", *M], "not_json", ["not JSON (Expecting value", LOCOMO_EXPECTED]),
    (["eval", "locomo", "{empty}", *M], "empty", ["the file is empty", LOCOMO_EXPECTED]),
    (["eval", "locomo", "{cut}", *M], "cut", ["not JSON", LOCOMO_EXPECTED]),
    (
        ["eval", "locomo", "{other_shape}", *M],
        "other_shape",
        ["an object with keys ['a', 'b']", "locomo10.json"],
    ),
    (["eval", "locomo", "{numbers}", *M], "numbers", ["a list of 3 item(s) (numbers)", LOCOMO_EXPECTED]),
    (["eval", "locomo", "{empty_list}", *M], "empty_list", ["no records", LOCOMO_EXPECTED]),
    (["eval", "locomo", "{one_sample}", *M], "one_sample", ["one record", "not a list", "[ ]"]),
    (["eval", "locomo", "{no_conversation}", *M], "no_conversation", ["has no 'conversation' field"]),
    (["eval", "locomo", "{no_dates}", *M], "no_dates", ["session_1 has no session_1_date_time"]),
    (["eval", "locomo", "{bad_category}", *M], "bad_category", ["category 'temporal', not a number 1-5"]),
    (["eval", "locomo", "{hotpot}", *M], "hotpot", ["has no 'conversation' field", LOCOMO_EXPECTED]),
    (["eval", "locomo", "{bad_jsonl}", *M], "bad_jsonl", ["line 2 is not JSON", LOCOMO_EXPECTED]),
    (["eval", "locomo", "{csv}", *M], "csv", ["not JSON", ".json, .jsonl or .parquet"]),
    (["eval", "locomo", "{not_parquet}", *M], "not_parquet", ["not a Parquet file", LOCOMO_EXPECTED]),
    (["eval", "locomo", "{not_utf8}", *M], "not_utf8", ["not UTF-8 text", LOCOMO_EXPECTED]),
    (["eval", "locomo", "{empty_dir}", *M], "empty_dir", ["no .json, .jsonl or .parquet file", "a folder"]),
    # lstmem eval hotpotqa DATA
    (["eval", "hotpotqa", "{locomo}", *M], "locomo", ["has no 'question' field", HOTPOT_EXPECTED]),
    (["eval", "hotpotqa", "{other_shape}", *M], "other_shape", ["an object with keys", HOTPOT_EXPECTED]),
    (
        ["eval", "hotpotqa", "{bad_context}", *M],
        "bad_context",
        ['"context" is a number (3)', HOTPOT_EXPECTED],
    ),
    (["eval", "hotpotqa", "{missing}", *M], "missing", ["no such file or folder", "hotpot_dev_distractor"]),
    # lstmem eval mab DATA
    (["eval", "mab", "{other_shape}", *M], "other_shape", ["an object with keys", MAB_EXPECTED]),
    (["eval", "mab", "{mab_row}", *M], "mab_row", ["row 0: missing answers, metadata", MAB_EXPECTED]),
    (
        ["eval", "mab", "{empty_dir}", *M],
        "empty_dir",
        ["named after a split", "a folder holding MemoryAgentBench"],
    ),
    (["eval", "mab", "{not_parquet}", *M], "not_parquet", ["not a Parquet file", MAB_EXPECTED]),
    (["eval", "mab", "{missing}", *M], "missing", ["no such file or folder", "ai-hyz/MemoryAgentBench"]),
    # lstmem eval: --rescore, --model, --adapter, --out, --entity-map and option errors
    (
        ["eval", "locomo", "{locomo}", "--rescore", "{missing}"],
        "missing",
        ["no such file", "predictions.jsonl"],
    ),
    (["eval", "locomo", "{locomo}", "--rescore", "{not_json}"], "not_json", ["line 1 is not JSON"]),
    (["eval", "locomo", "{locomo}", "--rescore", "{predictions}"], "predictions", ["has no 'system' field"]),
    (
        ["eval", "locomo", "{locomo}", "--rescore", "{empty_dir}"],
        "empty_dir",
        ["a folder", "predictions.jsonl"],
    ),
    (["eval", "locomo", "{locomo}", "--model", "{model_dir}"], "model_dir", ["without config.json"]),
    (["eval", "locomo", "{locomo}", "--model", "{file}"], "file", ["a file, not a folder", "model folder"]),
    (["eval", "locomo", "{locomo}", "--model", "{missing}"], "missing", ["no such file or folder"]),
    (
        ["eval", "locomo", "{locomo}", *M, "--adapter", "{adapter_dir}"],
        "adapter_dir",
        ["adapter_config.json"],
    ),
    (["eval", "locomo", "{locomo}", *M, "--out", "{file}"], "file", ["an existing file", "a folder"]),
    (["eval", "mab", "{empty_dir}", *M, "--entity-map", "{missing}"], "missing", ["entity2id.json"]),
    (["eval", "locomo", "{locomo}", *M, "--template-arg", "thinking"], None, ["expected KEY=VALUE"]),
    (["eval", "locomo", "{locomo}", *M, "--device", "abacus"], None, ["--device abacus", "expected cpu"]),
    (["eval", "locomo", "{locomo}"], None, ["--model is required", "expected a base model"]),
    (["eval", "locomo", "{locomo}", *M, "--rescore", "{predictions}"], None, ["expected no --model"]),
    (["eval", "mab", "{empty_dir}", *M, "--split", "test"], None, ["--split does not apply", "--families"]),
    (["eval", "locomo", "{locomo}", *M, "--passages", "supporting"], None, ["hotpotqa only", "expected"]),
    (["eval", "locomo", "{locomo}", *M, "--max-questions", "2"], None, ["mab only", "expected"]),
    (["eval", "locomo", "{locomo}", *M, "--limit", "0"], None, ["expected a positive integer, got 0"]),
    (["eval", "mab", "{empty_dir}", *M, "--families", "XX"], None, ["invalid choice: 'XX'"]),
    (["eval", "squad", "{locomo}", *M], None, ["invalid choice: 'squad'"]),
    # lstmem demo
    (["demo", "--model", "{missing}"], "missing", ["no such file or folder", "expected a model folder"]),
    (["demo", "--model", "{model_dir}"], "model_dir", ["a folder without config.json"]),
    (["demo", "--episodes", "0"], None, ["expected a positive integer, got 0"]),
    (["demo", "--steps", "many"], None, ["expected a positive integer, got 'many'"]),
    # lstmem bench
    (
        ["bench", "report", "{missing}"],
        "missing",
        ["no such folder", "expected a folder of the JSON records"],
    ),
    (["bench", "report", "{empty_dir}"], "empty_dir", ["no .json record in it"]),
    (["bench", "report", "{records}"], "records", ["decode-cpu-1.json: not JSON", "expected a JSON record"]),
    (["bench", "report", "{records}", "--results", "{empty_dir}"], "empty_dir", ["the markdown file"]),
    (["bench", "decode", "--preset", "gpt5"], None, ["--preset gpt5", "expected one of cpu-small"]),
    (["bench", "decode", "{empty_dir}"], "empty_dir", ["report only", "--out"]),
    (["bench", "decode", "--out", "{file}"], "file", ["an existing file", "a folder"]),
    (["bench", "decode", "--device", "abacus"], None, ["--device abacus", "expected cpu"]),
    (["bench", "generate", "--reps", "0"], None, ["expected a positive integer"]),
    (["bench", "latency"], None, ["invalid choice: 'latency'"]),
    # lstmem serve
    (["serve", "--api-keys-file", "{missing}"], "missing", ["no such file", "one accepted API key a line"]),
    (["serve", "--api-keys-file", "{keys}"], "keys", ["no key in it", "--api-key"]),
    (["serve", "--api-keys-file", "{empty_dir}"], "empty_dir", ["a folder", "API key"]),
    (["serve", "--store", "{file}"], "file", ["an existing file", "a folder"]),
    (["serve", "--model", "{model_dir}", "--adapter", "x/y"], "model_dir", ["without config.json"]),
    (["serve", *M, "--adapter", "{adapter_dir}"], "adapter_dir", ["without adapter_config.json"]),
    (["serve", *M], None, ["--model and --adapter go together", "expected both"]),
    (["serve", "--vllm-arg", "max_model_len"], None, ["expected KEY=VALUE"]),
    (["serve", "--port", "70000"], None, ["expected a port number 1-65535"]),
    (["serve", "--batch-wait-ms", "-1"], None, ["expected a number >= 0"]),
    (["serve", "--device", "abacus"], None, ["--device abacus", "expected cpu"]),
    # no subcommand, or an unknown one
    ([], None, ["the following arguments are required: command"]),
    (["train"], None, ["invalid choice: 'train'"]),
]


@pytest.fixture
def nothing_loads(monkeypatch):
    """Every path that would load a model, build a benchmark model or start a server fails the test:
    bad inputs must be refused before any of it."""
    import types

    from lstmem_peft.cli.bench import command as bench
    from lstmem_peft.cli.demo import command as demo
    from lstmem_peft.tuner import loading

    def loaded(*args, **kwargs):
        raise AssertionError("a model loaded (or a server started) before the inputs were checked")

    monkeypatch.setattr(loading, "load_model_and_adapter", loaded)
    monkeypatch.setattr(demo, "run", loaded)
    monkeypatch.setattr(bench, "run", loaded)
    monkeypatch.setitem(sys.modules, "lstmem_peft.serve", types.SimpleNamespace(serve=loaded))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize(
    "argv, named, words",
    BAD_INPUTS,
    ids=[" ".join(a[:2]) + f" [{i}]" for i, (a, *_) in enumerate(BAD_INPUTS)],
)
def test_every_subcommand_refuses_a_bad_file_format_or_option_in_one_line(
    argv, named, words, tmp_path, capsys, nothing_loads
):
    """Exit status 2, and stderr is one line: the subcommand, the file (or option), what was
    expected and the fix; no traceback, and nothing loaded first."""
    import lstmem_cli as cli

    files = bad_inputs(tmp_path)
    argv = [a.format(**files) for a in argv]
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    (line,) = lines
    assert line.startswith("lstmem") and ": error: " in line and "Traceback" not in err
    if argv[:1] in (["eval"], ["bench"], ["demo"], ["serve"]) and argv[1:2] != ["squad"]:
        assert line.startswith(f"lstmem {argv[0]}"), line
    if named is not None:
        assert files[named] in line, line
    for word in words:
        assert word in line, (word, line)
    if named is not None or "expected" in " ".join(words):  # what was expected, and the fix
        assert "expected" in line, line


def test_a_bad_file_is_refused_before_the_model_loads_and_one_line_says_why(tmp_path, capsys, nothing_loads):
    """The issue's report: LoCoMo given a JSON file of another shape said "argument of type 'int' is not
    iterable", and given a file that is not JSON "Expecting value: line 1 column 1 (char 0)"."""
    import lstmem_cli as cli

    (tmp_path / "other.json").write_text(json.dumps({"a": 1, "b": 2}))
    (tmp_path / "text.json").write_text("not json at all")
    code = cli.main(["eval", "locomo", str(tmp_path / "other.json"), "--model", "x/y"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        f"lstmem eval locomo: error: {tmp_path / 'other.json'}: the file holds an object with keys ['a', 'b']; "
        'expected the LoCoMo JSON list of samples, each an object with "conversation" (session_<n> lists of '
        'turns and their session_<n>_date_time) and "qa". Download data/locomo10.json from '
        "https://github.com/snap-research/locomo and pass its path"
    )
    assert cli.main(["eval", "locomo", str(tmp_path / "text.json"), "--model", "x/y"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lstmem eval locomo: error: {tmp_path / 'text.json'}: not JSON (Expecting value")
    assert "not iterable" not in err and "\n" not in err


def test_a_bug_keeps_its_traceback_and_debug_shows_every_traceback(tmp_path, monkeypatch, capsys):
    import lstmem_cli as cli
    from lstmem_peft.utils.errors import DataFormatError

    def bug(*args, **kwargs):
        raise TypeError("argument of type 'int' is not iterable")

    monkeypatch.setattr("lstmem_peft.eval.locomo.LoCoMo.__init__", bug)
    data = write_hotpot(tmp_path / "dev.json")
    with pytest.raises(TypeError, match="not iterable"):  # not turned into a one-line message
        cli.main(["eval", "locomo", data, "--model", "x/y"])
    with pytest.raises(DataFormatError, match="none.json: no such file"):  # --debug: the exception itself
        cli.main(["eval", "hotpotqa", str(tmp_path / "none.json"), "--model", "x/y", "--debug"])


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
    from lstmem_peft.utils.errors import MissingDataError

    with pytest.raises(MissingDataError, match=r"nobody/nothing: not in the Hub cache.*snap-research/locomo"):
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
