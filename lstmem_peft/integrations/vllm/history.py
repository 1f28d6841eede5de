"""History requests on vLLM: the block geometry that the scheduler, the worker and the memory layers share.

A history request (``extra_args["lstmem_history"] = True``) has its prompt written into memory the
way :func:`lstmem_peft.write_history` writes a history: in blocks of the adapter's ``block_size``
tokens (the last one may be shorter), every token reading and then writing memory, and block-end
feedback (:func:`lstmem_peft.memory.feedback.block_feedback`) after every block, the last included.
Block ``b`` is the prompt's positions ``[b * block_size, min((b + 1) * block_size, prompt_len))``.

vLLM runs a prompt in chunks (chunked prefill); a chunk of a history request never runs past the
end of its block (:class:`~lstmem_peft.integrations.vllm.scheduler.LSTMemScheduler` caps it with
:func:`cap_history_chunk`), so a block's end is always a chunk's end, where feedback can run before
the next block's first token. The feedback positions ``I_b`` of a block depend only on its length
(:func:`~lstmem_peft.memory.feedback.sample_feedback_positions` over a block with no padding), so
each chunk knows which of its tokens are samples (:func:`plan_chunk`).

No vLLM import: this module's rules are tested on their own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lstmem_peft.memory.feedback import sample_feedback_positions


def block_end(num_computed: int, prompt_len: int, block_size: int) -> int:
    """The prompt position where the block holding position ``num_computed`` ends (exclusive)."""
    return min((num_computed // block_size + 1) * block_size, prompt_len)


def cap_history_chunk(num_computed: int, num_new: int, prompt_len: int, block_size: int) -> int:
    """The length of a history request's next chunk: ``num_new`` (what vLLM's scheduler chose), cut
    at the end of the current block. Chunks past the prompt (generated tokens) are not cut."""
    if num_computed >= prompt_len or num_new <= 0:
        return num_new
    return min(num_new, block_end(num_computed, prompt_len, block_size) - num_computed)


@functools.lru_cache(maxsize=256)
def _block_samples(length: int, num_positions: int) -> tuple[int, ...]:
    positions, mask = sample_feedback_positions(torch.ones(1, length, dtype=torch.bool), num_positions)
    return tuple(positions[0][mask[0]].tolist())


def block_samples(length: int, num_positions: int) -> tuple[int, ...]:
    """The feedback positions ``I_b`` (offsets within the block, increasing) of a block of ``length``
    tokens without padding: the library's :func:`~lstmem_peft.memory.feedback.sample_feedback_positions`."""
    return _block_samples(int(length), int(num_positions))


@dataclass(frozen=True)
class ChunkPlan:
    """What a history request's chunk does for block-end feedback.

    Attributes:
        length: the chunk's tokens.
        first: the chunk starts a block (the block's samples start empty).
        ends_block: the chunk's last token is its block's last: feedback runs after this chunk.
        slots: indices into the block's sample set ``I_b`` of the samples inside this chunk.
        rows: their offsets within the chunk (same order as ``slots``).
        num_samples: ``|I_b|`` of the chunk's block.
    """

    length: int
    first: bool
    ends_block: bool
    slots: tuple[int, ...]
    rows: tuple[int, ...]
    num_samples: int


def plan_chunk(start: int, length: int, prompt_len: int, block_size: int, num_positions: int) -> ChunkPlan:
    """The :class:`ChunkPlan` of the chunk ``[start, start + length)`` of a prompt of ``prompt_len``
    tokens written in blocks of ``block_size``, with ``|I_b| <= num_positions``.

    Raises:
        ValueError: the chunk is empty, runs past the prompt, or crosses a block end (the scheduler
            did not cap it: the engine was not started with the plugin's scheduler).
    """
    end = start + length
    if length < 1 or start < 0 or end > prompt_len:
        raise ValueError(f"chunk [{start}, {end}) is not inside a prompt of {prompt_len} tokens")
    first_position = start // block_size * block_size
    last_position = block_end(start, prompt_len, block_size)
    if end > last_position:
        raise ValueError(
            f"chunk [{start}, {end}) crosses the history block end {last_position} (block_size {block_size}): "
            "history requests need the plugin's scheduler, lstmem_peft.integrations.vllm.scheduler.LSTMemScheduler"
        )
    samples = block_samples(last_position - first_position, num_positions)
    inside = [
        (j, p + first_position - start) for j, p in enumerate(samples) if start <= p + first_position < end
    ]
    return ChunkPlan(
        length=length,
        first=start == first_position,
        ends_block=end == last_position,
        slots=tuple(j for j, _ in inside),
        rows=tuple(t for _, t in inside),
        num_samples=len(samples),
    )
