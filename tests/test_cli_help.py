"""The command line explains itself: every subcommand and option has help, and defaults are shown
(issue 37, item 4)."""

import argparse

import pytest


def _parsers(parser: argparse.ArgumentParser, prog: str = "lstmem"):
    """``(prog, parser)`` for ``parser`` and every subparser below it."""
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prog} {name}")


def test_every_subcommand_and_option_has_help():
    from lstmem_cli.parser import build_parser

    seen, missing = set(), []
    for prog, parser in _parsers(build_parser()):
        seen.add(prog)
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{prog} {c.dest}" for c in action._choices_actions if not (c.help or "").strip()]
            if not (action.help or "").strip():
                missing.append(f"{prog} {'/'.join(action.option_strings) or action.dest}")
    assert {"lstmem serve", "lstmem bench", "lstmem eval", "lstmem demo", "lstmem data long"} <= seen
    assert not missing, missing


def _help(capsys, monkeypatch, *argv) -> str:
    """``lstmem ARGV -h`` as printed on a terminal wide enough that argparse wraps no line."""
    from lstmem_cli.parser import build_parser

    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "-h"])
    return capsys.readouterr().out


def test_serve_help_shows_the_defaults(capsys, monkeypatch):
    entries = []  # one per option: its line and the help argparse put on the next one
    for line in _help(capsys, monkeypatch, "serve").splitlines():
        if line.startswith("  -"):
            entries.append(line.strip())
        elif entries and line.startswith("   "):
            entries[-1] += " " + line.strip()
    for option, default in [
        ("--host HOST", "127.0.0.1"),
        ("--port PORT", "8000"),
        ("--store STORE", "lstmem-sessions"),
        ("--max-batch MAX_BATCH", "32"),
        ("--max-tokens MAX_TOKENS", "64, at most half the context window"),
        ("--engine {hf,vllm}", "hf"),
    ]:
        entry = next(entry for entry in entries if entry.startswith(option + " "))
        assert entry.endswith(f"(default: {default})"), entry


def test_bench_help_explains_each_kind_and_reps_with_the_real_defaults(capsys, monkeypatch):
    from lstmem_cli.parser import BENCH_KINDS, build_parser
    from lstmem_peft.cli.bench import command as bench
    from lstmem_peft.cli.bench import gpu_suite as bench_gpu

    text = " ".join(_help(capsys, monkeypatch, "bench").split())
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    kind = next(a for a in commands.choices["bench"]._actions if a.dest == "kind")
    assert list(kind.choices) == list(BENCH_KINDS)
    for name, what in BENCH_KINDS.items():
        assert f"{name} {what}" in text
    assert "--reps REPS timed repetitions" in text
    # the sizes the help names are the benchmarks' own
    for device in ("cpu", "cuda"):
        sizes = bench.DEFAULTS[device]
        for value in (sizes["kv_lengths"], sizes["histories"]):
            assert " ".join(map(str, value)) in text
        for key in ("write_tokens", "prompt_tokens", "answer_tokens", "generate_tokens"):
            assert str(sizes[key]) in text
    gpu = bench_gpu.SETTINGS["gpu"]
    assert f"gpu {gpu['reps']}" in text and f"gpu {gpu['new_tokens']}" in text
    assert f"gpu {' '.join(map(str, gpu['scan_lengths']))}" in text
