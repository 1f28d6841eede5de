"""Training an LSTMem adapter with TRL: episode collator, config and trainer (paper App. C.4).

One training episode:

1. starts from zero memory (a fresh :class:`~lstmem_peft.memory.cache.MemoryCache`);
2. writes the history into memory in blocks with block-end feedback: with gradients through writing
   and feedback (stage 1, histories capped at 8,192 tokens) or without gradients, states detached
   between blocks (stage 2, histories up to 131,072 tokens);
3. predicts the final assistant turn with writing and feedback disabled and without the historical
   KV cache, from a read sequence of at most 512 tokens, whose prompt is dropped (all but its last
   token) with probability 0.2 ("context dropout");
4. a conversation episode (:func:`~lstmem_peft.training.data.tokenize_conversation`) goes on, turn
   by turn, as ``lstmem serve`` runs it: the turn's write calls (``write_history``, under the same
   mode as the history), then its read, memory read-only;
5. the loss is the mean cross-entropy over every answer token. Only the adapter trains.

Several processes (``torchrun``, ``accelerate launch``) train data-parallel: DDP, DeepSpeed ZeRO-2
(on GPUs, or on CPUs through DeepSpeed's CPU accelerator over gloo, which the config sets up itself)
and, for stage 2, FSDP2 on the frozen backbone (:func:`~.distributed.shard_backbone`). Launches that would train
wrongly without an error (each process alone, gradients never averaged, a sharding plugin that
does nothing) are refused when the trainer is built, each with its fix
(:func:`~.distributed.check_distributed_setup`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import weakref
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

from .distributed import (  # after TRL: a missing train extra is named before anything else fails
    _check_sharded_model,
    _flag,
    check_distributed_setup,
    fsdp2_sharded,
    launched_world_size,
)

HISTORY_MODES = ("stage1", "stage2")
#: The training argument that turns gradient (activation) checkpointing on: ``activation_checkpointing``
#: on transformers 5.24 and later, where ``gradient_checkpointing`` is its deprecated alias (removed in
#: transformers 6), else ``gradient_checkpointing``. ``LSTMemTrainingConfig(**{ACTIVATION_CHECKPOINTING:
#: True})`` turns it on without a deprecation warning on every supported transformers.
ACTIVATION_CHECKPOINTING = (
    "activation_checkpointing"
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(SFTConfig)}
    else "gradient_checkpointing"
)
CHECKPOINTING_HELP = (
    "Recompute decoder layers in backward to save activation memory on long histories: exact with LSTMem in "
    "non-reentrant mode (transformers' default); reentrant mode is refused."
)
#: The accelerator whose DeepSpeed engine last trained a model (see LSTMemTrainer.train).
_DEEPSPEED_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class EpisodeCollator:
    """Pads tokenized episodes (see :func:`lstmem_peft.training.data.tokenize_episode`) into a batch.

    Returns::

        {"history_input_ids": (B, Th), "history_attention_mask": (B, Th),   # left-padded history
         "input_ids": (B, Ta), "attention_mask": (B, Ta), "labels": (B, Ta)}  # read sequence, -100 off-answer

    and, for conversation episodes (:func:`~lstmem_peft.training.data.tokenize_conversation`),
    ``"turns"``: one entry per later turn, ``{"writes": [{"input_ids": (B, Tw), "attention_mask":
    (B, Tw)}, ...], "input_ids": (B, Tr), "attention_mask": (B, Tr), "labels": (B, Tr)}``.

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

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        history, history_mask = left_pad([list(f["history_input_ids"]) for f in features], self.pad_token_id)
        batch = {"history_input_ids": history, "history_attention_mask": history_mask}
        batch.update(self.pad_reads([(f["input_ids"], f["labels"]) for f in features]))
        turns = max(len(f.get("turn_input_ids") or ()) for f in features)
        if turns:
            batch["turns"] = [self.pad_turn(features, j) for j in range(turns)]
        return batch

    def pad_reads(self, reads: list[tuple[list[int], list[int]] | None]) -> dict[str, torch.Tensor]:
        """Reads (``None``: a row without one, padded to one token that carries no loss)."""
        done = [
            self.read_sequence(list(r[0]), list(r[1])) if r else ([self.pad_token_id], [-100]) for r in reads
        ]
        input_ids, attention_mask = left_pad([ids for ids, _ in done], self.pad_token_id)
        labels, _ = left_pad([y for _, y in done], -100)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def pad_turn(self, features: list[dict[str, Any]], j: int) -> dict[str, Any]:
        """Later turn ``j`` of a batch of conversation episodes: its write calls, aligned by their
        index (a row with fewer calls, or without turn ``j``, writes nothing there: an empty row,
        which ``write_history`` leaves untouched), and its read."""
        writes = [list(f["turn_writes"][j]) if j < len(f.get("turn_writes") or ()) else [] for f in features]
        calls = []
        for c in range(max(len(w) for w in writes)):
            ids, mask = left_pad([list(w[c]) if c < len(w) else [] for w in writes], self.pad_token_id)
            calls.append({"input_ids": ids, "attention_mask": mask})
        has = [j < len(f.get("turn_input_ids") or ()) for f in features]
        reads = [
            (f["turn_input_ids"][j], f["turn_labels"][j]) if h else None
            for f, h in zip(features, has, strict=True)
        ]
        return {"writes": calls, **self.pad_reads(reads)}


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

    Defaults that differ from ``SFTConfig``: gradient checkpointing off (``activation_checkpointing=True``
    turns it on, ``gradient_checkpointing=True`` before transformers 5.24, which deprecates that name;
    :data:`ACTIVATION_CHECKPOINTING` is the one this transformers reads. Exact in transformers'
    non-reentrant mode; it saves activation memory on long histories at about 1.3x the step time),
    ``remove_unused_columns=False`` and ``dataset_kwargs={"skip_prepare_dataset": True}`` (episode
    columns are kept and not re-tokenized), ``bf16`` on when a CUDA device supports it, and
    ``dataloader_pin_memory`` only with CUDA (pinning on a CPU-only machine does nothing but warn).
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
    if ACTIVATION_CHECKPOINTING == "activation_checkpointing":  # transformers 5.24 on
        activation_checkpointing: bool | None = field(
            default=None,
            metadata={
                "help": CHECKPOINTING_HELP + " Default: off.",
                "nargs": "?",
                "const": True,
            },
        )
        # TRL's default (True) would be a use of transformers' deprecated alias: unset, it follows the above
        gradient_checkpointing: bool | None = field(
            default=None,
            metadata={"help": "Deprecated alias of activation_checkpointing (transformers 5.24 on)."},
        )
    else:
        gradient_checkpointing: bool = field(default=False, metadata={"help": CHECKPOINTING_HELP})
    dataloader_pin_memory: bool | None = field(
        default=None,
        metadata={"help": "Pin the batches' host memory; default: when an accelerator (CUDA) is there."},
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
        if self.dataloader_pin_memory is None:  # pinning without an accelerator only warns
            self.dataloader_pin_memory = torch.cuda.is_available()
        unset = getattr(self, ACTIVATION_CHECKPOINTING) is None and self.gradient_checkpointing is None
        if ACTIVATION_CHECKPOINTING == "activation_checkpointing" and unset:
            self.activation_checkpointing = False  # off, by the current name: transformers warns of no alias
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
        """``no_sync`` for a model sharded by :func:`~.distributed.shard_backbone` during gradient accumulation:
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
        return self.write_tokens(model, history_ids, history_mask, MemoryCache())

    def write_tokens(self, model, ids: torch.Tensor, mask: torch.Tensor, cache: MemoryCache) -> MemoryCache:
        """One ``write_history`` call's worth of ``(B, T)`` tokens into ``cache``: with gradients in
        stage 1; in stage 2 without, block by block, states detached between blocks."""
        if ids.shape[1] == 0:
            return cache
        block = self.args.history_block_size
        if self.args.history_mode == "stage1":
            return write_history(model, ids, cache, attention_mask=mask, block_size=block, progress=False)
        block = block or find_memory(model).config().block_size
        with torch.no_grad():
            for start in range(0, ids.shape[1], block):
                write_history(
                    model,
                    ids[:, start : start + block],
                    cache,
                    attention_mask=mask[:, start : start + block],
                    block_size=block,
                    progress=False,
                )
                cache.detach_()
        return cache

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """transformers' batches and answer-token count, the count including the later turns'
        answers of conversation episodes (it counts ``labels`` only)."""
        batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
        if count is None or not any("turns" in b for b in batches):
            return batches, count
        more = sum(t["labels"][..., 1:].ne(-100).sum() for b in batches for t in b.get("turns", ()))
        more = torch.as_tensor(more, device=device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            more = self.accelerator.gather(more).sum()
        return batches, count + more.to(count.device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Mean cross-entropy over every answer token of the batch: the first read, then each later
        turn of conversation episodes after its writes (in the server's order)."""
        cache = self.write_episode_history(
            model, inputs["history_input_ids"], inputs["history_attention_mask"]
        )
        losses, correct, total = [], 0, 0
        outputs = None
        for n, read in enumerate([inputs, *inputs.get("turns", ())]):
            for call in read["writes"] if n else ():
                self.write_tokens(model, call["input_ids"], call["attention_mask"], cache)
            mask = read["attention_mask"]
            outputs = model(
                input_ids=read["input_ids"],
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1).clamp_min(0),  # as generate() counts them
                memory_cache=cache,
                memory_write=False,
                use_cache=False,
            )
            logits = outputs.logits[:, :-1].float()
            targets = read["labels"][:, 1:]
            answer = targets != -100
            token_loss = F.cross_entropy(
                logits.flatten(0, 1), targets.flatten().clamp_min(0), reduction="none"
            )
            losses.append((token_loss.view_as(targets) * answer).sum())
            with torch.no_grad():
                correct = correct + ((logits.argmax(-1) == targets) & answer).sum()
                total = total + answer.sum()
        count = total if num_items_in_batch is None else num_items_in_batch
        loss = torch.stack(losses).sum() / torch.as_tensor(count, device=losses[0].device).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes
        mode = "train" if model.training else "eval"
        with torch.no_grad():
            correct, total = self.accelerator.gather_for_metrics(
                torch.stack([correct, total]).view(1, 2)
            ).sum(0)
        self._metrics[mode]["answer_token_accuracy"].append((correct / total.clamp(min=1)).item())
        return (loss, outputs) if return_outputs else loss
