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
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
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

HISTORY_MODES = ("stage1", "stage2")


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
                seed=args.seed,
            )
        super().__init__(
            model=model, args=args, data_collator=data_collator, processing_class=processing_class, **kwargs
        )
        self.model_accepts_loss_kwargs = True  # compute_loss normalises by num_items_in_batch itself

    def train(self, *args, **kwargs):
        """Train, then record the base model, data and schedule for the adapter's model card."""
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
