"""The served model: its facts (:class:`LoadedModel`: tokenizer, name, memory layout, limits, EOS
ids, adapter fingerprint) and the :class:`~.engine.Engine` that runs it, and loading them: the library
model, or with ``--engine vllm`` a vLLM engine and only what the server must know about the model,
read from the files. (How messages become tokens: :mod:`lstmem_peft.utils.chat`; a session's fresh
memory and batched memory writes: :mod:`.memories`; reading memory to answer and to score:
:mod:`.generation`.)
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace

import torch

from lstmem_peft.memory.adapter_files import ADAPTER_CONFIG_NAME, adapter_file, adapter_weights_file
from lstmem_peft.memory.cache import MemoryLayout
from lstmem_peft.memory.spec import read_memory_spec
from lstmem_peft.tuner.backbones import resolve_model
from lstmem_peft.tuner.history import memory_layers, memory_layout
from lstmem_peft.tuner.loading import load_model_and_adapter, load_tokenizer
from lstmem_peft.tuner.shipped_adapters import check_pair
from lstmem_peft.utils.offline import DEMO_ASSETS
from lstmem_peft.utils.positions import trained_positions
from lstmem_peft.utils.shipped_adapters import resolve_adapter

from .engine import Engine, NoEngine
from .engine_library import LibraryEngine
from .protocol import MAX_LOGPROBS

DEMO_MODEL_NAME = "lstmem-demo"


@dataclass
class LoadedModel:
    """The served model: the engine that runs it, its tokenizer and what the server says about it.

    Build one with :func:`load_model`, or :meth:`of_model` around a PeftModel already in memory.

    Attributes:
        tokenizer: a transformers tokenizer of the backbone.
        name: the model id clients pass as ``model``.
        layout: the :class:`~lstmem_peft.MemoryLayout` every session's cache must have.
        block_size: the adapter's history block length (``write_history`` writes in such blocks).
        max_positions: the most prompt tokens the model takes: the backbone's position limit
            (``max_position_embeddings``), or ``None``; with a vLLM engine at most its
            ``max_model_len - 1`` (a prompt and the token it samples; :meth:`with_engine`), so that the
            server's context window (at most this) never sends vLLM a request it refuses.
        trained_positions: how many positions the backbone was trained for, or ``None`` when its
            config says nothing (:func:`trained_positions`); the server's window is at most this too.
            The embedded demo's config allows 4,096 positions, but it was trained for 64.
        trained_from: the config key ``trained_positions`` was read from, for messages.
        vocab_size: the token ids the backbone embeds are ``0 .. vocab_size - 1``.
        eos_ids: the token ids that end an answer (:func:`end_of_sequence_ids`).
        adapter_fingerprint: SHA-256 (16 hex) of the memory layers' weights (:func:`memory_fingerprint`).
        device: where session memories live: the model's device; the CPU with a vLLM engine (it
            reads and writes them through session files).
        engine: what answers, scores and writes memory (:class:`~.engine.Engine`): a
            :class:`~.engine_library.LibraryEngine` over the PeftModel, or a
            :class:`~.engine_vllm.VLLMEngine` (``lstmem serve --engine vllm``); :class:`~.engine.NoEngine`
            for facts read from files with nothing to run them.
    """

    tokenizer: object
    name: str
    layout: MemoryLayout
    block_size: int
    max_positions: int | None
    vocab_size: int
    eos_ids: frozenset[int]
    adapter_fingerprint: str
    device: torch.device
    engine: Engine = field(default_factory=NoEngine)
    trained_positions: int | None = None
    trained_from: str = ""

    @property
    def model(self) -> torch.nn.Module | None:
        """The library model the engine runs (a PeftModel with an active LSTMem adapter), or
        ``None`` where none is loaded (``--engine vllm``: the vLLM engine holds the only copy of
        the weights)."""
        return getattr(self.engine, "model", None)

    def with_engine(self, engine: Engine) -> LoadedModel:
        """These facts served by ``engine``: the position limit becomes at most what one request of
        the engine holds, less the one token it samples (``engine.request_limit - 1``)."""
        limit = engine.request_limit
        positions = self.max_positions
        if limit is not None:
            positions = min(positions or limit - 1, limit - 1)
        return replace(self, engine=engine, max_positions=positions)

    @classmethod
    def of_model(cls, model: torch.nn.Module, tokenizer, name: str) -> LoadedModel:
        """The served model of the default engine: ``model`` (a PeftModel with an active LSTMem
        adapter, eval mode) answers and writes memory; everything else is read from it."""
        configs = getattr(model, "peft_config", None)
        adapter = getattr(model, "active_adapter", None)
        if not isinstance(configs, dict) or adapter not in configs:
            raise TypeError(
                f"{type(model).__name__} is not a PeftModel with an active LSTMem adapter; load one with "
                "PeftModel.from_pretrained(backbone, adapter_path)"
            )
        try:
            vocab_size = int(model.get_input_embeddings().num_embeddings)
        except Exception:  # noqa: BLE001  (a model without input embeddings: the tokenizer's size)
            vocab_size = len(tokenizer)
        trained, trained_from = trained_positions(getattr(model, "config", None))
        block_size = int(configs[adapter].block_size)
        eos_ids = end_of_sequence_ids(getattr(model, "generation_config", None), tokenizer)
        return cls(
            tokenizer=tokenizer,
            name=name,
            layout=memory_layout(model),
            block_size=block_size,
            max_positions=getattr(getattr(model, "config", None), "max_position_embeddings", None),
            vocab_size=vocab_size,
            eos_ids=eos_ids,
            adapter_fingerprint=memory_fingerprint(memory_layers(model)),
            device=next(model.parameters()).device,
            engine=LibraryEngine(model, tokenizer, block_size, vocab_size, eos_ids),
            trained_positions=trained,
            trained_from=trained_from,
        )

    @classmethod
    def of_files(
        cls, model: str, adapter: str, tokenizer, name: str, engine: Engine | None = None
    ) -> LoadedModel:
        """The served model of an engine that holds the weights itself (``lstmem serve --engine vllm``):
        no library model is loaded; what the server says about it comes from the files, equal to what
        :meth:`of_model` reads from the PeftModel of the same backbone and adapter.

        * ``layout``: :meth:`MemoryLayout.of_adapter <lstmem_peft.MemoryLayout.of_adapter>` of the
          adapter's config, its memory layers and the backbone's config (as the vLLM model builds it);
        * ``max_positions``, ``trained_positions``, ``vocab_size``: the backbone's config;
        * ``eos_ids``: the backbone's generation config (``generation_config.json``, else the one
          transformers derives from its config), else the tokenizer's;
        * ``adapter_fingerprint``: the adapter's memory layers loaded from its safetensors file as
          ``PeftModel.from_pretrained`` loads them (float32, :func:`adapter_memory_layers`).

        Args:
            model, adapter: the backbone and the LSTMem adapter, local folders or Hub ids.
            tokenizer: the backbone's tokenizer (or the adapter's, as :func:`load_model` picks it).
            name: the model id clients pass as ``model``.
            engine: what runs the model (:meth:`with_engine`); ``None``: the facts alone
                (:class:`~.engine.NoEngine`).
        """
        from transformers import AutoConfig, GenerationConfig

        backbone = AutoConfig.from_pretrained(model)
        config = read_memory_spec(adapter)  # what the vLLM plugin builds its memory layers from
        layers = adapter_memory_layers(config, adapter_weights_file(adapter), backbone)
        try:
            generation = GenerationConfig.from_pretrained(model)
        except OSError:  # no generation_config.json: transformers derives one from the config
            generation = GenerationConfig.from_model_config(backbone)
        trained, trained_from = trained_positions(backbone)
        facts = cls(
            tokenizer=tokenizer,
            name=name,
            layout=MemoryLayout.of_adapter(config, [layer.layer_idx for layer in layers], backbone),
            block_size=int(config.block_size),
            max_positions=getattr(backbone, "max_position_embeddings", None),
            vocab_size=int(backbone.vocab_size),
            eos_ids=end_of_sequence_ids(generation, tokenizer),
            adapter_fingerprint=memory_fingerprint(layers),
            device=torch.device("cpu"),
            trained_positions=trained,
            trained_from=trained_from,
        )
        return facts if engine is None else facts.with_engine(engine)


def end_of_sequence_ids(generation_config, tokenizer) -> frozenset[int]:
    """The token ids that end an answer: the generation config's EOS (one id or a list), else the
    tokenizer's; empty when neither has one."""
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if eos is None:
        eos = tokenizer.eos_token_id
    return frozenset(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))


def memory_fingerprint(layers) -> str:
    """SHA-256 (16 hex) of memory layers' weights: changes whenever the adapter's weights do.

    The digest runs over the layers in depth order, and in each over its ``state_dict()`` items sorted
    by name: the name, then the tensor's float32 bytes (so a bfloat16 file and the float32 layers
    PEFT loads it into give one value)."""
    digest = hashlib.sha256()
    for layer in layers:
        for name, p in sorted(layer.state_dict().items()):
            digest.update(name.encode())
            digest.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def adapter_memory_layers(config, weights_file: str, backbone_config) -> list[torch.nn.Module]:
    """The adapter's memory layers, loaded from its weights file without the backbone.

    Each is the layer :func:`~lstmem_peft.memory.spec.memory_layer` builds for its decoder layer (the
    one the PEFT tuner and the vLLM plugin build), float32 on the CPU, with its depth input as
    injection sets it, then ``load_state_dict(strict=True)`` of its tensors: the values
    ``PeftModel.from_pretrained`` gives it (PEFT casts the adapter to float32; the layer's load hooks
    convert older files and refuse NaN).

    Args:
        config: the adapter's :class:`~lstmem_peft.memory.spec.MemorySpec`
            (:func:`~lstmem_peft.memory.spec.read_memory_spec`, or
            :meth:`LSTMemConfig.memory_spec <lstmem_peft.LSTMemConfig.memory_spec>`).
        weights_file: its ``adapter_model.safetensors``, keys as PEFT saves them
            (``...layers.<i>.self_attn.<query module>.lstmem_memory.<name>``).
        backbone_config: the backbone's transformers config (``num_hidden_layers``, ``hidden_size``,
            ``num_attention_heads``, ``head_dim``).

    Returns:
        the memory layers in depth order (``layer.layer_idx``: the decoder layer).

    Raises:
        ValueError: the file lacks a chosen layer's weights, holds weights of other layers or
            tensors that are not memory weights, or its tensors do not fit the backbone.
    """
    from safetensors.torch import load_file

    from lstmem_peft.memory.adapter_files import memory_weights_by_layer
    from lstmem_peft.memory.spec import memory_layer

    chosen = config.memory_layer_indices(backbone_config.num_hidden_layers)
    by_layer = memory_weights_by_layer(load_file(weights_file), config.query_module, chosen, weights_file)
    hidden = backbone_config.hidden_size
    heads = backbone_config.num_attention_heads
    query = heads * (getattr(backbone_config, "head_dim", None) or hidden // heads)
    layers = []
    for depth, layer_idx in enumerate(chosen):
        layer = memory_layer(config, hidden, query, layer_idx, dtype=torch.float32)
        layer.set_depth_input(config.receives_depth(depth))
        try:
            layer.load_state_dict(by_layer[layer_idx], strict=True)
        except RuntimeError as err:
            raise ValueError(
                f"{weights_file}: the memory weights of decoder layer {layer_idx} do not fit this backbone "
                f"(hidden size {hidden}, query size {query}); was the adapter trained on it? {err}"
            ) from err
        layers.append(layer.eval())
    return layers


def load_model(
    model: str | None = None,
    adapter: str | None = None,
    name: str | None = None,
    device: str | None = None,
    dtype: str = "auto",
    engine: str = "hf",
    vllm_options: dict | None = None,
    store: str | None = None,
) -> LoadedModel:
    """Load the embedded demo (no arguments) or a backbone + LSTMem adapter (local folders or Hub ids).

    Args:
        model: backbone, a short name of ``lstmem models`` (its converted folder), a Hub id or a local
            folder; ``None`` with ``adapter=None``: the embedded demo.
        adapter: LSTMem adapter folder, Hub id or the short name of a shipped adapter
            (``smollm2-135m-english-numbers``; required with ``model``).
        name: the model id served at ``/v1/models`` (default: ``lstmem-demo`` or the adapter's name).
        device: ``cpu`` or ``cuda`` (default: cuda when available); with ``engine="vllm"`` only ``cpu``
            (session memories stay on the CPU; vLLM places the model itself).
        dtype: backbone dtype (``auto``, ``float32``, ``bfloat16``, ``float16``).
        engine: ``hf`` (answers from the library model's ``generate``) or ``vllm`` (answers,
            log-probabilities and memory writes from a vLLM engine over the same backbone and adapter;
            needs ``model`` and ``adapter``; no library model is loaded: :meth:`LoadedModel.of_files`).
        vllm_options: more keyword arguments of ``vllm.LLM`` (``engine="vllm"``).
        store: the session store's folder (``lstmem serve --store``): with ``engine="vllm"`` required,
            as it becomes vLLM's session directory (the engine reads and writes the store's own
            memory files; :mod:`.engine_vllm`); the default engine does not use it.
    """
    if engine not in ("hf", "vllm"):
        raise ValueError(f"engine must be 'hf' or 'vllm', got {engine!r}")
    check_pair(model, adapter)  # a shipped adapter on another backbone: refused before anything loads
    adapter = resolve_adapter(adapter)  # a shipped adapter's short name: its folder in the package
    if engine == "vllm":
        if model is None or adapter is None:
            raise ValueError(
                "--engine vllm needs --model and --adapter (a Qwen3 or Llama backbone and its LSTMem adapter); the "
                "embedded demo runs with the default engine"
            )
        from .engine_vllm import VLLMEngine, require_vllm

        require_vllm()  # before anything loads
        if store is None:
            raise ValueError(
                "--engine vllm reads and writes the session store's memory files: pass the store's folder "
                "(load_model(..., store=...), what lstmem serve --store gives)"
            )
        if device not in (None, "cpu"):
            raise ValueError(
                f"--device {device} applies to the default engine's model; with --engine vllm, vLLM places the "
                "model itself and session memories stay on the CPU: drop --device"
            )
        check_saved_memory_id(adapter)
        model = resolve_model(model)  # a short name of `lstmem models`: its converted folder
        facts = LoadedModel.of_files(
            model, adapter, load_tokenizer(model, adapter), _served_name(name, adapter)
        )
        engine = VLLMEngine(
            model,
            adapter,
            store,
            facts.block_size,
            facts.eos_ids,
            dtype=dtype,
            top_logprobs=MAX_LOGPROBS,
            **(vllm_options or {}),
        )
        return facts.with_engine(engine)
    if (model is None) != (adapter is None):
        raise ValueError(
            "pass both --model and --adapter (a backbone and the LSTMem adapter trained on it), or neither "
            "for the embedded demo"
        )
    check_saved_memory_id(str(DEMO_ASSETS / "adapter_full") if adapter is None else adapter)
    peft_model, tokenizer = load_model_and_adapter(model, adapter, dtype=dtype, device=device)
    return LoadedModel.of_model(peft_model, tokenizer, _served_name(name, adapter))


def _served_name(name: str | None, adapter: str | None) -> str:
    """The model id served at ``/v1/models``: ``name``, else the demo's or the adapter folder's name."""
    return name or (DEMO_MODEL_NAME if adapter is None else os.path.basename(os.path.normpath(adapter)))


def check_saved_memory_id(adapter: str) -> None:
    """Refuse an adapter whose saved ``adapter_config.json`` has no ``memory_id``.

    Such an adapter draws a new random ``memory_id`` at every load, so the memory a server stored
    would be refused (another layout) after a restart.
    """
    path = adapter_file(adapter, ADAPTER_CONFIG_NAME)
    with open(path) as fh:
        saved = json.load(fh)
    if not saved.get("memory_id"):
        raise ValueError(
            f"{path} has no memory_id, so the adapter gets a new identity at every load and stored session "
            "memory could not be reloaded after a restart; load it once and save it again "
            "(PeftModel.from_pretrained(...).save_pretrained(...)) to give it a fixed memory_id"
        )
