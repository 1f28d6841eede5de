"""Fused query/key/value projections: ``Δq`` reaches the query and nothing else.

Each fused family is checked against its unfused twin: the same model with the fused projection's
weights split into separate ``q_proj``/``k_proj``/``v_proj`` projections (the fused module is
replaced by one that computes its output from them, in the family's layout, written here from each
model's own split code). With the same adapter weights, both must give the same logits and the same
memory. Projections LSTMem cannot place are refused when the adapter is created.
"""

import copy

import pytest
import torch
import transformers as tf
from peft import get_peft_model
from tiny_models import VOCAB, history_then_question_logits, randomize_memory

from lstmem_peft import LSTMemConfig, MemoryCache, memory_layers

HEADS, HEAD_DIM, HIDDEN = 4, 12, 48
TOKENS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _by_head(groups: int, *widths: int):
    """Split and merge for a layout of ``groups`` groups, each ``widths`` features of q, k, v."""

    def split(fused):
        parts = fused.unflatten(-1, (groups, sum(widths))).split(widths, dim=-1)
        return [p.flatten(-2) for p in parts]

    def merge(q, k, v):
        return torch.cat([t.unflatten(-1, (groups, -1)) for t in (q, k, v)], dim=-1).flatten(-2)

    return split, merge


def _query_first(*widths: int):
    """Split and merge for ``[q | k | v]``."""
    return (lambda fused: list(fused.split(widths, dim=-1))), (lambda q, k, v: torch.cat([q, k, v], dim=-1))


q_width, kv_width = HEADS * HEAD_DIM, 2 * HEAD_DIM  # two key/value heads where the family has them
# family: (the tiny model, fused projection, output projection, split and merge of the fused output)
FUSED = {
    "phi3": (
        lambda: tf.Phi3ForCausalLM(
            tf.Phi3Config(hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=3, num_attention_heads=HEADS,
                          num_key_value_heads=2, **TOKENS)
        ),
        "qkv_proj", "o_proj", _query_first(q_width, kv_width, kv_width),
    ),
    "gpt2": (
        lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=HIDDEN, n_layer=3, n_head=HEADS, n_positions=128, **TOKENS)),
        "c_attn", "c_proj", _query_first(HIDDEN, HIDDEN, HIDDEN),
    ),
    "gpt-neox": (
        lambda: tf.GPTNeoXForCausalLM(
            tf.GPTNeoXConfig(hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=3, num_attention_heads=HEADS,
                             partial_rotary_factor=0.5, **TOKENS)
        ),
        "query_key_value", "dense", _by_head(HEADS, HEAD_DIM, HEAD_DIM, HEAD_DIM),
    ),
    "bloom": (
        lambda: tf.BloomForCausalLM(tf.BloomConfig(hidden_size=HIDDEN, n_layer=3, n_head=HEADS, **TOKENS)),
        "query_key_value", "dense", _by_head(HEADS, HEAD_DIM, HEAD_DIM, HEAD_DIM),
    ),
    "falcon (per head)": (
        lambda: tf.FalconForCausalLM(
            tf.FalconConfig(hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=HEADS, multi_query=False,
                            **TOKENS)
        ),
        "query_key_value", "dense", _by_head(HEADS, HEAD_DIM, HEAD_DIM, HEAD_DIM),
    ),
    "falcon (multi-query)": (
        lambda: tf.FalconForCausalLM(
            tf.FalconConfig(hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=HEADS, multi_query=True,
                            **TOKENS)
        ),
        "query_key_value", "dense", _query_first(q_width, HEAD_DIM, HEAD_DIM),
    ),
    "falcon (key/value groups)": (
        lambda: tf.FalconForCausalLM(
            tf.FalconConfig(hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=HEADS,
                            new_decoder_architecture=True, num_kv_heads=2, **TOKENS)
        ),
        "query_key_value", "dense", _by_head(2, 2 * HEAD_DIM, HEAD_DIM, HEAD_DIM),
    ),
}  # fmt: skip


class FusedFromSplit(torch.nn.Module):
    """Stands in for a fused projection: its output, computed from the attention block's separate
    ``q_proj``, ``k_proj`` and ``v_proj`` (looked up at call time, so an adapter's wrapper of
    ``q_proj`` is the one called) and merged in the family's layout."""

    def __init__(self, attention: torch.nn.Module, merge) -> None:
        super().__init__()
        self._attention = [attention]  # a list: not registered as a child (it is the parent)
        self.merge = merge

    def forward(self, x):
        attention = self._attention[0]
        return self.merge(attention.q_proj(x), attention.k_proj(x), attention.v_proj(x))


def unfused_twin(model, fused_name: str, split, merge):
    """A copy of ``model`` whose fused projections are split into ``q_proj``/``k_proj``/``v_proj``."""
    twin = copy.deepcopy(model)
    blocks = [m for m in twin.modules() if isinstance(getattr(m, fused_name, None), torch.nn.Module)]
    for block in blocks:
        fused = getattr(block, fused_name)
        conv1d = isinstance(fused, tf.pytorch_utils.Conv1D)
        weight = fused.weight if conv1d else fused.weight.t()  # (in, out): the layout is on the outputs
        bias = fused.bias if fused.bias is not None else None
        parts = split(weight.detach())
        biases = split(bias.detach()) if bias is not None else [None] * 3
        for name, w, b in zip(("q_proj", "k_proj", "v_proj"), parts, biases, strict=True):
            linear = torch.nn.Linear(w.shape[0], w.shape[1], bias=b is not None, dtype=w.dtype)
            with torch.no_grad():
                linear.weight.copy_(w.t())
                if b is not None:
                    linear.bias.copy_(b)
            block.add_module(name, linear)
        block.add_module(fused_name, FusedFromSplit(block, merge))
    assert blocks, f"no {fused_name} in the model"
    return twin


@pytest.mark.parametrize("family", sorted(FUSED))
def test_fused_projection_equals_its_unfused_twin(family):
    build, fused_name, output_name, (split, merge) = FUSED[family]
    torch.manual_seed(0)
    base = build().double().eval()
    twin = unfused_twin(base, fused_name, split, merge)
    x = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the twin is the same backbone
        torch.testing.assert_close(twin(input_ids=x).logits, base(input_ids=x).logits, rtol=1e-12, atol=1e-12)

    fused = get_peft_model(base, LSTMemConfig())
    assert fused.peft_config["default"].target_modules == [fused_name, output_name]  # found by structure
    unfused = get_peft_model(twin, LSTMemConfig(target_modules=["q_proj", output_name]))
    # the corrections start from the same backbone rows (App. C.4): the query's rows of the fused weight,
    # up to the float32 rounding of the column norms the initialisation takes (summed in another order
    # where a Conv1D's weight is stored transposed: a few units of 2^-24 over 48 terms)
    for a, b in zip(memory_layers(fused), memory_layers(unfused), strict=True):
        torch.testing.assert_close(a.w_dq, b.w_dq, rtol=4e-6, atol=0)
        torch.testing.assert_close(a.w_do, b.w_do, rtol=4e-6, atol=0)
    randomize_memory(fused)
    for a, b in zip(memory_layers(fused), memory_layers(unfused), strict=True):
        b.load_state_dict(a.state_dict())  # the same adapter weights in both

    cache, twin_cache = MemoryCache(), MemoryCache()
    logits = history_then_question_logits(fused.eval(), cache)
    twin_logits = history_then_question_logits(unfused.eval(), twin_cache)
    torch.testing.assert_close(logits, twin_logits, rtol=1e-10, atol=1e-10)
    for a, b in zip(cache.layers, twin_cache.layers, strict=True):
        torch.testing.assert_close(a.cell, b.cell, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(a.hidden, b.hidden, rtol=1e-10, atol=1e-10)
    with torch.no_grad(), fused.disable_adapter():
        plain = fused(
            input_ids=torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
        ).logits
    assert not torch.allclose(plain, logits)  # the memory changed the answer


def test_delta_q_changes_only_the_query_features():
    build, fused_name, _, (split, _) = FUSED["gpt-neox"]
    torch.manual_seed(0)
    model = get_peft_model(build().double().eval(), LSTMemConfig())
    randomize_memory(model)
    wrapper = model.base_model.model.gpt_neox.layers[1].attention.query_key_value
    seen = {}
    wrapper.register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out))
    with torch.no_grad():
        model(input_ids=torch.randint(3, VOCAB, (1, 5)), memory_cache=MemoryCache())
        plain = wrapper.base_layer(seen["x"])
    q, k, v = split(seen["out"])
    q0, k0, v0 = split(plain)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    assert not torch.allclose(q, q0)


def _codegen():
    return tf.CodeGenForCausalLM(
        tf.CodeGenConfig(
            vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=HEADS, n_positions=64, rotary_dim=6
        )
    )


def test_unknown_fused_layout_is_refused_with_the_reason():
    # CodeGen's qkv_proj holds q, k and v in its own partitioned layout
    with pytest.raises(
        ValueError, match=r"qkv_proj has 144 output features.*48.*model type 'codegen'.*split"
    ):
        get_peft_model(_codegen(), LSTMemConfig(target_modules=["qkv_proj", "out_proj"]))


def test_no_known_projection_names_asks_for_target_modules():
    with pytest.raises(ValueError, match=r"no attention block.*q_proj/o_proj.*target_modules=\["):
        get_peft_model(_codegen(), LSTMemConfig())


def test_an_output_projection_that_is_not_one_is_refused():
    from tiny_models import tiny_model

    with pytest.raises(ValueError, match=r"k_proj maps 48 features to 24.*hidden size 48"):
        get_peft_model(tiny_model("llama"), LSTMemConfig(target_modules=["q_proj", "k_proj"]))
