"""``lstmem bench gpu --acceptance``: its runner (each step isolated, timed out, skipped at the deadline,
the table last), its tolerances, its command line, and its dry run end to end from a checkout that is
not installed, with only the packages a lent GPU machine has (slow tier).
"""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lstmem_cli import main
from lstmem_peft.cli.gpu import acceptance as acc
from lstmem_peft.cli.gpu import cases as gpu_cases

REPO = Path(__file__).resolve().parents[1]


def test_the_tolerances_are_the_kernel_tests():
    from test_triton_kernels import TOLERANCES

    assert gpu_cases.TOLERANCES == TOLERANCES


def test_close_case_follows_the_kernel_tests_rule():
    """``|a - e| <= atol max(1, max|e|) + rtol |e|``, with the error and the tolerance at the worst element."""
    e = torch.tensor([10.0, 0.0])
    atol, rtol = gpu_cases.TOLERANCES[torch.float32]
    inside = gpu_cases.close_case("in", e + torch.tensor([0.0, 0.99 * atol * 10]), e, torch.float32)
    outside = gpu_cases.close_case("out", e + torch.tensor([0.0, 1.01 * atol * 10]), e, torch.float32)
    assert inside["passed"] and not outside["passed"]
    assert outside["tolerance"] == pytest.approx(atol * 10) and outside["max_error"] == pytest.approx(1.01e-4)
    assert not gpu_cases.close_case("nan", torch.tensor([float("nan")]), torch.tensor([1.0]), torch.float32)[
        "passed"
    ]


# ---------------------------------------------------------------------- the runner, with stand-in steps
def _stand_in_plan(s, device, dry_run, ctx, log):
    """Every step of the real plan by name, each doing one thing the runner must survive."""

    def case(passed):
        return lambda limit: dict(
            cases=[dict(name="c", passed=passed, max_error=2.0 - passed, tolerance=1.0)]
        )

    def raising(limit):
        raise RuntimeError("boom")

    def sleeping(limit):
        time.sleep(30)  # far past any limit: the alarm cuts it

    behaviour = {
        "kernel-scan": case(True),
        "kernel-step": case(False),  # a check that fails
        "kernel-decode-step": sleeping,  # past its own budget
        "build-model": raising,  # an error: the steps that need the model are skipped
        "time-scan": sleeping,  # cut at the overall deadline, before its own budget
        "pytest-kernels": sleeping,  # never starts: no time left
    }
    needs = (
        "model-train-grads",
        "model-generate-exact",
        "time-write",
        "time-decode-eager",
        "time-decode-compiled",
    )
    steps = []
    for name in acc.STEPS:
        kind = "timing" if name.startswith("time-") else "setup" if name == "build-model" else "check"
        run = behaviour.get(name, case(True))
        steps.append(acc.Step(name, kind, run, needs=("model",) if name in needs else ()))
    return steps


def test_each_step_is_isolated_timed_and_cut_at_the_deadline(monkeypatch, tmp_path):
    monkeypatch.setattr(acc, "plan", _stand_in_plan)
    monkeypatch.setitem(acc.BUDGETS, "kernel-decode-step", 0.5)
    monkeypatch.setitem(acc.BUDGETS, "pytest-kernels", 0.5)
    monkeypatch.setattr(acc, "MIN_START_S", 0.2)
    monkeypatch.setitem(acc.BUDGETS, "time-scan", 60)
    monkeypatch.setattr(acc, "_release", lambda device: None)  # gc.collect: seconds on a loaded machine
    lines = []
    path, record = acc.run_acceptance(out=tmp_path, dry_run=True, budget_s=4.0, log_to=lines.append)
    rows = {r["name"]: r for r in record["rows"]}
    assert list(rows) == list(acc.STEPS)
    assert all(r["status"] in acc.STATUSES for r in rows.values())
    assert rows["kernel-scan"]["status"] == "passed"
    assert rows["kernel-step"]["status"] == "failed"
    assert rows["kernel-step"]["max_error"] == 2.0 and rows["kernel-step"]["tolerance"] == 1.0
    assert rows["kernel-decode-step"]["status"] == "timed_out" and rows["kernel-decode-step"]["seconds"] < 5
    assert rows["build-model"]["status"] == "error" and "RuntimeError: boom" in rows["build-model"]["reason"]
    for name in ("model-train-grads", "model-generate-exact", "time-write", "time-decode-compiled"):
        assert rows[name]["status"] == "skipped" and "needs the model" in rows[name]["reason"]
    assert rows["time-scan"]["status"] == "timed_out" and rows["time-scan"]["seconds"] < 5
    assert rows["pytest-kernels"]["status"] == "skipped"
    assert "overall deadline (--budget-s 4)" in rows["pytest-kernels"]["reason"]
    assert not acc.ok(record) and record["dry_run"] is True
    assert json.loads(path.read_text())["rows"] == json.loads(json.dumps(record["rows"]))
    assert path.with_suffix(".log").read_text().count("kernel-step") >= 2
    # the table comes last: its header after every log line, then one row per step, the totals last
    header = next(i for i, line in enumerate(lines) if line.startswith("GPU acceptance (DRY RUN"))
    assert not any(line.startswith("[dry run]") for line in lines[header:])
    assert [line.split()[0] for line in lines[header + 2 : header + 2 + len(acc.STEPS)]] == list(acc.STEPS)
    assert lines[-1].startswith("1 passed, 1 failed,") and lines[-1].endswith("ok: False")


def test_a_record_of_the_acceptance_is_one_lstmem_bench_report_reads(monkeypatch, tmp_path):
    """Written into benchmarks/results (its default), the record must not break ``lstmem bench report``."""
    from lstmem_peft.cli.bench import records as bench_records

    monkeypatch.setattr(
        acc, "plan", lambda *a: [acc.Step("kernel-scan", "check", lambda limit: dict(cases=[]))]
    )
    acc.run_acceptance(out=tmp_path, dry_run=True, log_to=lambda line: None)
    (record,) = bench_records.read_records(tmp_path)
    assert record["benchmark"] == "gpu-acceptance" and record["rows"][0]["status"] == "failed"  # no case
    text = bench_records.report(tmp_path, tmp_path / "RESULTS.md").read_text()
    assert "gpu-acceptance" in text and "dry run" in text


def test_the_pytest_step_is_skipped_with_its_reason_where_pytest_is_missing(monkeypatch):
    monkeypatch.setattr(acc, "_importable", lambda name: name != "pytest")
    result = acc.run_kernel_tests(acc.settings_for(True), 10, True, log=lambda line: None)
    assert result == dict(skipped="pytest is not importable here; the kernel checks above ran without it")


# ---------------------------------------------------------------------- the command line
def test_acceptance_without_a_gpu_refuses_in_one_line_and_is_a_gpu_option(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "gpu", "--acceptance", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--acceptance needs a CUDA GPU" in err[0] and "--dry-run" in err[0]
    assert main(["bench", "decode", "--acceptance"]) == 2
    assert "--acceptance applies to lstmem bench gpu only" in capsys.readouterr().err
    assert main(["bench", "gpu", "--acceptance", "--dry-run", "--steps", "hf"]) == 2
    assert "--steps does not apply to --acceptance" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "gpu", "--acceptance", "--budget-s", "0"])
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- the dry run, end to end
# A child process as a lent GPU machine would run it: the checkout not installed (lstmem_kernels found
# through kernels/ on PYTHONPATH, as benchmarks/gpu_acceptance.sh sets it), one check broken on
# purpose (its float64 reference off by one), and afterwards none of trl, datasets, fastapi, vllm or
# pytest imported in that process.
CHILD = textwrap.dedent(
    """
    import json, runpy, sys
    sys.meta_path[:] = [f for f in sys.meta_path if not str(getattr(f, "__module__", "")).startswith("__editable__")]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not str(getattr(h, "__module__", "")).startswith("__editable__")]
    sys.path_importer_cache.clear()
    import lstmem_kernels
    assert lstmem_kernels.__file__.startswith(sys.argv[1]), lstmem_kernels.__file__
    step_naive = lstmem_kernels.step_naive
    def broken(*args, **kwargs):
        return step_naive(*args, **kwargs) + 1.0
    lstmem_kernels.step_naive = broken
    sys.argv = ["lstmem", "bench", "gpu", "--acceptance", "--dry-run", "--out", sys.argv[2]]
    try:
        runpy.run_module("lstmem_cli", run_name="__main__")
    except SystemExit as done:
        status = done.code
    imported = sorted(m for m in ("trl", "datasets", "fastapi", "vllm", "pytest") if m in sys.modules)
    print(json.dumps({"status": status, "imported": imported}))
    """
)


@pytest.mark.slow
def test_the_dry_run_records_every_step_survives_a_broken_check_and_prints_the_table_last(tmp_path):
    folder, out = REPO / "kernels", tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{folder}", TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder), str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(lines[-1])
    assert outcome == {"status": 1, "imported": []}, outcome  # a check failed: exit status 1
    (path,) = out.glob("gpu-acceptance-cpu-*.json")
    record = json.loads(path.read_text())
    assert path.with_suffix(".log").exists()
    assert record["dry_run"] is True and record["device_kind"] == "cpu" and record["git"]["commit"]
    for key in ("device", "torch", "triton", "transformers", "cuda", "driver", "compute_capability", "date"):
        assert key in record
    rows = {r["name"]: r for r in record["rows"]}
    assert list(rows) == list(acc.STEPS)
    for name, row in rows.items():
        expected = "measured" if name.startswith("time-") else "failed" if name == "kernel-step" else "passed"
        assert row["status"] == expected, (name, row.get("reason"), row.get("worst_case"))
        if row["kind"] == "check" and name != "pytest-kernels":
            assert row["max_error"] is not None and row["tolerance"] > 0
    assert rows["kernel-step"]["max_error"] > rows["kernel-step"]["tolerance"]
    assert rows["kernel-scan"]["chunk_keyword"]["takes_chunk"] in (True, False)
    assert rows["kernel-scan"]["triton"] == "interpreted"
    compiled = rows["time-decode-compiled"]["rows"]
    assert [r["kv_length"] for r in compiled] == acc.SETTINGS["dry-run"]["kv_lengths"]
    assert all("memory_in_graph" in r and "cudagraph_skips" in r for r in compiled)
    # the table is the last thing the run printed (before the child's own line)
    table = lines[:-1]
    header = next(i for i, line in enumerate(table) if line.startswith("GPU acceptance (DRY RUN"))
    assert not any(line.startswith("[dry run]") for line in table[header:])
    assert table[-1].startswith("6 passed, 1 failed, 4 measured;") and table[-1].endswith("ok: False")
