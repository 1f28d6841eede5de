"""Adapters that ship inside the package, by short name: ``--adapter smollm2-135m-english-numbers``.

Each is an ordinary PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``, a
model card) under ``lstmem_peft/assets/adapters/``, trained for one backbone of
:data:`~lstmem_peft.tuner.backbones.BACKBONES`. Every entry point that takes an adapter (the
library's :func:`~lstmem_peft.tuner.loading.load_model_and_adapter`, ``lstmem serve``, ``lstmem
eval``, the vLLM plugin, the examples) passes its value through :func:`resolve_adapter`: a short
name becomes its folder, anything else (a path, a Hub id) is returned unchanged. An existing local
path wins over a short name of the same spelling, as for ``--model``. Which backbone a shipped
adapter goes on is checked by :func:`lstmem_peft.tuner.shipped_adapters.check_pair`.

The catalogue stands here, below the PEFT tuner, so that the vLLM plugin resolves a short name
without importing the tuner. Importing this module loads only the standard library.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

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
