"""Errors in what the user gave: a file, a data format or an option. ``lstmem`` prints them as one line
that names the file (or option), what was expected and the fix, and exits with status 2, as argparse
does for its own usage errors; anything else keeps its traceback (``--debug``)."""

from __future__ import annotations

from typing import Any


class UsageError(ValueError):
    """A bad option or option combination; the message says which and what to do instead."""


class DataFormatError(UsageError):
    """A user-given file or folder that cannot be used: unreadable, or not in the expected format.

    ``str(err)`` is one line: ``<path>: <got>; expected <expected>. <fix>``.

    Attributes:
        path: the file, folder or Hub id as given (or the file inside it that is wrong).
        expected: what that input must be, e.g. ``the LoCoMo JSON list of samples (...)``.
        got: what is wrong with it, e.g. ``the file holds an object with keys ['a']`` (``None``: not said).
        fix: what to do, e.g. where the official file is downloaded (``None``: not said).
    """

    def __init__(self, path: Any, expected: str, got: str | None = None, fix: str | None = None) -> None:
        self.path, self.expected, self.got, self.fix = str(path), expected, got, fix
        super().__init__(self._line())

    def _line(self) -> str:
        line = f"{self.path}: " + (f"{self.got}; " if self.got else "") + f"expected {self.expected}"
        if self.fix:
            line += f". {self.fix}"
        return " ".join(line.split())  # one line, whatever the parts held

    def __str__(self) -> str:
        return self._line()

    def __reduce__(self):  # picklable with its fields (multiprocessing, test runners)
        return (type(self), (self.path, self.expected, self.got, self.fix))


class MissingDataError(DataFormatError, FileNotFoundError):
    """A user-given file, folder or Hub dataset that is not there (or holds no data file)."""


def looks_local(source: str, bare_names: bool = True) -> bool:
    """Whether ``source`` (a ``--model``, ``--adapter`` or data argument) is meant as a local path
    rather than a Hub id ``owner/name[/folder]``: it exists, starts like a path, or names a file by its
    suffix; with ``bare_names`` (datasets, whose Hub ids always have an owner) also a name without
    ``/``."""
    import os

    return (
        os.path.exists(os.path.expanduser(source))
        or source.startswith(("/", ".", "~"))
        or os.path.isabs(source)
        or source.lower().endswith((".json", ".jsonl", ".parquet", ".safetensors", ".bin", ".gguf"))
        or (bare_names and "/" not in source)
    )


def read_json_object(path: str, expected: str, fix: str) -> dict:
    """The JSON object in the file ``path``, or a :class:`DataFormatError` naming the file, ``expected``
    and ``fix`` (not JSON, not UTF-8, or JSON of another shape; a missing file: :class:`MissingDataError`)."""
    import json
    import os

    if not os.path.isfile(path):
        raise MissingDataError(path, expected, "no such file", fix)
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataFormatError(
            path, expected, f"not JSON ({getattr(err, 'msg', type(err).__name__)})", fix
        ) from None
    if not isinstance(value, dict):
        raise DataFormatError(path, expected, f"the file holds {describe(value)}", fix)
    return value


def describe(value: Any, limit: int = 6) -> str:
    """A short phrase naming what a JSON value is: ``an object with keys ['a', 'b']``, ``a number (1)``."""
    if isinstance(value, dict):
        keys = list(value)
        shown = ", ".join(repr(str(k)) for k in keys[:limit]) + (", ..." if len(keys) > limit else "")
        return f"an object with keys [{shown}]" if keys else "an empty object"
    if isinstance(value, (list, tuple)):
        if not value:
            return "an empty list"
        kinds = sorted({_kind(v) for v in value})
        return f"a list of {len(value)} item(s) ({', '.join(kinds)})"
    if isinstance(value, str):
        text = value if len(value) <= 40 else value[:37] + "..."
        return f"a string ({text!r})"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if value is None:
        return "null"
    return f"a {type(value).__name__}"


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "objects"
    if isinstance(value, (list, tuple)):
        return "lists"
    if isinstance(value, str):
        return "strings"
    if isinstance(value, bool):
        return "booleans"
    if isinstance(value, (int, float)):
        return "numbers"
    return "nulls" if value is None else type(value).__name__
