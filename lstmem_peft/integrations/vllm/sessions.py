"""Sessions on vLLM: a request starts from a saved memory and its final memory is saved, by name.

``SamplingParams(extra_args={"lstmem_session_in": "alice", "lstmem_session_out": "alice"})``, or
``"vllm_xargs"`` with the same keys on vLLM's OpenAI server; either key may be left out. The values
are session *names*, never paths: a name is a ``lstmem serve`` session id
(:func:`~lstmem_peft.memory.sessions.check_session_id`: 1 to 128 letters, digits, ``.``, ``_``, ``-``,
not starting with ``.``), and session ``NAME`` is the file ``NAME.safetensors`` of the session
directory (:func:`~lstmem_peft.memory.sessions.session_file`), which only the operator chooses: the
environment variable ``LSTMEM_SESSION_DIR`` of the processes that run vLLM. Without it, sessions are
off and a request that names one is refused, as is any other ``lstmem_`` key. Names are one
namespace shared by every client of the server (vLLM has no notion of callers): give sessions
unguessable names where clients must not reach each other's (``lstmem serve`` keeps callers apart).

Files are :meth:`lstmem_peft.MemoryCache.save` files of one row. A session directory belongs to one
adapter: the worker records the served memory layout in ``.lstmem-layout.json`` when it starts
(:func:`~.session_files.prepare_session_directory`), an engine with another layout refuses to start
there, and every session file is checked against that layout.

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

In the worker (:class:`~.worker_sessions.Sessions`, driven by
:class:`~lstmem_peft.integrations.vllm.worker.LSTMemWorker`; what it knows of requests comes from
vLLM's model runner, V1 or V2, through :mod:`~lstmem_peft.integrations.vllm.runner_view`):

* before each step, every request that starts (new, or resumed from scratch after a preemption)
  marks its state slot read-only or writing for the memory layers
  (``EngineMemory.set_read_only``) and has its starting memory written into its state slot, every
  memory layer's ``(C, D)``: its in-session's memory (read once per request; a restarted request
  starts again from the memory it first read), else zeros; a history request's slot is marked as
  such (``EngineMemory.set_history``: its blocks start over), and before each step the chunk each
  history request runs is recorded (``EngineMemory.step_history``: where it starts in the prompt);
* after each step, before its outputs go back to the scheduler, every request that sampled its last
  token in that step (vLLM's own stop rule, :func:`~.worker_sessions.finishes`) and names an
  out-session has its slot's states written there: to a temporary file of the session directory,
  then renamed over the session's file (atomic: a reader sees the previous memory or the new one,
  never a part). So the file is complete when ``llm.generate`` returns and before vLLM's server
  answers. The memory holds the prompt and every generated token but the last, as
  ``generate(memory_cache=...)`` leaves it; ``tokens_written`` is the starting memory's count plus
  the tokens the model ran for the request. A request that does not finish (aborted, a client that
  went away) leaves its session as it was. With tensor parallelism every rank reads in-sessions
  (each holds the whole memory) and rank 0 writes out-sessions.

Nothing a request carries can stop the engine: the worker checks names again, and a file that
fails there (removed or replaced by someone else after admission, a full disk) is logged and
counted (``lstmem_counts()["failed"]``): a request whose in-session cannot be read runs from an
empty memory and its out-session is not written; a failed write leaves the previous file in place.

This module holds the rules of a request's ``lstmem_`` keys (:func:`request_sessions`,
:func:`request_memory_write`, :func:`request_history`) and the admission check
(:class:`SessionFileCheck`, which ``--logits-processors`` names here); the worker's side is
:mod:`~.worker_sessions`, the session directory's files :mod:`~.session_files`.
"""

from __future__ import annotations

import os

import torch
from vllm.logger import init_logger
from vllm.v1.sample.logits_processor import LogitsProcessor

try:  # Model Runner V2 loads logits processors of its own interface (vLLM 0.32 and 0.33 have it)
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as LogitsProcessorV2
except ImportError:  # a vLLM without Model Runner V2: the V1 interface only
    LogitsProcessorV2 = None

from lstmem_peft.memory.sessions import session_file

from . import HISTORY, MEMORY_WRITE, SESSION_DIR_ENV, SESSION_IN, SESSION_OUT
from .session_files import load_session, read_layout, session_directory

logger = init_logger(__name__)

NO_SESSION_IN = (
    f"{SESSION_IN}: there is no usable session {{name!r}} (it does not exist, or its memory cannot be read "
    f"for this adapter); start a session by naming it in {SESSION_OUT}"
)


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
