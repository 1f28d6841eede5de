"""The LSTMem variants of vLLM's Qwen3 and Llama: the model classes vLLM is pointed at.

``LSTMemQwen3ForCausalLM`` and ``LSTMemLlamaForCausalLM`` (registered by
:func:`lstmem_peft.integrations.vllm.register` as ``lstmem_peft.integrations.vllm.model:<name>``) are
vLLM's own models whose decoder layers chosen by the adapter hold a memory layer
(:class:`~.state.LSTMemState`): :class:`_MemoryDecoderLayer` adds its ``Δq`` to the query projection's
output before q-norm and RoPE and its ``Δo`` after the output projection, and :class:`_MemoryModel`
checks the engine (:func:`~.checks.check_engine_config`), declares the memory's state shapes and
dtypes to vLLM, shares one :class:`~.engine_memory.EngineMemory` among the memory layers and loads the
adapter's weights (``W_dq`` sliced by query head under tensor parallelism).

How a forward routes requests to state slots: :mod:`~.state`; the per-step metadata and the state
backend: :mod:`~.backend`. Adding a backbone family: docs/vllm.md, "Adding a backbone".
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from safetensors.torch import load_file
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model
from vllm.model_executor.models.utils import PPMissingLayer, extract_layer_index, maybe_prefix

from lstmem_peft.memory.adapter_files import memory_weights_by_layer
from lstmem_peft.memory.cache import STATE_DTYPES, MemoryLayout

from .checks import adapter_of, check_engine_config
from .engine_memory import EngineMemory
from .state import LSTMemState


class _MemoryDecoderLayer:
    """What a decoder layer with memory adds to vLLM's (Qwen3 and Llama layouts: ``input_layernorm``,
    ``self_attn`` with ``qkv_proj`` / optional ``q_norm``, ``k_norm`` / ``rotary_emb`` / ``attn`` /
    ``o_proj``, ``post_attention_layernorm``, ``mlp``): the corrections of paper Sec. 3.2 where the
    adapter puts memory, ``Δq`` on the query projection's output before q-norm and RoPE and ``Δo``
    after the output projection."""

    def _attach_memory(self, config, prefix: str) -> None:
        adapter, _ = adapter_of(config)
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
        self.lstmem_adapter, self.lstmem_weights = adapter_of(config)
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
        adapter, _ = adapter_of(vllm_config.model_config.hf_config)
        shape = (adapter.num_heads, adapter.r, adapter.r)
        return (shape, shape)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        adapter, _ = adapter_of(vllm_config.model_config.hf_config)
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
