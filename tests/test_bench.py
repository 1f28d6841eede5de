"""The benchmark pipeline on a tiny preset: records, report and plots (timings are not asserted)."""

import contextlib
import json
from pathlib import Path

import pytest

from lstmem_peft.cli.bench import command as bench
from lstmem_peft.cli.bench import records as bench_records


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("records")
    made = {
        "decode": bench.run("decode", preset="tiny", out=str(out), reps=1, kv_lengths=[16, 32]),
        "write": bench.run("write", preset="tiny", out=str(out), reps=1, tokens=48),
        "e2e": bench.run("e2e", preset="tiny", out=str(out), reps=1, histories=[32], answer_tokens=3),
        "generate": bench.run(
            "generate", preset="tiny", out=str(out), reps=1, prompt_tokens=16, answer_tokens=4
        ),
        "scan": bench.run("scan", out=str(out), reps=1, lengths=[5], batches=[1]),
        "ops": bench.run("ops", preset="tiny", out=str(out), answer_tokens=3),
    }
    return out, made


def test_records_carry_device_versions_date_and_every_figure(records):
    out, made = records
    files = sorted(out.glob("*.json"))
    assert len(files) == 6
    for record in map(lambda p: json.loads(p.read_text()), files):
        assert {"device", "torch", "transformers", "date", "rows", "benchmark"} <= set(record)
    decode = made["decode"]["rows"]
    assert [r["kv_length"] for r in decode] == [16, 32]
    timed = [*decode, *made["write"]["rows"], made["e2e"]["rows"][0], made["generate"]["rows"][0]]
    for r in timed:  # every derived figure is derived from the medians it reports
        for side in ("lstmem", "plain"):
            assert r[side]["n"] == 1 and r[side]["min"] <= r[side]["median"] <= r[side]["max"]
        assert r["ratio"] == pytest.approx(r["lstmem"]["median"] / r["plain"]["median"])
        # one repetition: its one pair's ratio is the ratio of the two times
        assert r["ratio_pairs"]["n"] == 1 and r["ratio_pairs"]["median"] == pytest.approx(r["ratio"])
    for r in decode:  # one token per timed step
        assert r["lstmem_tok_s"] == pytest.approx(1 / r["lstmem"]["median"])
        assert r["plain_tok_s"] == pytest.approx(1 / r["plain"]["median"])
    assert [(r["tokens"], r["kv_cache"]) for r in made["write"]["rows"]] == [(48, True), (48, False)]
    assert made["e2e"]["rows"][0]["answer_tokens"] == 3
    generate = made["generate"]["rows"][0]
    assert (generate["prompt_tokens"], generate["new_tokens"]) == (16, 4)
    assert {r["backend"] for r in made["scan"]["rows"]} >= {"naive", "torch"}
    ops = made["ops"]["rows"][0]
    assert ops["lstmem_per_step"] > ops["plain_per_step"] > 0 and ops["memory_layers"] > 0
    assert (
        0
        < ops["extra_non_view_per_layer"]
        <= ops["extra_per_layer"]
        == pytest.approx(sum(ops["extra_by_op"].values()))
    )
    assert 0 < ops["forward_extra_non_view_per_layer"] < ops["extra_per_layer"]  # a model() step, counted too


def test_report_writes_tables_and_plots_and_marks_gpu_unmeasured(records, tmp_path):
    out, _ = records
    md = bench_records.report(out, tmp_path / "RESULTS.md")
    text = md.read_text()
    assert "GPU: not yet measured" in text
    for heading in ("## decode", "## generate", "## write", "## e2e", "## scan", "## ops"):
        assert heading in text
    generate = text[text.index("## generate") :].split("\n\n")[1]  # the table under the heading
    assert "(pairs " in generate  # the ratio within each repetition beside the ratio of medians
    assert (tmp_path / "decode-cpu-tiny.png").stat().st_size > 0 and (
        tmp_path / "e2e-cpu-tiny.png"
    ).stat().st_size > 0


def test_a_new_report_keeps_the_hand_written_history_of_results_md(records, tmp_path):
    out, _ = records
    md = tmp_path / "RESULTS.md"
    history = "## History of re-measurements\n\n- generate 1.08x (2026-11-24)\n"
    md.write_text("old tables\n\n" + bench_records.HAND_WRITTEN + "\n\n" + history)
    for _ in range(2):  # regenerated twice: the history stays, once, after the new tables
        text = bench_records.report(out, md).read_text()
        assert "old tables" not in text and "## decode" in text
        assert text.count(bench_records.HAND_WRITTEN) == 1 and text.endswith(history)
        assert text.index("## decode") < text.index(bench_records.HAND_WRITTEN)


def test_unknown_preset_and_kind_are_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        bench.run("decode", preset="gpt5", out=str(tmp_path))
    with pytest.raises(ValueError, match="unknown benchmark"):
        bench.run("latency", preset="tiny", out=str(tmp_path))


# ---------------------------------------------------------------------- lstmem bench gpu
@pytest.fixture(scope="module")
def gpu_dry_run(tmp_path_factory):
    """``lstmem bench gpu --dry-run`` into a tmp folder, with a free memory that holds the KV caches of
    16 tokens but not those of 64, and a length past the config's positions."""
    from lstmem_cli import main
    from lstmem_peft.cli.bench import gpu_suite as bench_gpu

    out = tmp_path_factory.mktemp("gpu-dry-run")
    patch = pytest.MonkeyPatch()
    patch.setattr(bench_gpu, "_free_bytes", lambda device: 50_000)  # tiny: 1,024 bytes a token for two caches
    try:
        status = main(["bench", "gpu", "--dry-run", "--out", str(out), "--kv-lengths", "16", "64", "1000000"])
    finally:
        patch.undo()
    records = {json.loads(p.read_text())["benchmark"]: json.loads(p.read_text()) for p in out.glob("*.json")}
    return out, status, records


def test_gpu_dry_run_records_every_step_with_environment_settings_and_skip_reasons(gpu_dry_run):
    _, status, records = gpu_dry_run
    assert status == 0
    assert set(records) == {"gpu-hf-decode", "gpu-vllm-decode", "gpu-kernels"}
    for r in records.values():
        assert r["dry_run"] is True and r["device_kind"] == "cpu" and r["device"].startswith("CPU")
        assert r["suite"] == "lstmem bench gpu" and r["suite_run"] and r["date"]
        for key in (
            "torch",
            "transformers",
            "triton",
            "vllm",
            "cuda",
            "driver",
            "peft",
            "python",
            "settings",
        ):
            assert key in r
        assert set(r["git"]) == {"commit", "dirty"}
    hf = records["gpu-hf-decode"]
    assert hf["preset"] == "tiny" and hf["settings"]["kv_lengths"] == [16, 64, 1000000]
    assert hf["settings"]["batch"] == 1 and "adapter disabled" in hf["settings"]["baseline"]
    assert [(r["kv_length"], r["variant"]) for r in hf["rows"]] == [
        (16, "forward"),
        (16, "generate"),
        (16, "generate-static-compile"),
    ]
    for r in hf["rows"]:
        assert r["lstmem_tok_s"] == pytest.approx(r["tokens_per_call"] / r["lstmem"]["median"])
        assert r["speed_retained"] == pytest.approx(r["plain"]["median"] / r["lstmem"]["median"])
    dynamic, generate, static = hf["rows"]
    assert (dynamic["cache"], dynamic["compiled"], dynamic["tokens_per_call"]) == ("DynamicCache", False, 1)
    assert generate["tokens_per_call"] == hf["settings"]["new_tokens"]
    assert static["cache"] == "StaticCache" and static["compiled"] is True  # transformers compiled the step
    assert static["compile_config"]["backend"] == "eager"  # a dry run captures, generates no code
    skipped = {(s["kv_length"], s["variant"]): s["reason"] for s in hf["skipped_runs"]}
    assert set(skipped) == {
        (n, v) for n in (64, 1000000) for v in ("forward", "generate", "generate-static-compile")
    }
    assert skipped[(64, "forward")].startswith("does not fit: two KV caches of 68 tokens")
    assert "max_position_embeddings" in skipped[(1000000, "forward")]
    vllm = records["gpu-vllm-decode"]
    assert vllm["rows"] == [] and "vllm is not importable" in vllm["skipped"]
    kernels = records["gpu-kernels"]
    assert {(r["kind"], r["backend"]) for r in kernels["rows"]} == {
        (kind, backend) for kind in ("scan", "step") for backend in ("naive", "torch")
    }
    assert "no CUDA device" in kernels["skipped_backends"]["triton"]


def test_report_never_shows_dry_run_records_as_figures(gpu_dry_run, tmp_path):
    out, _, _ = gpu_dry_run
    text = bench_records.report(out, tmp_path / "RESULTS.md").read_text()
    assert "GPU: not yet measured" in text and "lstmem bench gpu" in text
    assert "Dry runs of `lstmem bench gpu` (not measurements)" in text
    assert "## gpu-" not in text and "tok/s" not in text  # no table, no figure
    assert text.count(": dry run,") == 3


def test_report_renders_the_gpu_suite_tables(gpu_dry_run, tmp_path):
    """The tables a GPU run's records will get, rendered here from the dry run's records relabelled
    in a tmp folder (the rendering is tested; nothing is written where records are kept)."""
    out, _, records = gpu_dry_run
    folder = tmp_path / "records"
    folder.mkdir()
    for name, r in records.items():
        (folder / f"{name}.json").write_text(json.dumps({**r, "dry_run": False, "device_kind": "cuda"}))
    vllm = {**records["gpu-vllm-decode"], "dry_run": False, "device_kind": "cuda"}
    del vllm["skipped"]
    vllm["bench_vllm"] = {
        "settings": {"kv": [16]},
        "decode_tokens_per_s": {
            "plain": {"16": 2.0, "cudagraph_mode": "FULL_AND_PIECEWISE"},
            "lstmem": {"16": 1.0, "cudagraph_mode": "FULL_AND_PIECEWISE"},
        },
    }
    (folder / "gpu-vllm-decode.json").write_text(json.dumps(vllm))
    text = bench_records.report(folder, tmp_path / "RESULTS.md").read_text()
    assert "GPU: not yet measured" not in text and "Dry runs" not in text
    assert "| 16 | generate-static-compile | StaticCache | yes |" in text
    assert "Skipped: KV 64, forward: does not fit" in text
    assert "| 16 | 1.00 | 2.00 | 0.500 |" in text
    assert "(resolved by vLLM, lstmem: FULL_AND_PIECEWISE, plain: FULL_AND_PIECEWISE)" in text
    assert "Skipped: triton: no CUDA device" in text
    assert (tmp_path / "gpu-hf-decode-cuda-tiny.png").stat().st_size > 0


def test_gpu_suite_without_a_gpu_exits_non_zero_with_one_line(monkeypatch, capsys, tmp_path):
    import torch

    from lstmem_cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "gpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("lstmem bench gpu: error: needs a CUDA GPU") and "--dry-run" in err[0]
    assert not list(tmp_path.iterdir())  # no record
    assert main(["bench", "decode", "--dry-run"]) == 2  # gpu only
    assert "--dry-run applies to lstmem bench gpu only" in capsys.readouterr().err


def test_gpu_suite_vllm_step_runs_bench_vllm_sweep_with_cuda_graphs_on_a_saved_random_checkpoint(
    monkeypatch, tmp_path
):
    """The vLLM step's plumbing, vLLM replaced by a stand-in script: the arguments a GPU run passes
    (the preset's random checkpoint, saved; ``--compile``: CUDA graphs), its record wrapped."""
    import sys

    import torch

    from lstmem_peft.cli.bench import gpu_suite as bench_gpu

    script = tmp_path / "bench_vllm.py"
    script.write_text(
        "import json, os, sys\n"
        "args = sys.argv[1:]\n"
        "out = args[args.index('--out') + 1]\n"
        "model = args[args.index('--model') + 1]\n"
        "assert os.path.exists(os.path.join(model, 'config.json')), model\n"
        "print('stand-in sweep', flush=True)\n"
        "record = {'bench': 'vllm-decode-sweep', 'argv': args}\n"
        "open(os.path.join(out, 'vllm-decode-sweep-cuda-1.json'), 'w').write(json.dumps(record))\n"
    )
    monkeypatch.setattr(bench_gpu, "VLLM_SCRIPT", script)
    monkeypatch.setattr(bench_gpu, "_vllm_importable", lambda: True)
    lines = []
    s = bench_gpu.settings_for(False, preset="tiny", dtype="float32", kv_lengths=[16, 32], new_tokens=3)
    result = bench_gpu.vllm_sweep(s, torch.device("cpu"), dry_run=False, log=lines.append)
    argv = result["bench_vllm"]["argv"]
    assert argv[:4] == ["sweep", "--kv", "16", "32"] and "--compile" in argv and "--adapter" in argv
    assert result["cuda_graphs"] is True and "vllm | stand-in sweep" in lines
    assert result["command"][0] == sys.executable and "base" in result["command"]  # no temp paths kept
    script.write_text("import sys\nprint('boom')\nsys.exit(3)\n")
    failed = bench_gpu.vllm_sweep(s, torch.device("cpu"), dry_run=True, log=lines.append)
    assert failed["failed"] == "bench_vllm.py sweep exited with status 3" and failed["output_tail"] == [
        "boom"
    ]


def test_the_shipped_results_folder_holds_only_records_the_report_reads():
    """``lstmem bench report`` renders ``benchmarks/results/`` as shipped: every file there is a record
    of ``lstmem bench`` (the scripts in ``benchmarks/`` write theirs to folders of their own)."""
    folder = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    records = bench_records.read_records(folder)
    assert records and all(r["rows"] for r in records)


def test_alternate_keeps_setup_and_the_context_off_the_clock():
    """What ``_alternate`` times is ``run`` alone: a slow ``setup`` and a slow context around the
    call (PEFT's ``disable_adapter()`` walks the whole model on entry and exit) add nothing, and the
    context encloses the call it belongs to (the bound is far below the 0.05 s sleeps it keeps out)."""
    import time

    import torch

    inside = []

    @contextlib.contextmanager
    def slow(memory):
        time.sleep(0.05)
        inside.append(memory)
        yield
        inside.pop()
        time.sleep(0.05)

    def run(memory, state):
        assert inside == [memory] and state == ("state", memory)

    result = bench._alternate(
        run, 2, 1, torch.device("cpu"), lambda m: (time.sleep(0.05), ("state", m))[1], slow
    )
    for side in ("lstmem", "plain"):
        assert result[side]["n"] == 2 and result[side]["max"] < 0.04
    assert not inside


def test_the_plain_side_runs_with_the_adapter_disabled():
    calls = []

    class Model:
        @contextlib.contextmanager
        def disable_adapter(self):
            calls.append("off")
            yield

    context = bench.adapter_off(Model())
    with context(True):
        assert calls == []
    with context(False):
        assert calls == ["off"]
