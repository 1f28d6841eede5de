"""Sessions by name, and the one way a session's file reaches the disk.

A session is named by a plain name that becomes a file: ``lstmem serve``'s store
(``STORE/<namespace>/<session>/``, :mod:`lstmem_peft.serve.store`) and the vLLM plugin's session
directory (``DIR/<session>.safetensors``, :mod:`lstmem_peft.integrations.vllm.session_files`) take
the same names (:data:`SESSION_ID`, :func:`check_session_id`), so a name that could reach outside
its folder is refused by the same rule with the same message wherever it arrives.

Both write their files with :func:`write_atomically`: a temporary file of the same folder (a hidden
name, which no session name can be, readable and writable by its owner only), fsynced, renamed over
the target, then the folder fsynced. A reader sees the old file or the new one, never a part, and
after the call returns the new file survives a crash of the machine.

Nothing here imports torch, transformers or vLLM.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable

#: The file suffix of a session in a session directory (:func:`session_file`).
SESSION_SUFFIX = ".safetensors"

#: Session ids (``lstmem serve``) and vLLM session names: letters, digits, ``.``, ``_``, ``-``; 1 to
#: 128 characters; not starting with ``.`` (so never ``.``, ``..`` or a hidden file); no separator.
SESSION_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}\Z")


class SessionIdError(ValueError):
    """A session id that is not a plain name (it could reach outside the store)."""


def check_session_id(session: str) -> str:
    """Return ``session`` if it is a valid session id, else raise :class:`SessionIdError`.

    The whole string must match :data:`SESSION_ID` (``\\Z``: a trailing newline does not pass)."""
    if not isinstance(session, str) or not SESSION_ID.match(session):
        raise SessionIdError(
            f"invalid session id {session!r}: use 1 to 128 letters, digits, '.', '_' or '-', not starting with '.'"
        )
    return session


def session_file(directory: str, name: str) -> str:
    """The file of session ``name`` in the session directory ``directory``: ``directory/name.safetensors``.

    Raises:
        SessionIdError: ``name`` is not a session id (a path, ``..``, a separator, a hidden name,
            not a string).
        ValueError: the file would resolve outside ``directory`` (a symbolic link placed there that
            points elsewhere).
    """
    check_session_id(name)
    root = os.path.realpath(directory)
    path = os.path.join(root, name + SESSION_SUFFIX)
    if os.path.dirname(os.path.realpath(path)) != root:
        raise ValueError(f"session {name!r} resolves outside the session directory")
    return path


def fsync_directory(folder: str | os.PathLike) -> None:
    """Flush ``folder``'s entries (a rename or removal in it) to disk.

    Raises:
        OSError: the folder cannot be opened or flushed (on a platform that cannot open folders,
            such as Windows, too): what was renamed there is not known to be durable.
    """
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str | os.PathLike, write: Callable[[str], object]) -> None:
    """Replace the file ``path`` by what ``write(temporary_path)`` writes, atomically and durably.

    The temporary file is created empty in ``path``'s folder, readable and writable by its owner
    only (``0o600``, which the new file keeps when ``write`` writes into it), under a new hidden
    name (``.<file name>.<random>.tmp``, which no session name can reach: none starts with ``.``);
    ``write`` fills it, then it is fsynced, renamed over ``path`` (a reader sees the old file or the
    new one) and the folder is fsynced.

    Args:
        path: the target file (its folder must exist).
        write: writes the whole new file at the path it is given (``MemoryCache.save``, or
            ``lambda tmp: Path(tmp).write_text(text)``); may overwrite the empty file there.

    Raises:
        OSError: the folder is missing or not writable, the disk is full, or the folder cannot be
            fsynced (then the new file is already in place); whatever ``write`` raises. Before the
            rename, any failure (an interrupt too) removes the temporary file and leaves ``path``
            as it was.
    """
    folder, name = os.path.split(os.fspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder or ".", prefix=f".{name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDWR)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    fsync_directory(folder or ".")
