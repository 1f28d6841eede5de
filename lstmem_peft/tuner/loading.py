"""One loader for every entry point (``lstmem eval``, ``lstmem serve``, the demo): a causal LM from
the Hub or a local folder, optionally with an LSTMem adapter on it, and its tokenizer; or, with
neither, the embedded demo shipped inside the package."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lstmem_peft.utils.offline import DEMO_ASSETS, demo_tokenizer
from lstmem_peft.utils.shipped_adapters import resolve_adapter

from .backbones import resolve_model
from .config import require_adapter_weights
from .shipped_adapters import check_pair


def load_model_and_adapter(
    model: str | None = None, adapter: str | None = None, *, dtype: str = "auto", device: str | None = None
) -> tuple[torch.nn.Module, object]:
    """Load a backbone and, when given, the LSTMem adapter trained on it, in eval mode.

    Args:
        model: the backbone: a short name of ``lstmem models`` (e.g. ``smollm2-135m``: its converted
            folder, converted once from the installed package, :func:`~.backbones.resolve_model`), a
            Hub id or a local folder; ``None``: the embedded demo's backbone (and its word-level tokenizer).
        adapter: the LSTMem adapter, a Hub id, a local folder or the short name of an adapter shipped
            in the package (:data:`~lstmem_peft.utils.shipped_adapters.SHIPPED_ADAPTERS`, e.g.
            ``smollm2-135m-english-numbers``); ``None``: the plain backbone, or with ``model=None`` the
            demo's ``full`` adapter.
        dtype: ``auto`` (the checkpoint's), ``float32``, ``bfloat16`` or ``float16``.
        device: ``cpu`` or ``cuda`` (default: cuda when available).

    Returns:
        ``(model, tokenizer)``: the ``PeftModel`` (or the plain backbone) on ``device``, and the
        adapter folder's tokenizer when it saved one (it may add chat tokens), else the backbone's.

    Raises:
        WrongBackbone: a shipped adapter with a ``model`` it was not trained for (before anything loads).
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    check_pair(model, adapter)
    adapter = resolve_adapter(adapter)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if model is None:
        adapter = DEMO_ASSETS / "adapter_full" if adapter is None else adapter
        require_adapter_weights(adapter)
        demo = PeftModel.from_pretrained(load_demo_backbone(), adapter)
        return demo.to(device).eval(), demo_tokenizer()
    model = resolve_model(model)
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
    if adapter is not None:
        require_adapter_weights(adapter)  # before PEFT takes a weightless folder for a Hub id
        loaded = PeftModel.from_pretrained(loaded, adapter)
    return loaded.to(device).eval(), load_tokenizer(model, adapter)


def load_tokenizer(model: str, adapter: str | None = None):
    """The tokenizer a backbone ``model`` is served with: the LSTMem adapter folder's when it saved
    one (it may add chat tokens), else the backbone's (local folders or Hub ids)."""
    from transformers import AutoTokenizer

    adapter = resolve_adapter(adapter)
    own = adapter is not None and os.path.isfile(os.path.join(adapter, "tokenizer_config.json"))
    return AutoTokenizer.from_pretrained(adapter if own else resolve_model(model))


def load_demo_backbone(path: Path = DEMO_ASSETS):
    """The embedded demo's backbone (a tiny Qwen3 trained on key-value recall), in eval mode."""
    from transformers import Qwen3ForCausalLM

    if not (path / "backbone" / "config.json").exists():
        raise FileNotFoundError(
            f"the demo backbone is missing from {path}; rebuild it with `python -m lstmem_peft.cli.demo build`"
        )
    return Qwen3ForCausalLM.from_pretrained(path / "backbone").eval()
