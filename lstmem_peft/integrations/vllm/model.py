"""The LSTMem variants of vLLM's Qwen3 and Llama: memory layers whose states are vLLM engine state.

A forward of vLLM runs a flat batch of ``N`` tokens from several requests: first the decoding
requests (one token each), then the prefilling ones (a chunk of their prompt each). Per memory
layer (decoder layer ``l`` with memory, depth ``m`` among the memory layers)::

    x = input_layernorm(h)                         (N, d)   the attention input
    Δq, Δo = LSTMemState(x)                         the library's LSTMemLayer, per request:
        decodes:  one batched step from the requests' state slots          (fused step weights)
        prefills: the block scan over each request's chunk from its slot, or from its start state
                  (zeros, or a session's memory) when the chunk is the request's first
        D_t of every token goes up to memory layer m + 1 (EngineMemory.depth_seq)
    q = q_proj(x) + Δq -> q_norm -> RoPE -> attention -> o_proj(.) + Δo

A read-only request (``lstmem_memory_write`` false) runs the same layer with ``write=False``, as the
library's read-only pass (:class:`lstmem_peft.memory.engine.MemoryPass` with ``write=False``) runs it: every
token reads the fixed states of its slot, which hold the request's starting memory from its first
chunk on and are never written, and its depth input is the fixed ``D`` of memory layer ``m - 1``
(that layer hands it up in place of ``D_t`` at each of the request's tokens). In a decode batch that
mixes read-only and writing requests, each group runs as one batch.

The memory math is :class:`lstmem_peft.memory.layer.LSTMemLayer`, the same module the PEFT adapter runs,
with the weights of the adapter's ``adapter_model.safetensors``; this module only routes tokens and
state slots. The per-request work runs inside one opaque custom op per layer
(``torch.ops.vllm.lstmem_memory``), so vLLM's ``torch.compile`` sees a fixed graph around it.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable

import torch
from safetensors.torch import load_file
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_pp_group
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model
from vllm.model_executor.models.utils import PPMissingLayer, extract_layer_index, maybe_prefix
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from lstmem_peft.memory.cache import STATE_DTYPES, MemoryLayout
from lstmem_peft.memory.layer import LSTMemLayer
from lstmem_peft.tuner.config import LSTMemConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"


@functools.lru_cache(maxsize=8)
def load_adapter(name: str) -> tuple[LSTMemConfig, str]:
    """The config and the weights file of the LSTMem adapter ``name`` (a local folder or a Hub id,
    through the Hub cache)."""
    config = LSTMemConfig.from_pretrained(name)
    if os.path.isdir(name):
        weights = os.path.join(name, ADAPTER_WEIGHTS)
        if not os.path.isfile(weights):
            raise FileNotFoundError(f"{name} has no {ADAPTER_WEIGHTS}; save the adapter with save_pretrained")
    else:
        from huggingface_hub import hf_hub_download

        weights = hf_hub_download(name, ADAPTER_WEIGHTS)
    return config, weights


def memory_layer_indices(config: LSTMemConfig, num_layers: int) -> list[int]:
    """The decoder layers that carry memory, in depth order."""
    chosen = range(num_layers) if config.layers_to_transform is None else config.layers_to_transform
    return sorted(chosen)


def _adapter_of(hf_config) -> tuple[LSTMemConfig, str]:
    name = getattr(hf_config, "lstmem_adapter", None)
    if not name:
        raise ValueError(
            "the LSTMem vLLM model needs an adapter: build the engine with "
            "lstmem_peft.integrations.vllm.engine_args(model, adapter), which sets hf_overrides['lstmem_adapter']"
        )
    return load_adapter(name)


class EngineMemory:
    """What the memory layers of one model share within a forward, and between the sessions
    extension and the layers.

    Attributes:
        depth_seq: ``(N, n_h, r, r)`` ``D_t`` of every token from the memory layer that ran last in
            the current forward (the depth input of the next one), or ``None``.
        batch: the running forward's requests as host lists, read from vLLM's metadata once per
            forward by the first memory layer (all memory layers share one state group, so one
            metadata object).
        starts: state slot -> one ``(C, D)`` pair ``(n_h, r, r)`` per memory layer (depth order): a
            session's memory, staged by :class:`~lstmem_peft.integrations.vllm.sessions.Sessions` for
            the request that owns the slot and taken by each layer at the request's first chunk.
        read_only: the state slots of read-only requests, kept by
            :class:`~lstmem_peft.integrations.vllm.sessions.Sessions` (set or cleared whenever a request
            starts in a slot).
    """

    def __init__(self) -> None:
        self.depth_seq: torch.Tensor | None = None
        self.batch: _Batch | None = None
        self.starts: dict[int, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
        self.read_only: set[int] = set()

    def take_start(self, slot: int, depth: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        states = self.starts.get(slot)
        if states is None:
            return None
        pair, states[depth] = states[depth], None
        if all(s is None for s in states):
            del self.starts[slot]
        return pair


class _Batch:
    """The requests of one forward, on the host: token ranges, sequence lengths, state slots, which
    requests only read their memory, and the decodes split into writing and read-only groups
    (``(read_only, rows)``, ``rows`` a slice when the group is every decode, else an index tensor)."""

    def __init__(self, metadata, read_only_slots: set[int]) -> None:
        self.decodes, self.prefills = metadata.num_decodes, metadata.num_prefills
        self.requests = self.decodes + self.prefills
        self.tokens = metadata.num_decode_tokens + metadata.num_prefill_tokens
        self.starts = metadata.query_start_loc[: self.requests + 1].tolist()
        self.seq_lens = metadata.seq_lens[: self.requests].tolist()
        self.slots = metadata.state_indices_tensor[: self.requests].long()
        self.slot_list = self.slots.tolist()
        self.read_only = [slot in read_only_slots for slot in self.slot_list]
        flags = self.read_only[: self.decodes]
        self.decode_groups: list[tuple[bool, slice | torch.Tensor]] = []
        if self.decodes and all(f == flags[0] for f in flags):
            self.decode_groups.append((flags[0], slice(0, self.decodes)))
        elif self.decodes:
            for mode in (False, True):
                rows = [i for i, f in enumerate(flags) if f == mode]
                self.decode_groups.append((mode, torch.tensor(rows, device=self.slots.device)))


class LSTMemState(nn.Module, MambaBase):
    """One memory layer as a vLLM state layer: ``C`` and ``D`` per request slot, ``(n_h, r, r)`` each.

    Args:
        hidden_size, query_size: the backbone layer's ``d`` and query width ``d_q``.
        config: the adapter's config.
        layer_idx: the decoder layer.
        depth: the memory layer's index among the memory layers (0: no depth input).
        prefix: the module's name (vLLM finds the layer and its metadata by it).
    """

    def __init__(
        self, hidden_size: int, query_size: int, config: LSTMemConfig, layer_idx: int, depth: int, prefix: str
    ) -> None:
        nn.Module.__init__(self)
        # float32, as the PEFT adapter (PEFT keeps adapter weights in float32 unless told otherwise)
        self.memory = LSTMemLayer(
            hidden_size,
            query_size,
            num_heads=config.num_heads,
            head_dim=config.r,
            alpha=config.alpha,
            layer_idx=layer_idx,
            dtype=torch.float32,
        )
        self.memory.set_depth_input(config.depth_coupling and depth > 0)
        self.depth = depth
        self.prefix = prefix
        self.backend = config.scan_backend
        self.state_dtype = STATE_DTYPES[config.state_dtype]
        self.shared: EngineMemory | None = None  # set by the model
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
        return MambaAttentionBackendEnum.LINEAR

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``(N, d)`` -> ``Δq`` ``(N, d_q)``, ``Δo`` ``(N, d)`` in ``x.dtype``."""
        delta_q = x.new_empty(x.shape[0], self.memory.query_size)
        delta_o = torch.empty_like(x)
        torch.ops.vllm.lstmem_memory(x, delta_q, delta_o, self.prefix)
        return delta_q, delta_o

    def _start(self, slot: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The states a request starts from: its session's memory, else zeros (vLLM does not clear
        a slot it hands out)."""
        pair = self.shared.take_start(slot, self.depth)
        if pair is None:
            zeros = torch.zeros_like(like)
            return zeros, zeros
        return pair[0].to(like), pair[1].to(like)

    def run(self, x: torch.Tensor, delta_q: torch.Tensor, delta_o: torch.Tensor) -> None:
        """The body of the custom op: this layer's memory for the batch of the running forward."""
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        shared = self.shared
        if metadata is None:  # vLLM's profiling / warm-up forwards: no requests, no states
            delta_q.zero_()
            delta_o.zero_()
            shared.depth_seq = shared.batch = None
            return
        if self.depth == 0:  # the first memory layer of the forward reads the requests for all
            shared.batch = _Batch(metadata, shared.read_only)
        batch = shared.batch
        cells, hiddens = self.kv_cache
        decodes, requests, tokens = batch.decodes, batch.requests, batch.tokens
        starts, seq_lens, slots, slot_list = batch.starts, batch.seq_lens, batch.slots, batch.slot_list
        depth_seq = shared.depth_seq if self.memory.depth_input else None
        x = x[:tokens]
        H, R = self.memory.num_heads, self.memory.head_dim
        # D_t of every token for the next memory layer; a read-only request's rows hold its fixed D
        out_seq = torch.empty(tokens, H, R, R, dtype=torch.float32, device=x.device)
        if decodes:
            for i in range(decodes):
                if seq_lens[i] == 1:  # a one-token prompt: the request's first chunk
                    slot = slot_list[i]
                    cells[slot], hiddens[slot] = self._start(slot, cells[slot])
            for read_only, rows in batch.decode_groups:
                group = slots[rows]
                cell, hidden = cells[group], hiddens[group]
                depth = None if depth_seq is None else depth_seq[rows]
                if read_only:  # the fixed states; the lower layer's fixed D as depth input
                    out = self.memory(
                        x[rows].unsqueeze(1), cell, hidden, depth=depth, write=False, backend=self.backend
                    )
                    out_seq[rows] = hidden.to(out_seq.dtype)
                else:
                    out = self.memory(
                        x[rows].unsqueeze(1),
                        cell,
                        hidden,
                        depth=None if depth is None else depth.unsqueeze(1),
                        backend=self.backend,
                        aux=False,  # no feedback samples: vLLM runs no feedback
                    )
                    cells[group] = out.cell
                    hiddens[group] = out.hidden
                    out_seq[rows] = out.hidden_seq[:, 0]
                delta_q[rows] = out.correction(0)[:, 0]
                delta_o[rows] = out.correction(1)[:, 0]
        for i in range(decodes, requests):
            a, b = starts[i], starts[i + 1]
            slot = slot_list[i]
            first = seq_lens[i] == b - a  # the request's first chunk
            if first:
                cell, hidden = self._start(slot, cells[slot])
            else:
                cell, hidden = cells[slot], hiddens[slot]
            if batch.read_only[i]:
                if first:  # the slot holds the starting memory for every later chunk and step
                    cells[slot], hiddens[slot] = cell, hidden
                out = self.memory(
                    x[None, a:b],
                    cell[None],
                    hidden[None],
                    depth=None if depth_seq is None else depth_seq[None, a],
                    write=False,
                    backend=self.backend,
                )
                out_seq[a:b] = hidden.to(out_seq.dtype)
            else:
                out = self.memory(
                    x[None, a:b],
                    cell[None],
                    hidden[None],
                    depth=None if depth_seq is None else depth_seq[None, a:b],
                    backend=self.backend,
                    aux=False,
                )
                cells[slot], hiddens[slot] = out.cell[0], out.hidden[0]
                out_seq[a:b] = out.hidden_seq[0]
            delta_q[a:b] = out.correction(0)[0]  # a one-token chunk keeps its corrections factored
            delta_o[a:b] = out.correction(1)[0]
        delta_q[tokens:] = 0  # vLLM pads the batch for its graphs
        delta_o[tokens:] = 0
        shared.depth_seq = out_seq


def _lstmem_memory(x: torch.Tensor, delta_q: torch.Tensor, delta_o: torch.Tensor, layer_name: str) -> None:
    with torch.no_grad():
        get_forward_context().no_compile_layers[layer_name].run(x, delta_q, delta_o)


def _lstmem_memory_fake(
    x: torch.Tensor, delta_q: torch.Tensor, delta_o: torch.Tensor, layer_name: str
) -> None:
    return None


direct_register_custom_op(
    op_name="lstmem_memory",
    op_func=_lstmem_memory,
    mutates_args=["delta_q", "delta_o"],
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
        chosen = memory_layer_indices(adapter, config.num_hidden_layers)
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

    def _attach_memory(self, config) -> None:
        self.lstmem_adapter, self.lstmem_weights = _adapter_of(config)
        self.lstmem_shared = EngineMemory()
        for state in self.memory_states():
            state.shared = self.lstmem_shared
        self.lstmem_layout = MemoryLayout.of_adapter(
            self.lstmem_adapter, memory_layer_indices(self.lstmem_adapter, config.num_hidden_layers), config
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
        tensors = load_file(self.lstmem_weights)
        pattern = re.compile(
            rf"(?:^|\.)layers\.(\d+)\.self_attn\.{re.escape(self.lstmem_adapter.query_module)}"
            r"\.lstmem_memory\.(\w+)$"
        )
        by_layer: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            match = pattern.search(key)
            if match is None:
                raise ValueError(f"{self.lstmem_weights}: {key!r} is not an LSTMem memory weight")
            by_layer.setdefault(int(match[1]), {})[match[2]] = tensor
        for state in self.memory_states():
            layer_idx = state.memory.layer_idx
            if layer_idx not in by_layer:
                raise ValueError(
                    f"{self.lstmem_weights} holds no memory weights for decoder layer {layer_idx}"
                )
            state.memory.load_state_dict(by_layer.pop(layer_idx), strict=True)
            loaded |= {
                f"model.layers.{layer_idx}.lstmem.memory.{name}"
                for name, _ in state.memory.named_parameters()
            }
        if by_layer:
            raise ValueError(
                f"{self.lstmem_weights} holds memory weights for decoder layers {sorted(by_layer)}, which the "
                "adapter config does not choose (layers_to_transform)"
            )
        return loaded


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
        self._attach_memory(config)


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
        self._attach_memory(vllm_config.model_config.hf_config)
