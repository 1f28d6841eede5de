"""Writing a history into memory in blocks, and finding a model's memory layers."""

from __future__ import annotations

import inspect

import torch
from torch import nn
from tqdm.auto import tqdm

from lstmem_peft.memory.cache import MemoryCache, MemoryLayout
from lstmem_peft.memory.layer import LSTMemLayer

from .context import closing_interrupted_passes, run_memory_only
from .hooks import MemoryHooks, check_token_ids
from .kv_argument import kv_kwargs
from .model import LSTMemModel


def find_memory(model: nn.Module) -> MemoryHooks:
    """The :class:`~lstmem_peft.tuner.hooks.MemoryHooks` of a model with LSTMem layers: a ``PeftModel``,
    the tuner, a backbone the adapter was injected into (``inject_adapter_in_model``, transformers'
    ``load_adapter``), or any of them inside a DDP/accelerate wrapper."""
    seen = model
    while (
        hasattr(seen, "module") and isinstance(seen.module, nn.Module) and not isinstance(seen, LSTMemModel)
    ):
        seen = seen.module  # DistributedDataParallel and similar wrappers
    base = getattr(seen, "base_model", None)
    if isinstance(base, LSTMemModel):
        seen = base
    if isinstance(seen, LSTMemModel):
        seen = seen.model
    hooks = MemoryHooks.of(seen) if isinstance(seen, nn.Module) else None
    if hooks is None:
        raise TypeError(
            f"{type(model).__name__} carries no LSTMem adapter; wrap the model first with "
            "peft.get_peft_model(model, LSTMemConfig(...)) or PeftModel.from_pretrained(model, path)"
        )
    return hooks


def memory_layers(model: nn.Module) -> list[LSTMemLayer]:
    """The active adapter's memory layers in depth order.

    Each has ``.layer_idx`` (its decoder layer) and ``paper_parameters()``.
    """
    return find_memory(model).memory_layers()


def memory_layout(model: nn.Module) -> MemoryLayout:
    """The :class:`MemoryLayout` a :class:`MemoryCache` for this model must have (e.g. to load one)."""
    return find_memory(model).memory_layout()


def generate(
    model: nn.Module,
    *args,
    memory_cache: MemoryCache | None = None,
    memory_write: bool | None = None,
    **kwargs,
):
    """``model.generate(*args, memory_cache=..., **kwargs)`` for any model with LSTMem layers.

    ``PeftModel.generate`` already takes ``memory_cache``. A backbone that received the adapter
    through transformers' ``load_adapter`` or ``inject_adapter_in_model`` keeps transformers' own
    ``generate``, which refuses unknown keyword arguments; call this function for it instead (it is
    the same exact, transactional generation; see :mod:`lstmem_peft.tuner.generation`).
    """
    return find_memory(model).generate(*args, memory_cache=memory_cache, memory_write=memory_write, **kwargs)


def _accepts(module: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


# 50 lines of code under a 30-line docstring: the argument checks, then one loop over the blocks.
@closing_interrupted_passes()  # an interrupt inside a block's forward leaves no memory pass open
def write_history(
    model: nn.Module,
    input_ids: torch.Tensor,
    memory_cache: MemoryCache,
    attention_mask: torch.Tensor | None = None,
    block_size: int | None = None,
    past_key_values=None,
    progress: bool | None = None,
    *,
    cache=None,
) -> MemoryCache:
    """Write a history into memory block by block, with block-end feedback after every block.

    Every token reads and then writes memory; after each block (the last included) feedback corrects
    the carried states (unless the adapter's ``block_feedback`` is off). Runs under the caller's
    grad mode: with gradients the whole history stays in the graph (the paper's stage 1); wrap it in
    ``torch.no_grad()`` and ``memory_cache.detach_()`` between calls for stage 2.

    Args:
        model: a model carrying an LSTMem adapter.
        input_ids: ``(B, T)`` history tokens (left padding allowed).
        memory_cache: the sessions' memory; written in place.
        attention_mask: ``(B, T)`` (or ``(B, P + T)`` when ``past_key_values`` already holds ``P``
            tokens), 1 for tokens, 0 for padding; ``None`` for no padding.
        block_size: tokens per block; defaults to the adapter's ``block_size`` (2048).
        past_key_values: a transformers cache to fill with the history too (the paper's evaluation
            protocol keeps the history in the KV cache); blocks then attend to earlier blocks. Without
            it each block is an independent forward (positions restart at 0), peak memory does not
            grow with the history length, and, without gradients, each block's forward stops after
            the topmost memory layer (the layers above it and the head cannot change memory;
            ``memory_only=True``), except on backbones whose wrappers work after each module's
            forward (accelerate's ``device_map`` offload, FSDP, DeepSpeed ZeRO-3), which run whole.
        progress: show a progress bar; default: when there is more than one block.
        cache: the KV cache under transformers' newer name (5.24 and later): the same as
            ``past_key_values`` (pass one of them).

    Returns:
        ``memory_cache``.
    """
    hooks = find_memory(model)
    config = hooks.config()
    block = config.block_size if block_size is None else block_size
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block_size must be a positive integer (or None for the adapter's), got {block!r}")
    check_token_ids(input_ids)
    if not isinstance(memory_cache, MemoryCache):
        raise TypeError(f"memory_cache must be a MemoryCache, got {type(memory_cache).__name__}")
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("pass the KV cache once: cache= or past_key_values=, not two caches")
    past_key_values = cache if cache is not None else past_key_values
    B, T = input_ids.shape
    past = 0 if past_key_values is None else past_key_values.get_seq_length()
    full_mask = _full_mask(attention_mask, B, T, past, input_ids.device)
    extra = {"logits_to_keep": 1} if _accepts(hooks.model, "logits_to_keep") else {}
    forward = model
    if past_key_values is None and not torch.is_grad_enabled() and not _runs_whole(model):
        # no KV cache to fill and no gradient: skip everything above the topmost memory layer
        def forward(**kwargs):
            run_memory_only(model, **kwargs)

    valid = full_mask[:, past:].bool()
    if not bool(valid.all()):  # padding: every row is cut into blocks of its own tokens
        if past_key_values is None:
            _write_row_blocks(forward, model, input_ids, valid, memory_cache, block, extra, show=progress)
            return memory_cache
        _refuse_ragged_rows_with_kv(valid)
    positions = (full_mask.cumsum(dim=1) - 1).clamp_min(0)
    starts = range(0, T, block)
    show = len(starts) > 1 if progress is None else progress
    for start in tqdm(starts, desc="writing history", unit="block", disable=not show):
        end = min(start + block, T)
        if past_key_values is not None:
            mask = full_mask[:, : past + end]
            pos = positions[:, past + start : past + end]
        else:
            mask = full_mask[:, past + start : past + end]
            pos = (mask.cumsum(dim=1) - 1).clamp_min(0)
        forward(
            input_ids=input_ids[:, start:end],
            attention_mask=mask,
            position_ids=pos,
            **kv_kwargs(model, past_key_values),
            use_cache=past_key_values is not None,
            memory_cache=memory_cache,
            memory_write=True,
            memory_feedback=True,
            **extra,
        )
    return memory_cache


def _full_mask(attention_mask, B: int, T: int, past: int, device) -> torch.Tensor:
    """The ``(B, past + T)`` long attention mask of a history whose KV cache holds ``past`` tokens,
    from the caller's mask of the history alone, of cache and history, or none."""
    if attention_mask is None:
        return torch.ones(B, past + T, dtype=torch.long, device=device)
    if attention_mask.shape == (B, past + T):
        return attention_mask.long()
    if attention_mask.shape == (B, T):
        return torch.cat([attention_mask.new_ones(B, past), attention_mask], dim=1).long()
    raise ValueError(
        f"attention_mask must have shape {(B, T)} (or {(B, past + T)} with the KV cache's {past} tokens), "
        f"got {tuple(attention_mask.shape)}"
    )


def _refuse_ragged_rows_with_kv(valid: torch.Tensor) -> None:
    """With a KV cache, padded rows must all start at one column and be contiguous: each row is cut
    into blocks of its own tokens, and one KV cache cannot hold blocks that end at different columns."""
    first = valid.long().argmax(dim=1)
    contiguous = valid.sum(dim=1) == valid.shape[1] - first
    if not (bool(contiguous.all()) and bool((first == first[0]).all())):
        raise ValueError(
            "write_history with past_key_values needs the rows' tokens to start at the same column: each "
            "row is cut into blocks of its own tokens, and one KV cache cannot hold blocks that end at "
            "different columns. Write each history with its own KV cache (batch size 1), or without "
            "past_key_values"
        )


def _runs_whole(model: nn.Module) -> bool:
    """Whether ``model``'s forwards must run to their end: accelerate's offload hooks, FSDP and
    DeepSpeed ZeRO-3 do work after each module's forward (offload, reshard) that a forward stopped
    after its topmost memory layer would skip."""
    for module in model.modules():
        name = type(module).__name__
        if hasattr(module, "_hf_hook") or "FullyShardedDataParallel" in name or name.startswith("FSDP"):
            return True
    return any(hasattr(p, "ds_id") for p in model.parameters())


def row_blocks(lengths: list[int], block: int) -> list[list[int]]:
    """The padded-batch rule of :func:`write_history` (without a KV cache): block ``k`` of every row is
    that row's own tokens ``[k * block, (k + 1) * block)``, and block ``k``'s forward runs on the rows
    that have any. Returns the rows of each block's forward, in order (``lengths``: each row's token
    count)."""
    count = max((-(-n // block) for n in lengths), default=0)
    return [[b for b, n in enumerate(lengths) if n > k * block] for k in range(count)]


def _write_row_blocks(forward, model, input_ids, valid, memory_cache, block, extra, show) -> None:
    """``write_history`` for a padded batch without a KV cache: block ``k`` of every row is that
    row's tokens ``[k * block, (k + 1) * block)``, whatever padding the batch gave it, so each row's
    memory equals its history written alone. A block forward runs on the rows that still have
    tokens (the others keep their memory) and commits them all at once."""
    B = input_ids.shape[0]
    tokens = [input_ids[b][valid[b]] for b in range(B)]
    blocks = row_blocks([len(t) for t in tokens], block)
    memory_cache.bind(find_memory(model).memory_layout())  # all rows exist before sub-batches are cut
    memory_cache.ensure(B, input_ids.device)
    show = len(blocks) > 1 if show is None else show
    for k, rows in enumerate(tqdm(blocks, desc="writing history", unit="block", disable=not show)):
        pieces = [t[k * block : (k + 1) * block] for t in tokens]
        width = max(len(pieces[b]) for b in rows)
        ids = input_ids.new_zeros(len(rows), width)
        mask = torch.zeros_like(ids)
        for i, b in enumerate(rows):  # left-padded within the block
            ids[i, width - len(pieces[b]) :] = pieces[b]
            mask[i, width - len(pieces[b]) :] = 1
        index = torch.tensor(rows, device=input_ids.device)
        part = memory_cache.clone()
        if len(rows) < B:
            part.batch_select_indices(index)
        forward(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(dim=1) - 1).clamp_min(0),
            memory_cache=part,
            memory_write=True,
            memory_feedback=True,
            **extra,
        )
        memory_cache.update_rows(index, part)
