"""The memory layers' state backend on vLLM: per-step metadata, its builder, and the backend class.

:class:`LSTMemAttentionBackend` is vLLM's linear-attention state handling with the memory's own
metadata builder; the plugin registers it as ``MambaAttentionBackendEnum.LSTMEM`` by its class path
(:data:`~lstmem_peft.integrations.vllm.MEMORY_BACKEND_CLASS`), in every vLLM process.
:class:`LSTMemMetadataBuilder` builds :class:`LSTMemMetadata` once per step for all memory layers:
the state slots of the decodes and of the prefills, which of them only read, the prefill chunks in
groups of similar length with the gather and scatter indices of each group's padded scan
(:mod:`.prefill`), and the history chunks that block-end feedback follows. A
decode-only step reads nothing back to the host (slots and read-only flags stay device tensors, in
fixed buffers where a full CUDA graph may replay the step);
:func:`keep_history_chunks_out_of_full_graphs` keeps the one decode-only step that needs the memory
op's Python out of full graphs.

The memory's custom op (:data:`~lstmem_peft.integrations.vllm.MEMORY_OP`, ``torch.ops.vllm.lstmem_memory``,
whose body is :meth:`~.state.LSTMemState.run`) is registered here, so that resolving the backend by
its class path registers it too: vLLM splits its compiled graph at it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.linear_attn import (
    LinearAttentionBackend,
    LinearAttentionMetadata,
    LinearAttentionMetadataBuilder,
)

from .checks import full_decode_graphs
from .engine_memory import EngineMemory
from .prefill import PrefillGroup, prefill_groups


@dataclass
class LSTMemMetadata(LinearAttentionMetadata):
    """One step's requests as the memory layers read them (built once per step).

    Decodes come first (``num_decodes`` requests, one token each), then ``P = num_prefills`` prefill
    chunks, which run in groups of similar length, each one padded block scan (:mod:`.prefill`).

    Attributes:
        decode_slots: ``(num_decodes,)`` int64 state slots of the decoding requests.
        decode_write: ``(num_decodes,)`` bool: the request writes its memory (``False``: it only
            reads it).
        prefill_slots: ``(P,)`` int64 state slots of the prefilling requests.
        prefill_groups: the prefill chunks in groups of similar length (:class:`~.prefill.PrefillGroup`:
            slots, read-only flags, gather and write masks of its padded scan, where its tokens go).
        read_only_pass: whether the step may hold a read-only prefill (host).
        history_decodes, history_prefills: ``(row, slot, plan)`` (host) for each history request's
            chunk of the step that block-end feedback follows (:class:`~lstmem_peft.memory.chunks.ChunkPlan`),
            by its row among the decodes (a one-token chunk) or among the prefill chunks.
    """

    decode_slots: torch.Tensor | None = None
    decode_write: torch.Tensor | None = None
    prefill_slots: torch.Tensor | None = None
    prefill_groups: tuple[PrefillGroup, ...] = ()
    read_only_pass: bool = False
    history_decodes: tuple = ()
    history_prefills: tuple = ()


class LSTMemMetadataBuilder(LinearAttentionMetadataBuilder):
    """Builds :class:`LSTMemMetadata` once per step for every memory layer (they share one state
    group). The prefill indices come from the host copy of the query start offsets vLLM keeps
    (``query_start_loc_cpu``); the slots and read-only flags stay on the device.

    Full CUDA graphs capture decode-only steps (``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE``:
    vLLM's default ``FULL_AND_PIECEWISE`` keeps them; steps with prefills run piecewise graphs, which
    leave the memory op, a splitting op, outside). A graph replays the kernels the op launched when
    it was captured, reading the addresses they read then: in a decode-only step that a full graph
    may replay, the decode slots and write flags go into buffers made once
    (:attr:`graph_slots`, :attr:`graph_write`), and the rows vLLM adds to fill a graph's batch
    (``seq_lens`` 0, slot: vLLM's null block or ``-1``) write no state. The one decode-only step
    that needs the op's Python, a one-token chunk of a history prompt, never runs in a full graph
    (:func:`keep_history_chunks_out_of_full_graphs`).

    Attributes:
        graph_slots: ``(rows,)`` int64, ``rows`` the largest batch a full graph captures
            (``max_num_seqs``, at most ``max_cudagraph_capture_size``).
        graph_write: ``(rows,)`` bool.
    """

    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.layer = vllm_config.compilation_config.static_forward_context[layer_names[0]]
        rows = vllm_config.scheduler_config.max_num_seqs
        largest = vllm_config.compilation_config.max_cudagraph_capture_size
        rows = rows if largest is None else min(rows, largest)
        self.graph_slots = torch.zeros(rows, dtype=torch.int64, device=device)
        self.graph_write = torch.zeros(rows, dtype=torch.bool, device=device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> LSTMemMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        shared = self.layer.shared
        nd, num_prefills = base.num_decodes, base.num_prefills
        slots = base.state_indices_tensor[: nd + num_prefills].long()
        read_only = shared.read_only_slots(self.layer.kv_cache[0].shape[0], slots.device)[slots]
        if not num_prefills and 0 < nd <= self.graph_slots.shape[0] and full_decode_graphs(self.vllm_config):
            # a step a full CUDA graph may replay: fixed addresses; vLLM's padding rows only read
            decode_slots = self.graph_slots[:nd]
            decode_slots.copy_(slots, non_blocking=True)
            decode_write = self.graph_write[:nd]
            torch.logical_not(read_only, out=decode_write)
            decode_write &= base.seq_lens[:nd] > 0
            decode_write &= decode_slots >= 0
        else:
            decode_slots, decode_write = slots[:nd], ~read_only[:nd]
        fields = dict(decode_slots=decode_slots, decode_write=decode_write)
        if num_prefills:  # the sequence boundaries: chunks of similar length share a padded scan
            starts = common_attn_metadata.query_start_loc_cpu[nd : nd + num_prefills + 1].long()
            fields.update(
                prefill_slots=slots[nd:],
                prefill_groups=prefill_groups(starts, slots[nd:], read_only[nd:]),
                read_only_pass=shared.step_has_read_only,
            )
        if shared.step_history:  # history chunks: which rows they are (one host read of the slots)
            plans = [(row, slot, shared.plan_history(slot)) for row, slot in enumerate(slots.tolist())]
            plans = [(row, slot, plan) for row, slot, plan in plans if plan is not None]
            fields["history_decodes"] = tuple(p for p in plans if p[0] < nd)
            fields["history_prefills"] = tuple(
                (row - nd, slot, plan) for row, slot, plan in plans if row >= nd
            )
        return LSTMemMetadata(**vars(base), **fields)


def keep_history_chunks_out_of_full_graphs(view, memory: EngineMemory) -> None:
    """Make the model runner's CUDA graph dispatch choose no full graph for a step that holds a
    one-token history chunk (:attr:`~.engine_memory.EngineMemory.step_has_history_decode`, set by
    the sessions before each step, before vLLM dispatches it): such a step runs a piecewise graph or
    none, so the memory op's Python routes the chunk. Other steps dispatch as vLLM decides. ``view`` is the
    runner as the plugin sees it (:class:`~.runner_view.RunnerView`: V1's dispatcher or V2's graph
    manager); a runner without CUDA graphs is left as it is."""
    view.keep_out_of_full_graphs(lambda: memory.step_has_history_decode)


class LSTMemAttentionBackend(LinearAttentionBackend):
    """vLLM's state backend of the LSTMem memory layers (registered as ``MambaAttentionBackendEnum``
    member ``LSTMEM`` by the plugin): linear-attention state handling with :class:`LSTMemMetadataBuilder`."""

    @staticmethod
    def get_name() -> str:
        return "LSTMEM"

    @staticmethod
    def get_builder_cls() -> type[LSTMemMetadataBuilder]:
        return LSTMemMetadataBuilder


def _lstmem_memory(x: torch.Tensor, delta: torch.Tensor, layer_name: str) -> None:
    with torch.no_grad():
        get_forward_context().no_compile_layers[layer_name].run(x, delta)


def _lstmem_memory_fake(x: torch.Tensor, delta: torch.Tensor, layer_name: str) -> None:
    return None


direct_register_custom_op(
    op_name="lstmem_memory",
    op_func=_lstmem_memory,
    mutates_args=["delta"],
    fake_impl=_lstmem_memory_fake,
)
