"""Training an LSTMem adapter with TRL: episode collator, config and trainer (paper App. C.4).

One training episode:

1. starts from zero memory (a fresh :class:`~lstmem_peft.memory.cache.MemoryCache`);
2. writes the history into memory in blocks with block-end feedback: with gradients through writing
   and feedback (stage 1, histories capped at 8,192 tokens) or without gradients, states detached
   between blocks (stage 2, histories up to 131,072 tokens);
3. predicts the final assistant turn with writing and feedback disabled and without the historical
   KV cache, from a read sequence of at most 512 tokens, whose prompt is dropped (all but its last
   token) with probability 0.2 ("context dropout");
4. the loss is the mean cross-entropy over answer tokens. Only the adapter trains.

Several processes (``torchrun``, ``accelerate launch``) train data-parallel: DDP, DeepSpeed ZeRO-2
(on GPUs, or on CPUs through DeepSpeed's CPU accelerator over gloo, which the config sets up itself)
and, for stage 2, FSDP2 on the frozen backbone (:func:`shard_backbone`). Launches that would train
wrongly without an error (each process alone, gradients never averaged, a sharding plugin that
does nothing) are refused when the trainer is built, each with its fix
(:func:`check_distributed_setup`).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import random
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from lstmem_peft.memory import constants as K
from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.tuner.history import find_memory, write_history
from lstmem_peft.utils.extras import missing_extra

from .card import record_training, write_model_card
from .data import left_pad

try:
    from trl import SFTConfig, SFTTrainer
except ModuleNotFoundError as err:
    raise missing_extra(err, "train", "LSTMem training (lstmem_peft.training.trainer)") from err
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from transformers import Trainer

HISTORY_MODES = ("stage1", "stage2")
#: The accelerator whose DeepSpeed engine last trained a model (see LSTMemTrainer.train).
_DEEPSPEED_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Environment variables that launchers set to the number of processes they started.
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


# ---------------------------------------------------------------------- multi-process launches
def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() in ("1", "true", "yes")


def launched_world_size(environ: Mapping[str, str] | None = None) -> int:
    """How many processes the launcher started (``torchrun``, ``accelerate launch``, ``deepspeed``,
    ``mpirun``), read from its environment variables; 1 without a launcher."""
    environ = os.environ if environ is None else environ
    for name in WORLD_SIZE_VARIABLES:
        if environ.get(name):
            return int(environ[name])
    return 1


def _has_accelerator_device() -> bool:
    """Whether torch sees a device other than the CPU (CUDA, XPU, MPS, ...)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def check_distributed_setup(
    args: LSTMemTrainingConfig, accelerator, environ: Mapping[str, str] | None = None
) -> None:
    """Refuse the launches that train wrongly without any error, each with its fix.

    Checked against what the launcher asked for (``environ``, default ``os.environ``; ``args.fsdp``)
    and what accelerate set up (``accelerator.num_processes`` and ``accelerator.distributed_type``):

    - ``accelerate launch --cpu`` (or ``use_cpu: true``) with several processes: accelerate's simple
      launcher starts one process;
    - accelerate's FSDP plugin (``distributed_type: FSDP``, TrainingArguments ``fsdp``): on CPU it
      shards nothing and each process trains alone; on GPUs it would shard the LSTMem parameters
      with their decoder layers, while memory writing and block-end feedback use them outside the
      layer's forward (sharded that way on CPU, training crashes);
    - a process that trains alone although the launcher started several (no backend on a CPU-only
      machine without ``use_cpu=True``);
    - several processes whose gradients are never averaged (a process group without DDP/DeepSpeed).

    Raises:
        RuntimeError: naming what went wrong and the fix.
    """
    environ = os.environ if environ is None else environ
    world = launched_world_size(environ)
    processes = accelerator.num_processes
    kind = accelerator.distributed_type
    if _flag(environ, "ACCELERATE_USE_CPU") and environ.get("MASTER_PORT") and world == 1:
        # accelerate's simple launcher sets MASTER_PORT only when asked for several processes
        raise RuntimeError(
            "`accelerate launch --cpu` (or `use_cpu: true` in its config) with several processes started "
            "only this one: accelerate's CPU launcher runs one process unless mpirun is set up. Launch "
            "with `torchrun --nproc_per_node N` and LSTMemTrainingConfig(use_cpu=True), or drop `--cpu` / "
            "`use_cpu` from an accelerate DeepSpeed config (examples/accelerate_zero2_cpu.yaml). (One "
            "process meant? Unset MASTER_PORT.)"
        )
    if args.fsdp or _flag(environ, "ACCELERATE_USE_FSDP"):
        where = "GPU" if _has_accelerator_device() else "CPU"
        raise RuntimeError(
            f"accelerate's FSDP plugin cannot train an LSTMem adapter here ({where}): on CPU it shards "
            "nothing and every process trains alone, without an error; on GPUs it shards the LSTMem "
            "parameters too, which memory writing and block-end feedback use outside their decoder "
            "layer's forward. Shard the frozen backbone with FSDP2 instead, under torchrun: "
            "lstmem_peft.training.trainer.shard_backbone(model) before building the trainer "
            "(history_mode='stage2'), or use DeepSpeed ZeRO-2 (examples/accelerate_zero2.yaml)"
        )
    if world > 1 and processes != world:
        raise RuntimeError(
            f"the launcher started {world} processes but this one trains as {processes} of {processes}: "
            "each process would train alone on the whole dataset. On a CPU-only machine pass "
            "LSTMemTrainingConfig(use_cpu=True) (gloo) under torchrun; with accelerate launch, use a config "
            "whose distributed_type is MULTI_GPU or DEEPSPEED"
        )
    if processes > 1 and kind == DistributedType.NO:
        raise RuntimeError(
            f"{processes} processes share a process group but accelerate set up no data parallelism "
            "(distributed_type NO): gradients would never be averaged and the processes would drift "
            "apart. On a CPU-only machine pass LSTMemTrainingConfig(use_cpu=True)"
        )


def _fsdp2_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        return None
    return FSDPModule


def fsdp2_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds modules sharded with FSDP2's ``fully_shard``."""
    kind = _fsdp2_module_type()
    return kind is not None and any(isinstance(m, kind) for m in model.modules())


def _adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if "lstmem_memory" in name}


def shard_backbone(model: torch.nn.Module, mesh=None, reshard_after_forward: bool = True) -> torch.nn.Module:
    """Shard the frozen backbone's weights across the processes with FSDP2; the adapter stays whole.

    Every decoder layer (the classes in the backbone's ``_no_split_modules``), then the whole model,
    becomes an FSDP2 unit (``torch.distributed.fsdp.fully_shard``): each process keeps ``1/N`` of
    every backbone weight and gathers a layer's weights for its forward and backward. The LSTMem
    parameters are left out (``ignored_params``): memory writing and block-end feedback use them
    outside their decoder layer's forward, where FSDP2 would have freed them. They stay whole on
    every process, and :class:`LSTMemTrainer` broadcasts them from rank 0 and averages their
    gradients over the processes, so the result equals one process with the same global batch.

    For ``history_mode="stage2"`` only (see :class:`LSTMemTrainer`). Call it under ``torchrun``
    once the process group exists, i.e. after creating the
    ``LSTMemTrainingConfig(use_cpu=True, ...)`` on CPU (gloo), or after
    ``torch.distributed.init_process_group``; then pass the model to the trainer::

        args = LSTMemTrainingConfig(output_dir="out", history_mode="stage2", use_cpu=True)
        model = shard_backbone(get_peft_model(base, LSTMemConfig()))
        LSTMemTrainer(model=model, args=args, ...).train()

    Args:
        model: a model carrying an LSTMem adapter (``get_peft_model(base, LSTMemConfig())``).
        mesh: a 1-D ``DeviceMesh`` over the processes; default: all of them, on this process's
            device type (``"cpu"`` or ``"cuda"``).
        reshard_after_forward: FSDP2's option of the same name (free gathered weights after each
            layer's forward).

    Returns:
        ``model``, sharded in place.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard_backbone needs the process group: launch with torchrun and create the "
            "LSTMemTrainingConfig first (use_cpu=True on CPU), or call torch.distributed.init_process_group"
        )
    if "ignored_params" not in inspect.signature(fully_shard).parameters:
        raise RuntimeError("shard_backbone needs torch >= 2.7 (fully_shard's ignored_params)")
    find_memory(model)
    adapter = set(_adapter_parameters(model).values())
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in base.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(base).__name__} lists no decoder layer classes in _no_split_modules; "
            "apply torch.distributed.fsdp.fully_shard to its layers yourself, with the LSTMem "
            "parameters (names containing 'lstmem_memory') in ignored_params"
        )
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device = next(p.device for p in base.parameters()).type
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=adapter)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=adapter)
    return model


def _check_sharded_model(model: torch.nn.Module, args: LSTMemTrainingConfig) -> None:
    """Refuse FSDP2-sharded models that cannot train correctly (see :func:`shard_backbone`)."""
    from torch.distributed.tensor import DTensor

    sharded = [n for n, p in model.named_parameters() if p.requires_grad and isinstance(p, DTensor)]
    if sharded:
        raise ValueError(
            f"FSDP2 sharded trainable parameters ({sharded[0]}, ...): LSTMem's memory writing and block-end "
            "feedback use them outside their decoder layer's forward, where FSDP2 has freed them. Shard "
            "with lstmem_peft.training.trainer.shard_backbone(model), which leaves the adapter whole"
        )
    if args.history_mode == "stage1":
        raise ValueError(
            "history_mode='stage1' cannot train on an FSDP2-sharded backbone: its gradient flows back "
            "through the history blocks' forwards, which read decoder-layer weights that FSDP2 frees "
            "after the layer's first backward (the process crashes or reads freed memory). Train stage 1 "
            "with DeepSpeed ZeRO-2 or DDP (backbone replicated) and shard the backbone for stage 2, "
            "whose history is written without gradients"
        )
    if not hasattr(Trainer, "_sync_replicated_trainable_parameters"):
        raise RuntimeError(
            "this transformers version cannot train a model sharded before the Trainer (no "
            "Trainer._sync_replicated_trainable_parameters); install the version pinned in "
            ".ci/constraints.txt"
        )


@dataclass
class EpisodeCollator:
    """Pads tokenized episodes (see :func:`lstmem_peft.training.data.tokenize_episode`) into a batch.

    Returns::

        {"history_input_ids": (B, Th), "history_attention_mask": (B, Th),   # left-padded history
         "input_ids": (B, Ta), "attention_mask": (B, Ta), "labels": (B, Ta)}  # read sequence, -100 off-answer

    Args:
        pad_token_id: id used for padding.
        answer_max_tokens: read-sequence limit (512); the prompt is cut from the left to fit.
        context_dropout: probability of dropping the prompt (all but its last token).
        seed: seed of the dropout draws.
    """

    pad_token_id: int
    answer_max_tokens: int = K.ANSWER_READ_LIMIT
    context_dropout: float = K.CONTEXT_DROPOUT
    seed: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def read_sequence(self, input_ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
        """Apply context dropout and the read-sequence limit to one episode's final turn."""
        n_prompt = next((i for i, y in enumerate(labels) if y != -100), len(labels))
        if n_prompt > 1 and self._rng.random() < self.context_dropout:
            input_ids, labels = input_ids[n_prompt - 1 :], labels[n_prompt - 1 :]
        if len(input_ids) > self.answer_max_tokens:
            input_ids, labels = input_ids[-self.answer_max_tokens :], labels[-self.answer_max_tokens :]
        return input_ids, labels

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        history, history_mask = left_pad([list(f["history_input_ids"]) for f in features], self.pad_token_id)
        reads = [self.read_sequence(list(f["input_ids"]), list(f["labels"])) for f in features]
        input_ids, attention_mask = left_pad([r[0] for r in reads], self.pad_token_id)
        labels, _ = left_pad([r[1] for r in reads], -100)
        return {
            "history_input_ids": history,
            "history_attention_mask": history_mask,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
        }


@dataclass
class LSTMemTrainingConfig(SFTConfig):
    """TRL ``SFTConfig`` for LSTMem episodes. Only the fields below are new.

    Args:
        history_mode (`str`, *optional*, defaults to `"stage1"`):
            ``"stage1"``: gradients flow through memory writing and feedback (the paper's QASPER
            stage). ``"stage2"``: the history is written without gradients and the states are
            detached between blocks (the paper's Long-dataset stage).
        history_max_tokens (`int`, *optional*):
            History cap; defaults to 8,192 in stage 1 and 131,072 in stage 2. Applied by the
            episode tokenizer (:func:`~lstmem_peft.training.data.tokenize_episode`) and checked here.
        history_block_size (`int`, *optional*):
            Tokens per history block; defaults to the adapter's ``block_size`` (2,048).
        answer_max_tokens (`int`, *optional*, defaults to `512`):
            Read-sequence limit of the answer pass.
        context_dropout (`float`, *optional*, defaults to `0.2`):
            Probability of dropping the answer pass's prompt (all but its last token).

    Defaults that differ from ``SFTConfig``: gradient checkpointing off (``gradient_checkpointing=True``
    turns it on, exact in transformers' non-reentrant mode; it saves activation memory on long
    histories at about 1.3x the step time), ``remove_unused_columns=False`` and
    ``dataset_kwargs={"skip_prepare_dataset": True}`` (episode columns are kept and not re-tokenized),
    ``bf16`` on when a CUDA device supports it.
    """

    history_mode: str = field(
        default="stage1", metadata={"help": "'stage1' (gradients) or 'stage2' (no gradients)."}
    )
    history_max_tokens: int | None = field(
        default=None, metadata={"help": "History cap (8192 / 131072 by mode)."}
    )
    history_block_size: int | None = field(default=None, metadata={"help": "Tokens per history block."})
    answer_max_tokens: int = field(default=K.ANSWER_READ_LIMIT, metadata={"help": "Read-sequence limit."})
    context_dropout: float = field(
        default=K.CONTEXT_DROPOUT, metadata={"help": "Prompt dropout probability."}
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "Recompute decoder layers in backward to save activation memory on long histories: exact "
            "with LSTMem in non-reentrant mode (transformers' default); reentrant mode is refused."
        },
    )
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Episode columns must reach the collator."}
    )
    dataset_kwargs: dict[str, Any] | None = field(
        default_factory=lambda: {"skip_prepare_dataset": True},
        metadata={"help": "TRL dataset preparation options."},
    )
    bf16: bool | None = field(
        default=None, metadata={"help": "bf16 mixed precision; default: if CUDA supports it."}
    )

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        self._check_precision_beside_deepspeed()
        super().__post_init__()
        if self.history_mode not in HISTORY_MODES:
            raise ValueError(f"history_mode must be one of {HISTORY_MODES}, got {self.history_mode!r}")
        if self.history_max_tokens is None:
            self.history_max_tokens = (
                K.STAGE1_HISTORY_CAP if self.history_mode == "stage1" else K.STAGE2_HISTORY_CAP
            )
        if not 0.0 <= self.context_dropout < 1.0:
            raise ValueError(f"context_dropout must be in [0, 1), got {self.context_dropout}")
        if self.answer_max_tokens < 2:
            raise ValueError(f"answer_max_tokens must be at least 2, got {self.answer_max_tokens}")

    def _check_precision_beside_deepspeed(self) -> None:
        """Refuse a launcher precision that disagrees with a DeepSpeed config (before accelerate
        reads either): the DeepSpeed config decides, and ``"bf16": {"enabled": "auto"}`` follows
        this config's ``bf16``."""
        if "mixed_precision" in os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(","):
            raise ValueError(
                "the accelerate config sets `mixed_precision` beside `deepspeed_config_file`: remove that "
                'line; precision belongs to the DeepSpeed config (`"bf16": {"enabled": "auto"}` follows '
                "LSTMemTrainingConfig(bf16=...), as in examples/deepspeed_zero2.json)"
            )
        launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
        deepspeed = bool(self.deepspeed) or _flag(os.environ, "ACCELERATE_USE_DEEPSPEED")
        ours = "bf16" if self.bf16 else "fp16" if self.fp16 else "no"
        if deepspeed and launcher not in ("", "no") and launcher != ours:
            raise ValueError(
                f"`accelerate launch --mixed_precision {launcher}` disagrees with LSTMemTrainingConfig "
                f"(bf16={self.bf16}, fp16={self.fp16}) beside a DeepSpeed config: drop --mixed_precision and "
                "choose the precision once, with LSTMemTrainingConfig(bf16=...) and "
                '`"bf16": {"enabled": "auto"}` in the DeepSpeed config'
            )

    @cached_property
    def _setup_devices(self) -> torch.device:
        """transformers' device setup, plus the process group DeepSpeed needs on a CPU-only machine.

        Under a launcher, DeepSpeed's CPU accelerator initialises the process group itself (gloo
        when oneCCL is absent), but accelerate finds no backend for a non-CPU run without a GPU and
        records one process: every rank would train alone (ZeRO's batch check aside). The state is
        rebuilt with the group's own backend, as ``Accelerator(kwargs_handlers=[
        InitProcessGroupKwargs(backend="gloo")])`` would do, so users need not pass it.
        """
        device = super()._setup_devices
        state = self.distributed_state
        if (
            launched_world_size() > 1
            and state is not None
            and state.distributed_type == DistributedType.DEEPSPEED
            and state.backend is None
            and device.type == "cpu"
        ):
            import torch.distributed as dist

            backend = dist.get_backend() if dist.is_initialized() else "gloo"
            previous = os.environ.get("ACCELERATE_USE_DEEPSPEED")
            os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # as transformers sets it for its own setup
            try:
                AcceleratorState._reset_state(reset_partial_state=True)
                self.distributed_state = PartialState(
                    backend=backend, timeout=timedelta(seconds=self.ddp_timeout)
                )
            finally:
                if previous is None:
                    del os.environ["ACCELERATE_USE_DEEPSPEED"]
                else:
                    os.environ["ACCELERATE_USE_DEEPSPEED"] = previous
        return device


class LSTMemTrainer(SFTTrainer):
    """TRL ``SFTTrainer`` that trains an LSTMem adapter on episodes (see the module docstring).

    Example::

        trainer = LSTMemTrainer(
            model=peft_model,                                  # get_peft_model(base, LSTMemConfig())
            args=LSTMemTrainingConfig(output_dir="out", learning_rate=2e-4),
            train_dataset=Dataset.from_list([tokenize_episode(tok, e) for e in episodes]),
            processing_class=tok,
        )
        trainer.train()
    """

    _tag_names = ["trl", "lstmem", "memory"]
    _name = "LSTMem"
    _paper = {"title": K.PAPER_TITLE, "id": None, "citation": K.PAPER_BIBTEX}

    def __init__(
        self,
        model,
        args: LSTMemTrainingConfig | None = None,
        data_collator=None,
        processing_class=None,
        **kwargs,
    ):
        if args is None:
            args = LSTMemTrainingConfig(output_dir="lstmem-trainer")
        if not isinstance(args, LSTMemTrainingConfig):
            raise TypeError(
                "LSTMemTrainer needs an LSTMemTrainingConfig (TRL's SFTConfig plus the episode fields)"
            )
        if processing_class is None:
            raise ValueError("pass processing_class=<tokenizer>: LSTMemTrainer never downloads one")
        find_memory(model)  # fails early, with the fix, when the model has no LSTMem adapter
        sharded = fsdp2_sharded(model)
        if sharded:
            _check_sharded_model(model, args)
        if data_collator is None:
            pad = (
                processing_class.pad_token_id
                if processing_class.pad_token_id is not None
                else processing_class.eos_token_id
            )
            data_collator = EpisodeCollator(
                pad_token_id=pad,
                answer_max_tokens=args.answer_max_tokens,
                context_dropout=args.context_dropout,
                # one stream per process: with one seed, every process would drop the same batch slots
                seed=args.seed + args.process_index,
            )
        super().__init__(
            model=model, args=args, data_collator=data_collator, processing_class=processing_class, **kwargs
        )
        check_distributed_setup(args, self.accelerator)
        if sharded:
            # as for a model sharded at load time: no DDP around it; the replicated adapter is
            # broadcast from rank 0 and its gradients averaged (Trainer._sync_replicated_trainable_parameters)
            self.is_distributed_loading_by_transformers = True
        self.model_accepts_loss_kwargs = True  # compute_loss normalises by num_items_in_batch itself

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """``no_sync`` for a model sharded by :func:`shard_backbone` during gradient accumulation:
        FSDP2 waits for the last micro-batch (transformers' version reads a ``distributed_config``
        that only models sharded at load time have). Its units hold frozen weights only, and the
        adapter's gradients are averaged after the last micro-batch anyway."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def train(self, *args, **kwargs):
        """Train, then record the base model, data and schedule for the adapter's model card.

        Under DeepSpeed, an earlier trainer's engine still attached to the same model (a new trainer
        per stage, as in the paper's schedule) is destroyed first: its ZeRO gradient hooks stay on
        the parameters and would reduce every gradient a second time."""
        if self.is_deepspeed_enabled:
            previous = _DEEPSPEED_OWNERS.get(self.model)
            if previous is not None and previous is not self.accelerator:
                previous.free_memory()  # DeepSpeedEngine.destroy(): removes its gradient hooks
            _DEEPSPEED_OWNERS[self.model] = self.accelerator
        output = super().train(*args, **kwargs)
        base = getattr(getattr(self.model, "config", None), "_name_or_path", None) or None
        data = self.train_dataset
        record_training(
            self.model,
            base_model=base,
            training_data=getattr(getattr(data, "info", None), "dataset_name", None),
            episodes=len(data) if hasattr(data, "__len__") else None,
            history_mode=self.args.history_mode,
            history_max_tokens=self.args.history_max_tokens,
            updates=self.state.global_step,
            learning_rate=self.args.learning_rate,
            effective_batch=self.args.per_device_train_batch_size
            * self.args.gradient_accumulation_steps
            * self.accelerator.num_processes,
            seed=self.args.seed,
        )
        return output

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Save the adapter (every checkpoint and the final model) with its LSTMem model card."""
        super()._save(output_dir, state_dict=state_dict)
        self._write_card(output_dir or self.args.output_dir)

    def create_model_card(self, *args, **kwargs) -> None:
        """TRL's card for ``push_to_hub``, with the LSTMem section (settings, training, citation)."""
        super().create_model_card(*args, **kwargs)
        self._write_card(self.args.output_dir)

    def _write_card(self, output_dir: str) -> None:
        if self.args.should_save:
            write_model_card(self.accelerator.unwrap_model(self.model), output_dir)

    def write_episode_history(
        self, model, history_ids: torch.Tensor, history_mask: torch.Tensor
    ) -> MemoryCache:
        """Step 2 of an episode: a fresh memory with the history written into it."""
        if history_ids.shape[1] > self.args.history_max_tokens + 1:
            raise ValueError(
                f"history of {history_ids.shape[1]} tokens exceeds history_max_tokens={self.args.history_max_tokens}; "
                "truncate it when tokenizing (lstmem_peft.training.data.tokenize_episode)"
            )
        cache = MemoryCache()
        block = self.args.history_block_size
        if self.args.history_mode == "stage1":
            write_history(
                model, history_ids, cache, attention_mask=history_mask, block_size=block, progress=False
            )
            return cache
        block = block or find_memory(model).config().block_size
        with torch.no_grad():
            for start in range(0, history_ids.shape[1], block):
                write_history(
                    model,
                    history_ids[:, start : start + block],
                    cache,
                    attention_mask=history_mask[:, start : start + block],
                    block_size=block,
                    progress=False,
                )
                cache.detach_()
        return cache

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        cache = self.write_episode_history(
            model, inputs["history_input_ids"], inputs["history_attention_mask"]
        )
        outputs = model(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            memory_cache=cache,
            memory_write=False,
            use_cache=False,
        )
        logits = outputs.logits[:, :-1].float()
        targets = inputs["labels"][:, 1:]
        mask = targets != -100
        token_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten().clamp_min(0), reduction="none")
        token_loss = token_loss.view_as(targets) * mask
        count = mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = token_loss.sum() / torch.as_tensor(count, device=token_loss.device).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes
        mode = "train" if model.training else "eval"
        with torch.no_grad():
            correct = ((logits.argmax(-1) == targets) & mask).sum()
            total = mask.sum()
            correct, total = self.accelerator.gather_for_metrics(
                torch.stack([correct, total]).view(1, 2)
            ).sum(0)
        self._metrics[mode]["answer_token_accuracy"].append((correct / total.clamp(min=1)).item())
        return (loss, outputs) if return_outputs else loss
