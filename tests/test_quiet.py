"""Quiet and runnable (issue 48, item 4): ``lstmem demo``, ``serve``, ``bench`` and training print no
warning a user cannot act on; install hints fit how lstmem-peft was installed; a request without a
session reports nothing stored.

The child-process tests (slow tier) filter nothing themselves: they read stderr as a user sees it,
whole, in an environment with the ``quant`` extra's backends installed (the test extra has them), whose
import under PEFT logs what the command drops (:data:`quiet.UPSTREAM_LOG_LINES`).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from lstmem_cli import quiet
from lstmem_cli.parser import BENCH_KINDS
from lstmem_peft.cli.bench import command as bench
from lstmem_peft.utils.extras import install_command, missing_extra

ROOT = Path(__file__).resolve().parents[1]
#: What a warning looks like on stderr: Python's warnings, logging's and torch's, a deprecation, a
#: backend's failed load, the weight-loading bars, the serve defaults that did not fit.
WARNING = re.compile(
    r"Warning\b|\bwarn\(|WARNING|\bdeprecated\b|Failed to load|Loading weights|leaves no room|pin_memory"
)


# ---------------------------------------------------------------------- install hints
def test_an_install_from_the_index_gets_the_index_command():
    for direct_url in ("", '{"url": "https://example.org/lstmem_peft-0.1.0.whl", "archive_info": {}}'):
        assert install_command("eval", direct_url=direct_url) == 'pip install "lstmem-peft[eval]"'


def test_an_install_from_a_clone_gets_the_command_to_run_in_that_clone(tmp_path):
    clone = tmp_path / "my clone"
    clone.mkdir()
    (clone / "pyproject.toml").write_text("[project]\nname = 'lstmem-peft'\n")
    url = clone.as_uri()
    editable = json.dumps({"url": url, "dir_info": {"editable": True}})
    plain = json.dumps({"url": url, "dir_info": {}})
    assert install_command("eval", direct_url=editable) == f"cd '{clone}' && pip install -e \".[eval]\""
    assert install_command("train", direct_url=plain) == f"cd '{clone}' && pip install \".[train]\""
    (clone / "pyproject.toml").unlink()  # the folder it came from is gone: the index's command
    assert install_command("eval", direct_url=editable) == 'pip install "lstmem-peft[eval]"'


def test_the_missing_extra_message_names_this_installation_command():
    """The test environment is this clone, installed editable (README): the clone's command."""
    err = missing_extra(ModuleNotFoundError("No module named 'nltk'", name="nltk"), "eval", "Scoring")
    assert str(err).endswith(f"Install it with: {install_command('eval')}")
    assert install_command("eval") == f'cd {ROOT} && pip install -e ".[eval]"'


# ---------------------------------------------------------------------- the CLI's filter
def _warn(message: str, module: str, category=FutureWarning) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.filter_upstream_deprecations()
        warnings.warn_explicit(message, category, "x.py", 1, module=module)
    return [str(w.message) for w in caught]


def test_the_cli_filters_the_upstream_deprecation_by_category_message_and_module():
    message = "`is_gradient_checkpointing` is deprecated and will be removed in v6."
    assert _warn(message, "transformers.modeling_utils") == []
    assert _warn(message, "lstmem_peft.tuner.model") == [message]  # ours would show
    assert _warn(message, "transformers.modeling_utils", DeprecationWarning) == [message]
    assert _warn("`something_else` is deprecated", "transformers.modeling_utils") != []


def test_each_filtered_deprecation_is_in_the_readme_with_the_release_that_removes_it():
    readme = (ROOT / "README.md").read_text()
    for _category, _message, _module, _why, removed in quiet.UPSTREAM_DEPRECATIONS:
        assert "is_gradient_checkpointing" in readme and removed.split(" (")[0] in readme


def _logged(logger: str, message: str, *args) -> list[str]:
    """What ``logger`` prints of ``message % args`` once the command's log filters are set."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    target = logging.getLogger(logger)
    keep, propagate = Keep(), target.propagate
    target.addHandler(keep)
    target.propagate = False
    try:
        quiet.drop_upstream_log_lines()
        quiet.drop_upstream_log_lines()  # set once: a second call adds no second filter
        assert sum(isinstance(f, quiet._DropUpstreamLines) for f in target.filters) <= 1
        target.warning(message, *args)
    finally:
        target.removeHandler(keep)
        target.propagate = propagate
    return records


def test_the_cli_drops_the_quant_backends_import_lines_by_logger_message_and_condition():
    import enum

    import torch

    so = "/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this library"
    shown = [] if torch.version.cuda is None else [f"Failed to load {so}"]  # with CUDA it is the user's
    assert _logged("torchao", "Failed to load %s", so) == shown
    assert _logged("torchao", "Skipping import of cpp extensions due to incompatible torch version.") != []
    assert _logged("lstmem_peft.tuner", "Failed to load %s", so) != []  # another logger: shown

    ours = enum.Enum("Ours", "A B")
    theirs = enum.Enum("KernelPreference", "A B", module="torchao.quantization.quantize_.common")
    deprecated = "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value"
    assert _logged("torch.utils._pytree", deprecated, theirs) == []
    assert _logged("torch.utils._pytree", deprecated, ours) != []  # not torchao's enum: shown

    bnb = "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ..."
    assert _logged("bitsandbytes.backends.cpu.ops", bnb, "No module named 'kernels'") == []
    assert _logged("bitsandbytes.backends.cpu.ops", "Something else failed") != []


def test_each_dropped_log_line_is_in_the_readme_with_what_ends_it():
    readme = (ROOT / "README.md").read_text()
    for line in quiet.UPSTREAM_LOG_LINES:
        assert f"`{line.logger}`" in readme, line.logger
        assert line.gone_with.split(" (")[0].split(":")[0] in readme, line.gone_with


def test_the_library_itself_drops_nothing():
    """Only the command sets the filters: importing the library's modules leaves the loggers as they were."""
    code = (
        "import logging, lstmem_peft, lstmem_peft.tuner.model, lstmem_peft.cli.commands\n"
        "names = ['torchao', 'torch.utils._pytree', 'bitsandbytes.backends.cpu.ops']\n"
        "print(sum(len(logging.getLogger(n).filters) for n in names))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.stdout.strip() == "0", out.stderr[-2000:]


# ---------------------------------------------------------------------- training's own settings
def test_the_training_config_warns_of_nothing_by_default_and_checkpoints_by_the_current_name(tmp_path):
    import dataclasses

    trainer = pytest.importorskip("lstmem_peft.training.trainer")
    from transformers import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert trainer.ACTIVATION_CHECKPOINTING in fields
    expected = (
        "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    )
    assert trainer.ACTIVATION_CHECKPOINTING == expected
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        off = trainer.LSTMemTrainingConfig(output_dir=str(tmp_path), report_to=[])
        on = trainer.LSTMemTrainingConfig(
            output_dir=str(tmp_path), report_to=[], **{trainer.ACTIVATION_CHECKPOINTING: True}
        )
    ours = [str(w.message) for w in caught if "checkpointing" in str(w.message) or "pin" in str(w.message)]
    assert ours == []
    assert not off.gradient_checkpointing and on.gradient_checkpointing
    assert getattr(off, expected) is False and getattr(on, expected) is True
    import torch

    assert off.dataloader_pin_memory == torch.cuda.is_available()


# ---------------------------------------------------------------------- serve
def test_serve_defaults_fit_the_demo_window_without_a_warning(loaded, tmp_path, caplog):
    pytest.importorskip("fastapi")
    import logging

    from lstmem_cli.parser import build_parser
    from lstmem_peft.serve import create_app

    args = build_parser().parse_args(["serve"])
    with caplog.at_level(logging.WARNING):
        app = create_app(loaded, str(tmp_path / "store"), default_max_tokens=args.max_tokens)
    assert caplog.records == []
    window = app.state.scheduler.window
    assert window == 64 and app.state.serving_chat.default_max_tokens == 32 < window


def test_a_request_without_a_session_reports_nothing_stored(loaded, tmp_path):
    pytest.importorskip("fastapi")
    from test_serve import in_process

    from lstmem_peft.serve import create_app

    app = create_app(loaded, str(tmp_path / "store"))
    facts = [{"role": "user", "content": f"k{i:02d} v{i:02d} ;"} for i in range(12)]
    messages = [*facts, {"role": "user", "content": "? k03"}]
    body = {"model": loaded.name, "messages": messages, "max_tokens": 2, "temperature": 0}

    async def scenario(client):
        none = await client.post("/v1/chat/completions", json=body)
        named = await client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "s"})
        sessions = await client.get("/v1/sessions")
        return none.json(), named.json(), sessions.json()

    none, named, sessions = in_process(app, scenario)
    assert none["lstmem"]["session"] is None
    assert (none["lstmem"]["memory_tokens_written"], none["lstmem"]["session_tokens_written"]) == (0, 0)
    assert named["lstmem"]["memory_tokens_written"] > 0  # the same conversation, stored: written
    assert [s["id"] for s in sessions["data"]] == ["s"]


# ---------------------------------------------------------------------- bench
def test_every_bench_kind_shows_a_progress_bar_on_stderr(tmp_path, capsys):
    sizes = {
        "decode": dict(kv_lengths=[8]),
        "generate": dict(prompt_tokens=8, answer_tokens=2),
        "ops": dict(answer_tokens=2),
        "e2e": dict(histories=[16], answer_tokens=2),
        "write": dict(tokens=16),
        "scan": dict(lengths=[4], batches=[1]),
    }
    assert set(sizes) | {"gpu", "report"} == set(BENCH_KINDS)
    for kind, size in sizes.items():
        bench.run(kind, preset="tiny", device="cpu", out=str(tmp_path), reps=1, **size)
        err = capsys.readouterr().err
        label = {"e2e": "e2e, history", "ops": "ops, counting"}.get(kind, kind)
        assert label in err and "run/s" in err, (kind, err[-500:])


def test_the_cpu_defaults_are_the_quick_ones_and_the_long_ones_are_documented():
    quick, long_ = bench.DEFAULTS["cpu"], bench.DEFAULTS["cpu-long"]
    assert quick["write_tokens"] < long_["write_tokens"] and max(quick["scan_lengths"]) < 2048
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    for option, value in (
        ("--kv-lengths", long_["kv_lengths"]),
        ("--histories", long_["histories"]),
        ("--tokens", [long_["write_tokens"]]),
        ("--lengths", long_["scan_lengths"]),
    ):
        assert f"{option} {' '.join(map(str, value))}" in doc, option


# ---------------------------------------------------------------------- the commands as a user runs them
def _lines(stderr: str) -> list[str]:
    lines = []
    for line in stderr.replace("\r", "\n").splitlines():
        line = re.sub(r"^[IWEF]\d{4} [\d:.]+ +\d+ ", "", line).strip()
        if line:
            lines.append(line)
    return lines


def _warnings(stderr: str) -> list[str]:
    return [line for line in _lines(stderr) if WARNING.search(line)]


def _lstmem(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lstmem_cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "train", [[], ["--train", "--steps", "2", "--chat-steps", "2"]], ids=["shipped", "training"]
)
def test_lstmem_demo_prints_no_warning(train, tmp_path):
    result = _lstmem(["demo", "--episodes", "16", "--no-ablations", *train], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _warnings(result.stderr) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["decode", "--kv-lengths", "8"],
        ["generate", "--prompt-tokens", "8", "--answer-tokens", "2"],
        ["ops", "--answer-tokens", "2"],
        ["e2e", "--histories", "16", "--answer-tokens", "2"],
        ["write", "--tokens", "16"],
        ["scan", "--lengths", "4", "--batches", "1"],
    ],
    ids=lambda argv: argv[0],
)
def test_lstmem_bench_prints_no_warning_and_a_progress_bar(argv, tmp_path):
    preset = [] if argv[0] == "scan" else ["--preset", "tiny"]
    result = _lstmem(["bench", *argv, *preset, "--reps", "1", "--out", str(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _warnings(result.stderr) == []
    assert "run/s]" in result.stderr or "s/run]" in result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_lstmem_serve_starts_with_its_defaults_without_a_warning(tmp_path):
    pytest.importorskip("uvicorn")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "lstmem_cli", "serve", "--port", str(_free_port())]
    server = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    stderr = b""
    try:
        deadline = time.monotonic() + 300
        while b"Application startup complete" not in stderr and time.monotonic() < deadline:
            assert server.poll() is None, stderr.decode()[-3000:]
            stderr += server.stderr.read1(65536) if hasattr(server.stderr, "read1") else b""
    finally:
        server.terminate()
        out, rest = server.communicate(timeout=60)
    stderr = (stderr + rest).decode()
    assert "Application startup complete" in stderr, stderr[-3000:]
    assert "context window 64 tokens" in out.decode()  # the start line names the window
    # uvicorn's own INFO lines aside, nothing: no warning, no loading bar, no backend's import lines
    extra = [line for line in _lines(stderr) if not line.startswith("INFO:")]
    assert extra == [], extra
