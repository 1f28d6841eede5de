"""History blocks written over several forwards: which tokens of a chunk are feedback samples, and
the samples a block keeps until it ends.

The library's :class:`~lstmem_peft.memory.engine.MemoryPass` writes a history block in one forward
and samples it whole. A serving engine runs a prompt in chunks (chunked prefill), so one block may
span several forwards: each chunk is a row of some forward's pass over the engine's slot tables.
Block ``b`` of a prompt is its positions ``[b * block_size, min((b + 1) * block_size, prompt_len))``;
its feedback positions ``I_b`` depend only on its length
(:func:`~lstmem_peft.memory.feedback.sample_feedback_positions` over a block without padding), so
each chunk knows beforehand which of its tokens are samples (:func:`plan_chunk`, host arithmetic).
A chunk must not run past its block's end, so that feedback can run before the next block's first
token (the engine's scheduler cuts chunks there).

:class:`BlockSamples` keeps, per slot, every memory layer's keys and values at the samples of the
block seen so far, fills them chunk by chunk as the pass over the slot tables runs each layer
(``MemoryPass(..., samples=store, chunks=...)``), and at the chunk that ends the block hands each
layer's :class:`~lstmem_peft.memory.feedback.LayerTerminal` to a
:class:`~lstmem_peft.memory.feedback.BlockEnds`, which applies feedback after the forward's last
memory layer, exactly as for a block written in one forward.

Torch only.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .feedback import BlockEnds, layer_terminal, sample_feedback_positions


def block_end(start: int, prompt_len: int, block_size: int) -> int:
    """Where the block holding prompt position ``start`` ends (exclusive)."""
    return min((start // block_size + 1) * block_size, prompt_len)


@functools.lru_cache(maxsize=256)
def _block_samples(length: int, num_positions: int) -> tuple[int, ...]:
    positions, mask = sample_feedback_positions(torch.ones(1, length, dtype=torch.bool), num_positions)
    return tuple(positions[0][mask[0]].tolist())


def block_samples(length: int, num_positions: int) -> tuple[int, ...]:
    """The feedback positions ``I_b`` (offsets within the block, increasing) of a block of ``length``
    tokens without padding, ``|I_b| <= num_positions``: those of
    :func:`~lstmem_peft.memory.feedback.sample_feedback_positions`."""
    return _block_samples(int(length), int(num_positions))


@dataclass(frozen=True)
class ChunkPlan:
    """What one chunk of a history block does for block-end feedback.

    Attributes:
        length: the chunk's tokens.
        first: the chunk starts its block (the block's samples start empty).
        ends_block: the chunk's last token is its block's last: feedback follows this chunk.
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
        ValueError: the chunk is empty, runs past the prompt, or crosses a block end.
    """
    end = start + length
    if length < 1 or start < 0 or end > prompt_len:
        raise ValueError(f"chunk [{start}, {end}) is not inside a prompt of {prompt_len} tokens")
    block_start = start // block_size * block_size
    block_stop = block_end(start, prompt_len, block_size)
    if end > block_stop:
        raise ValueError(
            f"chunk [{start}, {end}) crosses the history block end {block_stop} (block_size {block_size})"
        )
    samples = block_samples(block_stop - block_start, num_positions)
    inside = [(j, block_start + p - start) for j, p in enumerate(samples) if start <= block_start + p < end]
    return ChunkPlan(
        length=length,
        first=start == block_start,
        ends_block=end == block_stop,
        slots=tuple(j for j, _ in inside),
        rows=tuple(t for _, t in inside),
        num_samples=len(samples),
    )


#: A history chunk in a pass's batch: ``(row, slot, plan)``, its row in the batch (its token ``t`` at
#: time index ``t``), the slot its request's states are in, and its :class:`ChunkPlan`.
Chunk = tuple[int, int, ChunkPlan]


class BlockSamples:
    """The feedback samples of history blocks being written chunk by chunk, by slot.

    For each slot it holds, per memory layer (depth order), the ``(P, n_h, r)`` memory keys and
    values at the samples ``I_b`` of the slot's current block seen so far (``P = |I_b|``; samples
    not reached yet are zero). Terminals of the blocks that end go to ``ends``.

    Args:
        ends: where the layers' terminals go at a block's end (its ``num_layers`` is the stack's depth).
    """

    def __init__(self, ends: BlockEnds) -> None:
        self.ends = ends
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}

    def discard(self, slot: int) -> None:
        """Forget ``slot``'s samples and terminals (its request left or starts over)."""
        self.keys.pop(slot, None)
        self.values.pop(slot, None)
        self.ends.discard(slot)

    def take(self, depth: int, out, chunks: Sequence[Chunk]) -> None:
        """Keep memory layer ``depth``'s samples of the history ``chunks`` of a batch, and at each
        chunk that ends its block the layer's terminal (in ``ends``, group and index: the slot).

        Args:
            depth: the memory layer (layers take their samples shallow to deep within a forward).
            out: the layer's :class:`~lstmem_peft.memory.layer_common.LayerOutput` over the batch
                ``(B, T)``, with its feedback samples (``aux=True``): ``key``, ``value``
                ``(B, T, n_h, r)``, gates ``(B, T, n_h, r)``, ``cell``, ``hidden`` ``(B, n_h, r, r)``.
            chunks: the batch's history chunks (:data:`Chunk`).
        """
        device = out.key.device
        for row, slot, plan in chunks:
            if slot not in self.keys or (plan.first and depth == 0):  # a new block: no samples yet
                shape = (plan.num_samples, *out.key.shape[2:])
                self.keys[slot] = [out.key.new_zeros(shape) for _ in range(self.ends.num_layers)]
                self.values[slot] = [out.value.new_zeros(shape) for _ in range(self.ends.num_layers)]
            keys, values = self.keys[slot][depth], self.values[slot][depth]
            if plan.rows:
                times = torch.tensor(plan.rows, device=device)
                index = torch.tensor(plan.slots, device=device)
                keys.index_copy_(0, index, out.key[row, times])
                values.index_copy_(0, index, out.value[row, times])
            if plan.ends_block:
                last = torch.tensor([plan.length - 1], device=device)
                rows = torch.tensor([row], device=device)
                terminal = layer_terminal(out, last, keys[None], values[None], rows=rows)
                mask = torch.ones(1, plan.num_samples, dtype=torch.bool, device=device)
                self.ends.add(slot, terminal, mask, index=slot)
