"""Tiny random-init causal LMs built from configs (no downloads)."""

import torch
from transformers import (
    FalconConfig,
    FalconForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

ARCHITECTURES = {
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(head_dim=12, **COMMON)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON)),
    "smollm3": lambda: SmolLM3ForCausalLM(SmolLM3Config(no_rope_layers=[1, 0, 1], **COMMON)),
    # sliding-window attention: a 4-token window, shorter than the tests' prompts and generations
    "mistral-sliding": lambda: MistralForCausalLM(MistralConfig(sliding_window=4, **COMMON)),
    # eager attention only; in float64 its softmax (taken in float32) turns the mask into -inf and makes
    # NaN at left padding (a query that sees no key), so the battery runs it in float32
    # eager attention only; in float64 its softmax (taken in float32) turns the mask into -inf and makes
    # NaN at left padding (a query that sees no key), so the battery runs it in float32
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(head_dim=12, sliding_window=4, **COMMON)),
    "gemma3": lambda: Gemma3ForCausalLM(
        Gemma3TextConfig(
            head_dim=12,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            **COMMON,
        )
    ),
    # mixture-of-experts decoders (the experts' loop, not torch's grouped GEMM, which has no float64)
    "mixtral": lambda: MixtralForCausalLM(
        MixtralConfig(num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager", **COMMON)
    ),
    "qwen3-moe": lambda: Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            head_dim=12,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            experts_implementation="eager",
            **COMMON,
        )
    ),
    # other projection names, and fused query/key/value projections
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**COMMON)),  # qkv_proj / o_proj
    "opt": lambda: OPTForCausalLM(
        OPTConfig(
            ffn_dim=96, word_embed_proj_dim=48, **_without(COMMON, "intermediate_size", "num_key_value_heads")
        )
    ),  # q_proj / out_proj
    "gpt-neox": lambda: GPTNeoXForCausalLM(  # query_key_value / dense, per head (q, k, v)
        GPTNeoXConfig(partial_rotary_factor=0.5, **_without(COMMON, "num_key_value_heads"))
    ),
    "falcon": lambda: FalconForCausalLM(  # query_key_value / dense, per key/value group
        FalconConfig(
            new_decoder_architecture=True,
            num_kv_heads=2,
            **_without(COMMON, "intermediate_size", "num_key_value_heads"),
        )
    ),
    "gpt2": lambda: GPT2LMHeadModel(  # c_attn / c_proj, transformers Conv1D projections
        GPT2Config(
            vocab_size=VOCAB,
            n_embd=48,
            n_layer=3,
            n_head=4,
            n_positions=512,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    ),
}


def _without(config: dict, *names: str) -> dict:
    return {k: v for k, v in config.items() if k not in names}


def tiny_model(arch: str = "qwen3", seed: int = 0):
    torch.manual_seed(seed)
    model = ARCHITECTURES[arch]()
    model.eval()
    return model


def history_then_question_logits(model, cache=None):
    """Logits of a fixed question after a fixed 40-token history written into a fresh memory
    (``cache``, a new ``MemoryCache`` if not given: after the call it holds that memory)."""
    from lstmem_peft import MemoryCache, write_history

    g = torch.Generator().manual_seed(0)
    history = torch.randint(3, VOCAB, (2, 40), generator=g)
    question = torch.randint(3, VOCAB, (2, 6), generator=g)
    cache = MemoryCache() if cache is None else cache
    with torch.no_grad():
        write_history(model, history, cache, block_size=16, progress=False)
        return model(input_ids=question, memory_cache=cache).logits


def randomize_memory(model, scale=0.2, seed=1):
    """Move the adapter off its initialisation so that every path carries signal."""
    from lstmem_peft import memory_layers

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in memory_layers(model):
            for p in layer.parameters():
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def memory_stack(d: int, num_layers: int, seed: int = 0, **shape):
    """``num_layers`` memory layers of width ``d`` (``shape``: ``num_heads``, ``head_dim``), shallow to
    deep, as injection builds them (the first without a depth input), moved off their initialisation
    so that every path carries signal: a memory stack without a transformer."""
    from lstmem_peft import LSTMemLayer

    torch.manual_seed(seed)
    layers = [LSTMemLayer(d, d, layer_idx=i, **shape) for i in range(num_layers)]
    layers[0].set_depth_input(False)
    with torch.no_grad():
        for layer in layers:
            layer.init_corrections(torch.randn(d, d), torch.randn(d, d))
            for p in layer.parameters():
                p.add_(0.2 * torch.randn_like(p))
    return layers


def make(arch="qwen3", seed=0, **config):
    """A tiny model of ``arch`` with an LSTMem adapter moved off its initialisation (eval mode)."""
    from peft import get_peft_model

    from lstmem_peft import LSTMemConfig

    model = get_peft_model(tiny_model(arch, seed), LSTMemConfig(**config))
    randomize_memory(model)
    return model.eval()
