"""``LSTMemWorker``: vLLM's worker for the current platform, with per-request sessions.

Selected by :func:`lstmem_peft.integrations.vllm.engine_args` (``worker_cls``), or for ``vllm serve`` with
``--worker-cls lstmem_peft.integrations.vllm.worker.LSTMemWorker``. When the model is loaded it chooses
how it reads vLLM's model runner, V1 or V2 (:func:`~.runner_view.runner_view`; a runner it does not
know stops the engine there, before any request) and sets up the session directory
(``LSTMEM_SESSION_DIR``; :func:`~.session_files.prepare_session_directory`). Before each step it runs, it
writes the starting memory of every request that starts into its state slot
(:meth:`~.worker_sessions.Sessions.before_step`; the model needs this worker); after the step, before the step's
output goes back to the scheduler (and so to the client), it saves the memories of the requests
that ended in it (:class:`~.worker_sessions.Sessions`): at once where the runner returns a
``ModelRunnerOutput`` (V1), and where it returns an ``AsyncModelRunnerOutput`` (V2, whose sampled
tokens reach the host in ``get_output()``, which vLLM calls before it sends the output on) when that
output is read. The step itself is the platform worker's, except that a step holding a one-token
history chunk is never dispatched to a full CUDA graph (:func:`~.backend.keep_history_chunks_out_of_full_graphs`).
"""

from __future__ import annotations

import torch
from vllm.platforms import current_platform
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

from .backend import keep_history_chunks_out_of_full_graphs
from .runner_view import RunnerView, runner_view
from .session_files import prepare_session_directory
from .worker_sessions import Sessions

# the worker each platform runs by default (vLLM's platforms set these when worker_cls is "auto")
PLATFORM_WORKERS = {
    "cpu": "vllm.v1.worker.cpu_worker.CPUWorker",
    "cuda": "vllm.v1.worker.gpu_worker.Worker",
}

if current_platform.device_type not in PLATFORM_WORKERS:
    raise RuntimeError(
        f"the LSTMem vLLM plugin runs on {sorted(PLATFORM_WORKERS)} platforms, not on "
        f"{current_platform.device_type!r}"
    )


class SavingOutput(AsyncModelRunnerOutput):
    """A runner's ``AsyncModelRunnerOutput`` whose ``get_output()`` hands the step's output to
    ``after_step`` (the sessions' save) before returning it: vLLM reads it once, in the worker's
    process, before the output goes on to the scheduler. With tensor parallelism vLLM reads the
    output of tensor-parallel rank 0 only (``MultiprocExecutor._get_output_rank``), the rank that
    writes out-sessions."""

    def __init__(self, inner: AsyncModelRunnerOutput, after_step) -> None:
        self.inner = inner
        self.after_step = after_step

    def get_output(self) -> ModelRunnerOutput:
        output = self.inner.get_output()
        self.after_step(output)
        return output

    def get_kv_connector_output(self):
        return self.inner.get_kv_connector_output()


class LSTMemWorker(resolve_obj_by_qualname(PLATFORM_WORKERS[current_platform.device_type])):
    """The platform's vLLM worker; :meth:`execute_model` and :meth:`sample_tokens` also handle sessions."""

    _lstmem_view: RunnerView | None = None
    _lstmem_sessions: Sessions | None = None
    _lstmem_directory: str | None = None

    def load_model(self, *args, **kwargs):
        out = super().load_model(*args, **kwargs)
        # an engine that cannot serve sessions as configured, or whose runner the plugin does not
        # know, stops here, before any request
        self._lstmem_view = runner_view(self.model_runner)
        model = self._lstmem_view.model
        self._lstmem_directory = prepare_session_directory(self.vllm_config, model.lstmem_layout)
        return out

    def execute_model(self, scheduler_output, *args, **kwargs):
        if self._lstmem_sessions is None:  # the state cache and V2's graph manager exist by the first step
            view = self._lstmem_view or runner_view(self.model_runner)
            self._lstmem_sessions = Sessions(view, self._lstmem_directory)
            keep_history_chunks_out_of_full_graphs(view, view.model.lstmem_shared)
        with torch.inference_mode():  # it writes states and flags that vLLM made in inference mode
            self._lstmem_sessions.before_step(scheduler_output)
        output = super().execute_model(scheduler_output, *args, **kwargs)
        return self._after_step(output)

    def sample_tokens(self, *args, **kwargs):
        output = super().sample_tokens(*args, **kwargs)
        if self._lstmem_sessions is None:
            return output
        return self._after_step(output)

    def _after_step(self, output):
        """Hand a step's output to the sessions: now (a ``ModelRunnerOutput``; a step that sampled
        nothing returns its output from ``execute_model``), or when vLLM reads it (an
        ``AsyncModelRunnerOutput``). Anything else (``None``: the output follows from
        ``sample_tokens``) passes as it is."""
        if isinstance(output, ModelRunnerOutput):
            self._lstmem_sessions.after_step(output)
        elif isinstance(output, AsyncModelRunnerOutput):
            return SavingOutput(output, self._lstmem_sessions.after_step)
        return output

    def lstmem_graph_mode(self) -> str:
        """The CUDA graph mode this worker's model runs with, as vLLM resolved it against the memory's
        state backend (``NONE`` without CUDA graphs) (``llm.collective_rpc("lstmem_graph_mode")``)."""
        return self.vllm_config.compilation_config.cudagraph_mode.name

    def lstmem_runner(self) -> str:
        """Which of vLLM's model runners this worker reads, ``"v1"`` or ``"v2"``
        (:mod:`~.runner_view`; ``llm.collective_rpc("lstmem_runner")``)."""
        return (self._lstmem_view or runner_view(self.model_runner)).kind

    def lstmem_counts(self) -> dict[str, int]:
        """Requests started and restarted from scratch (after a preemption), memories loaded and
        saved, and session reads or writes that failed in the worker (logged)
        (``llm.collective_rpc("lstmem_counts")``)."""
        if self._lstmem_sessions is None:
            return {"started": 0, "restarted": 0, "loaded": 0, "saved": 0, "failed": 0}
        return dict(self._lstmem_sessions.counts)
