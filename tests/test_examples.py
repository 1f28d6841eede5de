"""The examples run as a user would run them: as written in their docstrings, from a clone, and
without a warning the user cannot act on (issue 48, item 4)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: stderr lines that are warnings (tests/test_quiet.py: the same pattern), read whole: the examples set
#: what ``lstmem`` keeps off the terminal before PEFT imports its backends (README "Warnings").
WARNING = re.compile(r"Warning\b|\bwarn\(|WARNING|\bdeprecated\b|Failed to load|Loading weights|pin_memory")


def _lines(stderr: str) -> set[str]:
    lines = (re.sub(r"^[IWEF]\d{4} [\d:.]+ +\d+ ", "", line).strip() for line in stderr.splitlines())
    return {line for line in lines if line}


def warnings_in(stderr: str) -> list[str]:
    return sorted(line for line in _lines(stderr) if WARNING.search(line))


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
    assert warnings_in(result.stderr) == []


@pytest.mark.slow
def test_two_stage_recipe_smoke_run(tmp_path):
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
    assert warnings_in(result.stderr) == []


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


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--relations", "age,room", "--step-relations", "room"], "add --one-relation-per-step"),
        (
            ["--relations", "age,room", "--one-relation-per-step", "--step-relations", "room,price"],
            "--step-relations names ['price'], which --relations age,room lacks",
        ),
        (
            ["--layout", "text,chats"],
            "--layout takes chat, text, conversation, a comma list of them or mixed",
        ),
        (["--history-tokens", "512-128"], "--history-tokens takes a number of tokens or a range LOW-HIGH"),
        (["--history-tokens", "many"], "--history-tokens takes a number of tokens or a range LOW-HIGH"),
        (["--eval-history-tokens", "0"], "--eval-history-tokens takes a positive number of tokens, got 0"),
    ],
)
def test_english_training_refuses_cycles_it_cannot_take(tmp_path, options, says):
    """A cycle of update relations that is not a subset of what is scored, or that nothing cycles
    through, a layout forced choice does not know, or a history length that is not one, is refused
    before any model loads, naming the fix."""
    script = [sys.executable, str(ROOT / "examples" / "train_english.py"), "--output-dir", str(tmp_path)]
    done = subprocess.run([*script, *options], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and says in done.stderr, done.stderr[-2000:]
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_english_training_runs_checkpoints_and_resumes(tmp_path):
    """examples/train_english.py on a tiny random Llama with a character tokenizer (the real backbone is
    the default; docs/real-model-training.md): it trains, scores held-out episodes, checkpoints, and a
    second run with more steps resumes from the checkpoint instead of starting over."""
    import json

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import tiny_model

    from lstmem_peft.utils.offline import char_tokenizer

    folder = tmp_path / "tiny-llama"
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    model.resize_token_embeddings(len(tokenizer))  # English text: one id per printable character
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "run"

    def train_english(*options: str) -> subprocess.CompletedProcess:
        script = [sys.executable, str(ROOT / "examples" / "train_english.py")]
        done = subprocess.run([*script, *options], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    command = ["--output-dir", str(out)]
    command += ["--model", str(folder), "--layers", "all", "--batch", "2", "--eval-every", "2"]
    command += ["--eval-episodes", "2", "--save-every", "2", "--threads", "1"]
    command += ["--layout", "mixed", "--chatter", "0-1"]  # both question layouts, chatter among the facts
    command += ["--relations", "age,room", "--near-miss-weight", "1"]  # numbers, scored against near misses
    command += ["--one-relation-per-step", "--step-relations", "room,room,age"]  # room twice as often
    command += ["--history-tokens", "150-200"]  # one character per token: filled with chatter to 150-200
    first = train_english(*command, "--steps", "2")
    assert (out / "last.pt").exists() and (out / "adapter" / "adapter_config.json").exists()
    second = train_english(*command, "--steps", "4")
    assert f"resumed from {out / 'last.pt'} at step 2" in second.stdout
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert records and any("memory" in json.dumps(r) for r in records)
    # --layout mixed: text and chat questions on alternate updates, each scored
    assert [r["layout"] for r in records if "answer_loss" in r] == ["text", "chat"] * 2
    assert all(r["near_miss_loss"] > 0 for r in records if "answer_loss" in r)
    assert [r["relation"] for r in records if "answer_loss" in r] == ["room", "room", "age", "room"]
    # chatter fills each history towards the update's drawn length (it stops short by less than a
    # line): one or two facts with up to one line of chatter each are 72 characters on average
    # unfilled, 17 to 181 each
    lengths = [r["history_tokens"] for r in records if "answer_loss" in r]
    assert len(lengths) == 4 and all(n >= 120 for n in lengths), lengths
    assert {e["layout"] for r in records for e in r.get("eval", [])} == {"text", "chat"}
    assert warnings_in(first.stderr + second.stderr) == []

    shipped = tmp_path / "shipped"  # --export: the folder an adapter ships as, from last.pt
    export = train_english(*command, "--export", str(shipped), "--export-dtype", "bfloat16")
    assert f"wrote {shipped} (step 4)" in export.stdout
    import torch
    from safetensors.torch import load_file

    stored = load_file(shipped / "adapter_model.safetensors")
    saved = torch.load(out / "last.pt", map_location="cpu", weights_only=False)["adapter"]
    assert stored and {t.dtype for t in stored.values()} == {torch.bfloat16}  # half the bytes
    assert all(torch.equal(stored[k], saved[k].to(torch.bfloat16)) for k in stored)
    config = json.loads((shipped / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(folder)  # the --model value, as given
    card = (shipped / "README.md").read_text()
    assert "| updates | 4 |" in card and "More Information Needed" not in card
    assert json.loads((out / "log.jsonl").read_text().splitlines()[-1])["step"] == 4  # nothing trained

    # a run folder copied elsewhere is scored there, not in the folder it was trained in; the scores
    # include the choice against near misses of each value and exact recall by relation
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    train_english(
        "--output-dir",
        str(moved),
        "--eval-only",
        "--eval-episodes",
        "2",
        "--eval-facts",
        "1",
        "--threads",
        "1",
    )
    assert (moved / "eval.json").exists() and not (out / "eval.json").exists()
    result = json.loads((moved / "eval.json").read_text())
    assert {r["layout"] for r in result["near_miss_choice"]} == {"text", "chat"}
    assert all(0 <= r["memory"] <= 1 and r["chance"] == 0.25 for r in result["near_miss_choice"])
    assert all(set(r["memory_by_relation"]) <= {"age", "room"} for r in result["recall"])
