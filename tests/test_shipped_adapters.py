"""Adapters shipped in the package (``--adapter smollm2-135m-english-numbers``): names resolve to whole
folders, a shipped adapter is refused on another backbone before anything loads, and its weights load
onto a backbone of its base model's shapes (a random-init one here; the real model's recall is in the
slow tier, tests/test_real_backbones.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from lstmem_peft.tuner.backbones import RECORD_FORMAT, RECORD_NAME
from lstmem_peft.tuner.shipped_adapters import WrongBackbone, check_pair, default_adapter
from lstmem_peft.utils.shipped_adapters import (
    ADAPTER_ASSETS,
    SHIPPED_ADAPTERS,
    resolve_adapter,
    shipped_adapter,
)

NAME = "smollm2-135m-english-numbers"


def test_every_shipped_adapter_is_a_whole_folder_for_a_known_backbone():
    from lstmem_peft.tuner.backbones import BACKBONES

    assert NAME in SHIPPED_ADAPTERS
    on_disk = {p.name for p in ADAPTER_ASSETS.iterdir() if p.is_dir()}
    assert on_disk == set(SHIPPED_ADAPTERS), "a folder under assets/adapters without an entry, or the reverse"
    for adapter in SHIPPED_ADAPTERS.values():
        assert adapter.backbone in BACKBONES
        for part in ("adapter_config.json", "adapter_model.safetensors", "README.md"):
            assert (adapter.folder / part).is_file(), f"{adapter.name} lacks {part}"
        config = json.loads((adapter.folder / "adapter_config.json").read_text())
        assert config["peft_type"] == "LSTMEM"
        assert config["base_model_name_or_path"] == adapter.backbone  # no path of the machine it was made on
        assert config.get("memory_id"), "a saved memory_id keeps stored memories loadable across restarts"
        card = (adapter.folder / "README.md").read_text()
        assert f"--adapter {adapter.name}" in card and adapter.backbone in card


def test_short_names_resolve_and_everything_else_passes_through(tmp_path, monkeypatch):
    assert resolve_adapter(NAME) == str(ADAPTER_ASSETS / NAME)
    assert resolve_adapter(None) is None
    assert resolve_adapter("owner/some-adapter") == "owner/some-adapter"  # a Hub id
    assert resolve_adapter(tmp_path) == str(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / NAME).mkdir()  # a local folder of the same spelling wins, as for --model
    assert shipped_adapter(NAME) is None and resolve_adapter(NAME) == NAME


def test_a_shipped_adapter_is_refused_on_another_backbone_before_anything_loads(tmp_path):
    check_pair("smollm2-135m", NAME)
    check_pair("anything/else", "owner/other-adapter")  # not shipped: left to the loader
    for model in (None, "Qwen/Qwen3-0.6B", str(tmp_path)):
        with pytest.raises(
            WrongBackbone, match="trained for the backbone smollm2-135m.*--model smollm2-135m"
        ):
            check_pair(model, NAME)
    converted = tmp_path / "converted"  # the folder resolve_model gives for the short name
    converted.mkdir()
    (converted / RECORD_NAME).write_text(json.dumps({"format": RECORD_FORMAT, "name": "smollm2-135m"}))
    check_pair(str(converted), NAME)


def test_the_cli_refuses_the_pair_naming_the_model(capsys):
    from lstmem_cli import main

    assert main(["serve", "--model", "Qwen/Qwen3-0.6B", "--adapter", NAME]) == 2
    assert "pass --model smollm2-135m" in capsys.readouterr().err


def test_the_shipped_weights_load_whole_onto_the_base_models_shapes():
    """Every tensor of the file lands, unchanged, in a parameter of a backbone with SmolLM2-135M's
    shapes (random weights, a small vocabulary and MLP: the adapter touches neither)."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    from lstmem_peft import LSTMemConfig

    folder = SHIPPED_ADAPTERS[NAME].folder
    config = LSTMemConfig.from_pretrained(folder)
    backbone = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=576,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            num_hidden_layers=30,
            intermediate_size=32,
            vocab_size=64,
            max_position_embeddings=8192,
        )
    )
    model = PeftModel.from_pretrained(backbone, os.fspath(folder))
    saved = load_file(folder / "adapter_model.safetensors")
    state = get_peft_model_state_dict(model, save_embedding_layers=False)  # keyed as PEFT saves it
    assert saved and state.keys() == saved.keys()
    for key, tensor in saved.items():
        assert torch.equal(state[key].to(tensor.dtype), tensor), key
    assert {n.split(".")[4] for n, _ in model.named_parameters() if ".lstmem" in n} == {
        str(i) for i in config.memory_layer_indices(30)
    }


def test_a_backbone_with_a_shipped_adapter_is_served_with_it_by_default():
    assert default_adapter("smollm2-135m") == NAME  # lstmem serve --model smollm2-135m, no --adapter
    assert default_adapter("Qwen/Qwen3-0.6B") is None and default_adapter(None) is None
