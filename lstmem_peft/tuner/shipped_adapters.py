"""Which backbone a shipped adapter goes on: :func:`check_pair` refuses a shipped adapter on another
backbone before any weights load, and :func:`default_adapter` names the adapter shipped for a
backbone. The catalogue itself (:data:`~lstmem_peft.utils.shipped_adapters.SHIPPED_ADAPTERS`, and
:func:`~lstmem_peft.utils.shipped_adapters.resolve_adapter`, a short name to its folder) stands in
:mod:`lstmem_peft.utils.shipped_adapters`.

Importing this module loads only the standard library and ``utils``.
"""

from __future__ import annotations

import os
from pathlib import Path

from lstmem_peft.utils.errors import UsageError
from lstmem_peft.utils.shipped_adapters import SHIPPED_ADAPTERS, shipped_adapter


class WrongBackbone(UsageError):
    """A shipped adapter asked for on a backbone it was not trained for; the message names the one."""


def default_adapter(model: str | os.PathLike | None) -> str | None:
    """The short name of the adapter shipped for ``model`` (a ``--model`` short name), or ``None``:
    what ``lstmem serve --model NAME`` serves when no ``--adapter`` is given."""
    if model is None:
        return None
    from .backbones import short_name

    name = short_name(model)
    return next((a.name for a in SHIPPED_ADAPTERS.values() if a.backbone == name), None)


def check_pair(model: str | os.PathLike | None, adapter: str | os.PathLike | None) -> None:
    """Refuse a shipped adapter on a backbone it was not trained for, before anything loads.

    ``model`` is the ``--model`` value as the user gave it (a short name, a path, a Hub id, ``None``
    for the embedded demo). A path or Hub id is accepted when its folder's ``lstmem_backbone.json``
    names the adapter's backbone (the converted folder :func:`~.backbones.resolve_model` returns);
    otherwise it is refused, since the adapter's shapes and training hold for that backbone only.

    Raises:
        WrongBackbone: naming the ``--model`` to pass.
    """
    found = shipped_adapter(adapter)
    if found is None:
        return
    from .backbones import read_record, short_name

    name = short_name(model) if model is not None else None
    if name is None and model is not None and os.path.isdir(os.path.expanduser(os.fspath(model))):
        record = read_record(Path(os.path.expanduser(os.fspath(model)))) or {}
        name = record.get("name")
    if name != found.backbone:
        given = "the embedded demo backbone" if model is None else f"--model {os.fspath(model)}"
        raise WrongBackbone(
            f"the shipped adapter {found.name} was trained for the backbone {found.backbone}, not "
            f"{given}: pass --model {found.backbone} (model={found.backbone!r} in Python)"
        )
