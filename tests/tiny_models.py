"""Tiny random-init causal LMs built from configs (no downloads)."""

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
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
}


def tiny_model(arch: str = "qwen3", seed: int = 0):
    torch.manual_seed(seed)
    model = ARCHITECTURES[arch]()
    model.eval()
    return model


def history_then_question_logits(model):
    """Logits of a fixed question after a fixed 40-token history written into a fresh memory."""
    from lstmem_peft import MemoryCache, write_history

    g = torch.Generator().manual_seed(0)
    history = torch.randint(3, VOCAB, (2, 40), generator=g)
    question = torch.randint(3, VOCAB, (2, 6), generator=g)
    cache = MemoryCache()
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


def make(arch="qwen3", seed=0, **config):
    """A tiny model of ``arch`` with an LSTMem adapter moved off its initialisation (eval mode)."""
    from peft import get_peft_model

    from lstmem_peft import LSTMemConfig

    model = get_peft_model(tiny_model(arch, seed), LSTMemConfig(**config))
    randomize_memory(model)
    return model.eval()
