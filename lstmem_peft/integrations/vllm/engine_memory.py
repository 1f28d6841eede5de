"""What the memory layers of one LSTMem model share within a forward, and with the worker's sessions.

:class:`EngineMemory` holds the depth input ``D_t`` handed from one memory layer to the next, the
memory layers' slot tables (:class:`~lstmem_peft.memory.storage.SlotTables`), which state slots only
read, the prompt length of each history request, and the forward's passes over the slot tables
(:class:`~lstmem_peft.memory.engine.MemoryPass`). A history block spans several forwards: the
passes keep its feedback samples across its chunks in the library's
:class:`~lstmem_peft.memory.chunks.BlockSamples` (by slot), which hands the terminals of the blocks
that end in a forward to :class:`~lstmem_peft.memory.feedback.BlockEnds`, applied after its last
memory layer. The worker's sessions (:class:`~.worker_sessions.Sessions`) set its per-step fields
before each step; the memory layers (:class:`~.state.LSTMemState`) and the metadata builder
(:class:`~.backend.LSTMemMetadataBuilder`) read them.
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger

from lstmem_peft.memory.chunks import BlockSamples, ChunkPlan, plan_chunk
from lstmem_peft.memory.engine import MemoryPass
from lstmem_peft.memory.feedback import BlockEnds
from lstmem_peft.memory.spec import MemorySpec
from lstmem_peft.memory.storage import SlotTables

logger = init_logger(__name__)


class EngineMemory:
    """What the memory layers of one model share within a forward, and with the worker's sessions.

    Attributes:
        depth_seq: ``(n, n_h, r, r)`` float32 ``D_t`` of the ``n`` decoding requests from the memory
            layer that ran last in the current forward (the depth input of the next one), or ``None``.
        prefill_passes: one :class:`~lstmem_peft.memory.engine.MemoryPass` over the slot tables per
            group of prefill chunks of the current forward (:meth:`start_forward`): each memory layer
            runs the group through it, and it hands ``D_t`` from one memory layer to the next.
        history_decodes: ``(rows, pass)`` for the one-token history chunks of the current forward
            (vLLM runs them as decodes): their ``(h,)`` rows among the decodes and the
            :class:`~lstmem_peft.memory.engine.MemoryPass` over their slots that writes them with the
            block scan; ``None`` when the forward has none.
        read_only: the state slots of read-only requests (host), kept by
            :class:`~lstmem_peft.integrations.vllm.worker_sessions.Sessions` through :meth:`set_read_only`.
        step_has_read_only: whether the step about to run schedules a read-only request (host, set
            by the sessions before each step): only then do prefills run the read-only pass.
        history: state slot -> the prompt length of each history request (``lstmem_history``),
            kept by the sessions through :meth:`set_history`.
        step_history: state slot -> ``(start, length)`` of the prompt chunk each history request
            runs in the step about to run (host, set by the sessions before each step).
        samples: the history requests' feedback samples, kept across their blocks' chunks by
            state slot (:class:`~lstmem_peft.memory.chunks.BlockSamples`), which the forward's
            passes fill; its ``ends`` (:attr:`block_ends`) gets each memory layer's terminal of every
            request whose chunk ends a block.
        block_ends: those terminals in this forward, by state slot
            (:class:`~lstmem_peft.memory.feedback.BlockEnds`, the library pass's own); block-end
            feedback consumes them after the last memory layer.
        states: the memory layers (:class:`~.state.LSTMemState`), depth order (set by the model).
        slots: their slot tables (:class:`~lstmem_peft.memory.storage.SlotTables`), where the memory
            layers read and write the states of their requests.
        block_size, feedback_positions, block_feedback, depth_coupling: the adapter's history settings.
    """

    def __init__(self, config: MemorySpec | None = None) -> None:
        self.depth_seq: torch.Tensor | None = None
        self.prefill_passes: list[MemoryPass] = []
        self.history_decodes: tuple[torch.Tensor, MemoryPass] | None = None
        self.read_only: set[int] = set()
        self.step_has_read_only = False
        self._read_only_slots: torch.Tensor | None = None
        self.history: dict[int, int] = {}
        self.step_history: dict[int, tuple[int, int]] = {}
        config = config or MemorySpec()
        self.block_size = int(config.block_size)
        self.feedback_positions = int(config.feedback_positions)
        self.block_feedback = bool(config.block_feedback)
        self.depth_coupling = bool(config.depth_coupling)
        self.states = []

    @property
    def states(self) -> list[torch.nn.Module]:
        return self.slots.layers

    @states.setter
    def states(self, layers: list[torch.nn.Module]) -> None:
        self.slots = SlotTables(layers)
        self.block_ends = BlockEnds(len(layers), self.depth_coupling)
        self.samples = BlockSamples(self.block_ends)

    def set_history(self, slot: int, prompt_length: int | None) -> None:
        """Mark state slot ``slot`` as holding a history request of ``prompt_length`` prompt tokens
        (``None``: not a history request). Its blocks start over."""
        self.samples.discard(slot)
        if prompt_length is None:
            self.history.pop(slot, None)
        else:
            self.history[slot] = int(prompt_length)

    def plan_history(self, slot: int) -> ChunkPlan | None:
        """The :class:`~lstmem_peft.memory.chunks.ChunkPlan` of the chunk history slot ``slot`` runs
        in this step, or ``None`` (not a history request, a chunk past the prompt, feedback off). A
        chunk the scheduler did not cut at its block end is logged and written without feedback (the
        engine goes on; :func:`~.checks.check_engine_config` makes this impossible with the plugin's
        scheduler)."""
        prompt_length = self.history.get(slot)
        chunk = self.step_history.get(slot)
        if prompt_length is None or chunk is None or not self.block_feedback:
            return None
        start, length = chunk
        if start >= prompt_length:
            return None
        length = min(length, prompt_length - start)
        try:
            return plan_chunk(start, length, prompt_length, self.block_size, self.feedback_positions)
        except ValueError as err:
            logger.error(
                "LSTMem history request in state slot %d: no block-end feedback (%s; history requests need "
                "the plugin's scheduler, lstmem_peft.integrations.vllm.scheduler.LSTMemScheduler)",
                slot,
                err,
            )
            return None

    @property
    def step_has_history_decode(self) -> bool:
        """Whether the step about to run holds a one-token chunk of a history prompt that block-end
        feedback follows: vLLM runs it as a decode, and the memory op routes it through the block
        scan in Python (:meth:`~.state.LSTMemState._decode`), which a full CUDA graph would not run."""
        return self.block_feedback and any(
            length == 1 and slot in self.history and start < self.history[slot]
            for slot, (start, length) in self.step_history.items()
        )

    def start_forward(self, metadata) -> None:
        """Open the forward's passes: one :class:`~lstmem_peft.memory.engine.MemoryPass` over the
        slot tables per group of prefill chunks of ``metadata`` (an ``LSTMemMetadata``,
        :mod:`~.backend`), writing at the positions of its ``write`` mask; read-only chunks read the
        fixed states when the step holds any, and the history chunks of a group keep their samples
        (in :attr:`samples`, each by its row in the group's batch). One more over the slots of its
        one-token history chunks, if any."""
        history = {row: (slot, plan) for row, slot, plan in metadata.history_prefills}
        self.prefill_passes = [
            MemoryPass(
                self.slots,
                group.write,
                slots=group.slots,
                read_only=group.read_only if metadata.read_only_pass else None,
                depth_coupling=self.depth_coupling,
                samples=self.samples,
                chunks=[(i, *history[row]) for i, row in enumerate(group.rows) if row in history],
            )
            for group in metadata.prefill_groups
        ]
        self.history_decodes = None
        if metadata.history_decodes:
            slots = metadata.decode_slots
            rows = torch.tensor([row for row, _, _ in metadata.history_decodes], device=slots.device)
            history_pass = MemoryPass(
                self.slots,
                slots=slots[rows],
                depth_coupling=self.depth_coupling,
                samples=self.samples,
                chunks=[(i, slot, plan) for i, (_, slot, plan) in enumerate(metadata.history_decodes)],
            )
            self.history_decodes = (rows, history_pass)

    def finish_forward(self) -> None:
        """Close the forward after its last memory layer: its passes (each checks that every memory
        layer ran), then block-end feedback."""
        for memory_pass in self.prefill_passes:
            memory_pass.finish()
        if self.history_decodes is not None:
            self.history_decodes[1].finish()
        self.prefill_passes, self.history_decodes = [], None
        self.block_end_feedback()

    def block_end_feedback(self) -> None:
        """Block-end feedback (the library's :class:`~lstmem_peft.memory.feedback.BlockEnds`, one
        batch) for every history request whose chunk ended a block in this forward; the corrected
        states replace the block's terminal states in their slots, where the next block starts."""
        self.block_ends.apply(self.slots)

    def set_read_only(self, slot: int, read_only: bool) -> None:
        """Mark state slot ``slot`` read-only (or writing) for the request that starts in it."""
        if read_only:
            self.read_only.add(slot)
        else:
            self.read_only.discard(slot)
        if self._read_only_slots is not None:
            self._read_only_slots[slot] = read_only

    def read_only_slots(self, num_slots: int, device: torch.device) -> torch.Tensor:
        """``(num_slots,)`` bool on ``device``: which state slots only read (a device mirror of
        :attr:`read_only`, made once and then kept up to date element by element)."""
        if self._read_only_slots is None:
            mask = torch.zeros(num_slots, dtype=torch.bool)
            mask[sorted(self.read_only)] = True
            self._read_only_slots = mask.to(device)
        return self._read_only_slots
