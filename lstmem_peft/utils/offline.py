"""Tiny models and tokenizers built locally, for examples, demos and tests (no downloads)."""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]

#: The embedded demo shipped inside the package: its backbone, adapters and build record.
DEMO_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "demo"
#: The demo's vocabulary: keys ``k00..k31`` and values ``v00..v31``.
NUM_KEYS = NUM_VALUES = 32


def char_tokenizer(alphabet: str = string.printable[:95] + "\n") -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer: one id per character of ``alphabet`` (default: printable
    ASCII and newline) plus pad/bos/eos; other characters map to ``<pad>``."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )


def tiny_qwen3(
    vocab_size: int,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    tie_embeddings: bool = True,
    seed: int = 0,
) -> Qwen3ForCausalLM:
    """A random-init Qwen3 causal LM (4 query heads) with pad/bos/eos ids 0/1/2."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // 4,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=tie_embeddings,
    )
    return Qwen3ForCausalLM(config).eval()


def demo_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer: ``<pad> <s> </s> ; ?``, keys ``k00..k31``, values ``v00..v31``."""
    words = (
        ["<pad>", "<s>", "</s>", ";", "?"]
        + [f"k{i:02d}" for i in range(NUM_KEYS)]
        + [f"v{i:02d}" for i in range(NUM_VALUES)]
    )
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )
