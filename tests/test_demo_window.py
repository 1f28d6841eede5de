"""benchmarks/demo_window.py: adapters trained with the window in context, scored past the window."""

import importlib.util
import json
from pathlib import Path

import pytest

from lstmem_peft.cli.demo.recall import WINDOW
from lstmem_peft.training.data import long_recall_episodes
from lstmem_peft.utils.offline import demo_tokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "demo_window.py"
#: Facts that fit the 64-token window beside BOS and the 2-token question: 61 tokens, 3 per fact.
WINDOW_FACTS = (WINDOW - 1 - 2) // 3


def _script():
    spec = importlib.util.spec_from_file_location("bench_demo_window", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_rows_hold_the_whole_history_in_memory_and_only_the_window_in_context():
    window, tok = _script(), demo_tokenizer()
    episode = long_recall_episodes(1, 40, seed=3)[0]
    row = window.windowed_row(tok, episode)
    history = tok(episode["history"], add_special_tokens=False)["input_ids"]
    question = tok(episode["prompt"], add_special_tokens=False)["input_ids"]
    answer = tok(episode["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert row["history_input_ids"] == [tok.bos_token_id] + history  # all 40 facts go to memory
    # the read: BOS, the history's last tokens, the question (64 tokens in all), then the answer
    assert (
        row["input_ids"] == [tok.bos_token_id] + history[-(WINDOW - 1 - len(question)) :] + question + answer
    )
    assert row["labels"] == [-100] * WINDOW + answer
    rows = window.window_training_rows(tok, 40, 16, 48, memory_only_share=0.25, seed=1)
    in_context = [r for r in rows if len(r["input_ids"]) > 5]
    assert len(rows) == 40 and len(in_context) == 30
    facts = {(len(r["history_input_ids"]) - 1) // 3 for r in rows}  # BOS, then 3 tokens a fact
    assert facts <= {*range(1, 9), *range(16, 49)}
    assert all(len(r["input_ids"]) == 5 for r in rows if (len(r["history_input_ids"]) - 1) // 3 <= 8)
    with pytest.raises(ValueError, match="min_facts"):
        window.window_training_rows(tok, 4, 20, 10)


def test_a_fact_is_outside_the_window_once_twenty_facts_follow_it():
    window, tok = _script(), demo_tokenizer()
    episodes = long_recall_episodes(200, 32, seed=5)
    outside = window.outside_window(tok, episodes).tolist()
    assert outside == [e["facts_after"] >= WINDOW_FACTS for e in episodes]
    assert WINDOW_FACTS == 20 and 0 < sum(outside) < len(outside)


@pytest.mark.slow
def test_the_scaled_down_run_trains_scores_and_summarizes(tmp_path):
    window = _script()
    runs = tmp_path / "window-runs.jsonl"
    for seed in (0, 1):
        window.main(["--quick", "--seed", str(seed), "--out", str(runs)])
    records = [json.loads(line) for line in runs.read_text().splitlines()]
    assert [r["seed"] for r in records] == [0, 1]
    for r in records:
        assert r["date"] and r["torch"] and r["machine"] and r["train_s"] > 0 and r["threads"] == 1
        fits, past = r["scores"]["16"], r["scores"]["32"]
        # 16 facts fit the window: nothing is outside it, and the cut window is the whole history
        assert fits["outside_episodes"] == 0 and fits["recall"]["window"] == fits["recall"]["in_context"]
        # 32 facts: the plain backbone cut to its window cannot answer what fell out of it
        assert 0 < past["outside_episodes"] < past["episodes"]
        assert past["recall_outside"]["window"] <= 0.1 < past["recall_inside"]["window"]
        assert set(past["recall"]) == {"memory/full", "memory+window", "window", "in_context", "no_history"}
        assert len(past["cells"]) == 2
    window.main(["--summarize", "--out", str(runs)])
    summary = json.loads((tmp_path / "window-summary.json").read_text())
    entry = summary["recipes"]["window 16-48 facts, 20 steps"]
    gain = entry["facts_32"]["recall_outside"]["gain_memory+window_over_window"]
    assert entry["seeds"] == [0, 1] and gain["n"] == 2 and gain["sd"] is not None
    assert entry["facts_32"]["recall"]["window"]["sd"] == 0.0  # the plain backbone: the same every run
