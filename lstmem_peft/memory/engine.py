"""``MemoryPass``: one forward of the memory stack over a block of tokens.

One pass drives both kinds of storage (:mod:`~lstmem_peft.memory.storage`): a cache's dense rows
for the library, and a serving engine's slot tables for the vLLM plugin, whose memory layers run
one pass per group of prefill chunks of a step (``MemoryPass(tables, valid, slots=...)``).

The tuner opens a pass when the backbone's forward starts, calls :meth:`MemoryPass.run` from each
memory-enabled decoder layer (shallow to deep; the backbone's own order), and calls
:meth:`MemoryPass.finish` when the forward ends. A pass

* reads each layer's states from the :class:`~lstmem_peft.memory.cache.MemoryCache` and writes them back
  through its dense rows (:class:`~lstmem_peft.memory.storage.DenseRows`: staged, committed together),
* hands ``D_t`` of one memory layer to the next as its depth input, keeping it only until then,
* keeps each layer's states on the device its layer computes on (a ``device_map`` may spread the
  decoder layers over devices): states, depth input and validity mask move there when they are
  elsewhere, and the cache keeps them there,
* gathers what block-end feedback needs (terminal gates, shared sampled keys/values) and applies it
  in :meth:`finish` when asked to (:class:`~lstmem_peft.memory.feedback.BlockEnds`),
* over slot tables, keeps the feedback samples of history chunks whose blocks span several forwards
  (:class:`~lstmem_peft.memory.chunks.BlockSamples`, by slot), whose terminals reach the same
  :class:`~lstmem_peft.memory.feedback.BlockEnds` at each block's end; the engine applies it after
  the forward's last memory layer.

It depends on torch only, so the whole engine can be driven without a transformer (see the tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import constants as K
from .cache import MemoryCache
from .chunks import BlockSamples, Chunk
from .feedback import BlockEnds, FeedbackResult, layer_terminal, sample_feedback_positions
from .layer import LayerOutput, LSTMemLayer
from .storage import DenseRows, SlotTables


def _gather_time(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, T, ...)`` at per-row positions ``index`` ``(B, P)`` -> ``(B, P, ...)``."""
    view = index.view(*index.shape, *([1] * (x.dim() - 2))).expand(*index.shape, *x.shape[2:])
    return x.gather(1, view)


def run_layer(
    layer: LSTMemLayer,
    x: torch.Tensor,
    cell: torch.Tensor,
    hidden: torch.Tensor,
    *,
    depth: torch.Tensor | None,
    valid: torch.Tensor | None,
    read_only: bool | torch.Tensor,
    aux: bool = False,
) -> tuple[LayerOutput, torch.Tensor]:
    """One memory layer over a block of ``B`` rows, some writing, some only reading (the read-only
    read: every token reads the fixed states ``C``, ``D``, and ``D`` goes up as the depth input).

    Args:
        layer: the memory layer.
        x: ``(B, T, d)``; ``cell``, ``hidden``: ``(B, n_h, r, r)`` the states before the block.
        depth: the depth input ``D^(l-1)`` ``(B, T, n_h, r, r)``, or ``(B, n_h, r, r)`` fixed, or ``None``.
        valid: ``(B, T)`` bool, the positions that write (``False`` at padding and in read-only
            rows), or ``None``.
        read_only: ``True`` (every row only reads), ``False`` (every row writes), or ``(B,)`` bool,
            the rows that only read; their states come back unchanged when ``valid`` masks their tokens.
        aux: return the feedback samples (writing rows).

    Returns:
        ``(out, handoff)``: the layer's output (reads of read-only rows from the fixed states), and
        the next memory layer's depth input: ``D_t`` ``(B, T, n_h, r, r)``, the fixed ``D`` in
        read-only rows; ``(B, n_h, r, r)`` when every row only reads.
    """
    if read_only is True:
        return layer(x, cell, hidden, depth=depth, valid=valid, write=False), hidden
    out = layer(x, cell, hidden, depth=depth, valid=valid, aux=aux)
    if read_only is False:
        return out, out.hidden_seq
    fixed_depth = depth if depth is None or depth.dim() == 4 else depth[:, 0]  # reading rows: D fixed
    fixed = layer(x, cell, hidden, depth=fixed_depth, write=False)
    read = torch.where(read_only[:, None, None], fixed.read, out.read)
    handoff = torch.where(
        read_only[:, None, None, None, None], hidden[:, None].to(out.hidden_seq.dtype), out.hidden_seq
    )
    return out._replace(read=read, hidden_seq=handoff), handoff


class MemoryPass:
    """Run the memory layers of one forward against a cache's dense rows or a serving engine's slots.

    Args:
        cache: the session states: a :class:`~lstmem_peft.memory.cache.MemoryCache`, bound and
            allocated by the caller (its rows are the batch; new states are staged and committed by
            :meth:`finish`), or :class:`~lstmem_peft.memory.storage.SlotTables` with ``slots`` (the
            batch's rows are those slots, written in place as each layer runs).
        valid: ``(B, T)`` bool validity of the block's positions, or ``None`` (all valid); over slot
            tables, the positions that write (``False`` also at every token of a read-only row).
        write: update the states (``False``: read-only pass over fixed states).
        feedback: apply block-end feedback in :meth:`finish` (history blocks of dense rows only: an
            engine's blocks span several forwards, and ``samples`` collects them).
        depth_coupling: feed ``D^(l-1)_t`` to layer ``l`` (``False``: the paper's depth ablation).
        feedback_positions: ``|I_b|`` bound.
        every_layer: require every memory layer to run; ``False`` only for a read-only pass of a cut
            stack (an early-exit draft).
        slots: ``(B,)`` int64, the slot of each row (with :class:`~lstmem_peft.memory.storage.SlotTables`).
        read_only: ``(B,)`` bool, rows of a writing pass that only read (:func:`run_layer`), or ``None``.
        samples: over slot tables, where the history chunks among the rows keep their feedback
            samples (:class:`~lstmem_peft.memory.chunks.BlockSamples`: a block written over several
            forwards), or ``None``; each layer hands it its samples as it runs. Feedback itself
            follows the forward's last memory layer, through the store's
            :class:`~lstmem_peft.memory.feedback.BlockEnds`, not :meth:`finish`.
        chunks: with ``samples``, the batch's history chunks, ``(row, slot, plan)`` each
            (:data:`~lstmem_peft.memory.chunks.Chunk`).
    """

    def __init__(
        self,
        cache: MemoryCache | SlotTables,
        valid: torch.Tensor | None = None,
        *,
        write: bool = True,
        feedback: bool = False,
        depth_coupling: bool = True,
        feedback_positions: int = K.FEEDBACK_POSITIONS,
        every_layer: bool = True,
        slots: torch.Tensor | None = None,
        read_only: torch.Tensor | None = None,
        samples: BlockSamples | None = None,
        chunks: Sequence[Chunk] = (),
    ) -> None:
        if feedback and not write:
            raise ValueError("block feedback needs a writing pass (write=True)")
        if write and not every_layer:
            raise ValueError("a writing pass must run every memory layer (every_layer=True)")
        if isinstance(cache, SlotTables) != (slots is not None):
            raise ValueError("a pass over slot tables needs the rows' slots (slots=), and only such a pass")
        if feedback and slots is not None:
            raise ValueError("block feedback over slot tables spans a block's chunks: the engine applies it")
        if samples is not None and slots is None:
            raise ValueError("samples kept across a block's chunks need a pass over slot tables (slots=)")
        if chunks and samples is None:
            raise ValueError("history chunks need a store for their samples (samples=)")
        self.cache = cache
        self.valid = valid
        self.write = write
        self.feedback = feedback
        self.depth_coupling = depth_coupling
        self.feedback_positions = feedback_positions
        self.every_layer = every_layer
        self.slots = slots
        self.read_only = (not write) if read_only is None else read_only
        self.samples = samples
        self.chunks = tuple(chunks)
        self.feedback_result: FeedbackResult | None = None
        # where each layer's new (C, D) go: staged until finish() (dense rows), or in place (slots)
        self.storage = cache if slots is not None else DenseRows(cache)
        self.block_ends = BlockEnds(len(self.storage), depth_coupling)
        self._next = 0
        self._depth: torch.Tensor | None = None
        self._length = 0
        self._tokens: torch.Tensor | None = None
        self._valid_copies: dict[torch.device, torch.Tensor] = {}

    @property
    def layers_run(self) -> int:
        """Memory layers that have run in this pass so far."""
        return self._next

    @property
    def all_layers_run(self) -> bool:
        """Whether every memory layer has run in this pass."""
        return self._next == len(self.storage)

    def _sampling(self, T: int, device: torch.device) -> None:
        """Shared feedback positions ``I_b`` and the last valid position ``T_b`` of each row."""
        valid = self._valid_on(device)
        if valid is None:
            valid = torch.ones(self.cache.batch_size, T, dtype=torch.bool, device=device)
        self._positions, self._mask = sample_feedback_positions(valid, self.feedback_positions)
        idx = torch.arange(T, device=device).expand_as(valid)
        self._last = torch.where(valid, idx, torch.zeros_like(idx)).amax(dim=1)

    def _valid_on(self, device: torch.device) -> torch.Tensor | None:
        """The validity mask on ``device`` (copied once per device and pass)."""
        valid = self.valid
        if valid is None or valid.device == device:
            return valid
        moved = self._valid_copies.get(device)
        if moved is None:
            moved = self._valid_copies[device] = valid.to(device)
        return moved

    def run(self, index: int, layer: LSTMemLayer, x: torch.Tensor) -> LayerOutput:
        """Run memory layer ``index`` (depth order) on its input ``x`` ``(B, T, d)``."""
        if index != self._next:
            raise RuntimeError(
                f"memory layer {index} ran before memory layer {self._next}: memory layers must run "
                "once each, shallow to deep, within one forward"
            )
        device = x.device
        # on this layer's device (a sharded backbone moves dense rows there)
        cell, hidden = self.storage.read(index, self.slots, device=device)
        depth, valid = self._depth, self._valid_on(device)
        if depth is not None and depth.device != device:
            depth = depth.to(device)
        # the feedback samples (aux) only where block feedback reads them
        aux = self.feedback or bool(self.chunks)
        out, handoff = run_layer(
            layer, x, cell, hidden, depth=depth, valid=valid, read_only=self.read_only, aux=aux
        )
        self._depth = handoff if self.depth_coupling else None
        if self.write:
            self.storage.write(index, out.cell, out.hidden, self.slots)
        if self.chunks:  # history chunks of blocks that span forwards: their samples, their block ends
            self.samples.take(index, out, self.chunks)
        if index == 0:
            self._length = x.shape[1]
            if self.write and self.slots is None:  # the rows' new token counts, committed by finish()
                tokens = self.cache.tokens_written
                n = self._length if self.valid is None else self.valid.sum(dim=1).to(tokens.device)
                # here rather than in finish(): a one-token step's count joins the layers' graph
                # (torch.compile), where finish() would trace it as a graph of its own
                self._tokens = tokens + n
        if self.feedback:
            if index == 0:
                self._sampling(x.shape[1], x.device)
            last, positions = self._last.to(device), self._positions.to(device)
            key, value = _gather_time(out.key, positions), _gather_time(out.value, positions)
            self.block_ends.add(0, layer_terminal(out, last, key, value), self._mask)
        self._next += 1
        return out

    def finish(self) -> FeedbackResult | None:
        """Close the pass: apply feedback (history blocks), then commit every layer's new states and
        ``tokens_written`` to the cache at once. Until this returns the cache holds exactly what it held
        before the pass, so a forward that raises (or is interrupted) leaves it untouched. (Over slot
        tables each layer wrote its slots in place as it ran: this only checks that every layer ran.)

        Returns the :class:`~lstmem_peft.memory.feedback.FeedbackResult` when feedback ran.
        """
        if not self.all_layers_run and self.every_layer:
            raise RuntimeError(
                f"only {self._next} of {len(self.storage)} memory layers ran in this forward; "
                "every memory-enabled layer must run (is the model truncated or the adapter disabled?)"
            )
        self._depth = None
        if not self.write or self.slots is not None:  # slot tables were written in place
            return None
        if self.feedback and self.block_ends:
            self.feedback_result = self.block_ends.apply(self.storage)  # stages the corrected states
        # block ends (one-token steps: at the next block end or save); a graph torch.compile traces
        # cannot read values on the host, so there too the check waits for the next eager block end
        check = (self._length > 1 or self.feedback) and not torch.compiler.is_compiling()
        self.storage.commit(self._tokens, check=check)
        return self.feedback_result
