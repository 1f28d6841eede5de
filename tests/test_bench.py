"""The benchmark pipeline on a tiny preset: records, report and plots (timings are not asserted)."""

import json

import pytest

from lstmem_peft import bench


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
    md = bench.report(out, tmp_path / "RESULTS.md")
    text = md.read_text()
    assert "GPU: not yet measured" in text
    for heading in ("## decode", "## generate", "## write", "## e2e", "## scan", "## ops"):
        assert heading in text
    assert (tmp_path / "decode-cpu-tiny.png").stat().st_size > 0 and (
        tmp_path / "e2e-cpu-tiny.png"
    ).stat().st_size > 0


def test_unknown_preset_and_kind_are_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        bench.run("decode", preset="gpt5", out=str(tmp_path))
    with pytest.raises(ValueError, match="unknown benchmark"):
        bench.run("latency", preset="tiny", out=str(tmp_path))
