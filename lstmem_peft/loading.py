"""One loader for every entry point (``lstmem eval``, ``lstmem serve``): a causal LM from the Hub or a
local folder, optionally with an LSTMem adapter on it, and its tokenizer."""

from __future__ import annotations

import os

import torch


def load_model_and_adapter(
    model: str, adapter: str | None = None, *, dtype: str = "auto", device: str | None = None
) -> tuple[torch.nn.Module, object]:
    """Load a backbone and, when given, the LSTMem adapter trained on it, in eval mode.

    Args:
        model: the backbone, a Hub id or a local folder.
        adapter: the LSTMem adapter, a Hub id or a local folder (``None``: the plain backbone).
        dtype: ``auto`` (the checkpoint's), ``float32``, ``bfloat16`` or ``float16``.
        device: ``cpu`` or ``cuda`` (default: cuda when available).

    Returns:
        ``(model, tokenizer)``: the ``PeftModel`` (or the plain backbone) on ``device``, and the
        adapter folder's tokenizer when it saved one (it may add chat tokens), else the backbone's.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
    if adapter is not None:
        loaded = PeftModel.from_pretrained(loaded, adapter)
    own = adapter is not None and os.path.isfile(os.path.join(adapter, "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(adapter if own else model)
    return loaded.to(device).eval(), tokenizer
