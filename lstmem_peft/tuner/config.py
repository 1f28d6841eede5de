"""``LSTMemConfig``: the adapter's configuration, a PEFT ``PeftConfig``."""

from __future__ import annotations

import enum
import os
import uuid
import warnings
from dataclasses import dataclass, field

from peft import PeftConfig
from peft.utils import SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME

from lstmem_peft.memory import constants as K
from lstmem_peft.memory.spec import MemorySpec, check_memory_id


class LSTMemPeftType(str, enum.Enum):
    """PEFT's ``PeftType`` is a closed enum; LSTMem registers its own member (name == value)."""

    LSTMEM = "LSTMEM"


@dataclass
class LSTMemConfig(PeftConfig):
    """Configuration of an LSTMem adapter.

    Args:
        r (`int`, *optional*, defaults to `8`):
            Width of a memory head (the paper's ``r``); each state is ``r x r`` per head.
        num_heads (`int`, *optional*, defaults to `4`):
            Memory heads per layer (``n_h``); ``d_s = num_heads * r``.
        alpha (`float`, *optional*, defaults to `16.0`):
            Correction scale: ``dq = (alpha / r) W_dq u``.
        layers_to_transform (`int` or `list[int]`, *optional*):
            Decoder layers that get memory; ``None`` means all. Any subset works (even, odd, first,
            middle, last); depth coupling links consecutive memory layers in this order.
        target_modules (`list[str]`, *optional*):
            ``[query projection, output projection]`` module names inside each attention block.
            By default they are found in the model's structure: ``q_proj``/``o_proj``,
            ``q_proj``/``out_proj``, ``q_proj``/``dense``, ``qkv_proj``/``o_proj``,
            ``query_key_value``/``dense`` or ``c_attn``/``c_proj``
            (:mod:`~lstmem_peft.tuner.attention`); set it for other names. A fused query/key/value
            projection gets ``Δq`` on its query features only, or is refused if its layout is unknown.
        depth_coupling (`bool`, *optional*, defaults to `True`):
            Feed ``D_t`` of the memory layer below into each layer. ``False`` is the paper's depth
            ablation (``D^(l-1) := 0`` in training and inference).
        block_feedback (`bool`, *optional*, defaults to `True`):
            Apply block-end feedback after each history block.
        feedback_positions (`int`, *optional*, defaults to `32`):
            Upper bound on the shared sampled positions ``|I_b|`` per block.
        block_size (`int`, *optional*, defaults to `2048`):
            History block length used by ``write_history``.
        state_dtype (`str`, *optional*, defaults to `"float32"`):
            ``"float32"`` or ``"bfloat16"`` (the paper's 36 KiB for Qwen3-4B) for the stored states.
        update_during_generation (`bool`, *optional*, defaults to `True`):
            Whether prompt and generated tokens write into memory during ``generate``; ``False``
            makes generation read-only.
        scan_backend (`str`, *optional*, defaults to `"auto"`):
            ``"auto"`` (Triton on CUDA, vectorised PyTorch otherwise), ``"torch"``, ``"triton"`` or
            ``"naive"``.
        memory_id (`str`, *optional*):
            Identity of this adapter's memory: a random id drawn when the config is created and saved
            with the adapter. Memory caches carry it, and an adapter with another id refuses them
            even when every shape matches. Leave it unset.
    """

    r: int = field(default=K.HEAD_DIM, metadata={"help": "Width r of a memory head."})
    num_heads: int = field(default=K.NUM_HEADS, metadata={"help": "Memory heads n_h per layer."})
    alpha: float = field(default=K.ALPHA, metadata={"help": "Correction scale alpha (dq = alpha/r W_dq u)."})
    layers_to_transform: int | list[int] | None = field(
        default=None, metadata={"help": "Decoder layer indices that get memory; None for all."}
    )
    target_modules: list[str] | str | None = field(
        default=None,
        metadata={"help": "[query projection, output projection] module names; found by structure if unset."},
    )
    depth_coupling: bool = field(
        default=True, metadata={"help": "Pass D_t of the layer below up (False: ablation)."}
    )
    block_feedback: bool = field(
        default=True, metadata={"help": "Apply block-end feedback after history blocks."}
    )
    feedback_positions: int = field(default=K.FEEDBACK_POSITIONS, metadata={"help": "Bound on |I_b|."})
    block_size: int = field(
        default=K.BLOCK_SIZE, metadata={"help": "History block length for write_history."}
    )
    state_dtype: str = field(default="float32", metadata={"help": "'float32' or 'bfloat16' memory states."})
    update_during_generation: bool = field(
        default=True, metadata={"help": "Write prompt and generated tokens into memory during generate."}
    )
    scan_backend: str = field(default="auto", metadata={"help": "'auto', 'torch', 'triton' or 'naive'."})
    memory_id: str | None = field(
        default=None,
        metadata={"help": "Identity of the adapter's memory (drawn at creation, saved with it)."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.memory_id is None:
            self.memory_id = uuid.uuid4().hex
        check_memory_id(self.memory_id)
        self.peft_type = LSTMemPeftType.LSTMEM
        if self.task_type is None:
            self.task_type = "CAUSAL_LM"
        if str(self.task_type) not in ("CAUSAL_LM", "TaskType.CAUSAL_LM"):
            raise ValueError(
                f"task_type must be 'CAUSAL_LM' (LSTMem adapts causal LMs), got {self.task_type!r}"
            )
        spec = self.memory_spec()  # checks the memory's options (memory/spec.py holds the rules)
        self.layers_to_transform = (
            None if spec.layers_to_transform is None else list(spec.layers_to_transform)
        )
        self.target_modules = None if spec.target_modules is None else list(spec.target_modules)
        if not isinstance(self.update_during_generation, bool):
            raise ValueError(
                f"update_during_generation must be true or false (a JSON boolean), got "
                f"{self.update_during_generation!r}; a string such as 'false' would count as true"
            )

    def memory_spec(self) -> MemorySpec:
        """The memory stack this config describes (:class:`~lstmem_peft.memory.spec.MemorySpec`): what
        builds and runs its memory layers, here and where the adapter is loaded without PEFT."""
        return MemorySpec.of_options(vars(self))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, subfolder: str | None = None, **kwargs):
        """Load the config from a folder or Hub repo (PEFT's ``PeftConfig.from_pretrained``).

        A config-only load works from a folder that holds ``adapter_config.json`` alone, with a
        warning that names the folder: a config alone builds a fresh adapter with ``get_peft_model``.
        PEFT's own loaders, which go on to read the adapter's weights, read its config through
        :class:`PeftLoaderConfig` instead, which refuses such a folder. The project's own loader
        (:func:`~lstmem_peft.tuner.loading.load_model_and_adapter`) refuses it too.
        """
        config = super().from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)
        folder = _adapter_folder(pretrained_model_name_or_path, subfolder)
        if os.path.isdir(folder) and not has_adapter_weights(folder):
            warnings.warn(missing_weights_message(folder), UserWarning, stacklevel=2)
        return config

    @property
    def query_module(self) -> str:
        return self.target_modules[0]

    @property
    def output_module(self) -> str:
        return self.target_modules[1]

    # ------------------------------------------------------------------ which layers get memory
    def carries_memory(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` gets a memory layer (:meth:`MemorySpec.carries_memory
        <lstmem_peft.memory.spec.MemorySpec.carries_memory>`)."""
        return self.memory_spec().carries_memory(layer_idx)

    def memory_layer_indices(self, num_layers: int) -> list[int]:
        """The decoder layers of a ``num_layers``-layer model that get memory, in depth order
        (:meth:`MemorySpec.memory_layer_indices <lstmem_peft.memory.spec.MemorySpec.memory_layer_indices>`)."""
        return self.memory_spec().memory_layer_indices(num_layers)

    def receives_depth(self, depth: int) -> bool:
        """Whether the memory layer at depth index ``depth`` gets a depth input
        (:meth:`MemorySpec.receives_depth <lstmem_peft.memory.spec.MemorySpec.receives_depth>`)."""
        return self.memory_spec().receives_depth(depth)


class PeftLoaderConfig(LSTMemConfig):
    """LSTMem's entry in PEFT's table of config classes (``peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING``):
    where PEFT's loaders read the config of an adapter whose weights they read next.

    ``PeftModel.from_pretrained`` (so ``AutoPeftModelForCausalLM.from_pretrained`` too),
    ``PeftModel.load_adapter`` and PEFT's other loaders look the config class up in that table by the
    saved ``peft_type`` and call its ``from_pretrained``; then they add the adapter and read its weights
    from the same place. A user reads a config with :meth:`LSTMemConfig.from_pretrained` or
    ``PeftConfig.from_pretrained``, neither of which comes here. So a read here is a load:

    - a local folder without weights is refused (``FileNotFoundError`` naming the missing file) before
      anything is added to the model; PEFT would take the folder for a Hub repo id and fail with an
      unrelated error;
    - the config is marked with where it was read from (:func:`expect_first_weights`), so that weights
      refused for another base model, rank or head count name that place and the adapter PEFT added
      for them is removed again (:meth:`LSTMemModel._refuse_weights_that_do_not_fit
      <lstmem_peft.tuner.model.LSTMemModel._refuse_weights_that_do_not_fit>`).

    PEFT also builds configs from saved fields through the table (``PeftConfig.from_pretrained``,
    ``get_peft_config``): calling this class builds a plain :class:`LSTMemConfig`, so every config a
    user meets is one; this class never has an instance.
    """

    def __new__(cls, *args, **kwargs) -> LSTMemConfig:
        return LSTMemConfig(*args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, subfolder: str | None = None, **kwargs):
        config = LSTMemConfig.from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)
        folder = _adapter_folder(pretrained_model_name_or_path, subfolder)
        require_adapter_weights(folder)
        expect_first_weights(config, folder)
        return config


def _adapter_folder(pretrained_model_name_or_path: str | os.PathLike, subfolder: str | None) -> str:
    """Where PEFT reads an adapter's files: the folder (or Hub repo id), joined with ``subfolder``."""
    folder = os.fspath(pretrained_model_name_or_path)
    return os.path.join(folder, subfolder) if subfolder else folder


#: The attribute that marks a config whose adapter is being loaded (not saved: no dataclass field).
_LOADING_FROM = "_loading_from"


def expect_first_weights(config: LSTMemConfig, source: str | os.PathLike) -> None:
    """Mark ``config``: the adapter built from it is a load in progress, and the next weights checked
    for it (:meth:`~lstmem_peft.tuner.model.LSTMemModel._refuse_weights_that_do_not_fit`) are its
    first, from ``source`` (a folder or Hub id; the adapter's name where the place is not known). A
    mark already there is kept."""
    if getattr(config, _LOADING_FROM, None) is None:
        setattr(config, _LOADING_FROM, os.fspath(source))


def take_first_weights_mark(config: LSTMemConfig) -> str | None:
    """Take the mark of :func:`expect_first_weights` off ``config``: the source it names, or ``None``
    when the weights are not the first of a load in progress (the user's own weights, for an adapter
    the user holds)."""
    return vars(config).pop(_LOADING_FROM, None)


def has_adapter_weights(folder: str | os.PathLike) -> bool:
    """Whether the local folder ``folder`` holds an adapter weights file (safetensors or ``.bin``)."""
    return any(
        os.path.isfile(os.path.join(folder, name)) for name in (SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME)
    )


def missing_weights_message(folder: str | os.PathLike) -> str:
    return (
        f"{os.fspath(folder)!r} has an adapter_config.json but no adapter weights: neither "
        f"{SAFETENSORS_WEIGHTS_NAME} nor {WEIGHTS_NAME} is in it, so no adapter can be loaded from it "
        "(PeftModel.from_pretrained, load_adapter). Save the adapter with model.save_pretrained(folder) (it "
        "writes both config and weights); a config alone builds a fresh adapter with get_peft_model."
    )


def require_adapter_weights(folder: str | os.PathLike) -> None:
    """Raise ``FileNotFoundError`` if the local folder ``folder`` has no adapter weights file.

    A name that is not a local folder (a Hub repo id) is left to PEFT's own download and errors.
    """
    if os.path.isdir(folder) and not has_adapter_weights(folder):
        raise FileNotFoundError(missing_weights_message(folder))
