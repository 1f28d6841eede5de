"""LSTMem on quantised backbones (QLoRA-style): bitsandbytes NF4 and 8-bit, torchao int8 weight-only,
optimum-quanto int8, each loaded through transformers' ``quantization_config`` on a tiny random Qwen3.

A backend whose library is not installed (they are the optional ``quant`` extra) is skipped; one that
is installed but cannot load a model on this machine is skipped with the loader's error.

The tiny models here are 64 wide (not the 48 of ``tiny_models``): bitsandbytes' 4-bit kernels on a
CPU take only projections whose in_features are a multiple of the blocksize (64) and, on a CPU with
AVX512-BF16 where ``Linear4bit`` repacks its weight at the first eval forward, whose out_features are a
multiple of ``block_n`` (32). Both of bitsandbytes' CPU weight layouts are tested on any machine: the
repacking and its inverse are plain torch, applied directly where the native kernel cannot run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training
from tiny_models import COMMON, VOCAB, randomize_memory, tiny_model
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from lstmem_peft import LSTMemConfig, MemoryCache, memory_layers
from lstmem_peft.memory.layer import LSTMemLayer
from lstmem_peft.tuner.layer import LSTMemQueryLayer
from lstmem_peft.tuner.quant import (
    BNB_CPU_BLOCK_N,
    SUPPORTED_PROJECTIONS,
    bnb_4bit_layout,
    dense_weight,
    is_supported_projection,
    projection_kind,
)

#: bfloat16's unit roundoff (8 significant bits): rounding to nearest changes a value by at most
#: this much of itself. bitsandbytes' CPU-packed layout keeps its scales in bfloat16, and its native
#: kernel computes in bfloat16.
BF16_U = 2.0**-8

#: The tiny models' sizes for quantised backbones (module docstring): every projection's
#: in_features is 64 or 128 and its out_features 32, 64 or 128.
WIDE = dict(COMMON, hidden_size=64, intermediate_size=128)
QUANTISABLE = {
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(head_dim=16, **WIDE)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**WIDE)),
}


def quantisable_model(arch: str = "qwen3", seed: int = 0):
    """A tiny random ``arch`` (eval mode) whose projections bitsandbytes' CPU 4-bit kernels accept."""
    torch.manual_seed(seed)
    model = QUANTISABLE[arch]().eval()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head":  # transformers keeps lm_head unquantised
            assert module.in_features % 64 == 0 and module.out_features % BNB_CPU_BLOCK_N == 0, name
    return model


def _bnb_nf4(double_quant: bool = False):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_use_double_quant=double_quant,
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
    model = quantisable_model("qwen3")
    model.save_pretrained(path)
    return path, model


def load_quantized(path, backend: str, config=None, **kwargs):
    """The checkpoint at ``path`` quantised by ``backend`` (``config``: its quantization_config if not
    the default one of :data:`BACKENDS`), in eval mode."""
    library, make_config, _, _ = BACKENDS[backend]
    pytest.importorskip(library)
    kwargs.setdefault("dtype", torch.float32)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=config or make_config(), **kwargs
        )
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
        if (
            kind == "bnb-4bit"
            and bnb_4bit_layout(module.weight.data, module.weight.quant_state) == "cpu-packed"
        ):
            # the forward repacked the weight (AVX512-BF16 CPU): its scales are now bfloat16 and the
            # native kernel computes in bfloat16, so compare with the matrix of the new layout
            assert_bf16_product(y, xin, dense_weight(module))
        else:
            torch.testing.assert_close(y, F.linear(xin, dense), rtol=tol, atol=tol * y.abs().max().item())


def assert_bf16_product(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``y`` (``(m, n)``) is ``x @ weight.T`` (``(m, k)``, ``(n, k)``) as bitsandbytes' native CPU kernel
    computes it: the input, each weight entry and the output rounded to bfloat16, float32 sums. Each
    rounding changes a term by at most ``BF16_U`` of itself, so the error is at most about
    ``3 BF16_U (|x| @ |weight|.T)``, elementwise; checked with ``4 BF16_U``."""
    bound = 4 * BF16_U * (x.abs() @ weight.abs().T) + 1e-6
    err = (y.float() - x @ weight.T).abs()
    assert (err <= bound).all(), f"{(err / bound).max():.2f} times the bfloat16 bound"


@backends
def test_adapter_attaches_in_float32_with_corrections_from_the_dequantised_weights(checkpoint, backend):
    path, reference = checkpoint
    model = get_peft_model(load_quantized(path, backend), LSTMemConfig(**CONFIG))
    params = adapter_parameters(model)
    assert params and all(p.dtype == torch.float32 for p in params.values())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and trainable <= set(params), "only adapter parameters may train"
    float_model = get_peft_model(quantisable_model("qwen3"), LSTMemConfig(**CONFIG))
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
            min_new_tokens=4,  # no row ends early on EOS (the count below assumes every step is written)
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
    ):  # prepare_model_for_kbit_training turns it on for bnb and torchao only (reentrant: torch's default)
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={})
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
    quantisable_model("llama").save_pretrained(tmp_path)
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
            min_new_tokens=3,  # no row ends early on EOS (the count below assumes every step is written)
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


# --------------------------------------------------------------- bitsandbytes' two CPU 4-bit layouts


def _bnb_functional():
    return pytest.importorskip("bitsandbytes").functional


def quantised_linear(quant_type: str = "nf4", double_quant: bool = False, in_features=128, out_features=96):
    """A bitsandbytes ``Linear4bit`` (eval mode, float32 compute) quantised on the CPU from a random
    ``(out_features, in_features)`` weight whose rows have different magnitudes (so that scales read
    from the wrong block show)."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    dense = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        dense.weight.mul_(torch.linspace(0.1, 3.0, out_features)[:, None])
    layer = bnb.nn.Linear4bit(
        in_features,
        out_features,
        bias=False,
        compute_dtype=torch.float32,
        compress_statistics=double_quant,
        quant_type=quant_type,
    )
    layer.load_state_dict(dense.state_dict())
    return layer.to("cpu").eval()  # Params4bit quantises when moved to its device


def packed_reference(qweight: torch.Tensor, state) -> torch.Tensor:
    """``bitsandbytes.functional.dequantize_4bit`` of a weight in the plain layout (``qweight`` and its
    ``state``, before repacking) with the scales that the CPU repacking keeps: double quantisation
    undone as ``_convert_weight_packed_for_cpu`` undoes it, then rounded to bfloat16.

    Returns:
        ``(out_features, in_features)`` in ``state.dtype``.
    """
    functional = _bnb_functional()
    scales = state.absmax
    if state.nested:
        scales = functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    rounded = functional.QuantState(
        absmax=scales.to(torch.bfloat16).float(),
        shape=state.shape,
        code=state.code,
        blocksize=state.blocksize,
        quant_type=state.quant_type,
        dtype=state.dtype,
    )
    return functional.dequantize_4bit(qweight, rounded)


def storage(layer) -> dict:
    """What a ``Linear4bit`` stores: its weight's bytes and its quant_state's fields (tensors cloned)."""
    state = layer.weight.quant_state
    fields = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(state).items()}
    return {"data": layer.weight.data.clone(), "state": state, "fields": fields}


def assert_storage_unchanged(layer, before: dict) -> None:
    state = layer.weight.quant_state
    assert state is before["state"] and torch.equal(layer.weight.data, before["data"])
    assert set(vars(state)) == set(before["fields"])
    for k, v in before["fields"].items():
        now = getattr(state, k)
        assert torch.equal(now, v) if isinstance(v, torch.Tensor) else now == v, k


def pack_for_cpu(layer) -> None:
    """Repack ``layer``'s weight as ``Linear4bit.forward`` does on a CPU with AVX512-BF16 (plain torch)."""
    functional = _bnb_functional()
    layer.weight.data, layer.weight.quant_state = functional._convert_weight_packed_for_cpu(
        layer.weight.data, layer.weight.quant_state
    )


def relative_bf16_rounding(a: torch.Tensor, b: torch.Tensor) -> None:
    """``a`` is ``b`` with each entry's scale rounded to bfloat16: at most ``BF16_U`` of it, elementwise."""
    assert ((a - b).abs() <= BF16_U * b.abs()).all()
    assert not torch.equal(a, b)  # the rounding happened (these scales are not bfloat16 numbers)


@pytest.mark.parametrize("double_quant", [False, True], ids=["single", "double-quant"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_dense_weight_is_exact_in_both_cpu_layouts_of_a_4bit_weight(quant_type, double_quant):
    """bitsandbytes' repacking and its inverse applied directly (plain torch: runs on any CPU)."""
    functional = _bnb_functional()
    layer = quantised_linear(quant_type, double_quant)
    state = layer.weight.quant_state
    qweight = layer.weight.data.clone()
    plain = functional.dequantize_4bit(qweight, state).float()
    expected_packed = packed_reference(qweight, state).float()
    assert bnb_4bit_layout(layer.weight.data, state) == "plain"
    assert torch.equal(dense_weight(layer), plain)

    pack_for_cpu(layer)
    assert bnb_4bit_layout(layer.weight.data, layer.weight.quant_state) == "cpu-packed"
    before = storage(layer)
    dense = dense_weight(layer)
    assert torch.equal(dense, expected_packed)  # the same dequantisation, of the same codes and scales
    relative_bf16_rounding(dense, plain)
    assert_storage_unchanged(layer, before)  # read, not restored to the plain layout

    inverse = functional._convert_weight_packed_for_cpu_inverse
    layer.weight.data, layer.weight.quant_state = inverse(layer.weight.data, layer.weight.quant_state)
    assert torch.equal(layer.weight.data, qweight)  # the codes come back exactly
    if double_quant:  # the inverse re-quantises the scales: dense_weight is the library's dequantisation
        assert torch.equal(
            dense_weight(layer), functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        )
    else:  # bitsandbytes 0.50.2 leaves the scales transposed: refused, never read as plain
        with pytest.raises(ValueError, match=r"half-restored.*bitsandbytes \S+ .*Reload"):
            dense_weight(layer)


@pytest.mark.parametrize("double_quant", [False, True], ids=["single", "double-quant"])
@pytest.mark.parametrize("cpu", ["avx512bf16", "without-avx512bf16"])
def test_dense_weight_is_the_matrix_a_4bit_forward_multiplies_by_in_the_layout_it_leaves(cpu, double_quant):
    """A real eval forward without gradients: on a CPU with AVX512-BF16 it repacks the weight and runs
    bitsandbytes' native kernel; without, it keeps the plain layout (simulated on a CPU that has
    AVX512-BF16 by clearing the flag ``Linear4bit`` sets from ``has_avx512bf16()`` when it is built)."""
    functional = _bnb_functional()
    if cpu == "avx512bf16" and not functional.has_avx512bf16():
        pytest.skip(
            "this CPU lacks AVX512-BF16, so bitsandbytes' native packed kernel cannot run here; "
            "test_dense_weight_is_exact_in_both_cpu_layouts_of_a_4bit_weight covers the packed layout"
        )
    layer = quantised_linear("nf4", double_quant)
    layer.support_avx512bf16_for_cpu = cpu == "avx512bf16"
    qweight, state = layer.weight.data.clone(), layer.weight.quant_state
    plain = functional.dequantize_4bit(qweight, state).float()
    expected_packed = packed_reference(qweight, state).float()
    assert torch.equal(dense_weight(layer), plain)
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the first forward repacks (AVX512-BF16), the second runs on the repacked weight
        with torch.no_grad():
            y = layer(x)
        dense = dense_weight(layer)
        if cpu == "avx512bf16":
            assert bnb_4bit_layout(layer.weight.data, layer.weight.quant_state) == "cpu-packed"
            assert torch.equal(dense, expected_packed)
            relative_bf16_rounding(dense, plain)
            assert_bf16_product(y, x, dense)
        else:
            assert bnb_4bit_layout(layer.weight.data, layer.weight.quant_state) == "plain"
            assert torch.equal(dense, plain)
            torch.testing.assert_close(y, x @ dense.T, rtol=1e-5, atol=1e-5 * y.abs().max().item())


@pytest.mark.parametrize("double_quant", [False, True], ids=["single", "double-quant"])
@pytest.mark.parametrize("after", ["eval-forward", "cpu-repacking"])
def test_attaching_after_the_quantised_base_ran_initialises_the_corrections_as_before(
    checkpoint, after, double_quant
):
    """The user's sequence: evaluate the NF4 base, then ``get_peft_model``. ``eval-forward`` runs the
    base (it repacks its weights on a CPU with AVX512-BF16, not elsewhere); ``cpu-repacking`` applies
    bitsandbytes' repacking to every 4-bit layer directly, as that forward would (any CPU)."""
    functional = _bnb_functional()
    bnb = pytest.importorskip("bitsandbytes")
    path = checkpoint[0]
    config = _bnb_nf4(double_quant)
    fresh = get_peft_model(load_quantized(path, "bnb-nf4", config), LSTMemConfig(**CONFIG))
    base = load_quantized(path, "bnb-nf4", config)
    if after == "eval-forward":
        with torch.no_grad():
            base(input_ids=torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5)))
    else:
        for module in base.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                pack_for_cpu(module)
    packed = after == "cpu-repacking" or functional.has_avx512bf16()
    layouts = {bnb_4bit_layout(p.weight.data, p.weight.quant_state) for p in projections(base)}
    assert layouts == {"cpu-packed" if packed else "plain"}
    ran = get_peft_model(base, LSTMemConfig(**CONFIG))
    memories = [
        (a.self_attn.q_proj.lstmem_memory["default"], b.self_attn.q_proj.lstmem_memory["default"])
        for a, b in zip(fresh.base_model.model.model.layers, ran.base_model.model.model.layers, strict=True)
    ]
    for before, later in memories:
        for name in ("w_dq", "w_do"):
            a, b = getattr(before, name), getattr(later, name)
            if not packed:
                assert torch.equal(a, b), name
                continue
            # each scale rounded to bfloat16 (at most BF16_U of itself) moves each column entry and the
            # column's norm by at most BF16_U of themselves: the normalised entry by 2 BF16_U / (1 - BF16_U)
            torch.testing.assert_close(b, a, rtol=2 * BF16_U / (1 - BF16_U) + 1e-6, atol=0)
            assert b.abs().max() > 0


def test_a_4bit_weight_in_an_unknown_layout_is_refused_naming_the_bitsandbytes_version():
    bnb = pytest.importorskip("bitsandbytes")
    layer = quantised_linear()
    layer.weight.quant_state.packing_format_for_xpu = True  # a layout of some other release
    with pytest.raises(ValueError, match=rf"packing_format_for_xpu.*bitsandbytes {bnb.__version__}"):
        dense_weight(layer)
    del layer.weight.quant_state.packing_format_for_xpu
    pack_for_cpu(layer)
    layer.weight.quant_state.absmax = layer.weight.quant_state.absmax.T.contiguous()  # not that layout
    with pytest.raises(ValueError, match=r"marked packing_format_for_cpu.*Install bitsandbytes"):
        dense_weight(layer)
