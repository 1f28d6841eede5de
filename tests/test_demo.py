"""`lstmem demo` on the shipped backbone and adapters, and a scaled-down training run."""

import json
import os
import subprocess
import sys

import pytest

from lstmem_peft.cli.demo import command as demo
from lstmem_peft.cli.demo import recall as demo_recall
from lstmem_peft.cli.demo import sweep as demo_sweep
from lstmem_peft.utils.errors import UsageError


def run_demo(cwd, *args: str) -> subprocess.CompletedProcess:
    """``lstmem demo ARGS`` in a child process, offline (bounded: 10 minutes)."""
    env = {"HF_HUB_OFFLINE": "1", "PATH": os.environ["PATH"]}
    return subprocess.run(
        [sys.executable, "-m", "lstmem_cli", "demo", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


@pytest.mark.slow
def test_lstmem_demo_runs_offline_and_ends_with_a_json_summary(tmp_path):
    result = run_demo(tmp_path, "--episodes", "256")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("recall_memory", "recall_no_history", "recall_in_context", "chance", "num_pairs"):
        assert key in summary
    assert summary["num_pairs"] >= 8
    assert "memory only" in result.stdout and "no_depth_coupling" in result.stdout
    assert summary["adapters"] == demo.ADAPTERS_SHIPPED
    for caption in ("Recall from one block of 8 facts", "Each row is one trained adapter", "Updates:"):
        assert caption in result.stdout, caption
    # what the shipped backbone and adapter do on held-out episodes
    assert summary["recall_in_context"] >= 0.9
    assert summary["recall_no_history"] <= 2 * summary["chance"]
    assert summary["recall_memory"] >= 0.8 > summary["bag_of_values"]
    # and over a conversation whose every question is written (issue 36), for both kinds of client
    assert "Conversations:" in result.stdout and "full, resend" in result.stdout
    for client in ("newest", "resend"):
        recall = summary[f"conversation_recall_{client}"]
        assert len(recall) == 4 and min(recall) >= 0.75 and recall[0] - min(recall) <= 0.15, (client, recall)


def test_demo_train_runs_the_chat_phase_of_the_shipped_adapters():
    """``lstmem demo --train`` trains as the shipped adapters were: 600 steps, then the chat phase."""
    from lstmem_cli.parser import build_parser
    from lstmem_peft.cli.demo.training import CHAT_STEPS

    args = build_parser().parse_args(["demo", "--train"])
    assert args.steps == 600 and args.chat_steps == CHAT_STEPS


@pytest.mark.slow
def test_scaled_down_training_run_learns_to_recall_from_memory(tmp_path):
    """A fresh adapter on the shipped backbone: the loss falls and memory recall beats no history."""
    model, trainer = demo.train_adapter(
        demo.load_backbone(), max_steps=150, output_dir=str(tmp_path), progress=False
    )
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
    result = demo.evaluate(model, num_episodes=256)
    assert result["recall_memory"] > result["recall_no_history"] + 0.2


def test_the_summary_says_which_adapters_it_scored():
    """``"adapters"``: the shipped ones (trained when the package was built) or ones trained in this run
    (``--train``); on ``--model`` the toy task has no shipped adapters, so ``train`` is required."""
    scored = {
        (train, model_id): demo.adapters_scored(demo.DemoSettings(train=train, model_id=model_id))
        for train, model_id in ((False, None), (True, None), (True, "some/model"))
    }
    assert scored == {
        (False, None): "shipped (trained when the package was built)",
        (True, None): "trained in this run",
        (True, "some/model"): "trained in this run",
    }
    with pytest.raises(UsageError, match="expected train=True"):
        demo.run(model_id="some/model")  # refused before anything loads


# The figures of docs/demo.md's tables (2026-11-27, the shipped adapters, 512 episodes).
ONE_BLOCK = {"full": 0.836, "no_depth_coupling": 0.857, "no_feedback": 0.857}
UPDATES = {
    "full": (0.631, 0.152, 0.604),
    "no_depth_coupling": (0.576, 0.184, 0.639),
    "no_feedback": (0.570, 0.186, 0.668),
    "full, feedback off while writing": (0.547, 0.203, 0.621),
}


def _one_block(recall: dict[str, float], n: int = 512) -> dict[str, dict]:
    return {
        name: {
            "recall_in_context": 1.0,
            "recall_no_history": 0.035,
            "recall_memory": r,
            "chance": 1 / 32,
            "bag_of_values": 1 / 8,
            "num_pairs": 8,
            "num_episodes": n,
        }
        for name, r in recall.items()
    }


def test_the_first_table_says_what_it_shows_and_why_the_full_adapter_may_score_below_an_ablation():
    text = demo.format_table(_one_block(ONE_BLOCK))
    table_at = text.index("adapter  ")
    above, below = text[:table_at], text[text.index("no_feedback  ") :]
    for column in ("in context:", "no history:", "memory only:", "chance:", "1/pairs:"):
        assert column in above, column
    assert "512 held-out episodes" in above and "one block of 8 facts" in above
    below = " ".join(below.split())
    assert "The full adapter scores 0.021 below no_depth_coupling here." in below
    assert "one standard error of the measurement is 0.016 at 512 episodes" in below
    assert "do not help" in below and "the next table" in below and "docs/demo.md" in below
    assert all(len(line) <= 100 for line in text.splitlines())
    # the full adapter on top: no gap to explain; alone: nothing to compare
    text = demo.format_table(_one_block({**ONE_BLOCK, "full": 0.9}))
    assert "scores" not in text and "Each row is one trained adapter" in text
    assert "Each row" not in demo.format_table(_one_block({"full": 0.836}))


def test_the_update_table_says_what_each_column_is_and_why_rows_score_lower():
    rows = {
        name: {"update_newest": a, "update_oldest": b, "update_kept": c, "num_episodes": 512}
        for name, (a, b, c) in UPDATES.items()
    }
    text = " ".join(demo.format_updates(rows).split())
    assert "(higher is better)" in text and "(lower is better)" in text
    assert (
        "Below the full adapter's newest value (0.631, one standard error 0.021): no_depth_coupling; "
        "no_feedback; full, feedback off while writing." in text
    )
    assert "The full adapter's untouched keys score 0.064 below no_feedback" in text
    rows["no_feedback"]["update_newest"] = 0.7
    assert (
        "Below the full adapter's newest value (0.631, one standard error 0.021): no_depth_coupling; full,"
        in (" ".join(demo.format_updates(rows).split()))
    )


def test_the_conversation_and_sweep_tables_have_captions():
    from lstmem_peft.cli.demo.conversation import format_conversation

    rows = {
        "full, newest": {
            "recall_by_position": [0.863, 0.867, 0.836, 0.844],
            "write": "messages",
            "num_sessions": 256,
        },
        "full, resend": {
            "recall_by_position": [0.863, 0.898, 0.793, 0.820],
            "write": "messages",
            "num_sessions": 256,
        },
    }
    text = " ".join(format_conversation(rows).split())
    assert "Qn: recall from memory at the n-th question" in text
    assert "One standard error of a figure: 0.022 at 256 sessions" in text
    assert "A later question's figure is lower where the turns written before it" in text


def test_missing_assets_name_the_rebuild_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m lstmem_peft.cli.demo build"):
        demo.load_backbone(tmp_path)


@pytest.mark.slow
def test_demo_runs_on_a_model_given_by_path(tmp_path):
    """`--model` takes any causal LM and tokenizer (a Hub id or, here, a local folder)."""
    from lstmem_peft.utils.offline import char_tokenizer, tiny_qwen3

    tok = char_tokenizer()
    tiny_qwen3(len(tok), hidden_size=64).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lstmem_cli",
            "demo",
            "--model",
            str(tmp_path / "model"),
            "--train",
            "--steps",
            "3",
            "--episodes",
            "16",
            "--no-ablations",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["adapters"] == demo.ADAPTERS_TRAINED == "trained in this run"
    assert summary["num_episodes"] == 16 and "train_full_s" in summary


# ---------------------------------------------------------------------- issue 26: past the window, episodes
@pytest.fixture(scope="module")
def shipped():
    from peft import PeftModel

    return {
        name: PeftModel.from_pretrained(demo.load_backbone(), demo.DEMO_ASSETS / f"adapter_{name}").eval()
        for name in ("full", "no_feedback")
    }


@pytest.mark.parametrize("facts", [1, 8, 32, 100])
def test_long_histories_ask_a_key_that_appears_once(facts):
    from lstmem_peft.training.data import long_recall_episodes

    for e in long_recall_episodes(20, facts, seed=facts):
        pairs = [f.split() for f in e["history"].split(";") if f.strip()]
        keys = [k for k, _ in pairs]
        asked = e["prompt"].split()[1]
        assert len(pairs) == facts and keys.count(asked) == 1
        where = keys.index(asked)
        assert e["facts_after"] == facts - 1 - where and " " + pairs[where][1] == e["answer"]
        if facts <= demo.NUM_KEYS:
            assert len(set(keys)) == facts


def test_the_window_keeps_the_question_and_the_latest_history():
    tok = demo.demo_tokenizer()
    history = [tok.bos_token_id] + list(range(5, 65)) * 2  # 121 tokens
    read = [tok.bos_token_id, 4, 7, 40]  # "<s> ? k02 v03"
    row = demo.window_row(tok, history, read, 1, window=16)
    assert len(row) == 16 + 1 and row[0] == tok.bos_token_id
    assert row[-3:] == read[1:] and row[1:-3] == history[-13:]
    assert demo.window_row(tok, history[:5], read, 1, window=16) == history[:5] + read[1:]
    assert demo.window_row(tok, history[:12], read, 1, window=16) == history[:12] + read[1:]


def test_a_scaled_down_sweep_marks_the_window_and_plots(shipped, tmp_path):
    record = demo_sweep.sweep(shipped, facts=(8, 32), num_episodes=24)
    short, long = record["rows"]
    assert record["window_tokens"] == demo.WINDOW and record["window_facts"] == 20
    assert short["fits_window"] and not long["fits_window"]
    assert (short["blocks"], long["blocks"]) == (1, 2) and long["history_tokens"] == 97
    assert set(short["recall"]) == {
        "memory/full",
        "memory/no_feedback",
        "memory+window",
        "window",
        "in_context",
        "no_history",
    }
    assert all(0 <= v <= 1 for row in record["rows"] for v in row["recall"].values())
    # the shipped adapter recalls one block of 8 facts from memory; without history it guesses
    assert short["recall"]["memory/full"] > short["recall"]["no_history"] + 0.4
    assert short["recall"]["window"] == short["recall"]["in_context"]  # 8 facts fit in the window
    assert sum(b["episodes"] for b in long["by_age"]) == 24
    assert record["adapters"]["full"]["cell_numbers_total"] == 2 * 4 * 8 * 8
    assert "window: 64 tokens" in demo_sweep.format_sweep(record)
    caption = " ".join(demo_sweep.format_sweep(record).split("\n facts")[0].split())
    assert caption.startswith("Recall against history length (24 episodes per length;")
    assert "memory/ADAPTER:" in caption and "Recall falls as the history grows" in caption
    png = demo_sweep.plot_sweep({**record, "device": "CPU", "date": "2026-11-25"}, tmp_path / "sweep.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_episodes_show_history_question_gold_and_both_answers(shipped):
    shown = demo.show_episodes(shipped["full"], num=3)
    assert len(shown) == 3
    for e in shown:
        assert e["gold"].startswith("v") and e["question"].startswith("? k") and e["fits_window"]
        assert e["history"].count("[") == 1 and e["facts"] == 8 and e["blocks"] == 1
        assert e["memory"].startswith("v") and 0 < e["memory_p"] <= 1
    text = demo.format_episodes(shown)
    for word in ("episode 3", "history", "question", "gold", "memory", "no history"):
        assert word in text
    long = demo.show_episodes(shipped["full"], num=1, num_facts=64)[0]
    assert not long["fits_window"] and "... (" in long["history"] and long["blocks"] == 4
    assert "history cut to its 64-token window" in demo.format_episodes([long])


@pytest.mark.slow
def test_lstmem_demo_show_and_sweep_from_the_command_line(tmp_path):
    args = ["--show", "2", "--sweep", "8", "64", "--episodes", "32", "--no-ablations"]
    result = run_demo(tmp_path, *args, "--out", str(tmp_path / "sweep"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "episode 2:" in result.stdout and "gold" in result.stdout
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    record = json.loads(open(summary["sweep"]["record"]).read())
    assert [r["facts"] for r in record["rows"]] == [8, 64] and record["torch"] and record["date"]
    assert summary["sweep"]["plot"].endswith(".png")


def _benchmark(name: str):
    """A script of benchmarks/ as a module (they are not part of the package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ablation_benchmark_scores_an_adapter_and_summarizes_runs(shipped, tmp_path):
    ablation = _benchmark("demo_ablation")
    keys = {
        "one_block_8",
        "facts_16",
        "facts_32",
        "turns_4x2",
        "update_newest",
        "update_oldest",
        "update_kept",
    }
    on = ablation.score(shipped["full"], demo.demo_tokenizer(), num=16)
    off = ablation.score_without_feedback(shipped["full"], num=16)
    assert set(on) == set(off) == keys and all(0 <= v <= 1 for v in on.values())
    assert ablation.score_without_feedback(shipped["no_feedback"], num=16) is None
    assert next(iter(shipped["full"].peft_config.values())).block_feedback  # switched back on
    runs = tmp_path / "runs.jsonl"
    runs.write_text(
        "".join(
            json.dumps(
                {
                    "variant": "full",
                    "seed": s,
                    "final_loss": 0.2,
                    "recall": on,
                    "recall_feedback_off_at_eval": off,
                }
            )
            + "\n"
            for s in (0, 1)
        )
    )
    summary = ablation.summarize(runs)["variants"]["full"]
    assert summary["seeds"] == [0, 1] and summary["update_newest"]["sd"] == 0.0
    assert summary["update_newest/feedback_gain_at_eval"]["n"] == 2


def test_the_capacity_benchmark_scores_memory_recall_by_history_length(shipped):
    assert demo_recall.adapter_config(r=16).r == 16 and demo_recall.adapter_config().r == 8
    capacity = _benchmark("demo_capacity")
    recall = capacity.memory_recall(shipped["full"], demo.demo_tokenizer(), facts=(8, 24), num=16)
    assert set(recall) == {"8", "24"} and all(0 <= v <= 1 for v in recall.values())


def test_update_episodes_supersede_some_keys_and_keep_others():
    for e in demo_recall.update_episodes(30, seed=3):
        first = dict(f.split() for f in e["turns"][0].split(" ;") if f.strip())
        later = dict(f.split() for f in e["turns"][1].split(" ;") if f.strip())
        asked, kept = e["prompt"].split()[1], e["kept_prompt"].split()[1]
        assert len(first) == demo.NUM_PAIRS and len(later) == 4 and set(later) <= set(first)
        assert later[asked] == e["newest"].strip() != e["oldest"].strip() == first[asked]
        assert kept not in later and first[kept] == e["kept"].strip()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["demo", "--show", "-1"], ["expected a whole number >= 0, got -1"]),
        (["demo", "--facts", "0"], ["expected a positive integer, got 0"]),
        (["demo", "--sweep", "8", "x"], ["expected a positive integer, got 'x'"]),
        (["demo", "--sweep", "--out", "{file}"], ["an existing file", "a folder"]),
    ],
)
def test_the_demo_refuses_bad_show_and_sweep_options_in_one_line(argv, words, tmp_path, capsys, monkeypatch):
    import lstmem_cli as cli

    def loaded(*args, **kwargs):
        raise AssertionError("the demo ran before its options were checked")

    monkeypatch.setattr(demo, "run", loaded)
    (tmp_path / "file").write_text("x")
    argv = [a.format(file=tmp_path / "file") for a in argv]
    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("lstmem demo"), err
    for word in words:
        assert word in err[0], (word, err)
