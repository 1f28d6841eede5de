"""The engine arguments that select the plugin (:func:`engine_args`) and the config overrides that
select the LSTMem variant of a backbone (:func:`hf_overrides`); they need no vLLM."""

from __future__ import annotations

from lstmem_peft.utils.shipped_adapters import resolve_adapter

from .plugin import ARCHITECTURES, MEMORY_LAYER_TYPE, SCHEDULER, SESSION_FILE_CHECK, WORKER


def hf_overrides(model: str, adapter: str) -> dict:
    """The config overrides that select the LSTMem variant of ``model``'s architecture with the
    adapter ``adapter`` (a local folder, a shipped adapter's short name or a Hub id).

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
        "lstmem_adapter": resolve_adapter(adapter),  # a shipped adapter's short name: its folder
        "layer_types": [MEMORY_LAYER_TYPE] * layers,
        # every layer still counts as an attention layer (KV cache sizing)
        "layers_block_type": ["attention"] * layers,
    }


def engine_args(model: str, adapter: str, **kwargs) -> dict:
    """Keyword arguments for ``vllm.LLM`` / ``AsyncEngineArgs``: ``model``, the overrides of
    :func:`hf_overrides`, the worker that loads and saves sessions (:mod:`.worker`), the scheduler
    that ends history requests' prompt chunks at block ends (:mod:`.scheduler`; another
    ``scheduler_cls`` is refused), the admission check of sessions
    (:class:`.sessions.SessionFileCheck`), no prefix caching (one fixed state slot per request; a
    cached prefix would skip writing its tokens into memory) and no asynchronous scheduling (it
    runs one more step of a request that has finished, into its memory, and samples tokens the
    worker sees only a step later, after the output left); speculative decoding is refused (its
    rejected draft tokens would be written into memory). CUDA graphs are vLLM's choice: by default
    full graphs of decode-only steps, piecewise graphs around the memory ops for the others (see the
    package docstring, :mod:`lstmem_peft.integrations.vllm`). ``kwargs`` are passed on (``dtype``,
    ``max_model_len``, ``tensor_parallel_size``, ``compilation_config``, ...); their
    ``hf_overrides`` are merged into these, and their ``logits_processors`` follow the check.

    The session directory is not an engine argument: set ``LSTMEM_SESSION_DIR`` in the environment
    before the engine starts (every vLLM process reads it)."""
    if kwargs.get("async_scheduling"):
        raise ValueError(
            "async_scheduling=True would run a finished request one more step into its memory before "
            "its session is saved; LSTMem on vLLM runs with async_scheduling=False"
        )
    if (kwargs.get("pipeline_parallel_size") or 1) > 1:
        raise ValueError(
            f"pipeline_parallel_size={kwargs['pipeline_parallel_size']}: LSTMem on vLLM does not run with pipeline "
            "parallelism (each memory layer reads D_t of the memory layer below it at every token, which would "
            "have to cross stages); use tensor_parallel_size instead"
        )
    if kwargs.get("scheduler_cls") not in (None, SCHEDULER):
        raise ValueError(
            f"scheduler_cls={kwargs['scheduler_cls']!r}: LSTMem on vLLM runs with its own scheduler {SCHEDULER} "
            "(vLLM's, with history requests' prompt chunks ending at block ends); leave scheduler_cls out"
        )
    if kwargs.get("speculative_config"):
        raise ValueError(
            "speculative_config: speculative decoding would write every draft token a step verifies into memory, "
            "the rejected ones too; LSTMem on vLLM runs without it"
        )
    if kwargs.get("enable_prefix_caching"):
        raise ValueError(
            "enable_prefix_caching=True would let a request skip writing a cached prefix into its memory; "
            "LSTMem on vLLM runs without prefix caching"
        )
    overrides = {**hf_overrides(model, adapter), **kwargs.pop("hf_overrides", {})}
    kwargs.pop("enable_prefix_caching", None)
    kwargs.pop("async_scheduling", None)
    kwargs.pop("scheduler_cls", None)
    return {
        "model": model,
        "hf_overrides": overrides,
        "worker_cls": WORKER,
        "scheduler_cls": SCHEDULER,
        "logits_processors": [SESSION_FILE_CHECK, *kwargs.pop("logits_processors", [])],
        "enable_prefix_caching": False,
        "async_scheduling": False,
        **kwargs,
    }
