"""The training memory plan (lstmem_peft/training/memory_plan.py) against real models and the recipe."""

import ctypes
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from transformers import Qwen3Config

from lstmem_peft import LSTMemConfig, MemoryCache, write_history
from lstmem_peft.training.memory_plan import (
    AdapterDims,
    ModelDims,
    Setting,
    adapter_parameters,
    choose_checkpointing,
    estimate,
    memory_table,
    parse_size,
)
from lstmem_peft.utils.offline import tiny_qwen3

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "config",
    [
        LSTMemConfig(),
        LSTMemConfig(layers_to_transform=[0, 2]),
        LSTMemConfig(depth_coupling=False),
        LSTMemConfig(r=16, num_heads=2),
        LSTMemConfig(layers_to_transform=1),
    ],
    ids=["default", "subset", "no-depth", "r16", "one-layer"],
)
def test_adapter_parameters_match_the_adapter(config):
    base = tiny_qwen3(100, hidden_size=64, num_layers=3)
    dims = ModelDims.from_config(base.config)
    model = get_peft_model(base, config)
    real = sum(p.numel() for n, p in model.named_parameters() if "lstmem_memory" in n)
    assert adapter_parameters(dims, AdapterDims.from_config(config, dims.num_layers)) == real


@pytest.mark.parametrize("tie", [True, False])
def test_model_dims_count_the_backbone(tie):
    model = tiny_qwen3(100, hidden_size=64, num_layers=2, num_kv_heads=1, tie_embeddings=tie)
    dims = ModelDims.from_config(model.config)
    assert dims.parameters == sum(p.numel() for p in model.parameters())
    assert (dims.query_size, dims.kv_size, dims.intermediate_size) == (64, 16, 128)


def test_model_dims_of_the_shipped_qwen3_4b_config():
    config = json.loads((ROOT / "lstmem_peft" / "assets" / "configs" / "qwen3-4b.json").read_text())
    dims = ModelDims.from_config(Qwen3Config(**config))
    assert (dims.query_size, dims.kv_size) == (32 * 128, 8 * 128)
    assert 4.0e9 < dims.parameters < 4.05e9  # Qwen3-4B: 4.0B parameters, embeddings tied


def _live_heap_bytes() -> int:
    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks")
            + ("uordblks", "fordblks", "keepcost")
        ]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd  # bytes in use, from the heap and from mmap


def _glibc_with_mallinfo2() -> bool:
    try:
        _live_heap_bytes()
    except (OSError, AttributeError):
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="measures the heap with glibc's mallinfo2")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_stage1_activation_estimate_matches_the_live_heap(checkpointing):
    """Writing a stage-1 history with gradients keeps activations until backward: the heap grows
    by what the plan estimates per history token, within 15%."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    from transformers import Qwen3ForCausalLM

    model = get_peft_model(Qwen3ForCausalLM(config), LSTMemConfig(block_size=256))
    model.train()
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.base_model.model.gradient_checkpointing_enable()
    grown = []
    for tokens in (256, 768):  # one block, three blocks: the difference is two blocks' worth
        history = torch.randint(3, 256, (1, tokens), generator=torch.Generator().manual_seed(tokens))
        before = _live_heap_bytes()
        cache = MemoryCache()
        write_history(model, history, cache, progress=False)
        grown.append(_live_heap_bytes() - before)
        del cache
    measured = grown[1] - grown[0]
    dims = ModelDims.from_config(config)
    adapter = AdapterDims.from_config(LSTMemConfig(), dims.num_layers)

    def kept(history):
        setting = Setting(
            history_tokens=history,
            answer_tokens=0,
            checkpointing=checkpointing,
            backbone_dtype="float32",
            activation_dtype="float32",
        )
        return estimate(dims, adapter, setting).activations

    predicted = kept(768) - kept(256)
    assert 0.85 < predicted / measured < 1.15, (predicted, measured)


def _plan(**setting):
    dims = ModelDims.from_config(tiny_qwen3(100, hidden_size=64, num_layers=2).config)
    return dims, AdapterDims.from_config(LSTMemConfig(), dims.num_layers), Setting(**setting)


def test_fit_memory_turns_checkpointing_on_only_when_needed():
    dims, adapter, setting = _plan(backbone_dtype="float32", activation_dtype="float32")
    plain = estimate(dims, adapter, setting).total
    ckpt = estimate(dims, adapter, Setting(**{**setting.__dict__, "checkpointing": True})).total
    assert ckpt < plain
    assert choose_checkpointing(dims, adapter, setting, plain) is False
    assert choose_checkpointing(dims, adapter, setting, (plain + ckpt) // 2) is True
    with pytest.raises(ValueError, match=r"cap stage-1 histories at ([\d,]+) tokens") as err:
        choose_checkpointing(dims, adapter, setting, ckpt - 1)
    cap = int(err.value.args[0].split("cap stage-1 histories at ")[1].split(" ")[0].replace(",", ""))
    shorter = Setting(**{**setting.__dict__, "history_tokens": cap, "checkpointing": True})
    assert estimate(dims, adapter, shorter).total < ckpt  # the named cap fits the budget
    assert choose_checkpointing(dims, adapter, shorter, ckpt - 1) is True


def test_fit_memory_names_the_micro_batch_when_nothing_shorter_fits():
    dims, adapter, setting = _plan(micro_batch=4)
    with pytest.raises(ValueError, match="lower the micro-batch") as err:
        choose_checkpointing(dims, adapter, setting, 1)
    assert "cap stage-1" not in str(err.value)


def test_stage2_memory_does_not_grow_with_the_history():
    dims, adapter, _ = _plan()
    short, long = (estimate(dims, adapter, Setting(stage="stage2", history_tokens=h)) for h in (2048, 131072))
    assert short == long
    stage1 = estimate(dims, adapter, Setting(stage="stage1", history_tokens=8192))
    assert stage1.activations > long.activations


def test_memory_table_lists_the_stages():
    dims, adapter, setting = _plan(history_tokens=4096)
    table = memory_table(dims, adapter, setting)
    rows = [line.split() for line in table.splitlines() if line.strip().startswith("stage")][1:]
    assert [(r[0], r[1]) for r in rows] == [
        ("stage1", "1,024"),
        ("stage1", "2,048"),
        ("stage1", "4,096"),
        ("stage2", "131,072"),
    ]
    assert all(float(r[2]) >= float(r[3]) for r in rows)  # checkpointing never costs memory


@pytest.mark.parametrize(
    "text, size",
    [
        ("24GB", 24 * 10**9),
        ("24GiB", 24 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5 GiB", 3 * 2**29),
        ("100", 100),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size
    with pytest.raises(ValueError, match="24GB"):
        parse_size("lots")


@pytest.mark.slow
def test_recipe_prints_the_table_and_refuses_a_budget_nothing_fits(tmp_path):
    script = str(ROOT / "examples" / "train_two_stage.py")
    run = dict(cwd=tmp_path, capture_output=True, text=True, timeout=300)
    table = subprocess.run([sys.executable, script, "--tiny", "--memory-table"], **run)
    assert table.returncode == 0, table.stderr[-3000:]
    assert "stage1    8,192" in table.stdout and "stage2  131,072" in table.stdout
    refused = subprocess.run(
        [sys.executable, script, "--tiny", "--qasper", "q.json", "--long", "l.jsonl", "--output-dir", "run"]
        + ["--fit-memory", "10MB"],
        **run,
    )
    assert refused.returncode != 0
    assert "--fit-memory 10MB: stage1 needs about" in refused.stderr
    assert "use a device with more memory" in refused.stderr
