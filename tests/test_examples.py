"""The examples run as a user would run them."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_runs_offline(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--max-new-tokens", "4"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reloaded adapter + memory give identical logits: True" in result.stdout
    assert result.stdout.count("Q: ") == 2


@pytest.mark.slow
def test_two_stage_recipe_smoke_run(tmp_path):
    import json

    from eval_fixtures import QASPER_OFFICIAL

    (tmp_path / "qasper.json").write_text(json.dumps(QASPER_OFFICIAL))
    (tmp_path / "long.jsonl").write_text(
        json.dumps(
            {
                "context": "The vault code is 1234. " * 20,
                "qas": [{"question": "Vault code?", "answer": "1234"}],
            }
        )
        + "\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_two_stage.py"),
            "--tiny",
            "--qasper",
            "qasper.json",
            "--long",
            "long.jsonl",
            "--output-dir",
            "run",
            "--stage1-steps",
            "2",
            "--stage2-steps",
            "2",
            "--global-batch",
            "2",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    card = (tmp_path / "run" / "adapter" / "README.md").read_text()
    assert "### Training" in card and "qasper.json (2 episodes)" in card and "LSTMem: Hierarchical" in card
