"""PEFT tuner layers: the query projection (which owns the memory) and the output projection.

``LSTMemQueryLayer`` wraps a decoder layer's query projection and owns that layer's
:class:`~lstmem_peft.memory.LSTMemLayer` per adapter (``lstmem_memory[adapter]``). When a memory pass
is open (see :mod:`lstmem_peft.context`), it runs the memory on the projection's input (the
attention input, after the layer's input norm), adds ``Δq`` to the projection's output (before any
q-norm and RoPE, which the backbone applies next) and leaves ``Δo`` with the pass. The matching
``LSTMemOutputLayer`` adds that ``Δo`` to the output projection's output. Outside a memory pass, or
with adapters disabled, both are the plain base layers.
"""

from __future__ import annotations

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from . import context
from .memory import LSTMemLayer


class LSTMemTunerLayer(BaseTunerLayer):
    """Common base of the two LSTMem wrappers (PEFT finds both through it)."""

    def merge(self, *args, **kwargs) -> None:
        raise NotImplementedError(
            "an LSTMem adapter cannot be merged: its contribution depends on a memory state that changes "
            "with every token, not on fixed weights; use model.unload() to get the base model back"
        )

    def unmerge(self) -> None:
        """Nothing to undo: LSTMem never merges."""

    def __repr__(self) -> str:
        return "lstmem." + super().__repr__()


class LSTMemQueryLayer(nn.Module, LSTMemTunerLayer):
    """Query projection with LSTMem memory. ``forward(x)``: ``(B, T, d) -> (B, T, d_q)``."""

    adapter_layer_names = ("lstmem_memory",)
    other_param_names = ()

    def __init__(self, base_layer: nn.Module, layer_idx: int) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.layer_idx = layer_idx
        self.lstmem_memory = nn.ModuleDict()
        self._disable_adapters = False
        self.merged_adapters = []
        self.kwargs = {}

    def update_layer(self, adapter_name: str, config, output_weight: torch.Tensor) -> None:
        """Create the memory of ``adapter_name`` and initialise ``W_dq``/``W_do`` from the backbone."""
        base = self.get_base_layer()
        weight = base.weight
        memory = LSTMemLayer(
            hidden_size=weight.shape[1],
            query_size=weight.shape[0],
            num_heads=config.num_heads,
            head_dim=config.r,
            alpha=config.alpha,
            layer_idx=self.layer_idx,
            device=weight.device,
            dtype=torch.float32,
        )
        memory.init_corrections(weight, output_weight)
        self.lstmem_memory[adapter_name] = memory
        self.set_adapter(self.active_adapters)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        active = context.current_pass()
        if active is None or self.disable_adapters:
            return result
        adapter = active.adapter_name
        if adapter not in self.lstmem_memory:
            return result
        delta_q = active.run_layer(self, self.lstmem_memory[adapter], x)
        return result + delta_q.to(result.dtype)


class LSTMemOutputLayer(nn.Module, LSTMemTunerLayer):
    """Output projection that adds the ``Δo`` of its decoder layer's memory. ``(B, T, d_q) -> (B, T, d)``."""

    adapter_layer_names = ()
    other_param_names = ()

    def __init__(self, base_layer: nn.Module, layer_idx: int) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.layer_idx = layer_idx
        self._disable_adapters = False
        self.merged_adapters = []
        self.kwargs = {}

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        active = context.current_pass()
        if active is None or self.disable_adapters:
            return result
        delta_o = active.pop_delta_o(self.layer_idx)
        return result if delta_o is None else result + delta_o.to(result.dtype)
