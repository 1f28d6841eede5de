"""Sessions on vLLM: a request starts from a saved memory and its final memory is saved, by name.

``SamplingParams(extra_args={"lstmem_session_in": "alice", "lstmem_session_out": "alice"})``, or
``"vllm_xargs"`` with the same keys on vLLM's OpenAI server; either key may be left out. The values
are session *names*, never paths: a name is a ``lstmem serve`` session id
(:func:`~lstmem_peft.integrations.vllm.check_session_id`: 1 to 128 letters, digits, ``.``, ``_``, ``-``,
not starting with ``.``), and session ``NAME`` is the file ``NAME.safetensors`` of the session
directory (:func:`~lstmem_peft.integrations.vllm.session_file`), which only the operator chooses: the
environment variable ``LSTMEM_SESSION_DIR`` of the processes that run vLLM. Without it, sessions are
off and a request that names one is refused, as is any other ``lstmem_`` key. Names are one
namespace shared by every client of the server (vLLM has no notion of callers): give sessions
unguessable names where clients must not reach each other's (``lstmem serve`` keeps callers apart).

Files are :meth:`lstmem_peft.MemoryCache.save` files of one row. A session directory belongs to one
adapter: the worker records the served memory layout in ``.lstmem-layout.json`` when it starts
(:func:`prepare_session_directory`), an engine with another layout refuses to start there, and
every session file is checked against that layout.

When vLLM admits a request (:class:`SessionFileCheck`, in the serving process; an error here is the
request's own error, HTTP 400 on vLLM's server, and the engine goes on):

* the keys and names are checked; the session directory must be set and hold the layout record
  (and be writable, for an out-session);
* ``lstmem_memory_write`` must be a bool (or ``0`` / ``1``: vLLM's OpenAI server reads the JSON
  booleans of ``vllm_xargs`` as integers); ``False`` (read-only: the request reads its starting
  memory, as ``generate(memory_cache=..., memory_write=False)``, and writes nothing) is refused with
  an out-session, which would only copy the in-session; it needs no session directory;
* ``lstmem_session_in`` must be a readable one-row memory of the served layout with finite states;
  a missing, unreadable, damaged or foreign file gets one and the same error text, so that a
  client cannot learn which files exist (the cause goes to the server's log);
* ``lstmem_history`` must be a bool (or ``0`` / ``1``); ``True`` (a history request:
  :mod:`lstmem_peft.integrations.vllm.history`) needs an out-session, a writing request and
  ``max_tokens=1``;
* ``lstmem_session_out`` must not name something that is not a session file (a folder, a link), and
  the request must be able to finish where the worker sees it: ``n == 1`` and no ``stop`` strings
  (vLLM ends a request on a stop string in the serving process, after its output left the engine).

In the worker (:class:`Sessions`, driven by :class:`~lstmem_peft.integrations.vllm.worker.LSTMemWorker`;
what it knows of requests comes from vLLM's model runner, V1 or V2, through
:mod:`~lstmem_peft.integrations.vllm.runner_view`):

* before each step, every request that starts (new, or resumed from scratch after a preemption)
  marks its state slot read-only or writing for the memory layers
  (``EngineMemory.set_read_only``) and has its starting memory written into its state slot, every
  memory layer's ``(C, D)``: its in-session's memory (read once per request; a restarted request
  starts again from the memory it first read), else zeros; a history request's slot is marked as
  such (``EngineMemory.set_history``: its blocks start over), and before each step the chunk each
  history request runs is recorded (``EngineMemory.step_history``: where it starts in the prompt);
* after each step, before its outputs go back to the scheduler, every request that sampled its
  last token in that step (vLLM's own stop rule, :func:`finishes`) and names an out-session has its
  slot's states written there: to a temporary file of the session directory, then renamed over the
  session's file (atomic: a reader sees the previous memory or the new one, never a part). So the
  file is complete when ``llm.generate`` returns and before vLLM's server answers. The memory holds
  the prompt and every generated token but the last, as ``generate(memory_cache=...)`` leaves it;
  ``tokens_written`` is the starting memory's count plus the tokens the model ran for the request.
  A request that does not finish (aborted, a client that went away) leaves its session as it was.
  With tensor parallelism every rank reads in-sessions (each holds the whole memory) and rank 0
  writes out-sessions.

Nothing a request carries can stop the engine: the worker checks names again, and a file that
fails there (removed or replaced by someone else after admission, a full disk) is logged and
counted (``lstmem_counts()["failed"]``): a request whose in-session cannot be read runs from an
empty memory and its out-session is not written; a failed write leaves the previous file in place.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict
from types import SimpleNamespace

import torch
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.logger import init_logger
from vllm.v1.sample.logits_processor import LogitsProcessor

try:  # Model Runner V2 loads logits processors of its own interface (vLLM 0.32 and 0.33 have it)
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as LogitsProcessorV2
except ImportError:  # a vLLM without Model Runner V2: the V1 interface only
    LogitsProcessorV2 = None

from lstmem_peft.memory.cache import MemoryCache, MemoryLayout

from . import (
    HISTORY,
    MEMORY_WRITE,
    SESSION_DIR_ENV,
    SESSION_FILE_CHECK,
    SESSION_IN,
    SESSION_OUT,
    session_file,
)
from .runner_view import RunnerView

logger = init_logger(__name__)

#: the file of a session directory that records the served memory layout (a hidden name: no session
#: name can reach it)
LAYOUT_RECORD = ".lstmem-layout.json"
_LAYOUT_FORMAT = "lstmem-session-directory"

NO_SESSION_IN = (
    f"{SESSION_IN}: there is no usable session {{name!r}} (it does not exist, or its memory cannot be read "
    f"for this adapter); start a session by naming it in {SESSION_OUT}"
)


def session_directory() -> str | None:
    """The session directory of this process (``LSTMEM_SESSION_DIR``), or ``None``: sessions are off."""
    return os.environ.get(SESSION_DIR_ENV) or None


def request_sessions(extra_args) -> tuple[str | None, str | None]:
    """The in- and out-session names a request's ``extra_args`` give (``None``: not given).

    Raises:
        ValueError: another ``lstmem_`` key, or a name that is not a string.
    """
    extra = extra_args or {}
    if not isinstance(extra, dict):
        return None, None
    for key in extra:
        if (
            isinstance(key, str)
            and key.startswith("lstmem_")
            and key not in (SESSION_IN, SESSION_OUT, MEMORY_WRITE, HISTORY)
        ):
            raise ValueError(
                f"unknown key {key!r}: the LSTMem keys are {SESSION_IN}, {SESSION_OUT}, {MEMORY_WRITE} and "
                f"{HISTORY}"
            )
    names = []
    for key in (SESSION_IN, SESSION_OUT):
        value = extra.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{key}: a session name is a string, not {type(value).__name__}")
        names.append(value)
    return names[0], names[1]


def request_memory_write(extra_args) -> bool:
    """Whether a request writes its prompt and generated tokens into its memory (``extra_args``
    key ``lstmem_memory_write``; default ``True``). ``False``: read-only, as
    ``generate(memory_cache=..., memory_write=False)``. The integers ``1`` and ``0`` stand for
    ``True`` and ``False``: vLLM's OpenAI server reads the JSON booleans of ``vllm_xargs`` as integers.

    Raises:
        ValueError: the value is not a bool, ``0`` or ``1``.
    """
    return _flag(extra_args, MEMORY_WRITE, True)


def _flag(extra_args, key: str, default: bool) -> bool:
    """The bool ``extra_args[key]`` (``default`` when absent; ``1`` / ``0`` stand for ``True`` /
    ``False``: vLLM's OpenAI server reads the JSON booleans of ``vllm_xargs`` as integers).

    Raises:
        ValueError: the value is not a bool, ``0`` or ``1``.
    """
    extra = extra_args or {}
    if not isinstance(extra, dict):
        return default
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise ValueError(f"{key} must be true or false, not {value!r}")


def request_history(extra_args) -> bool:
    """Whether a request asks for its prompt to be written as a history (``extra_args`` key
    ``lstmem_history``; default ``False``): in the adapter's blocks with block-end feedback, as
    :func:`lstmem_peft.write_history` writes (:mod:`lstmem_peft.integrations.vllm.history`).

    Raises:
        ValueError: the value is not a bool, ``0`` or ``1``.
    """
    return _flag(extra_args, HISTORY, False)


def is_history(extra_args) -> bool:
    """Whether a request is a history request (the scheduler's and the worker's rule: a value that
    :func:`request_history` refuses was refused at admission, and counts as ``False`` here)."""
    try:
        return request_history(extra_args)
    except ValueError:
        return False


def is_read_only(extra_args) -> bool:
    """Whether a request reads its memory only (the worker's rule: a value that
    :func:`request_memory_write` refuses was refused at admission, and writes here)."""
    try:
        return not request_memory_write(extra_args)
    except ValueError:
        return False


def _layout_record(layout: MemoryLayout) -> dict:
    return {"format": _LAYOUT_FORMAT, "fingerprint": layout.fingerprint(), "layout": asdict(layout)}


def read_layout(directory: str) -> MemoryLayout:
    """The memory layout recorded in a session directory.

    Raises:
        ValueError: no record, or a damaged one.
    """
    try:
        with open(os.path.join(directory, LAYOUT_RECORD), encoding="utf-8") as fh:
            record = json.load(fh)
        fields = dict(record["layout"])
        fields["layer_indices"] = tuple(fields["layer_indices"])
        layout = MemoryLayout(**fields)
        if record.get("format") != _LAYOUT_FORMAT or layout.fingerprint() != record.get("fingerprint"):
            raise ValueError("the record does not match its fingerprint")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"{os.path.join(directory, LAYOUT_RECORD)}: no readable layout record ({err}); the vLLM worker writes "
            f"it when it starts with {SESSION_DIR_ENV} set"
        ) from err
    return layout


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not every platform opens folders
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_atomically(path: str, write) -> None:
    """``write(temporary_path)``, then rename the temporary file over ``path`` (same folder; the
    temporary name starts with ``.``, which no session name does). The temporary file is removed
    on failure."""
    folder, base = os.path.split(path)
    tmp = os.path.join(folder, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    _fsync_directory(folder)


def save_session(cache: MemoryCache, path: str) -> None:
    """Write ``cache`` (one row) to ``path`` atomically: a reader sees the old file or the new one."""
    _replace_atomically(path, cache.save)


def prepare_session_directory(vllm_config, layout: MemoryLayout) -> str | None:
    """The session directory of a worker serving ``layout``, set up (created, layout recorded), or
    ``None`` when ``LSTMEM_SESSION_DIR`` is unset (sessions off; session keys are then ignored here
    and refused at admission).

    Raises:
        RuntimeError: the engine cannot run sessions as configured: the admission check is not
            among its logits processors (``--logits-processors``), asynchronous scheduling is on, or
            the directory records another adapter's layout.
    """
    directory = session_directory()
    if directory is None:
        return None
    processors = vllm_config.model_config.logits_processors or []
    names = {p if isinstance(p, str) else f"{p.__module__}:{p.__qualname__}" for p in processors}
    if SESSION_FILE_CHECK not in names and SESSION_FILE_CHECK.replace(":", ".") not in names:
        raise RuntimeError(
            f"{SESSION_DIR_ENV} is set, so this engine serves sessions, but requests are not checked when vLLM "
            f"admits them: add --logits-processors {SESSION_FILE_CHECK} (lstmem_peft.integrations.vllm.engine_args "
            "does), or unset the variable"
        )
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        raise RuntimeError(
            f"{SESSION_DIR_ENV} is set, so this engine serves sessions, which asynchronous scheduling would save "
            "a step late: start vLLM with --no-async-scheduling (lstmem_peft.integrations.vllm.engine_args does)"
        )
    os.makedirs(directory, exist_ok=True)
    record = _layout_record(layout)
    path = os.path.join(directory, LAYOUT_RECORD)
    if os.path.exists(path):
        try:
            existing = read_layout(directory)
        except ValueError:
            existing = None  # a damaged record is rewritten
        if existing is not None and existing != layout:
            raise RuntimeError(
                f"the session directory {directory} ({SESSION_DIR_ENV}) holds the sessions of another adapter "
                f"({MemoryCache._describe(existing)}), not of this one ({MemoryCache._describe(layout)}): give "
                "each adapter its own session directory"
            )
        if existing == layout:
            return directory

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(record, fh, sort_keys=True)

    _replace_atomically(path, write)
    return directory


def load_session(path: str, layout) -> MemoryCache:
    """A one-row memory for a request, checked against the model's layout (``None``: any layout)."""
    cache = MemoryCache.load(path, layout)
    if cache.batch_size != 1:
        raise ValueError(
            f"{path} holds the memory of {cache.batch_size} sequences; a request starts from one "
            "(cache.batch_select_indices([i]) selects a row before saving)"
        )
    return cache


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
        directory: the session directory (:func:`prepare_session_directory`), or ``None``: sessions
            are off and requests' session keys are ignored.
    """

    def __init__(self, view: RunnerView, directory: str | None) -> None:
        model = view.model
        self.view = view
        self.directory = directory
        self.states = model.memory_states()
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
        self.write_start(slot, self.starting_memory(request_id, extra, read_only))

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

    def write_start(self, slot: int, cache: MemoryCache | None) -> None:
        """Write ``cache``'s one row (``None``: zeros) into state slot ``slot`` of every memory layer."""
        for depth, state in enumerate(self.states):
            cells, hiddens = state.kv_cache
            if cache is None:
                cells[slot].zero_()
                hiddens[slot].zero_()
            else:
                cells[slot].copy_(cache.layers[depth].cell[0])
                hiddens[slot].copy_(cache.layers[depth].hidden[0])

    def save(self, request_id: str) -> None:
        """Write the memory in the request's state slot to its out-session (atomically)."""
        name, path = self.outputs[request_id]
        slot = self.slots[request_id]
        cache = MemoryCache(self.layout)
        cache.ensure(1, torch.device("cpu"))
        for layer, state in zip(cache.layers, self.states, strict=True):
            cells, hiddens = state.kv_cache
            layer.cell = cells[slot][None].to("cpu", copy=True)
            layer.hidden = hiddens[slot][None].to("cpu", copy=True)
        cache.tokens_written = torch.tensor(
            [self.start_tokens.get(request_id, 0) + self.ran.get(request_id, 0)]
        )
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


class SessionFileCheck(LogitsProcessor, *((LogitsProcessorV2,) if LogitsProcessorV2 is not None else ())):
    """Checks a request's sessions when vLLM admits it, in the serving process, so that anything
    wrong is refused with that request's error (``VLLMValidationError``; HTTP 400 on vLLM's server)
    before it reaches the worker. What is checked: see :mod:`lstmem_peft.integrations.vllm.sessions`.
    Selected by :func:`lstmem_peft.integrations.vllm.engine_args` (``logits_processors``), or
    ``--logits-processors lstmem_peft.integrations.vllm.sessions:SessionFileCheck``; a worker with a
    session directory refuses to start without it. It leaves logits alone.

    One class for both of vLLM's model runners, which load logits processors of two interfaces
    (each refuses a class that is not its own subclass): V1's
    (``vllm.v1.sample.logits_processor.LogitsProcessor``: built with ``(vllm_config, device,
    is_pin_memory)``, ``apply(logits)``, ``update_state``) and V2's
    (``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor``: built with ``(vllm_config,
    req_states)``, ``add_request``, which declines every request, and ``apply(logits, ctx)``); both
    call :meth:`validate_params` at admission."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        extra = getattr(sampling_params, "extra_args", None)
        name_in, name_out = request_sessions(extra)
        if not request_memory_write(extra) and name_out is not None:
            raise ValueError(
                f"{SESSION_OUT}: a request with {MEMORY_WRITE}=false only reads its memory, so it ends with the "
                f"memory it started from and has nothing to save in session {name_out!r}; leave out "
                f"{SESSION_OUT}, or {MEMORY_WRITE} to write the prompt and answer into memory"
            )
        if request_history(extra):
            if not request_memory_write(extra):
                raise ValueError(
                    f"{HISTORY}: a history request writes its prompt into memory, which {MEMORY_WRITE}=false "
                    "forbids; leave out one of the two"
                )
            if name_out is None:
                raise ValueError(
                    f"{HISTORY}: a history request writes its prompt into memory and saves that memory; name the "
                    f"session to save it in with {SESSION_OUT}"
                )
            if getattr(sampling_params, "max_tokens", None) != 1:
                raise ValueError(
                    f"{HISTORY}: a history request writes its prompt and generates nothing to keep; set "
                    f"max_tokens=1 (got {getattr(sampling_params, 'max_tokens', None)!r}) and ask questions in "
                    f"a later request that names the session in {SESSION_IN}"
                )
        if name_in is None and name_out is None:
            return
        key = SESSION_IN if name_in is not None else SESSION_OUT
        directory = session_directory()
        if directory is None:
            raise ValueError(
                f"{key}: sessions are off on this server; the operator enables them by starting vLLM with "
                f"{SESSION_DIR_ENV}=<a folder for session files> in its environment"
            )
        try:
            layout = read_layout(directory)
        except ValueError as err:
            logger.error("LSTMem sessions are unusable: %s", err)
            raise ValueError(
                f"{key}: the server's session directory is not set up (see the server's log); the operator "
                f"starts vLLM's worker with {SESSION_DIR_ENV} set, which records the adapter there"
            ) from None
        paths = {}
        for name_key, name in ((SESSION_IN, name_in), (SESSION_OUT, name_out)):
            if name is not None:
                try:
                    paths[name_key] = session_file(directory, name)
                except ValueError as err:  # SessionIdError, or a link out of the folder
                    raise ValueError(f"{name_key}: {err}") from None
        if name_in is not None:
            try:
                load_session(paths[SESSION_IN], layout)
            except Exception as err:  # noqa: BLE001 (one answer for missing and unreadable files)
                logger.warning("LSTMem: session %r refused at admission: %s", name_in, err)
                raise ValueError(NO_SESSION_IN.format(name=name_in)) from None
        if name_out is not None:
            path = paths[SESSION_OUT]
            if os.path.lexists(path) and (os.path.islink(path) or not os.path.isfile(path)):
                raise ValueError(
                    f"{SESSION_OUT}: session {name_out!r} cannot be written: its name is taken by something that "
                    "is not a session file; choose another name"
                )
            if not os.access(directory, os.W_OK):
                raise ValueError(
                    f"{SESSION_OUT}: the server cannot write its session directory; the operator gives vLLM "
                    "write access to it"
                )
            if (getattr(sampling_params, "n", 1) or 1) > 1:
                raise ValueError(
                    f"{SESSION_OUT}: n={sampling_params.n} choices would each write session {name_out!r}; ask "
                    "for one choice per request that writes a session"
                )
            stop = getattr(sampling_params, "stop", None)
            if stop:
                raise ValueError(
                    f"{SESSION_OUT}: stop strings end a request after its output has left vLLM's engine, too "
                    "late to save its memory; use stop_token_ids instead"
                )

    def __init__(self, vllm_config, *args) -> None:
        pass

    def apply(self, logits: torch.Tensor, ctx=None) -> torch.Tensor:
        return logits

    def add_request(self, req_idx: int, sampling_params) -> bool:
        return False  # V2: this processor changes no request's logits (V2 then skips their processing)

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass
