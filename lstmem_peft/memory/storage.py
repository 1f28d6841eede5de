"""Where one forward of the memory stack reads and writes the states: two storage kinds.

A memory layer ``m`` (depth order) keeps a cell ``C`` and a hidden ``D`` per sequence, ``(n_h, r, r)``
each. Two kinds of storage hold them:

* :class:`DenseRows`, the rows of a :class:`~lstmem_peft.memory.cache.MemoryCache`: row ``b`` of every
  layer's ``(B, n_h, r, r)`` pair is sequence ``b`` of the batch. A pass reads all rows, stages the new
  states of every layer, and :meth:`DenseRows.commit` replaces them all at once (a forward that raises
  leaves the cache as it was).
* :class:`SlotTables`, a serving engine's slot tables (vLLM's state layers): per memory layer a
  ``(cells, hiddens)`` pair of ``(num_slots, n_h, r, r)`` tensors, fixed in place (a CUDA graph reads
  them at the addresses it was captured with); a request owns one slot. A forward reads the slots of
  its requests and writes them in place; nothing waits for a commit.

Both read with ``read(depth, index)`` and write with ``write(depth, cell, hidden, index)``, where
``index`` names the rows or slots (``None``: every row of the dense rows), so block-end feedback
(:class:`~lstmem_peft.memory.feedback.BlockEnds`) writes its corrected states into either. States move
from one kind to the other only here (:meth:`SlotTables.load`, :meth:`SlotTables.rows`).

Torch only: the slot tables are plain tensors, whoever allocates them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .cache import MemoryCache, MemoryLayout, nonfinite_rows


class DenseRows:
    """A :class:`~lstmem_peft.memory.cache.MemoryCache`'s rows as one pass sees them: read in place,
    written to a stage, committed together.

    Args:
        cache: the session states, allocated (``cache.ensure``) before the pass.
    """

    def __init__(self, cache: MemoryCache) -> None:
        self.cache = cache
        self.staged: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(cache.layers)

    def __len__(self) -> int:
        return len(self.cache.layers)

    def read(self, depth: int, index: torch.Tensor | None = None, device: torch.device | None = None):
        """Layer ``depth``'s committed ``C``, ``D`` ``(B, n_h, r, r)`` (rows ``index``, or all), first
        moved to ``device`` where given: each layer's states live on the device its layer computes on
        (a ``device_map`` may spread the decoder layers), and the cache keeps them there."""
        state = self.cache.layers[depth]
        if device is not None and state.cell.device != device:
            state.to(device)
        if index is None:
            return state.cell, state.hidden
        return state.cell[index], state.hidden[index]

    def write(
        self, depth: int, cell: torch.Tensor, hidden: torch.Tensor, index: torch.Tensor | None = None
    ) -> None:
        """Stage layer ``depth``'s new ``C``, ``D``: all rows (``index`` ``None``), or rows ``index`` of
        what is staged already."""
        if index is not None:
            old_cell, old_hidden = self.staged[depth]
            cell = old_cell.index_copy(0, index.to(old_cell.device), cell.to(old_cell.dtype))
            hidden = old_hidden.index_copy(0, index.to(old_hidden.device), hidden.to(old_hidden.dtype))
        self.staged[depth] = (cell, hidden)

    def commit(self, tokens_written: torch.Tensor, check: bool = True) -> None:
        """Replace every layer's states with the staged ones and ``tokens_written`` ``(B,)``, all at
        once. ``check``: refuse nonfinite states first (one host read), leaving the cache untouched."""
        if any(pair is None for pair in self.staged):
            raise RuntimeError("a memory layer staged no states: a pass commits every memory layer at once")
        if check:
            rows = nonfinite_rows(self.staged)
            if rows:
                raise FloatingPointError(
                    f"the memory of batch row(s) {rows} became nonfinite (NaN or inf) in this forward: their inputs or "
                    "the adapter's weights hold nonfinite values. Nothing was written to the MemoryCache; check those "
                    "rows' inputs"
                )
        for state, (cell, hidden) in zip(self.cache.layers, self.staged, strict=True):
            state.cell, state.hidden = cell, hidden
        self.cache.tokens_written = tokens_written
        self.staged = [None] * len(self.cache.layers)


class SlotTables:
    """A serving engine's state slots: per memory layer (depth order) a ``(cells, hiddens)`` pair of
    ``(num_slots, n_h, r, r)`` tensors, read by slot and written in place.

    Args:
        layers: the memory layers, depth order; each one's ``kv_cache`` is its ``(cells, hiddens)``
            pair (the engine binds it after the model is built, so it is looked up at each use).
    """

    def __init__(self, layers: Sequence) -> None:
        self.layers = layers

    def __len__(self) -> int:
        return len(self.layers)

    def tables(self, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``depth``'s ``(cells, hiddens)``, ``(num_slots, n_h, r, r)`` each."""
        cells, hiddens = self.layers[depth].kv_cache
        return cells, hiddens

    def read(
        self, depth: int, index: torch.Tensor, device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``depth``'s ``C``, ``D`` of slots ``index`` ``(n,)``: ``(n, n_h, r, r)`` copies.
        ``device``: where the caller computes; the tables stay where the engine holds them, so
        another device is refused."""
        cells, hiddens = self.tables(depth)
        if device is not None and device != cells.device:
            raise ValueError(f"memory layer {depth}'s slot tables are on {cells.device}, not {device}")
        return cells[index], hiddens[index]

    def write(self, depth: int, cell: torch.Tensor, hidden: torch.Tensor, index: torch.Tensor) -> None:
        """Write ``C``, ``D`` ``(n, n_h, r, r)`` into layer ``depth``'s slots ``index`` ``(n,)``, in place,
        rounded to the tables' dtype."""
        cells, hiddens = self.tables(depth)
        cells.index_copy_(0, index, cell.to(cells.dtype))
        hiddens.index_copy_(0, index, hidden.to(hiddens.dtype))

    def load(self, slot: int, cache: MemoryCache | None, row: int = 0) -> None:
        """Dense rows into a slot: row ``row`` of ``cache`` into slot ``slot`` of every layer (``None``:
        zeros; an engine does not clear the slots it hands out)."""
        for depth in range(len(self.layers)):
            cells, hiddens = self.tables(depth)
            if cache is None:
                cells[slot].zero_()
                hiddens[slot].zero_()
            else:
                cells[slot].copy_(cache.layers[depth].cell[row])
                hiddens[slot].copy_(cache.layers[depth].hidden[row])

    def rows(
        self, slot: int, layout: MemoryLayout, tokens_written: int, device: str | torch.device = "cpu"
    ) -> MemoryCache:
        """A slot as dense rows: a one-row :class:`~lstmem_peft.memory.cache.MemoryCache` of ``layout``
        on ``device`` holding copies of slot ``slot``'s states and ``tokens_written``."""
        cache = MemoryCache(layout)
        cache.ensure(1, torch.device(device))
        for depth, layer in enumerate(cache.layers):
            cells, hiddens = self.tables(depth)
            layer.cell = cells[slot][None].to(device, copy=True)
            layer.hidden = hiddens[slot][None].to(device, copy=True)
        cache.tokens_written = torch.tensor([int(tokens_written)], device=device)
        return cache
