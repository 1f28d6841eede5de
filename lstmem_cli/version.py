"""``lstmem --version``: the installed distribution's version, read from its metadata so that the
library (and with it torch and PEFT) is not imported."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def installed_version() -> str:
    """``lstmem-peft``'s installed version, or what to do when it is not installed."""
    try:
        return version("lstmem-peft")
    except PackageNotFoundError:
        return "(not installed: pip install -e . at the repository's root)"
