"""The sessions of the requests in one vLLM worker: starting memories into state slots, final ones saved.

:class:`Sessions` is driven by :class:`~lstmem_peft.integrations.vllm.worker.LSTMemWorker` (before and
after each step): it writes each starting request's memory (its in-session's, else zeros) into its
state slot, marks read-only and history requests for the memory layers
(:class:`~.engine_memory.EngineMemory`), and saves the out-session of every request that ends in a
step (vLLM's own stop rule, :func:`finishes`). What sessions are, and what happens when one cannot
be used: :mod:`~lstmem_peft.integrations.vllm.sessions`.
"""

from __future__ import annotations

from types import SimpleNamespace

from vllm.distributed import get_tensor_model_parallel_rank
from vllm.logger import init_logger

from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.memory.sessions import session_file
from lstmem_peft.memory.storage import SlotTables

from . import MEMORY_WRITE, SESSION_OUT
from .runner_view import RunnerView
from .session_files import load_session, save_session
from .sessions import is_history, is_read_only, request_sessions

logger = init_logger(__name__)


def finishes(request, max_model_len: int, new_tokens: int) -> bool:
    """Whether vLLM's scheduler ends ``request`` (a request of the runner view,
    :meth:`~.runner_view.RunnerView.request`: ``num_prompt_tokens``, ``output_token_ids`` with the
    step's sampled tokens already appended, ``sampling_params``) at one of its ``new_tokens`` newest
    tokens: vLLM's own stop rule
    (``vllm.v1.core.sched.utils.check_stop``: end-of-sequence and stop tokens, ``max_tokens``,
    ``max_model_len``, repetition detection after ``min_tokens``) asked about a copy of the request.
    ``True`` when the rule cannot be asked (another vLLM): saving once too often is harmless."""
    from vllm.v1.core.sched.utils import check_stop

    outputs = list(request.output_token_ids)
    params = request.sampling_params
    try:
        for count in range(max(len(outputs) - new_tokens + 1, 1), len(outputs) + 1):
            view = SimpleNamespace(
                pooling_params=None,
                sampling_params=params,
                output_token_ids=outputs[:count],
                num_output_tokens=count,
                num_tokens=request.num_prompt_tokens + count,
                max_tokens=params.max_tokens,
                status=None,
                stop_reason=None,
            )
            if check_stop(view, max_model_len):
                return True
    except Exception:  # noqa: BLE001 (an unknown stop rule: save, the next step saves again if it goes on)
        return True
    return False


class Sessions:
    """The sessions of the requests in one vLLM worker (:class:`~lstmem_peft.integrations.vllm.worker.LSTMemWorker`
    calls :meth:`before_step` before each step and :meth:`after_step` with its output).

    Args:
        view: the worker's model runner, as the plugin sees it (:mod:`~.runner_view`: its model,
            state cache groups and requests, whichever runner vLLM runs).
        directory: the session directory (:func:`~.session_files.prepare_session_directory`), or
            ``None``: sessions
            are off and requests' session keys are ignored.
    """

    def __init__(self, view: RunnerView, directory: str | None) -> None:
        model = view.model
        self.view = view
        self.directory = directory
        self.states = model.memory_states()
        self.tables = SlotTables(self.states)  # the memory layers' state slots
        self.shared = model.lstmem_shared
        # every tensor-parallel rank holds the whole memory (replicated states): rank 0 saves
        self.writer = get_tensor_model_parallel_rank() == 0
        self.layout = model.lstmem_layout
        name = self.states[0].prefix
        self.group = next(g for g, group in enumerate(view.kv_cache_groups) if name in group.layer_names)
        self.slots: dict[str, int] = {}  # request id -> its state slot (where it started)
        self.start_tokens: dict[str, int] = {}  # request id -> tokens_written of its starting memory
        self.ran: dict[str, int] = {}  # request id -> tokens the model ran for it since it (re)started
        self.read_only: set[str] = set()  # ids of read-only requests
        self.history: dict[str, int] = {}  # history request id -> its state slot
        self.memories: dict[str, MemoryCache] = {}  # request id -> the memory it started from (read once)
        self.outputs: dict[str, tuple[str, str]] = {}  # request id -> (out-session name, its file)
        self.failed: set[str] = set()  # requests whose in-session could not be read here
        # requests started, restarted from scratch after a preemption, memories loaded and saved, and
        # session reads or writes that failed in the worker (logged)
        self.counts = {"started": 0, "restarted": 0, "loaded": 0, "saved": 0, "failed": 0}

    def before_step(self, scheduler_output) -> None:
        for request_id in scheduler_output.finished_req_ids:
            self.finish(request_id)
        for request in self.view.starting(scheduler_output):
            self.counts["restarted" if request.restarted else "started"] += 1
            self.start(request.request_id, request.sampling_params, request.block_ids, request.prompt_length)
        self.shared.step_history.clear()
        for request_id, count in scheduler_output.num_scheduled_tokens.items():
            slot = self.history.get(request_id)
            if slot is not None:  # the chunk of a history request: where it starts in the prompt
                self.shared.step_history[slot] = (self.ran.get(request_id, 0), count)
            self.ran[request_id] = self.ran.get(request_id, 0) + count
        self.shared.step_has_read_only = any(
            request_id in self.read_only for request_id in scheduler_output.num_scheduled_tokens
        )

    def after_step(self, output) -> None:
        """Save the out-session of every request that ended in the step of ``output`` (a
        ``ModelRunnerOutput``: ``req_ids``, ``sampled_token_ids`` per request)."""
        self.view.record_output(output)
        if not self.outputs:
            return
        sampled = output.sampled_token_ids or ()
        for i, request_id in enumerate(output.req_ids):
            if request_id not in self.outputs or i >= len(sampled) or len(sampled[i]) == 0:
                continue  # no out-session, or a prefill chunk that sampled nothing
            request = self.view.request(request_id)
            if request is not None and finishes(request, self.view.max_model_len, len(sampled[i])):
                self.save(request_id)

    def start(self, request_id: str, params, block_ids, prompt_length: int) -> None:
        """Set up the state slot of a request that starts (or restarts from scratch): its mode (a
        history request's blocks start over), and its starting memory in every memory layer (the
        in-session's, else zeros; vLLM does not clear a slot it hands out)."""
        slot = int(block_ids[self.group][0])
        self.slots[request_id] = slot
        extra = getattr(params, "extra_args", None)
        read_only = is_read_only(extra)
        self.shared.set_read_only(slot, read_only)
        if read_only:
            self.read_only.add(request_id)
        else:
            self.read_only.discard(request_id)
        history = is_history(extra) and not read_only  # both: refused at admission
        self.shared.set_history(slot, prompt_length if history else None)
        if history:
            self.history[request_id] = slot
        else:
            self.history.pop(request_id, None)
        self.start_tokens[request_id] = 0
        self.ran[request_id] = 0
        self.tables.load(slot, self.starting_memory(request_id, extra, read_only))

    def starting_memory(self, request_id: str, extra, read_only: bool) -> MemoryCache | None:
        """The memory of the request's in-session (read once per request), or ``None``: zeros. Records
        its out-session (on the writing rank). Never raises: a session that cannot be used is logged
        and counted, and the request runs from an empty memory without saving."""
        if self.directory is None or request_id in self.failed:
            return None
        try:
            name_in, name_out = request_sessions(extra)
            if name_out is not None and read_only:  # refused at admission; a read-only request writes nothing
                logger.error(
                    "LSTMem request %s: %s=false with %s %r; the session is not written",
                    request_id,
                    MEMORY_WRITE,
                    SESSION_OUT,
                    name_out,
                )
                self.counts["failed"] += 1
                name_out = None
            if name_out is not None and self.writer:
                self.outputs[request_id] = (name_out, session_file(self.directory, name_out))
            if name_in is None:
                return None
            cache = self.memories.get(request_id)
            if cache is None:
                cache = load_session(session_file(self.directory, name_in), self.layout)
                self.memories[request_id] = cache
                self.counts["loaded"] += 1
        except Exception as err:  # noqa: BLE001 (a request's file must not stop the engine)
            logger.error(
                "LSTMem request %s: its sessions cannot be used (%s); it runs from an empty memory and its "
                "out-session is not written",
                request_id,
                err,
            )
            self.counts["failed"] += 1
            self.failed.add(request_id)
            self.outputs.pop(request_id, None)
            return None
        self.start_tokens[request_id] = int(cache.tokens_written[0])
        return cache

    def save(self, request_id: str) -> None:
        """Write the memory in the request's state slot to its out-session (atomically)."""
        name, path = self.outputs[request_id]
        tokens = self.start_tokens.get(request_id, 0) + self.ran.get(request_id, 0)
        cache = self.tables.rows(self.slots[request_id], self.layout, tokens)
        try:
            save_session(cache, path)
        except Exception as err:  # noqa: BLE001 (a full disk must not stop the engine)
            logger.error("LSTMem request %s: session %r was not written (%s)", request_id, name, err)
            self.counts["failed"] += 1
            return
        self.counts["saved"] += 1

    def finish(self, request_id: str) -> None:
        """Forget a request vLLM has finished (its out-session was written at its last step)."""
        self.read_only.discard(request_id)
        self.slots.pop(request_id, None)
        slot = self.history.pop(request_id, None)
        if slot is not None:
            self.shared.set_history(slot, None)
        self.start_tokens.pop(request_id, None)
        self.ran.pop(request_id, None)
        self.memories.pop(request_id, None)
        self.outputs.pop(request_id, None)
        self.failed.discard(request_id)
