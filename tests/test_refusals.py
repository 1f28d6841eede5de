"""Every refusal names its real cause and the fix (issue 37, items 3 and 4): an adapter loaded onto
another base model, another rank or head count, a string or list where token ids are expected, a
folder without weights through PEFT's own loader, and a command line whose every option explains
itself. A refused call leaves the model as it was."""

import json
import warnings

import pytest
import torch
from peft import PeftModel
from tiny_models import COMMON, make, tiny_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from lstmem_peft import LSTMemConfig, MemoryCache, memory_layers
from lstmem_peft.tuner.layer import LSTMemTunerLayer
from lstmem_peft.tuner.loading import load_model_and_adapter


def qwen3(seed=0, **changes):
    """A tiny Qwen3 like ``tiny_models``' (3 layers, hidden 48, query 48), with ``changes``."""
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**{**COMMON, "head_dim": 12, **changes})).eval()


def plain(model) -> bool:
    """Whether ``model`` carries nothing of LSTMem: no wrappers, no memory hooks."""
    wrapped = any(isinstance(m, LSTMemTunerLayer) for m in model.modules())
    return not wrapped and not model._forward_pre_hooks and not model._forward_hooks


@pytest.fixture(scope="module")
def two_layer(tmp_path_factory):
    """An adapter trained on a 2-layer tiny Qwen3 saved in a folder (so its adapter config records
    the base by name), and that base's folder."""
    root = tmp_path_factory.mktemp("bases")
    qwen3(num_hidden_layers=2).save_pretrained(root / "qwen3-2-layers")
    base = Qwen3ForCausalLM.from_pretrained(root / "qwen3-2-layers")
    from peft import get_peft_model

    get_peft_model(base, LSTMemConfig(r=4, num_heads=2)).save_pretrained(root / "adapter")
    assert json.loads((root / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    return root


# ---------------------------------------------------------------------- another base model
@pytest.mark.parametrize(
    "changes, facts",
    [
        (dict(num_hidden_layers=3), ["3 decoder layers", "needs them for decoder layers 0-2"]),
        (dict(num_hidden_layers=1), ["1 decoder layer,", "needs them for decoder layers 0."]),
        (dict(num_hidden_layers=2, hidden_size=64), ["hidden width 64, query width 48"]),
        (dict(num_hidden_layers=2, head_dim=16), ["hidden width 48, query width 64"]),
    ],
    ids=["deeper", "shallower", "wider", "other-query-width"],
)
def test_an_adapter_loaded_onto_another_base_names_both_bases(two_layer, changes, facts):
    """Through PEFT's door: the adapter's base, layers and widths against the model's; not "damaged",
    not torch's list of size mismatches; the backbone passed in is left plain."""
    base = qwen3(**changes)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    with pytest.raises(ValueError) as refused:
        PeftModel.from_pretrained(base, str(two_layer / "adapter"))
    message = str(refused.value)
    assert "was trained on another base model" in message and "Load it onto the base model it was" in message
    assert str(two_layer / "qwen3-2-layers") in message  # the base the adapter records
    assert "2 decoder layers (0, 1) of hidden width 48 and query width 48" in message
    for fact in facts:
        assert fact in message, (fact, message)
    assert "size mismatch" not in message and "damaged, was renamed" not in message
    assert plain(base)
    assert all(torch.equal(before[k], v) for k, v in base.state_dict().items())


def test_the_project_s_loader_names_another_base_too(two_layer, tmp_path):
    qwen3(num_hidden_layers=3).save_pretrained(tmp_path / "qwen3-3-layers")
    with pytest.raises(ValueError, match="was trained on another base model") as refused:
        load_model_and_adapter(str(tmp_path / "qwen3-3-layers"), str(two_layer / "adapter"), device="cpu")
    message = str(refused.value)
    assert str(two_layer / "qwen3-2-layers") in message and str(tmp_path / "qwen3-3-layers") in message
    assert "this model (" + str(tmp_path / "qwen3-3-layers") + ", 3 decoder layers" in message


def test_load_adapter_of_another_base_leaves_the_loaded_adapters_as_they_were(two_layer):
    """``PeftModel.load_adapter`` adds the adapter before PEFT reads its weights: the refusal removes
    it again, and the adapter already there computes what it computed."""
    model = make()  # 3 layers
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = model(input_ids=ids, memory_cache=MemoryCache()).logits
    with pytest.raises(ValueError, match="was trained on another base model"):
        model.load_adapter(str(two_layer / "adapter"), adapter_name="other")
    assert list(model.peft_config) == ["default"]
    assert all("other" not in m.lstmem_memory for m in model.modules() if hasattr(m, "lstmem_memory"))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, memory_cache=MemoryCache()).logits, before)


def test_the_right_base_still_loads_after_a_refusal(two_layer):
    with pytest.raises(ValueError):
        PeftModel.from_pretrained(qwen3(num_hidden_layers=3), str(two_layer / "adapter"))
    right = Qwen3ForCausalLM.from_pretrained(two_layer / "qwen3-2-layers")
    loaded = PeftModel.from_pretrained(right, str(two_layer / "adapter"))
    assert [layer.layer_idx for layer in memory_layers(loaded)] == [0, 1]


# ---------------------------------------------------------------------- another rank or head count
@pytest.mark.parametrize("change", [dict(r=8), dict(num_heads=4), dict(r=2, num_heads=8)])
def test_weights_of_another_rank_or_head_count_are_refused_in_one_sentence(tmp_path, change):
    """An adapter config edited after saving (r=4, 2 heads saved): one sentence with the weights'
    num_heads * r and the config's, instead of torch's size mismatches (one per tensor)."""
    make(r=4, num_heads=2).save_pretrained(tmp_path / "adapter")
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(change)
    config_file.write_text(json.dumps(config))
    base = tiny_model()
    with pytest.raises(ValueError) as refused:
        PeftModel.from_pretrained(base, tmp_path / "adapter")
    message = str(refused.value)
    r, heads = config["r"], config["num_heads"]
    assert "num_heads * r = 8 (heads times rank)" in message
    assert f"num_heads={heads} and r={r} (num_heads * r = {heads * r})" in message
    assert "another rank or head count" in message and "size mismatch" not in message
    assert message.count("\n") == 0
    assert plain(base)


def test_a_config_passed_to_from_pretrained_with_another_rank_is_refused_and_undone(tmp_path):
    make(r=4, num_heads=2).save_pretrained(tmp_path / "adapter")
    base = tiny_model()
    with pytest.raises(ValueError, match=r"num_heads=2 and r=8 \(num_heads \* r = 16\)"):
        PeftModel.from_pretrained(base, tmp_path / "adapter", config=LSTMemConfig(r=8, num_heads=2))
    assert plain(base)


# ---------------------------------------------------------------------- a folder without weights
@pytest.mark.parametrize("door", ["PeftModel.from_pretrained", "load_adapter"])
def test_peft_s_own_loader_names_the_missing_weights_file(tmp_path, door):
    """Not PEFT's Hub fallback (HFValidationError): the folder and adapter_model.safetensors; before
    anything is added to the model."""
    LSTMemConfig(r=4, num_heads=2).save_pretrained(tmp_path / "config-only")
    base, model = tiny_model(), make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the config load's own warning says the same
        with pytest.raises(FileNotFoundError) as refused:
            if door == "load_adapter":
                model.load_adapter(str(tmp_path / "config-only"), adapter_name="other")
            else:
                PeftModel.from_pretrained(base, str(tmp_path / "config-only"))
    message = str(refused.value)
    assert str(tmp_path / "config-only") in message and "adapter_model.safetensors" in message
    assert "save_pretrained" in message and "Repo id" not in message
    assert plain(base)
    assert list(model.peft_config) == ["default"]


def test_a_config_alone_still_loads_as_a_config(tmp_path):
    LSTMemConfig(r=4, num_heads=2).save_pretrained(tmp_path / "config-only")
    with pytest.warns(UserWarning, match="adapter_model.safetensors"):
        config = LSTMemConfig.from_pretrained(str(tmp_path / "config-only"))
    assert (config.r, config.num_heads) == (4, 2)


# ---------------------------------------------------------------------- the doors PEFT loads through
def _edited(source, target, **changes):
    """A copy of the adapter folder ``source`` at ``target`` with ``changes`` in its adapter config
    (``weights=False``: the config alone)."""
    keep_weights = changes.pop("weights", True)
    target.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors")[: 2 if keep_weights else 1]:
        (target / name).write_bytes((source / name).read_bytes())
    config = json.loads((target / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return target


@pytest.mark.parametrize("refusal", ["another base", "another rank", "no weights"])
def test_auto_peft_model_refuses_with_the_same_messages(two_layer, tmp_path, refusal):
    """``AutoPeftModelForCausalLM.from_pretrained`` loads the base its adapter config names, then goes
    through ``PeftModel.from_pretrained``: each refusal reads as it does there."""
    from peft import AutoPeftModelForCausalLM

    adapter = two_layer / "adapter"
    if refusal == "another base":
        qwen3(num_hidden_layers=3).save_pretrained(tmp_path / "qwen3-3-layers")
        folder = _edited(adapter, tmp_path / "a", base_model_name_or_path=str(tmp_path / "qwen3-3-layers"))
        expected, error = "was trained on another base model", ValueError
    elif refusal == "another rank":
        folder = _edited(adapter, tmp_path / "a", r=8)
        expected, error = r"num_heads=2 and r=8 \(num_heads \* r = 16\)", ValueError
    else:
        folder = _edited(adapter, tmp_path / "a", weights=False)
        expected, error = "has an adapter_config.json but no adapter weights", FileNotFoundError
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the config load's own warning says the same
        with pytest.raises(error, match=expected) as refused:
            AutoPeftModelForCausalLM.from_pretrained(str(folder))
    assert str(folder) in str(refused.value)  # the adapter folder, not PEFT's name for it


def test_the_user_s_own_weights_load_leaves_the_user_s_model_as_it_was(tmp_path):
    """Weights refused for an adapter the user built (``get_peft_model``, then PEFT's
    ``set_peft_model_state_dict``) leave that adapter in place: only a load's own adapter is removed."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    make(r=4, num_heads=2).save_pretrained(tmp_path / "adapter")
    model = make(r=8, num_heads=2)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = model(input_ids=ids, memory_cache=MemoryCache()).logits
    with pytest.raises(ValueError, match="the LSTMem adapter 'default' holds memory weights"):
        set_peft_model_state_dict(model, load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert list(model.peft_config) == ["default"] and not plain(model.base_model.model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, memory_cache=MemoryCache()).logits, before)


def test_configs_peft_builds_are_plain_lstmem_configs(two_layer):
    """PEFT reads and builds configs through its table, whose LSTMem entry
    (:class:`~lstmem_peft.tuner.config.PeftLoaderConfig`) only marks the loads: every config it hands
    out is an ``LSTMemConfig``."""
    from peft import PeftConfig, get_peft_config
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    from lstmem_peft.tuner.config import PeftLoaderConfig

    assert PEFT_TYPE_TO_CONFIG_MAPPING["LSTMEM"] is PeftLoaderConfig
    saved = LSTMemConfig.from_pretrained(str(two_layer / "adapter"))
    base = Qwen3ForCausalLM.from_pretrained(two_layer / "qwen3-2-layers")
    configs = [
        PeftConfig.from_pretrained(str(two_layer / "adapter")),
        get_peft_config(saved.to_dict()),
        PeftLoaderConfig(**saved.to_dict()),
        PeftModel.from_pretrained(base, str(two_layer / "adapter")).peft_config["default"],
    ]
    for config in configs:
        assert type(config) is LSTMemConfig
        assert config.to_dict() == {**saved.to_dict(), "inference_mode": config.inference_mode}
    assert not hasattr(configs[-1], "_loading_from")  # the load's mark is gone once its weights are checked


def test_loading_without_peft_names_another_base_too():
    """The vLLM plugin's and the server's reader of adapter files (no PEFT): a file with memory for
    decoder layers 0-1 read for a model whose config chooses 0-2."""
    from lstmem_peft.memory.adapter_files import memory_weights_by_layer

    key = "base_model.model.model.layers.{}.self_attn.q_proj.lstmem_memory.w_in"
    tensors = {key.format(i): torch.zeros(32, 48) for i in (0, 1)}
    with pytest.raises(ValueError) as refused:
        memory_weights_by_layer(tensors, "q_proj", [0, 1, 2], "adapter_model.safetensors")
    message = str(refused.value)
    assert (
        "no memory weights for decoder layer 2 (it holds them for decoder layers 0, 1 of 0-2 chosen)"
        in message
    )
    assert "trained on another base model" in message and "base_model_name_or_path" in message
