"""`lstmem demo` on the shipped backbone and adapters, and a scaled-down training run."""

import json
import subprocess
import sys

import pytest

from lstmem_peft import demo


@pytest.mark.slow
def test_lstmem_demo_runs_offline_and_ends_with_a_json_summary(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "PATH": __import__("os").environ["PATH"]}
    result = subprocess.run(
        [sys.executable, "-m", "lstmem_peft.cli", "demo", "--episodes", "256"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("recall_memory", "recall_no_history", "recall_in_context", "chance", "num_pairs"):
        assert key in summary
    assert summary["num_pairs"] >= 8
    assert "memory only" in result.stdout and "no_depth_coupling" in result.stdout
    # what the shipped backbone and adapter do on held-out episodes
    assert summary["recall_in_context"] >= 0.9
    assert summary["recall_no_history"] <= 2 * summary["chance"]
    assert summary["recall_memory"] >= 0.8 > summary["bag_of_values"]


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


def test_missing_assets_name_the_rebuild_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m lstmem_peft.demo build"):
        demo.load_backbone(tmp_path)


@pytest.mark.slow
def test_demo_runs_on_a_model_given_by_path(tmp_path):
    """`--model` takes any causal LM and tokenizer (a Hub id or, here, a local folder)."""
    from lstmem_peft.offline import char_tokenizer, tiny_qwen3

    tok = char_tokenizer()
    tiny_qwen3(len(tok), hidden_size=64).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lstmem_peft.cli",
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
    assert summary["trained"] and summary["num_episodes"] == 16 and "train_full_s" in summary
