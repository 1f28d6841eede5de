"""``LSTMemWorker``: vLLM's worker for the current platform, with per-request sessions.

Selected by :func:`lstmem_peft.integrations.vllm.engine_args` (``worker_cls``), or for ``vllm serve`` with
``--worker-cls lstmem_peft.integrations.vllm.worker.LSTMemWorker``. When the model is loaded it sets up
the session directory (``LSTMEM_SESSION_DIR``; :func:`~.sessions.prepare_session_directory`). Before
each step it runs, it writes the starting memory of every request that starts into its state slot
(:meth:`~.sessions.Sessions.before_step`; the model needs this worker); after the step, before the step's
output goes back to the scheduler (and so to the client), it saves the memories of the requests
that ended in it (:class:`~.sessions.Sessions`). The step itself is the platform worker's, except
that a step holding a one-token history chunk is never dispatched to a full CUDA graph
(:func:`~.model.keep_history_chunks_out_of_full_graphs`).
"""

from __future__ import annotations

import torch
from vllm.platforms import current_platform
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.outputs import ModelRunnerOutput

from .model import keep_history_chunks_out_of_full_graphs
from .sessions import Sessions, prepare_session_directory

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


class LSTMemWorker(resolve_obj_by_qualname(PLATFORM_WORKERS[current_platform.device_type])):
    """The platform's vLLM worker; :meth:`execute_model` and :meth:`sample_tokens` also handle sessions."""

    _lstmem_sessions: Sessions | None = None
    _lstmem_directory: str | None = None

    def load_model(self, *args, **kwargs):
        out = super().load_model(*args, **kwargs)
        # an engine that cannot serve sessions as configured stops here, before any request
        model = self.model_runner.get_model()
        self._lstmem_directory = prepare_session_directory(self.vllm_config, model.lstmem_layout)
        keep_history_chunks_out_of_full_graphs(self.model_runner, model.lstmem_shared)
        return out

    def execute_model(self, scheduler_output, *args, **kwargs):
        if self._lstmem_sessions is None:  # the model and its state cache exist by the first step
            self._lstmem_sessions = Sessions(self.model_runner, self._lstmem_directory)
        with torch.inference_mode():  # it writes states and flags that vLLM made in inference mode
            self._lstmem_sessions.before_step(scheduler_output)
        output = super().execute_model(scheduler_output, *args, **kwargs)
        if isinstance(output, ModelRunnerOutput):  # a step that sampled nothing returns its output here
            self._lstmem_sessions.after_step(output)
        return output

    def sample_tokens(self, *args, **kwargs):
        output = super().sample_tokens(*args, **kwargs)
        if self._lstmem_sessions is not None and isinstance(output, ModelRunnerOutput):
            self._lstmem_sessions.after_step(output)
        return output

    def lstmem_graph_mode(self) -> str:
        """The CUDA graph mode this worker's model runs with, as vLLM resolved it against the memory's
        state backend (``NONE`` without CUDA graphs) (``llm.collective_rpc("lstmem_graph_mode")``)."""
        return self.model_runner.compilation_config.cudagraph_mode.name

    def lstmem_counts(self) -> dict[str, int]:
        """Requests started and restarted from scratch (after a preemption), memories loaded and
        saved, and session reads or writes that failed in the worker (logged)
        (``llm.collective_rpc("lstmem_counts")``)."""
        if self._lstmem_sessions is None:
            return {"started": 0, "restarted": 0, "loaded": 0, "saved": 0, "failed": 0}
        return dict(self._lstmem_sessions.counts)
