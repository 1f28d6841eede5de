"""One LSTMem memory layer as a vLLM state layer: how a forward routes requests to state slots.

A forward of vLLM runs a flat batch of ``N`` tokens from several requests: first the decoding
requests (one token each), then the prefilling ones (a chunk of their prompt each). Per memory
layer (decoder layer ``l`` with memory, depth ``m`` among the memory layers)::

    x = input_layernorm(h)                         (N, d)   the attention input (replicated on every TP rank)
    u = LSTMemState(x)                              the library's LSTMemLayer, all requests at once:
        decodes:  one batched step over every decoding request's state slot
        prefills: a batched block scan per group of chunks of similar length (.prefill), padded to its longest,
                  each group run by one MemoryPass over the slot tables (EngineMemory.prefill_passes)
        D_t of every token goes up to memory layer m + 1 (the decodes' in EngineMemory.depth_seq, the
        prefill groups' in their passes)
    q = q_proj(x) + Δq -> q_norm -> RoPE -> attention -> o_proj(.) + Δo      (Δq, Δo made from u)

Per-step metadata (:class:`~.backend.LSTMemMetadataBuilder`, built once per step for all memory
layers, the way vLLM builds it for its Mamba and linear-attention layers): the state slots of the
decodes and of the prefills, which of them only read, and the gather and scatter indices of each
group of prefill chunks (:mod:`.prefill`: chunks of similar length share a padded scan).
A decode-only step reads nothing back to the host: slots and read-only flags stay device tensors and
the step is one fixed sequence of tensor operations whatever the batch holds.

A request's state slot holds its starting memory before its first chunk runs: the worker's
:class:`~lstmem_peft.integrations.vllm.worker_sessions.Sessions` writes it there (a session's memory, or
zeros) when the request is scheduled, so no layer asks which chunk is a request's first.

A request's slot is a row of its memory layer's slot tables
(:class:`~lstmem_peft.memory.storage.SlotTables`, :attr:`.EngineMemory.slots`): the layer reads and
writes its requests' states there, in place.

A read-only request (``lstmem_memory_write`` false) reads the fixed states of its slot at every
token, as the library's read-only pass (:class:`lstmem_peft.memory.engine.MemoryPass` with
``write=False``) does; its depth input is the fixed ``D`` of memory layer ``m - 1`` (that layer hands
it up in place of ``D_t``). In the batched decode step it runs with the writing requests and its slot
keeps its states (``torch.where``): the step's read ``u`` uses ``D_{t-1}`` and the depth input before
any write, which is the read-only read. In a prefill batch, its tokens are masked out of the write
(``valid``) and its reads come from one read-only pass over the same batch (the group's
:class:`~lstmem_peft.memory.engine.MemoryPass`, with the chunks' read-only mask).

A history request (``lstmem_history``; :mod:`~lstmem_peft.integrations.vllm.history`) writes like any
writing request; its chunks never cross a block end (the plugin's scheduler). At each of its chunks,
the pass that runs it keeps each memory layer's keys and values at the block's feedback positions in
the chunk (the library's :class:`~lstmem_peft.memory.chunks.BlockSamples`, :attr:`.EngineMemory.samples`:
per-slot buffers that last the block), and at a block's end its terminal states and gates; after
the last memory layer,
:meth:`~.engine_memory.EngineMemory.block_end_feedback` runs the library's
:class:`~lstmem_peft.memory.feedback.BlockEnds` (the one :class:`~lstmem_peft.memory.engine.MemoryPass`
collects its terminals in) over every request whose block ended in this forward, which writes the
corrected states into their slots. A one-token history chunk, which vLLM runs as a decode, is
written by the block scan (which gives the samples) through a pass of its own
(:attr:`.EngineMemory.history_decodes`); the decode step only reads its slot.

Tensor parallelism (``tensor_parallel_size > 1``): every rank keeps the whole memory of every memory
layer (states replicated, not sharded by memory head: the read ``u``, the gates and the corrections
mix all memory heads, so sharding them would need a collective per memory layer and token, while the
whole memory is a few ``n_h r^2`` floats per request and layer, computed from the attention input
that every rank already holds). Each rank adds the rows of ``Δq`` that belong to its shard of the
column-parallel query projection (``W_dq`` is sliced by query head when the weights load) and the
whole ``Δo`` once, after the row-parallel output projection has reduced its output. Pipeline
parallelism is refused (:func:`~.checks.check_engine_config`).

CUDA graphs: a decode-only step is one fused Triton launch per memory layer reading fixed buffers
(:class:`~.backend.LSTMemMetadataBuilder`), which full graphs capture; steps with prefills run
piecewise graphs split at the memory op, which runs eagerly between the pieces
(:func:`~.checks.check_engine_config`, :func:`~.backend.keep_history_chunks_out_of_full_graphs`;
tested with vLLM's own code, not yet run on a GPU).

The memory math is :class:`lstmem_peft.memory.layer.LSTMemLayer`, the same module the PEFT adapter runs,
with the weights of the adapter's ``adapter_model.safetensors``; this module only routes tokens and
state slots. The work runs inside one opaque custom op per layer (``torch.ops.vllm.lstmem_memory``,
registered by :mod:`~.backend`, whose body is :meth:`LSTMemState.run`), so vLLM's ``torch.compile``
sees a fixed graph around it.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from lstmem_kernels import lstmem_decode_step
from lstmem_peft.memory import constants as K
from lstmem_peft.memory.cache import STATE_DTYPES
from lstmem_peft.memory.layer import LayerWeights
from lstmem_peft.memory.spec import MemorySpec, memory_layer

from . import MEMORY_BACKEND, register_memory_backend
from .backend import LSTMemMetadata
from .engine_memory import EngineMemory

register_memory_backend()  # the plugin's entry point did it already in a vLLM process


class LSTMemState(nn.Module, MambaBase):
    """One memory layer as a vLLM state layer: ``C`` and ``D`` per request slot, ``(n_h, r, r)`` each,
    the whole memory on every tensor-parallel rank.

    Args:
        hidden_size: the backbone layer's ``d``.
        query_size: the width of this rank's shard of the query projection (``d_q / tp``).
        config: the adapter's memory spec (:func:`~lstmem_peft.memory.spec.read_memory_spec`).
        layer_idx: the decoder layer.
        depth: the memory layer's index among the memory layers (0: no depth input).
        prefix: the module's name (vLLM finds the layer and its metadata by it).
    """

    def __init__(
        self, hidden_size: int, query_size: int, config: MemorySpec, layer_idx: int, depth: int, prefix: str
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
        weight after loading; :meth:`~.model._MemoryModel.load_weights` drops them when it loads new ones)."""
        if self.weights is None:
            with torch.no_grad():
                self.weights = self.memory.derived_weights()
        return self.weights

    def run(self, x: torch.Tensor, delta: torch.Tensor) -> None:
        """The body of the custom op: this layer's memory for every request of the running forward.

        ``x`` ``(N', d)`` (``N'`` >= the ``N`` real tokens: vLLM pads); writes ``delta``
        ``(N', d_q / tp + d)`` (``[Δq | Δo]``, zero on the padding), the states of the requests'
        slots, and ``EngineMemory.depth_seq`` (the decodes' ``D_t``; the prefill groups' passes hand
        up their own)."""
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        shared = self.shared
        if metadata is None:  # vLLM's profiling / warm-up forwards: no requests, no states
            delta.zero_()
            shared.depth_seq = None
            return
        nd = metadata.num_decode_tokens
        tokens = nd + metadata.num_prefill_tokens
        depth_seq = shared.depth_seq if self.memory.depth_input else None  # the decodes' D_t from below
        weights = self.layer_weights()
        if self.depth == 0:
            shared.start_forward(metadata)
        if metadata.num_prefills or not nd:
            read = x.new_empty(tokens, self.memory.num_heads * self.memory.head_dim, dtype=torch.float32)
            out_seq = self._decode(x[:nd], metadata, depth_seq, weights, read[:nd])[1] if nd else None
            if metadata.num_prefills:
                self._prefill(x, metadata, read[nd:tokens])
        else:  # decoding only (the steady state): the step's u and D_t are used where they are
            read, out_seq = self._decode(x[:nd], metadata, depth_seq, weights)
        # eq:injection: [Δq | Δo] = u (alpha / r) [W_dq; W_do]^T, one product
        _apply(read, weights.corr, delta[:tokens])
        if tokens < delta.shape[0]:
            delta[tokens:] = 0  # vLLM pads the batch for its graphs
        shared.depth_seq = out_seq
        if self.depth == len(shared.states) - 1:  # every memory layer has run: passes close, feedback
            shared.finish_forward()

    def _decode(self, x, metadata: LSTMemMetadata, depth, weights, read=None):
        """One batched step for the ``n`` decoding requests: ``x`` ``(n, d)``, ``depth`` ``(n, n_h, r, r)``
        or ``None``, ``weights`` the layer's derived weights. Returns ``u`` ``(n, d_s)`` and ``D_t``
        ``(n, n_h, r, r)`` (``u`` written into ``read`` when given). No host reads. The
        states are stepped in their slots (:func:`lstmem_kernels.lstmem_decode_step` with ``slots``:
        in place in one launch with the Triton member); read-only requests keep theirs."""
        cells, hiddens = self.shared.slots.tables(self.depth)
        history = metadata.history_decodes
        # Read-only requests keep their states: the fused kernel takes the mask as it is (the same
        # launch in every step, as a CUDA graph needs); the PyTorch step is spared its selections
        # when the step has no read-only request (a host flag the sessions set)
        member = self.memory.decode_member(weight=weights.w_in)  # chosen once per device and dtype
        write = metadata.decode_write
        if history:
            # one-token history chunks: the library writes a one-token block with its block scan,
            # which also gives the feedback samples; their pass runs it on their slots (keeping the
            # samples), which the step then only reads
            rows, history_pass = self.shared.history_decodes
            out = history_pass.run(self.depth, self.memory, x[rows, None])
            write = write.index_fill(0, rows, False)
        elif not (member == "triton" or self.shared.step_has_read_only):
            write = None
        H, R = self.memory.num_heads, self.memory.head_dim
        out_seq = x.new_empty(x.shape[0], H, R, R, dtype=torch.float32)  # D_t: the next layer's depth input
        u = lstmem_decode_step(
            x,
            *weights.step_weights(depth is not None),
            cells,
            hiddens,
            num_heads=self.memory.num_heads,
            out=(cells, hiddens),
            depth=depth,
            valid=write,
            norm_eps=K.NORM_EPS,
            slots=metadata.decode_slots,
            hidden_seq=out_seq,
            backend=member,
        )
        if read is None:
            read = u
        else:
            read.copy_(u)
        if history:  # the block scan's read and D_t replace the step's for these rows
            read[rows] = out.read[:, 0].to(read.dtype)
            out_seq[rows] = out.hidden_seq[:, 0]
        return read, out_seq

    def _prefill(self, x, metadata: LSTMemMetadata, read) -> None:
        """The ``P`` prefill chunks, one batched block scan per group of similar length
        (:mod:`.prefill`), each padded to its longest chunk and run through its group's
        :class:`~lstmem_peft.memory.engine.MemoryPass` over the slot tables (which writes the slots,
        hands ``D_t`` up to the next memory layer, reads the fixed states for read-only chunks, and
        keeps the feedback samples of history chunks); fills ``read`` ``(n, d_s)`` of the ``n``
        prefill tokens."""
        for group, group_pass in zip(metadata.prefill_groups, self.shared.prefill_passes, strict=True):
            out = group_pass.run(self.depth, self.memory, x[group.gather])  # (G, T, d) in
            read[group.put] = out.read.reshape(-1, out.read.shape[-1])[group.pick].to(read.dtype)


def _apply(read: torch.Tensor, corr: torch.Tensor, out: torch.Tensor) -> None:
    """``out = read corr`` (``(n, d_s) x (d_s, w) -> (n, w)``), rounded once to ``out``'s dtype."""
    if out.dtype == read.dtype:
        torch.mm(read, corr, out=out)
    else:
        out.copy_(torch.mm(read, corr))
