"""Sessions by name, and the one way a session's file reaches the disk.

A session is named by a plain name that becomes a file: ``lstmem serve``'s store
(``STORE/<namespace>/<session>/``, :mod:`lstmem_peft.serve.store`) and the vLLM plugin's session
directory (``DIR/<session>.safetensors``, :mod:`lstmem_peft.integrations.vllm.session_files`) take
the same names (:data:`SESSION_ID`, :func:`check_session_id`), so a name that could reach outside
its folder is refused by the same rule with the same message wherever it arrives. A vLLM session
name may also be a relative path of up to :data:`SESSION_PATH_PARTS` such names joined by ``/``
(``NAMESPACE/SESSION/memory-00000003``): that is how ``lstmem serve --engine vllm``, whose store is
vLLM's session directory, names the store's own memory files.

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


#: The most plain names a session path of a session directory joins (:func:`session_file`).
SESSION_PATH_PARTS = 3


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

    ``name`` is a session id, or up to :data:`SESSION_PATH_PARTS` session ids joined by ``/`` (a
    file in a folder of the directory, as ``lstmem serve``'s store keeps them): every part is a
    plain name, so none is empty, ``.``, ``..`` or hidden, and the path has no leading or doubled
    separator.

    Raises:
        SessionIdError: ``name`` is not a session id or such a path (``..``, a backslash, a hidden
            name, an absolute path, too many parts, not a string).
        ValueError: the file would resolve outside ``directory`` (a symbolic link placed there that
            points elsewhere).
    """
    if not isinstance(name, str) or not 1 <= len(parts := name.split("/")) <= SESSION_PATH_PARTS:
        raise SessionIdError(
            f"invalid session id {name!r}: a vLLM session is a session id, or up to {SESSION_PATH_PARTS} session ids "
            "joined by '/'"
        )
    for part in parts:
        check_session_id(part)
    root = os.path.realpath(directory)
    path = os.path.join(root, *parts[:-1], parts[-1] + SESSION_SUFFIX)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root or real == root:
        raise ValueError(f"session {name!r} resolves outside the session directory")
    return path


def fsync_file(path: str | os.PathLike) -> None:
    """Flush the file ``path``'s bytes to disk (before it is renamed into a place a reader trusts)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    fsync_directory(folder or ".")
