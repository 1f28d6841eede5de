"""The examples run as a user would run them: as written in their docstrings, from a clone, and
without a warning the user cannot act on (issue 48, item 4)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: stderr lines that are warnings (tests/test_quiet.py: the same pattern), and what ``import peft``
#: alone prints on this machine, which the examples cannot change.
WARNING = re.compile(r"Warning\b|\bwarn\(|WARNING|\bdeprecated\b|Loading weights|pin_memory")


def _lines(stderr: str) -> set[str]:
    lines = (re.sub(r"^[IWEF]\d{4} [\d:.]+ +\d+ ", "", line).strip() for line in stderr.splitlines())
    return {line for line in lines if line}


@pytest.fixture(scope="module")
def peft_alone(tmp_path_factory) -> set[str]:
    cwd = tmp_path_factory.mktemp("peft")
    result = subprocess.run([sys.executable, "-c", "import peft"], cwd=cwd, capture_output=True, text=True)
    return _lines(result.stderr)


def warnings_in(stderr: str, peft_alone: set[str]) -> list[str]:
    return sorted(line for line in _lines(stderr) - peft_alone if WARNING.search(line))


@pytest.mark.slow
def test_quickstart_runs_offline(tmp_path, peft_alone):
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
    assert warnings_in(result.stderr, peft_alone) == []


@pytest.mark.slow
def test_two_stage_recipe_smoke_run(tmp_path, peft_alone):
    """The docstring's CPU smoke test as written: ``--tiny`` trains on the files in examples/data/."""
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_two_stage.py"),
            "--tiny",
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
    assert "### Training" in card and "LSTMem: Hierarchical" in card
    assert "qasper_tiny.json (4 episodes)" in card and "long_tiny.jsonl (4 episodes)" in card
    assert warnings_in(result.stderr, peft_alone) == []


def test_the_docstrings_smoke_test_needs_only_what_ships():
    doc = (ROOT / "examples" / "train_two_stage.py").read_text()
    command = re.search(r"python examples/train_two_stage.py --tiny [^\n]*", doc).group(0)
    assert "--qasper" not in command and "--long" not in command
    for name in ("qasper_tiny.json", "long_tiny.jsonl"):
        assert (ROOT / "examples" / "data" / name).is_file()


@pytest.mark.slow
def test_without_the_train_extra_the_recipe_names_it(tmp_path):
    """``datasets`` missing: one line naming the extra and its install command, no traceback."""
    blocked = tmp_path / "blocked" / "datasets"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'datasets'\", name='datasets')\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(blocked.parent), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_two_stage.py"), "--tiny", "--output-dir", "run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    from lstmem_peft.utils.extras import install_command

    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "'datasets'" in result.stderr and install_command("train") in result.stderr
