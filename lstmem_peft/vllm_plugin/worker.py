"""``LSTMemWorker``: vLLM's worker for the current platform, with per-request memory files.

Selected by :func:`lstmem_peft.vllm_plugin.engine_args` (``worker_cls``), or for ``vllm serve`` with
``--worker-cls lstmem_peft.vllm_plugin.worker.LSTMemWorker``. Before each step it runs, it loads the
memories of starting requests and saves those of finished ones (:class:`~.sessions.Sessions`); the
step itself is the platform worker's, unchanged.
"""

from __future__ import annotations

from vllm.platforms import current_platform
from vllm.utils.import_utils import resolve_obj_by_qualname

from .sessions import Sessions

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
    """The platform's vLLM worker; :meth:`execute_model` first handles memory files."""

    _lstmem_sessions: Sessions | None = None

    def execute_model(self, scheduler_output, *args, **kwargs):
        if self._lstmem_sessions is None:  # the model and its state cache exist by the first step
            self._lstmem_sessions = Sessions(self.model_runner)
        self._lstmem_sessions.before_step(scheduler_output)
        return super().execute_model(scheduler_output, *args, **kwargs)

    def lstmem_counts(self) -> dict[str, int]:
        """Requests started and restarted from scratch (after a preemption), memories loaded and
        saved (``llm.collective_rpc("lstmem_counts")``)."""
        if self._lstmem_sessions is None:
            return {"started": 0, "restarted": 0, "loaded": 0, "saved": 0}
        return dict(self._lstmem_sessions.counts)
