"""LSTMem on quantised backbones (QLoRA-style): bitsandbytes NF4 and 8-bit, torchao int8 weight-only,
optimum-quanto int8, each loaded through transformers' ``quantization_config`` on a tiny random Qwen3.

A backend whose library is not installed (they are the optional ``quant`` extra) is skipped; one that
is installed but cannot load a model on this machine is skipped with the loader's error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training
from tiny_models import VOCAB, randomize_memory, tiny_model
from torch import nn
from transformers import AutoModelForCausalLM

from lstmem_peft import LSTMemConfig, MemoryCache, memory_layers
from lstmem_peft.layer import LSTMemQueryLayer, _plain_linear
from lstmem_peft.memory import LSTMemLayer
from lstmem_peft.quant import SUPPORTED_PROJECTIONS, dense_weight, is_supported_projection, projection_kind


def _bnb_nf4():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )


def _bnb_int8():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=True)


def _torchao_int8():
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


def _quanto_int8():
    from transformers import QuantoConfig

    return QuantoConfig(weights="int8")


# backend -> (library to import, quantization_config factory, projection kind, tolerance of the
# projection's output against x @ dense_weight.T: LLM.int8 quantises activations too, the others do not)
BACKENDS = {
    "bnb-nf4": ("bitsandbytes", _bnb_nf4, "bnb-4bit", 1e-5),
    "bnb-int8": ("bitsandbytes", _bnb_int8, "bnb-8bit", 5e-2),
    "torchao-int8wo": ("torchao", _torchao_int8, "torchao", 1e-5),
    "quanto-int8": ("optimum.quanto", _quanto_int8, "quanto", 1e-5),
}
CONFIG = dict(r=4, num_heads=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen3 saved as a normal checkpoint, and the float model it came from."""
    path = tmp_path_factory.mktemp("tiny-qwen3")
    model = tiny_model("qwen3")
    model.save_pretrained(path)
    return path, model


def load_quantized(path, backend: str, **kwargs):
    library, make_config, _, _ = BACKENDS[backend]
    pytest.importorskip(library)
    kwargs.setdefault("dtype", torch.float32)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=make_config(), **kwargs)
    except Exception as err:  # the precise reason this backend does not run here
        pytest.skip(f"{backend} cannot load a model on this machine: {type(err).__name__}: {err}")
    return model.eval()


def projections(model):
    """Every attention query/output projection of the backbone (the base layers under any wrapper)."""
    found = []
    for layer in model.model.layers:
        for name in ("q_proj", "o_proj"):
            module = getattr(layer.self_attn, name)
            found.append(module.get_base_layer() if hasattr(module, "get_base_layer") else module)
    return found


def adapter_parameters(model) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if ".lstmem_memory." in n}


def snapshot(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` as dense tensors (quantised ones dequantised)."""
    out = {}
    for name, t in model.state_dict().items():
        if type(t) not in (torch.Tensor, nn.Parameter) and callable(getattr(t, "dequantize", None)):
            t = t.dequantize()
        out[name] = t.detach().clone()
    return out


backends = pytest.mark.parametrize("backend", list(BACKENDS))


@backends
def test_dense_weight_is_the_matrix_each_quantised_projection_multiplies_by(checkpoint, backend):
    path, reference = checkpoint
    model = load_quantized(path, backend)
    kind, tol = BACKENDS[backend][2], BACKENDS[backend][3]
    x = torch.randn(5, reference.config.hidden_size)
    for module, original in zip(projections(model), projections(reference), strict=True):
        assert projection_kind(module) == kind and is_supported_projection(module)
        dense = dense_weight(module)
        assert dense.dtype == torch.float32 and dense.shape == original.weight.shape
        # the dequantised matrix is the quantised original, not packed bytes
        err = (dense - original.weight).norm() / original.weight.norm()
        assert err < 0.15, f"dequantised weight is {err:.3f} away from the original (relative)"
        with torch.no_grad():
            xin = x[:, : module.in_features]
            y = module(xin).float()
            torch.testing.assert_close(y, F.linear(xin, dense), rtol=tol, atol=tol * y.abs().max().item())


@backends
def test_adapter_attaches_in_float32_with_corrections_from_the_dequantised_weights(checkpoint, backend):
    path, reference = checkpoint
    model = get_peft_model(load_quantized(path, backend), LSTMemConfig(**CONFIG))
    params = adapter_parameters(model)
    assert params and all(p.dtype == torch.float32 for p in params.values())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and trainable <= set(params), "only adapter parameters may train"
    float_model = get_peft_model(tiny_model("qwen3"), LSTMemConfig(**CONFIG))
    for layer, float_layer in zip(
        model.base_model.model.model.layers, float_model.base_model.model.model.layers, strict=True
    ):
        wrapper = layer.self_attn.q_proj
        assert isinstance(wrapper, LSTMemQueryLayer)
        memory = wrapper.lstmem_memory["default"]
        expected = LSTMemLayer(memory.hidden_size, memory.query_size, memory.num_heads, memory.head_dim)
        expected.init_corrections(
            dense_weight(wrapper.get_base_layer()), dense_weight(layer.self_attn.o_proj.get_base_layer())
        )
        torch.testing.assert_close(memory.w_dq, expected.w_dq, rtol=0, atol=0)
        torch.testing.assert_close(memory.w_do, expected.w_do, rtol=0, atol=0)
        # and close to the init on the unquantised backbone (quantisation error only)
        float_memory = float_layer.self_attn.q_proj.lstmem_memory["default"]
        torch.testing.assert_close(memory.w_dq, float_memory.w_dq, rtol=0, atol=5e-3)
        torch.testing.assert_close(memory.w_do, float_memory.w_do, rtol=0, atol=5e-3)


@backends
def test_quantised_base_layers_run_their_own_forward(checkpoint, backend):
    """A quantised projection never takes the plain-Linear fast path (which would multiply by its storage)."""
    model = load_quantized(checkpoint[0], backend)
    x = torch.randn(1, 3, model.config.hidden_size)
    assert not any(_plain_linear(module, x, (), {}) for module in projections(model))


@backends
def test_one_optimizer_step_changes_only_adapter_parameters(checkpoint, backend):
    model = get_peft_model(load_quantized(checkpoint[0], backend), LSTMemConfig(**CONFIG))
    randomize_memory(model)  # off the initialisation, where some gates pass no gradient yet
    params = adapter_parameters(model)
    before = snapshot(model)
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-1)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and set(trainable) <= set(params)
    missing = [n for n, p in trainable.items() if p.grad is None or not p.grad.any()]
    assert not missing, f"trainable adapter parameters without a gradient: {missing}"
    optimizer.step()
    after = snapshot(model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == set(trainable), (
        f"changed: {sorted(changed)[:5]}...; trainable: {sorted(trainable)[:5]}..."
    )


@backends
def test_generate_with_memory_cache_reads_and_writes_it(checkpoint, backend):
    model = get_peft_model(load_quantized(checkpoint[0], backend), LSTMemConfig(**CONFIG))
    randomize_memory(model)
    g = torch.Generator().manual_seed(1)
    history, prompt = (
        torch.randint(3, VOCAB, (2, 12), generator=g),
        torch.randint(3, VOCAB, (2, 5), generator=g),
    )
    cache = MemoryCache()
    with torch.no_grad():
        model(input_ids=history, memory_cache=cache)
        start = cache.clone()
        expected_first = model(input_ids=prompt, memory_cache=start.clone()).logits[:, -1]
        out = model.generate(
            input_ids=prompt,
            memory_cache=cache,
            max_new_tokens=4,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    torch.testing.assert_close(out.logits[0], expected_first, rtol=1e-5, atol=1e-5)
    # prompt and every generated token but the last were written (the last is never forwarded)
    assert cache.tokens_written.tolist() == [12 + 5 + 3] * 2
    assert not torch.equal(cache.layers[0].cell, start.layers[0].cell)


@backends
def test_save_and_load_on_the_quantised_base_gives_identical_logits(checkpoint, backend, tmp_path):
    model = get_peft_model(load_quantized(checkpoint[0], backend), LSTMemConfig(**CONFIG))
    randomize_memory(model)
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(load_quantized(checkpoint[0], backend), tmp_path).eval()
    assert all(p.dtype == torch.float32 for p in adapter_parameters(loaded).values())
    for ours, theirs in zip(memory_layers(model), memory_layers(loaded), strict=True):
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a, b), name
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = model(input_ids=ids, memory_cache=MemoryCache()).logits
        b = loaded(input_ids=ids, memory_cache=MemoryCache()).logits
    assert torch.equal(a, b)


@backends
def test_prepare_model_for_kbit_training_without_checkpointing_trains(checkpoint, backend):
    base = prepare_model_for_kbit_training(
        load_quantized(checkpoint[0], backend), use_gradient_checkpointing=False
    )
    model = get_peft_model(base, LSTMemConfig(**CONFIG))
    model.train()
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for p in adapter_parameters(model).values() if p.requires_grad]
    assert grads and all(g is not None for g in grads) and any(g.any() for g in grads)


@backends
def test_gradient_checkpointing_on_a_quantised_backbone_is_refused_when_training(checkpoint, backend):
    base = prepare_model_for_kbit_training(load_quantized(checkpoint[0], backend))  # PEFT's default recipe
    if (
        not base.is_gradient_checkpointing
    ):  # prepare_model_for_kbit_training turns it on for bnb and torchao only
        base.gradient_checkpointing_enable()
    model = get_peft_model(base, LSTMemConfig(**CONFIG))
    model.train()
    ids = torch.randint(3, VOCAB, (1, 6))
    with pytest.raises(
        RuntimeError, match="does not support gradient checkpointing.*gradient_checkpointing_disable"
    ):
        model(input_ids=ids, labels=ids)
    with torch.no_grad():  # inference on the same model is unaffected
        model.eval()(input_ids=ids, memory_cache=MemoryCache())


def test_nf4_with_bfloat16_compute_keeps_the_adapter_in_float32(checkpoint):
    """The usual QLoRA setting: bf16 backbone and compute, adapter and memory in float32."""
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )
    base = AutoModelForCausalLM.from_pretrained(
        checkpoint[0], quantization_config=config, dtype=torch.bfloat16
    )
    model = get_peft_model(
        prepare_model_for_kbit_training(base, use_gradient_checkpointing=False), LSTMemConfig()
    )
    assert all(p.dtype == torch.float32 for p in adapter_parameters(model).values())
    model.train()
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    cache = MemoryCache()
    loss = model(input_ids=ids, labels=ids, memory_cache=cache).loss
    loss.backward()
    assert torch.isfinite(loss) and cache.layers[0].cell.dtype == torch.float32
    assert all(p.grad is not None for p in adapter_parameters(model).values() if p.requires_grad)


def test_nf4_llama_attaches_trains_and_generates(tmp_path):
    """The QLoRA recipe on a second architecture: a tiny Llama in NF4 (no q/k norms, so the query correction
    goes straight into RoPE)."""
    pytest.importorskip("bitsandbytes")
    tiny_model("llama").save_pretrained(tmp_path)
    model = get_peft_model(load_quantized(tmp_path, "bnb-nf4"), LSTMemConfig(**CONFIG))
    randomize_memory(model)
    assert {projection_kind(p) for p in projections(model.base_model.model)} == {"bnb-4bit"}
    assert all(p.dtype == torch.float32 for p in adapter_parameters(model).values())
    before = snapshot(model)
    model.train()
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-1).step()
    after = snapshot(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n for n in before if not torch.equal(before[n], after[n])} == trainable
    model.eval()
    cache = MemoryCache()
    with torch.no_grad():
        model(input_ids=ids, memory_cache=cache)
        expected = model(input_ids=ids[:, :4], memory_cache=cache.clone()).logits[:, -1]
        out = model.generate(
            input_ids=ids[:, :4],
            memory_cache=cache,
            max_new_tokens=3,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    torch.testing.assert_close(out.logits[0], expected, rtol=1e-5, atol=1e-5)
    assert cache.tokens_written.tolist() == [10 + 4 + 2] * 2


class PackedInt4Linear(nn.Module):
    """A stand-in for a projection LSTMem cannot read (GPTQ/AWQ-style packed weights, no ``weight``)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(in_features // 8, out_features, dtype=torch.int32))

    def forward(self, x):
        return x.new_zeros(*x.shape[:-1], self.out_features)


@pytest.mark.parametrize("kind", ["packed", "fp8"])
def test_unsupported_projection_is_refused_naming_the_supported_kinds(kind):
    model = tiny_model("qwen3")
    attention = model.model.layers[1].self_attn
    d = model.config.hidden_size
    if kind == "packed":
        attention.q_proj = PackedInt4Linear(d, attention.q_proj.out_features)
        what = "PackedInt4Linear"
    else:  # a float8 weight needs scales that nn.Linear does not carry
        attention.o_proj = attention.o_proj.to(torch.float8_e4m3fn)
        what = "float8_e4m3fn"
    with pytest.raises(
        ValueError, match=rf"cannot wrap model\.layers\.1\.self_attn\.\w+_proj: .*{what}"
    ) as info:
        get_peft_model(model, LSTMemConfig(**CONFIG))
    assert SUPPORTED_PROJECTIONS in str(info.value)


def test_a_bitsandbytes_layer_that_was_never_quantised_is_refused():
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear4bit(16, 8, bias=False, quant_type="nf4")  # quantised only when moved to a device
    with pytest.raises(ValueError, match="never quantised"):
        dense_weight(layer)
