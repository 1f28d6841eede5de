"""Adapters that ship inside the package, by short name: ``--adapter smollm2-135m-english-numbers``.

Each is an ordinary PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``, a
model card) under ``lstmem_peft/assets/adapters/``, trained for one backbone of
:data:`~.backbones.BACKBONES`. Every entry point that takes an adapter (the library's
:func:`~.loading.load_model_and_adapter`, ``lstmem serve``, ``lstmem eval``, the vLLM plugin, the
examples) passes its value through :func:`resolve_adapter`: a short name becomes its folder, anything
else (a path, a Hub id) is returned unchanged. An existing local path wins over a short name of the
same spelling, as for ``--model``. :func:`check_pair` refuses a shipped adapter on another backbone
before any weights load.

Importing this module loads only the standard library.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lstmem_peft.utils.errors import UsageError

ADAPTER_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "adapters"


@dataclass(frozen=True)
class ShippedAdapter:
    """An adapter folder shipped in the package.

    Attributes:
        name: the short name (``--adapter NAME``); also its folder under :data:`ADAPTER_ASSETS`.
        backbone: the short name of the backbone it was trained for (``--model``).
        summary: one line: what it was trained to remember (its model card says how and how well).
        relations: the relations of :func:`~lstmem_peft.training.english.english_episodes` it was
            trained and measured on (what to evaluate it on).
    """

    name: str
    backbone: str
    summary: str
    relations: tuple[str, ...] = ()

    @property
    def folder(self) -> Path:
        return ADAPTER_ASSETS / self.name


SHIPPED_ADAPTERS: dict[str, ShippedAdapter] = {
    "smollm2-135m-english-numbers": ShippedAdapter(
        name="smollm2-135m-english-numbers",
        backbone="smollm2-135m",
        summary="numbers and dates stated once in English notes (ages, appointment dates, rooms, phone "
        "extensions, prices), recalled from memory alone; memory on layers 12-29",
        relations=("age", "appointment", "room", "extension", "price"),
    ),
}


class WrongBackbone(UsageError):
    """A shipped adapter asked for on a backbone it was not trained for; the message names the one."""


def shipped_adapter(adapter: str | os.PathLike | None) -> ShippedAdapter | None:
    """The :class:`ShippedAdapter` that ``adapter`` (an ``--adapter`` value) names, or ``None`` for a
    path, a Hub id or ``None``. An existing local path of the same spelling wins."""
    if adapter is None:
        return None
    text = os.fspath(adapter)
    if text not in SHIPPED_ADAPTERS or os.path.exists(os.path.expanduser(text)):
        return None
    return SHIPPED_ADAPTERS[text]


def resolve_adapter(adapter: str | os.PathLike | None) -> str | None:
    """A shipped adapter's short name becomes its folder; a path, a Hub id or ``None`` is returned as
    it is (a path as a string)."""
    found = shipped_adapter(adapter)
    if found is not None:
        return str(found.folder)
    return None if adapter is None else os.fspath(adapter)


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
