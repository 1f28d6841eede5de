"""The session directory on vLLM: its layout record, one-row session files, atomic saves.

A session directory belongs to one adapter: :func:`prepare_session_directory` (run by the worker
when the model loads) records the served memory layout in :data:`LAYOUT_RECORD` and refuses a
directory that records another one; :func:`read_layout` reads the record back (the admission check,
:class:`~.sessions.SessionFileCheck`), :func:`load_session` reads a one-row
:class:`~lstmem_peft.MemoryCache` checked against a layout, and :func:`save_session` writes one
atomically (a temporary file renamed over the session's file, by
:func:`~lstmem_peft.memory.sessions.write_atomically`, the writer of ``lstmem serve``'s store too).
What sessions are: :mod:`~lstmem_peft.integrations.vllm.sessions`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from lstmem_peft.memory.cache import MemoryCache, MemoryLayout
from lstmem_peft.memory.sessions import write_atomically

from . import SESSION_DIR_ENV, SESSION_FILE_CHECK

#: the file of a session directory that records the served memory layout (a hidden name: no session
#: name can reach it)
LAYOUT_RECORD = ".lstmem-layout.json"
_LAYOUT_FORMAT = "lstmem-session-directory"


def session_directory() -> str | None:
    """The session directory of this process (``LSTMEM_SESSION_DIR``), or ``None``: sessions are off."""
    return os.environ.get(SESSION_DIR_ENV) or None


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


def save_session(cache: MemoryCache, path: str) -> None:
    """Write ``cache`` (one row) to ``path`` atomically: a reader sees the old file or the new one
    (:func:`~lstmem_peft.memory.sessions.write_atomically`)."""
    write_atomically(path, cache.save)


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

    write_atomically(path, write)
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
