"""The memory pass of the forward in progress, and the options that shape it.

A forward pre-hook on the backbone opens a :class:`ModelPass` (it pops ``memory_cache`` from the
forward's keyword arguments) and a forward hook closes it, so the pass follows the call through
PEFT, TRL's trainers, DDP and ``generate`` without wrapping ``forward``. The pass lives in a
``ContextVar``: no memory state is ever stored on modules, and concurrent sessions (threads,
interleaved calls) never see each other's pass.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace

import torch

from .engine import MemoryPass
from .memory import LayerOutput, LSTMemLayer


@dataclass(frozen=True)
class PassOptions:
    """How the next forwards use memory.

    Attributes:
        write: update the states token by token (``False``: read the fixed states only).
        feedback: apply block-end feedback when the forward ends (history blocks).
    """

    write: bool = True
    feedback: bool = False


_OPTIONS: contextvars.ContextVar[PassOptions] = contextvars.ContextVar("lstmem_options", default=PassOptions())
_CURRENT: contextvars.ContextVar[ModelPass | None] = contextvars.ContextVar("lstmem_pass", default=None)


@contextlib.contextmanager
def memory_options(**changes):
    """Set :class:`PassOptions` fields for the forwards run inside the block.

    >>> with memory_options(write=False):   # e.g. the answer pass of training
    ...     pass
    """
    token = _OPTIONS.set(replace(_OPTIONS.get(), **changes))
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def current_options() -> PassOptions:
    return _OPTIONS.get()


def current_pass() -> ModelPass | None:
    """The memory pass of the forward in progress, or ``None``."""
    return _CURRENT.get()


class ModelPass:
    """A :class:`~lstmem_peft.engine.MemoryPass` seen from the model's decoder layers.

    Args:
        adapter_name: the adapter whose memory runs.
        depth_index: decoder layer index -> memory layer index (depth order).
        memory_pass: the engine pass over the cache.
    """

    def __init__(self, adapter_name: str, depth_index: dict[int, int], memory_pass: MemoryPass) -> None:
        self.adapter_name = adapter_name
        self.depth_index = depth_index
        self.memory_pass = memory_pass
        self._outputs: dict[int, LayerOutput] = {}
        self._token: contextvars.Token | None = None

    def run_layer(self, wrapper, memory: LSTMemLayer, x: torch.Tensor) -> LayerOutput:
        """Run the memory of decoder layer ``wrapper.layer_idx``; keeps its output for ``Δo``."""
        out = self.memory_pass.run(self.depth_index[wrapper.layer_idx], memory, x)
        self._outputs[wrapper.layer_idx] = out
        return out

    def pop_output(self, layer_idx: int) -> LayerOutput | None:
        """The output of decoder layer ``layer_idx``'s memory (its ``Δo``), once."""
        return self._outputs.pop(layer_idx, None)

    def pop_delta_o(self, layer_idx: int) -> torch.Tensor | None:
        out = self._outputs.pop(layer_idx, None)
        return None if out is None else out.delta_o

    def open(self) -> None:
        self._token = _CURRENT.set(self)

    def close(self, completed: bool) -> None:
        """Leave the context; when the forward completed, finish the pass (feedback)."""
        _CURRENT.reset(self._token)
        self._outputs.clear()
        if completed:
            self.memory_pass.finish()
