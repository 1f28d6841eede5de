"""benchmarks/real_model_cost.py on a tiny random Llama saved as a local folder (the real backbone is
the default): every variant and measurement recorded, times positive and finite, ratios to plain."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    """benchmarks/real_model_cost.py as a module (the benchmarks are not part of the package)."""
    spec = importlib.util.spec_from_file_location(
        "real_model_cost", ROOT / "benchmarks" / "real_model_cost.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama (3 layers) and a character tokenizer saved as a model folder."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import tiny_model

    from lstmem_peft.utils.offline import char_tokenizer

    folder = tmp_path_factory.mktemp("tiny-llama")
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_record_holds_every_variant_and_measurement_with_ratios_to_plain(tiny_folder, tmp_path, capsys):
    bench = _script()
    out = tmp_path / "cost.json"
    args = ["--model", str(tiny_folder), "--layers", "1-2", "--context", "16", "--history", "64"]
    args += ["--train-history", "16", "--read", "4", "--batch", "2", "--decode-tokens", "2"]
    args += ["--reps", "1", "--warmup", "0", "--threads", "1", "--out", str(out), "--no-progress"]
    returned = bench.main(args)
    record = json.loads(out.read_text())
    assert record == json.loads(json.dumps(returned))  # the file holds what main returned
    assert {"date", "machine", "torch", "transformers", "peft", "settings", "model_path"} <= set(record)
    assert record["order"] == ["plain", "memory 1-2", "memory all"]
    assert record["variants"]["memory 1-2"]["memory_layers"] == [1, 2]
    assert record["variants"]["memory all"]["memory_layers"] == [0, 1, 2]
    assert record["settings"]["context"] == 16 and record["settings"]["batch"] == 2
    assert (
        set(record["results"])
        == set(bench.MEASUREMENTS)
        == {
            "decode",
            "write",
            "write_kv",
            "train_step",
            "train_step_read_only",
        }
    )
    for measurement, row in record["results"].items():
        assert list(row) == record["order"], measurement
        plain = row["plain"]["median_s"]
        for name, figures in row.items():
            assert len(figures["times_s"]) == 1
            assert all(t > 0 and math.isfinite(t) for t in figures["times_s"]), (measurement, name)
            assert figures["min_s"] <= figures["median_s"] <= figures["max_s"]
            assert figures["ratio"] == pytest.approx(figures["median_s"] / plain)
            assert figures["ratio_pairs_median"] == pytest.approx(figures["ratio"])  # one repetition
        assert row["plain"]["ratio"] == 1
    train, read_only = record["results"]["train_step"], record["results"]["train_step_read_only"]
    for name in ("memory 1-2", "memory all"):  # the same memory steps against the other plain baseline
        assert read_only[name]["times_s"] == train[name]["times_s"]
    printed = capsys.readouterr().out
    assert "| what | plain s | memory 1-2 s | ratio | memory all s | ratio |" in printed
    for label in ("decode, per token", "write", "write + KV", "train step", "train step (plain: read only)"):
        assert f"| {label} |" in printed


def test_layer_lists_parse_and_print_compactly():
    bench = _script()
    assert bench.parse_layers("12-29", 30) == list(range(12, 30))
    assert bench.parse_layers("0-2, 5,3", 30) == [0, 1, 2, 3, 5]
    assert bench.parse_layers("all", 4) == [0, 1, 2, 3]
    assert bench.layers_label([0, 1, 2, 3, 5, 7, 8], 30) == "0-3,5,7-8"
    assert bench.layers_label([0, 1, 2], 3) == "all"
    for bad in ("3-1", "0-30", "1,,2"):
        with pytest.raises(ValueError):
            bench.parse_layers(bad, 30)
