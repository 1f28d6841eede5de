"""What vLLM loads in each of its processes (the ``vllm.general_plugins`` entry point, :func:`register`):
the names the plugin's parts share (architectures, worker, scheduler, session and memory keys, the
memory's state backend and op) and the registration of the LSTMem architectures, the memory's state
backend and its op with vLLM. Imports vLLM only inside the registering functions."""

from __future__ import annotations

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
