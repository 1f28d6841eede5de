"""Every PEFT and transformers door to an LSTMem adapter, on Qwen3 and Llama.

The generic invariants PEFT checks for its own tuners that apply to a stateful adapter: config and
file round trips, several adapters through ``PeftModel``, ``peft.functional`` and transformers'
adapter API, ``inject_adapter_in_model``, ``deepcopy`` and pickling, gradients, dtypes, and the
refusals (mixed-adapter batches, per-layer disabling, merging).
"""

import copy
import io
import json
import warnings

import pytest
import torch
from peft import (
    PeftConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    inject_adapter_in_model,
    set_peft_model_state_dict,
)
from peft.functional import delete_adapter as functional_delete_adapter
from peft.functional import set_adapter as functional_set_adapter
from tiny_models import VOCAB, history_then_question_logits, randomize_memory, tiny_model

import lstmem_peft
from lstmem_peft import LSTMemConfig, MemoryCache, find_memory, memory_layers
from lstmem_peft.tuner.hooks import MemoryHooks
from lstmem_peft.tuner.peft_gate import GATED_DOORS, peft_gate

#: transformers' adapter methods refuse the installed PEFT (transformers 5.24 with peft 0.21.2)
GATE_CLOSED = peft_gate() is not None
needs_open_gate = pytest.mark.skipif(
    GATE_CLOSED,
    reason=f"transformers' adapter methods refuse this PEFT {peft_gate()}: "
    "test_transformers_adapter_api_behind_a_closed_peft_gate covers it",
)

ARCHS = ["qwen3", "llama"]
PROMPT = torch.tensor([[5, 9, 17, 3, 40, 8]])


def adapter(arch, seed, **config):
    """A PeftModel with a randomised adapter (eval mode)."""
    model = get_peft_model(tiny_model(arch), LSTMemConfig(**config))
    randomize_memory(model, seed=seed)
    return model.eval()


def greedy(generate, **kwargs):
    cache = MemoryCache()
    with torch.no_grad():
        out = generate(PROMPT, memory_cache=cache, max_new_tokens=5, do_sample=False, **kwargs)
    return out, cache


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per architecture: folders ``a`` and ``b`` holding two different adapters, and their logits."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for arch in ARCHS:
        entry = {}
        for name, seed in (("a", 1), ("b", 7)):
            model = adapter(arch, seed)
            folder = root / arch / name
            model.save_pretrained(folder)
            entry[name] = (folder, history_then_question_logits(model), greedy(model.generate))
        out[arch] = entry
    return out


# ---------------------------------------------------------------------- configs and files
def test_config_round_trips(tmp_path):
    config = LSTMemConfig(r=4, num_heads=2, alpha=8.0, layers_to_transform=[0, 2], depth_coupling=False)
    config.save_pretrained(tmp_path)
    for loaded in (LSTMemConfig.from_pretrained(tmp_path), PeftConfig.from_pretrained(tmp_path)):
        assert isinstance(loaded, LSTMemConfig)
        assert loaded.to_dict() == config.to_dict()
    assert json.loads((tmp_path / "adapter_config.json").read_text())["peft_type"] == "LSTMEM"


@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_load_in_every_variant(arch, saved, tmp_path):
    folder, logits, _ = saved[arch]["b"]
    model = PeftModel.from_pretrained(tiny_model(arch), folder, adapter_name="first")
    model.load_adapter(folder, adapter_name="second")
    # safetensors and .bin, selected adapters (the second lands in a subfolder named after it)
    model.save_pretrained(tmp_path / "st", selected_adapters=["second"])
    model.save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert (tmp_path / "st" / "second" / "adapter_model.safetensors").exists()
    assert (tmp_path / "bin" / "first" / "adapter_model.bin").exists()
    loads = [
        PeftModel.from_pretrained(tiny_model(arch), tmp_path / "st", subfolder="second"),
        PeftModel.from_pretrained(tiny_model(arch), tmp_path / "bin", subfolder="first"),
        PeftModel.from_pretrained(tiny_model(arch), folder, low_cpu_mem_usage=True),
    ]
    for loaded in loads:
        assert torch.equal(history_then_question_logits(loaded.eval()), logits)


# ---------------------------------------------------------------------- several adapters
@pytest.mark.parametrize("arch", ARCHS)
def test_peft_model_switches_and_deletes_adapters(arch, saved):
    (a, logits_a, _), (b, logits_b, gen_b) = saved[arch]["a"], saved[arch]["b"]
    model = PeftModel.from_pretrained(tiny_model(arch), a, adapter_name="a").eval()
    model.load_adapter(b, adapter_name="b")
    assert torch.equal(history_then_question_logits(model), logits_a)
    model.set_adapter("b")
    assert torch.equal(history_then_question_logits(model), logits_b)
    out, cache = greedy(model.generate)
    assert torch.equal(out, gen_b[0]) and torch.equal(cache.layers[0].cell, gen_b[1].layers[0].cell)
    functional_set_adapter(model, "a")  # the functional door sets the layers only
    assert torch.equal(history_then_question_logits(model), logits_a)
    model.set_adapter("b")
    model.delete_adapter("a")
    assert torch.equal(history_then_question_logits(model), logits_b)
    with model.disable_adapter():
        assert torch.equal(model(PROMPT).logits, tiny_model(arch)(PROMPT).logits)


@pytest.mark.parametrize("door", ["peft", "transformers"])
def test_deleting_the_last_adapter_gives_the_plain_model_back(saved, door):
    """PEFT's ``delete_adapter`` and transformers' ``delete_adapter`` of the only adapter: the model
    computes what the plain backbone does (PEFT's own expectation), and disabling adapters works.

    Through PEFT the tuner (``model.base_model``) is called: ``PeftModelForCausalLM.forward`` and
    ``get_base_model`` themselves look up the deleted adapter's config and raise ``KeyError`` for every
    PEFT method (LoRA too)."""
    a = saved["qwen3"]["a"][0]
    plain = tiny_model("qwen3")(PROMPT).logits
    if door == "peft":
        peft_model = PeftModel.from_pretrained(tiny_model("qwen3"), a, adapter_name="a").eval()
        peft_model.delete_adapter("a")
        model = peft_model.base_model
        assert torch.equal(model(PROMPT).logits, plain)
        assert torch.equal(model.model(PROMPT).logits, plain)  # the backbone itself
        model.disable_adapter_layers()
        assert torch.equal(model(PROMPT).logits, plain)
    else:
        model = tiny_model("qwen3")
        model.load_adapter(str(a), adapter_name="a")
        if GATE_CLOSED:  # transformers' own delete_adapter refuses this PEFT: its functional API instead
            functional_delete_adapter(model, adapter_name="a", prefix="lstmem_")
        else:
            model.delete_adapter(
                "a"
            )  # transformers then holds no adapter (disable_adapters() says so itself)
        assert torch.equal(model(PROMPT).logits, plain)
    with torch.no_grad():
        out = model.generate(PROMPT, max_new_tokens=3, do_sample=False)
        ref = tiny_model("qwen3").generate(PROMPT, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, ref)


@needs_open_gate
@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_adapter_api(arch, saved):
    """``load_adapter`` twice, ``set_adapter``, ``delete_adapter``, ``disable_adapters``: the
    adapter the layers report is the one that runs, and memory works through every step."""
    (a, logits_a, _), (b, logits_b, gen_b) = saved[arch]["a"], saved[arch]["b"]
    base = tiny_model(arch)
    base.load_adapter(str(a), adapter_name="a")
    base.load_adapter(str(b), adapter_name="b")
    hooks = [
        h for h in base._forward_pre_hooks.values() if isinstance(getattr(h, "__self__", None), MemoryHooks)
    ]
    assert len(hooks) == 1, "a second adapter must share the backbone's one set of memory hooks"
    reported = base.active_adapters()  # transformers activates the adapter it loaded last
    assert reported == ["b"] and torch.equal(history_then_question_logits(base), logits_b)
    base.set_adapter("a")
    assert torch.equal(history_then_question_logits(base), logits_a)
    base.set_adapter("b")
    assert torch.equal(history_then_question_logits(base), logits_b)
    out, cache = greedy(lambda *args, **kw: lstmem_peft.generate(base, *args, **kw))
    assert torch.equal(out, gen_b[0]) and torch.equal(cache.layers[-1].hidden, gen_b[1].layers[-1].hidden)
    base.delete_adapter("a")
    assert torch.equal(history_then_question_logits(base), logits_b)
    base.disable_adapters()
    assert torch.equal(base(PROMPT).logits, tiny_model(arch)(PROMPT).logits)
    base.enable_adapters()
    assert torch.equal(history_then_question_logits(base), logits_b)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_adapter_api_behind_a_closed_peft_gate(arch, saved, monkeypatch):
    """transformers 5.24 gates its adapter methods behind peft 0.22 (unreleased; forced here on other
    releases): ``load_adapter`` works, each gated method of a backbone carrying LSTMem raises an error
    that names both versions and what works instead, and those alternatives do work, memory included."""
    import transformers
    import transformers.integrations.peft as hf_peft

    if not GATE_CLOSED:
        monkeypatch.setattr(hf_peft, "MIN_PEFT_VERSION", "999.0")
    required, installed = peft_gate()
    (a, logits_a, _), (b, logits_b, _) = saved[arch]["a"], saved[arch]["b"]
    base = tiny_model(arch)
    base.load_adapter(str(a), adapter_name="a")
    base.load_adapter(str(b), adapter_name="b")
    for door in GATED_DOORS:
        with pytest.raises(ValueError) as refused:
            getattr(base, door)("a") if door in ("set_adapter", "delete_adapter") else getattr(base, door)()
        message = str(refused.value)
        for fact in (f"model.{door}()", transformers.__version__, installed, required, GATED_DOORS[door]):
            assert fact in message
    assert torch.equal(history_then_question_logits(base), logits_b)  # the refusals changed nothing
    functional_set_adapter(base, "a")  # the alternatives the messages name
    assert MemoryHooks.of(base).active_adapter() == "a"
    assert torch.equal(history_then_question_logits(base), logits_a)
    functional_set_adapter(base, "b")
    functional_delete_adapter(base, adapter_name="a", prefix="lstmem_")
    assert MemoryHooks.of(base).adapters() == ["b"]
    assert torch.equal(history_then_question_logits(base), logits_b)
    assert torch.equal(history_then_question_logits(copy.deepcopy(base)), logits_b)  # still copies


@pytest.mark.parametrize("arch", ARCHS)
def test_inject_adapter_in_model_with_and_without_state_dict(arch):
    source = inject_adapter_in_model(LSTMemConfig(), tiny_model(arch))
    randomize_memory(source, seed=3)
    state = get_peft_model_state_dict(source)
    assert state and all(".lstmem_memory." in key for key in state)
    for kwargs in ({}, {"state_dict": state}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a normal call warns about nothing (PEFT's target check included)
            target = inject_adapter_in_model(LSTMemConfig(), tiny_model(arch), **kwargs)
        set_peft_model_state_dict(target, state)
        assert torch.equal(history_then_question_logits(target), history_then_question_logits(source))


# ---------------------------------------------------------------------- copies
def test_deepcopy_gives_an_independent_model():
    model = adapter("qwen3", seed=1)
    before = history_then_question_logits(model)
    twin = copy.deepcopy(model)
    assert torch.equal(history_then_question_logits(twin), before)
    assert find_memory(twin) is not find_memory(model)
    randomize_memory(twin, seed=5)
    assert torch.equal(history_then_question_logits(model), before)
    assert not torch.equal(history_then_question_logits(twin), before)
    assert torch.equal(greedy(twin.generate)[0][:, : PROMPT.shape[1]], PROMPT)


def test_pickling_round_trips():
    model = adapter("llama", seed=2)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(history_then_question_logits(loaded), history_then_question_logits(model))
    (out, cache), (ref, ref_cache) = greedy(loaded.generate), greedy(model.generate)
    assert torch.equal(out, ref) and torch.equal(cache.layers[1].cell, ref_cache.layers[1].cell)


# ---------------------------------------------------------------------- training
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "config",
    [{}, {"depth_coupling": False}, {"layers_to_transform": [1, 2]}],
    ids=["all", "no-depth", "layers"],
)
def test_every_trainable_parameter_gets_a_gradient_and_only_adapter_parameters_change(arch, config):
    model = adapter(arch, seed=1, **config).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lstmem_memory" in n for n in trainable)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids, memory_cache=MemoryCache()).loss
    loss.backward()
    no_grad = sorted(n for n in trainable if dict(model.named_parameters())[n].grad is None)
    assert not no_grad, f"trainable parameters without a gradient: {no_grad}"
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == trainable
    # W~_pred exists exactly in the layers with a depth input; PEFT sees one trainable state
    model.set_adapter("default")
    layers = memory_layers(model)
    assert [layer.w_pred is not None for layer in layers] == [
        config.get("depth_coupling", True) and i > 0 for i in range(len(layers))
    ]
    assert model.get_model_status().requires_grad == {"default": True}


def test_autocast_adapter_dtype_is_honoured_in_every_load_path(tmp_path):
    def adapter_dtypes(model):
        return {p.dtype for n, p in model.named_parameters() if "lstmem_memory" in n}

    def bf16_base():
        return tiny_model("qwen3").to(torch.bfloat16)

    assert adapter_dtypes(get_peft_model(bf16_base(), LSTMemConfig())) == {torch.float32}
    kept = get_peft_model(bf16_base(), LSTMemConfig(), autocast_adapter_dtype=False)
    assert adapter_dtypes(kept) == {torch.bfloat16}
    assert kept(PROMPT, memory_cache=MemoryCache()).logits.dtype == torch.bfloat16
    kept.save_pretrained(tmp_path)
    assert adapter_dtypes(PeftModel.from_pretrained(bf16_base(), tmp_path)) == {torch.float32}
    loaded = PeftModel.from_pretrained(bf16_base(), tmp_path, autocast_adapter_dtype=False)
    assert adapter_dtypes(loaded) == {torch.bfloat16}
    loaded.load_adapter(tmp_path, adapter_name="second", autocast_adapter_dtype=False)
    loaded.load_adapter(tmp_path, adapter_name="third")
    second = {p.dtype for n, p in loaded.named_parameters() if ".second." in n}
    third = {p.dtype for n, p in loaded.named_parameters() if ".third." in n}
    assert second == {torch.bfloat16} and third == {torch.float32}


# ---------------------------------------------------------------------- wrappers and refusals
def test_wrappers_look_like_peft_layers():
    model = adapter("qwen3", seed=1)
    attention = model.base_model.model.model.layers[0].self_attn
    for wrapper in (attention.q_proj, attention.o_proj):
        base = wrapper.get_base_layer()
        assert (wrapper.in_features, wrapper.out_features) == (base.in_features, base.out_features)
        assert repr(wrapper).startswith("lstmem.")


def test_disabling_single_wrappers_is_refused_and_whole_disabling_works():
    model = adapter("qwen3", seed=1)
    model.base_model.model.model.layers[1].self_attn.q_proj.enable_adapters(False)
    with pytest.raises(RuntimeError, match=r"disabled in decoder layers \[1\] only"):
        model(PROMPT, memory_cache=MemoryCache())
    model.base_model.model.model.layers[1].self_attn.q_proj.enable_adapters(True)
    model.base_model.disable_adapter_layers()
    assert torch.equal(model(PROMPT).logits, tiny_model("qwen3")(PROMPT).logits)


def test_mixed_adapter_batches_are_refused():
    model = adapter("qwen3", seed=1)
    cache = MemoryCache()
    with pytest.raises(ValueError, match="adapter_names="):
        model(PROMPT, memory_cache=cache, adapter_names=["default"])
    with pytest.raises(ValueError, match="adapter_names="):
        model.generate(PROMPT, memory_cache=cache, adapter_names=["default"], max_new_tokens=2)
    assert cache.layout is None, "a refused call touched the cache"


def test_nothing_of_peft_or_transformers_is_patched():
    model = adapter("qwen3", seed=1)
    assert PeftModel.create_or_update_model_card.__module__ == "peft.peft_model"
    assert PeftModel._upload_modified_files.__module__.startswith("transformers")
    backbone = model.base_model.model
    assert not {"generate", "prepare_inputs_for_generation", "forward"} & set(vars(backbone))
    base = model.unload()
    assert MemoryHooks.of(base) is None
    assert not base._forward_pre_hooks and not base.model._forward_pre_hooks


@pytest.mark.parametrize("field,value", [("r", 0), ("depth_coupling", "no"), ("alpha", float("inf"))])
def test_every_door_validates_the_config_it_injects(field, value):
    """A config changed after it was built is checked again by get_peft_model, add_adapter and
    inject_adapter_in_model (PEFT itself does not re-run the config's checks)."""
    doors = [
        lambda config: get_peft_model(tiny_model(), config),
        lambda config: get_peft_model(tiny_model(), LSTMemConfig()).add_adapter("other", config),
        lambda config: inject_adapter_in_model(config, tiny_model()),
    ]
    for door in doors:
        config = LSTMemConfig()
        setattr(config, field, value)
        with pytest.raises(ValueError, match=field):
            door(config)
