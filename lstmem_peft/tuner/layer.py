"""PEFT tuner layers: the query projection (which owns the memory) and the output projection.

``LSTMemQueryLayer`` wraps a decoder layer's query projection and owns that layer's
:class:`~lstmem_peft.memory.layer.LSTMemLayer` per adapter (``lstmem_memory[adapter]``). When a memory pass
is open (see :mod:`lstmem_peft.tuner.context`), it runs the memory on the projection's input (the
attention input, after the layer's input norm), adds ``Δq`` to the projection's output (before any
q-norm and RoPE, which the backbone applies next) and leaves ``Δo`` with the pass. The matching
``LSTMemOutputLayer`` adds that ``Δo`` to the output projection's output. Outside a memory pass, or
with adapters disabled, both are the plain base layers. In an inference graph that ``torch.compile``
captures, each wrapper calls one opaque operation (``lstmem::query_correction`` /
``lstmem::output_correction``) that does the same, so the graph does not break per layer; inside
:func:`~lstmem_peft.tuner.context.traceable_memory` the compiler traces the memory itself.
"""

from __future__ import annotations

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from lstmem_peft.memory.spec import memory_layer

from . import context
from .attention import QueryColumns, projection_shape
from .quant import dense_weight

# the slot's getter, bound once: the wrappers ask it in every projection call
_active = context.ACTIVE.get


# ---------------------------------------------------------------------- compiled graphs
# torch.compile cannot trace the context variable that carries the memory pass (outside
# traceable_memory()), so in a graph it captures (inference: no gradients) each wrapper calls one
# opaque operation instead: the memory of its decoder layer runs inside it, eagerly, against this
# thread's pass, exactly as in eager mode. Outside a pass (adapters disabled, plain forwards) the
# correction is zeros.
def _current_pass():
    active = _active()
    return None if active is None else active.model_pass


@torch.library.custom_op("lstmem::query_correction", mutates_args=())
def _query_correction(x: torch.Tensor, layer_idx: int, width: int) -> torch.Tensor:
    """``Δq`` ``(B, T, width)`` of decoder layer ``layer_idx``: runs its memory in the open pass."""
    model_pass = _current_pass()
    out = None if model_pass is None else model_pass.query(layer_idx, x)
    if out is None:
        return x.new_zeros(*x.shape[:-1], width)
    return out.correction(0, x.dtype).reshape(*x.shape[:-1], width).contiguous()


@torch.library.custom_op("lstmem::output_correction", mutates_args=())
def _output_correction(x: torch.Tensor, layer_idx: int, width: int) -> torch.Tensor:
    """``Δo`` ``(B, T, width)`` of decoder layer ``layer_idx``, left in the pass by its query wrapper."""
    model_pass = _current_pass()
    out = None if model_pass is None else model_pass.output(layer_idx)
    if out is None:
        return x.new_zeros(*x.shape[:-1], width)
    return out.correction(1, x.dtype).reshape(*x.shape[:-1], width).contiguous()


def _correction_shape(x: torch.Tensor, layer_idx: int, width: int) -> torch.Tensor:
    """What both operations return, for tracing: ``(B, T, width)`` in ``x``'s dtype."""
    return x.new_empty(*x.shape[:-1], width)


_query_correction.register_fake(_correction_shape)
_output_correction.register_fake(_correction_shape)


def _in_captured_graph() -> bool:
    """Inside a graph torch.compile captures for inference (training keeps the eager wrappers,
    whose memory has gradients), unless :func:`~lstmem_peft.tuner.context.traceable_memory` lets
    the compiler trace the memory itself."""
    return torch.compiler.is_compiling() and not torch.is_grad_enabled() and not context.ACTIVE.shared


class LSTMemTunerLayer(BaseTunerLayer):
    """Common base of the two LSTMem wrappers (PEFT finds both through it)."""

    def merge(self, *args, **kwargs) -> None:
        raise NotImplementedError(
            "an LSTMem adapter cannot be merged: its contribution depends on a memory state that changes "
            "with every token, not on fixed weights; use model.unload() to get the base model back"
        )

    def unmerge(self) -> None:
        """Nothing to undo: LSTMem never merges."""

    @property
    def in_features(self) -> int:
        """Input width of the wrapped projection."""
        return projection_shape(self.get_base_layer())[1]

    @property
    def out_features(self) -> int:
        """Output width of the wrapped projection."""
        return projection_shape(self.get_base_layer())[0]


class LSTMemQueryLayer(nn.Module, LSTMemTunerLayer):
    """Query projection with LSTMem memory. ``forward(x)``: ``(B, T, d) -> (B, T, n)``, where ``n`` is
    ``d_q`` for a projection that computes the query alone, or wider for a fused query/key/value
    projection, whose query features ``query_columns`` locates (:mod:`~lstmem_peft.tuner.attention`):
    ``Δq`` ``(B, T, d_q)`` is added to those only."""

    adapter_layer_names = ("lstmem_memory",)
    # per-adapter facts written at injection (PEFT deletes an adapter's entry with its layers)
    other_param_names = ("lstmem_config", "lstmem_depth")

    def __init__(
        self, base_layer: nn.Module, layer_idx: int, query_columns: QueryColumns | None = None
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.layer_idx = layer_idx
        self.query_columns = query_columns or QueryColumns.whole(projection_shape(base_layer)[0])
        self.lstmem_memory = nn.ModuleDict()
        self.lstmem_config: dict[str, object] = {}  # adapter -> its LSTMemConfig
        self.lstmem_depth: dict[str, int] = {}  # adapter -> depth index among its memory layers
        self._disable_adapters = False
        self.merged_adapters = []
        self.kwargs = {}

    def update_layer(self, adapter_name: str, config, output_weight: torch.Tensor) -> None:
        """Create the memory of ``adapter_name`` and initialise ``W_dq``/``W_do`` from the backbone.

        Sizes and the correction init come from the dense weights (:func:`~lstmem_peft.tuner.quant.dense_weight`:
        a quantised projection is dequantised, never sliced). The memory is created on the
        projection's device, in its dtype when that is a floating dtype (else float32); PEFT then
        casts float16/bfloat16 adapters to float32 unless ``autocast_adapter_dtype=False``.
        ``output_weight``: the ``(d, d_q)`` dense weight of the output projection.
        """
        base = self.get_base_layer()
        weight = self.query_columns.query_rows(dense_weight(base))  # (d_q, d) float32
        stored = getattr(base, "weight", None)
        dtype = stored.dtype if stored is not None and stored.dtype.is_floating_point else torch.float32
        memory = memory_layer(
            config.memory_spec(),
            weight.shape[1],
            weight.shape[0],
            self.layer_idx,
            device=weight.device,
            dtype=dtype,
        )
        memory.init_corrections(weight, output_weight)
        self.lstmem_memory[adapter_name] = memory
        self.lstmem_config[adapter_name] = config
        self.set_adapter(self.active_adapters)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """``base(x) + Δq``: the memory of this decoder layer runs in the open memory pass (reads,
        then writes) and its ``Δq`` is added; outside a pass, or disabled, ``base(x)``."""
        base = self._modules["base_layer"]
        columns = self.query_columns
        if _in_captured_graph():
            delta = _query_correction(x, self.layer_idx, columns.query_size)
            return columns.add(base(x, *args, **kwargs), delta)
        model_pass = None if self._disable_adapters else _current_pass()
        out = None if model_pass is None else model_pass.query(self.layer_idx, x)
        result = base(x, *args, **kwargs)
        if out is None:
            return result
        if columns.fused:
            return columns.add(result, out.correction(0, result.dtype))
        return out.add_to(result, 0)

    def __repr__(self) -> str:
        return "lstmem." + super().__repr__()


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
        """``base(x) + Δo``, the ``Δo`` its decoder layer's memory left in the open pass."""
        base = self._modules["base_layer"]
        if _in_captured_graph():
            width = projection_shape(base)[0]
            return base(x, *args, **kwargs) + _output_correction(x, self.layer_idx, width)
        model_pass = None if self._disable_adapters else _current_pass()
        out = None if model_pass is None else model_pass.output(self.layer_idx)
        result = base(x, *args, **kwargs)
        return result if out is None else out.add_to(result, 1)

    def __repr__(self) -> str:
        return "lstmem." + super().__repr__()
