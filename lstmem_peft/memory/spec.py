"""What an adapter says about its memory stack, without PEFT: :class:`MemorySpec`, and
:func:`memory_layer`, the one way a memory layer is built from it.

A :class:`MemorySpec` holds the options of an LSTMem adapter that shape and run its memory: the
head width and count, the correction scale, the decoder layers that get memory and the projections
it sits on, depth coupling, block-end feedback and history blocks, the state dtype, the kernel
backend, and what names the adapter's memory (``memory_id``, ``base_model_name_or_path``). The PEFT
tuner's :class:`~lstmem_peft.tuner.config.LSTMemConfig` gives one
(:meth:`~lstmem_peft.tuner.config.LSTMemConfig.memory_spec`) and checks its options here; a
serving engine that loads an adapter without PEFT (the vLLM plugin, the server's facts) reads one
from the adapter's ``adapter_config.json``
(:func:`~lstmem_peft.memory.adapter_files.read_memory_spec`). Both build their memory layers with
:func:`memory_layer`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields

from . import constants as K
from .adapter_files import ADAPTER_CONFIG_NAME, adapter_file
from .cache import STATE_DTYPES
from .layer import LSTMemLayer

#: The kernel backends a memory layer may run (``lstmem_kernels``).
SCAN_BACKENDS = ("auto", "torch", "triton", "naive")


def check_memory_id(memory_id) -> None:
    """Refuse a ``memory_id`` that is neither ``None`` nor a non-empty string."""
    if memory_id is not None and (not isinstance(memory_id, str) or not memory_id):
        raise ValueError(f"memory_id must be a non-empty string (or unset), got {memory_id!r}")


@dataclass(frozen=True)
class MemorySpec:
    """The memory stack of an LSTMem adapter: the options of its ``adapter_config.json`` (or of an
    :class:`~lstmem_peft.tuner.config.LSTMemConfig`) that build and run its memory layers, checked
    when made (the errors name the option and the value).

    Attributes:
        r: width of a memory head; each state is ``r x r`` per head.
        num_heads: memory heads per layer (``n_h``).
        alpha: correction scale (``Δq = (alpha / r) W_dq u``).
        layers_to_transform: the decoder layers that get memory, sorted (a single index or a list is
            accepted); ``None``: all of them.
        target_modules: ``(query projection, output projection)`` module names, or ``None`` (not
            resolved yet: the tuner finds them in the backbone).
        depth_coupling: whether ``D_t`` of the memory layer below feeds each layer.
        block_feedback: whether block-end feedback runs after each history block.
        feedback_positions: bound on the sampled positions of a block's feedback.
        block_size: history block length.
        state_dtype: ``"float32"`` or ``"bfloat16"``.
        scan_backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"naive"``.
        memory_id: the identity of the adapter's memory (``None``: not recorded).
        base_model_name_or_path: the backbone the adapter was trained on, as recorded.
    """

    r: int = K.HEAD_DIM
    num_heads: int = K.NUM_HEADS
    alpha: float = K.ALPHA
    layers_to_transform: tuple[int, ...] | None = None
    target_modules: tuple[str, str] | None = None
    depth_coupling: bool = True
    block_feedback: bool = True
    feedback_positions: int = K.FEEDBACK_POSITIONS
    block_size: int = K.BLOCK_SIZE
    state_dtype: str = "float32"
    scan_backend: str = "auto"
    memory_id: str | None = None
    base_model_name_or_path: str | None = None

    def __post_init__(self) -> None:
        check_memory_id(self.memory_id)
        for name in ("r", "num_heads", "feedback_positions", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, (int, float))
            or not (math.isfinite(self.alpha) and self.alpha > 0)
        ):
            raise ValueError(f"alpha must be a positive finite number, got {self.alpha!r}")
        for name in ("depth_coupling", "block_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"{name} must be true or false (a JSON boolean), got {getattr(self, name)!r}; a string such as "
                    "'false' would count as true"
                )
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {sorted(STATE_DTYPES)}, got {self.state_dtype!r}")
        if self.scan_backend not in SCAN_BACKENDS:
            raise ValueError(
                f"scan_backend must be 'auto', 'torch', 'triton' or 'naive', got {self.scan_backend!r}"
            )
        object.__setattr__(self, "layers_to_transform", _checked_layers(self.layers_to_transform))
        if self.target_modules is not None:
            if isinstance(self.target_modules, str) or len(self.target_modules) != 2:
                raise ValueError(
                    "target_modules must be [query projection, output projection], e.g. ['q_proj', 'o_proj'], "
                    f"got {self.target_modules!r}"
                )
            object.__setattr__(self, "target_modules", tuple(self.target_modules))

    @classmethod
    def of_options(cls, options: dict) -> MemorySpec:
        """The spec of a mapping of options (an ``adapter_config.json``'s fields, an
        ``LSTMemConfig``'s): the fields this class has; every other key is left out."""
        return cls(**{f.name: options[f.name] for f in fields(cls) if f.name in options})

    @property
    def query_module(self) -> str:
        """The query projection's module name (the memory layers' weights are saved under it)."""
        if self.target_modules is None:
            raise ValueError("the adapter's target_modules are not set: it names no query projection")
        return self.target_modules[0]

    @property
    def output_module(self) -> str:
        if self.target_modules is None:
            raise ValueError("the adapter's target_modules are not set: it names no output projection")
        return self.target_modules[1]

    def carries_memory(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` gets a memory layer (all of them unless
        ``layers_to_transform`` names some)."""
        return self.layers_to_transform is None or layer_idx in self.layers_to_transform

    def memory_layer_indices(self, num_layers: int) -> list[int]:
        """The decoder layers of a ``num_layers``-layer model that get memory, in depth order; an
        index the model does not have is an error."""
        absent = sorted({i for i in self.layers_to_transform or () if i >= num_layers})
        if absent:
            raise ValueError(
                f"layers_to_transform names decoder layers {absent} that the model does not have "
                f"(it has {num_layers} layers)"
            )
        return [i for i in range(num_layers) if self.carries_memory(i)]

    def receives_depth(self, depth: int) -> bool:
        """Whether the memory layer at depth index ``depth`` (0: the lowest) gets a depth input
        ``D^(l-1)``: every one but the first, with depth coupling."""
        return self.depth_coupling and depth > 0


def _checked_layers(layers) -> tuple[int, ...] | None:
    """``layers_to_transform`` as sorted indices (a single index becomes one), or an error."""
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is None:
        return None
    if not isinstance(layers, (list, tuple)):
        raise ValueError(
            f"layers_to_transform must be None (all layers), a layer index or a list of them, got {layers!r}"
        )
    if not layers or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in layers):
        raise ValueError(
            f"layers_to_transform must be None (all layers) or non-negative layer indices, got {layers!r}"
        )
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers_to_transform has duplicates: {list(layers)}")
    return tuple(sorted(layers))


def read_memory_spec(adapter: str | os.PathLike) -> MemorySpec:
    """The :class:`MemorySpec` of the LSTMem adapter ``adapter`` (a local folder, a shipped adapter's
    short name, or a Hub id through the Hub cache: :func:`~.adapter_files.adapter_file`): the
    options of its ``adapter_config.json``, checked as
    :class:`~lstmem_peft.tuner.config.LSTMemConfig` checks them; its other fields are left out.

    Raises:
        FileNotFoundError: a local folder without ``adapter_config.json``.
        ValueError: the config of another kind of adapter (its ``peft_type``), or an option
            :class:`MemorySpec` refuses.
    """
    path = adapter_file(adapter, ADAPTER_CONFIG_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{os.fspath(adapter)} has no {ADAPTER_CONFIG_NAME}: it is not a saved adapter (save one with "
            "model.save_pretrained(folder), which writes its config and its weights)"
        )
    with open(path, encoding="utf-8") as file:
        options = json.load(file)
    peft_type = options.get("peft_type")
    if peft_type is not None and peft_type != "LSTMEM":
        raise ValueError(f"{path} is the config of a {peft_type} adapter, not of an LSTMem one")
    return MemorySpec.of_options(options)


def memory_layer(
    spec: MemorySpec, hidden_size: int, query_size: int, layer_idx: int, *, device=None, dtype=None
) -> LSTMemLayer:
    """The memory layer ``spec`` gives decoder layer ``layer_idx`` of a backbone with ``hidden_size``
    and ``query_size``: its heads, rank, scale and kernel backend (the paper's initialisation; the
    caller then sets the corrections from the backbone or loads the adapter's weights, and the depth
    input from ``spec.receives_depth``). The one definition the PEFT tuner, the vLLM plugin and the
    server's facts build their memory layers with."""
    memory = LSTMemLayer(
        hidden_size=hidden_size,
        query_size=query_size,
        num_heads=spec.num_heads,
        head_dim=spec.r,
        alpha=spec.alpha,
        layer_idx=layer_idx,
        device=device,
        dtype=dtype,
    )
    memory.backend = spec.scan_backend
    return memory
