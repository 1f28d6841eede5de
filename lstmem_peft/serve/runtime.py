"""The model side of the server: loading (the library model; with ``--engine vllm`` only what the
server must know about it, read from the files), message identity in a session's record, and batched
memory writes. (How messages become tokens: :mod:`lstmem_peft.utils.chat`.)

Everything here runs on the scheduler's single worker thread (the model is never entered by two
threads at once). Memory is handled only through the library's public API: a batch of sessions is
gathered into one :class:`~lstmem_peft.MemoryCache` with ``batch_repeat_interleave`` +
``update_rows``, written with :func:`~lstmem_peft.write_history` (:func:`write_rows`), and
scattered back with ``clone`` + ``batch_select_indices``. Reading memory to answer and to score is
:mod:`.generation`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch

from lstmem_peft.memory.cache import MemoryCache, MemoryLayout
from lstmem_peft.training.data import left_pad
from lstmem_peft.tuner.history import memory_layers, memory_layout, row_blocks, write_history
from lstmem_peft.tuner.loading import adapter_weights_file, load_model_and_adapter, load_tokenizer
from lstmem_peft.utils.offline import DEMO_ASSETS
from lstmem_peft.utils.positions import trained_positions

from .protocol import MAX_LOGPROBS

DEMO_MODEL_NAME = "lstmem-demo"


# ---------------------------------------------------------------------- loading
@dataclass
class LoadedModel:
    """The served model: what answers, its tokenizer and what the server says about it.

    Build one with :func:`load_model`, or :meth:`of_model` around a PeftModel already in memory.

    Attributes:
        model: the PeftModel (or anything :func:`~lstmem_peft.tuner.history.find_memory` accepts) with an
            active LSTMem adapter, eval mode; ``None`` with ``lstmem serve --engine vllm``, where the
            vLLM engine holds the only copy of the weights.
        tokenizer: a transformers tokenizer of the backbone.
        name: the model id clients pass as ``model``.
        layout: the :class:`~lstmem_peft.MemoryLayout` every session's cache must have.
        block_size: the adapter's history block length (``write_history`` writes in such blocks).
        max_positions: the most prompt tokens the model takes: the backbone's position limit
            (``max_position_embeddings``), or ``None``; with a vLLM engine at most its
            ``max_model_len - 1`` (a prompt and the token it samples), so that the server's context
            window (at most this) never sends vLLM a request it refuses.
        trained_positions: how many positions the backbone was trained for, or ``None`` when its
            config says nothing (:func:`trained_positions`); the server's window is at most this too.
            The embedded demo's config allows 4,096 positions, but it was trained for 64.
        trained_from: the config key ``trained_positions`` was read from, for messages.
        vocab_size: the token ids the backbone embeds are ``0 .. vocab_size - 1``.
        eos_ids: the token ids that end an answer (:func:`end_of_sequence_ids`).
        adapter_fingerprint: SHA-256 (16 hex) of the memory layers' weights (:func:`memory_fingerprint`).
        device: where session memories live: the model's device; the CPU with a vLLM engine (it
            reads and writes them through session files).
        engine: what generates the answers and writes memory: ``None``, the model (its own
            ``generate``, and :func:`~lstmem_peft.write_history`); or a
            :class:`lstmem_peft.integrations.vllm.serve.VLLMAnswers` (``lstmem serve --engine vllm``),
            which writes memory in the same history blocks with feedback (:func:`write_rows`) and
            gives the log-probabilities of its answers.
    """

    model: torch.nn.Module | None
    tokenizer: object
    name: str
    layout: MemoryLayout
    block_size: int
    max_positions: int | None
    vocab_size: int
    eos_ids: frozenset[int]
    adapter_fingerprint: str
    device: torch.device
    engine: object | None = None
    trained_positions: int | None = None
    trained_from: str = ""

    def library_model(self) -> torch.nn.Module:
        """``model``, which the default engine answers, scores and writes memory with; an error
        naming the fix when there is none (facts read by :meth:`of_files` and no engine to answer)."""
        if self.model is None:
            raise RuntimeError(
                f"{self.name!r} has no library model to run (LoadedModel.of_files reads only what the server says "
                "about the model): set its engine (lstmem serve --engine vllm) or load the model with "
                "load_model(..., engine='hf')"
            )
        return self.model

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
        return cls(
            model=model,
            tokenizer=tokenizer,
            name=name,
            layout=memory_layout(model),
            block_size=int(configs[adapter].block_size),
            max_positions=getattr(getattr(model, "config", None), "max_position_embeddings", None),
            vocab_size=vocab_size,
            eos_ids=end_of_sequence_ids(getattr(model, "generation_config", None), tokenizer),
            adapter_fingerprint=memory_fingerprint(memory_layers(model)),
            device=next(model.parameters()).device,
            trained_positions=trained,
            trained_from=trained_from,
        )

    @classmethod
    def of_files(
        cls, model: str, adapter: str, tokenizer, name: str, engine: object | None = None
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
            engine: what answers (see the class's attributes).
        """
        from transformers import AutoConfig, GenerationConfig

        from lstmem_peft.tuner.config import LSTMemConfig

        backbone = AutoConfig.from_pretrained(model)
        config = LSTMemConfig.from_pretrained(adapter)
        layers = adapter_memory_layers(config, adapter_weights_file(adapter), backbone)
        try:
            generation = GenerationConfig.from_pretrained(model)
        except OSError:  # no generation_config.json: transformers derives one from the config
            generation = GenerationConfig.from_model_config(backbone)
        trained, trained_from = trained_positions(backbone)
        return cls(
            model=None,
            tokenizer=tokenizer,
            name=name,
            layout=MemoryLayout.of_adapter(config, [layer.layer_idx for layer in layers], backbone),
            block_size=int(config.block_size),
            max_positions=getattr(backbone, "max_position_embeddings", None),
            vocab_size=int(backbone.vocab_size),
            eos_ids=end_of_sequence_ids(generation, tokenizer),
            adapter_fingerprint=memory_fingerprint(layers),
            device=torch.device("cpu"),
            engine=engine,
            trained_positions=trained,
            trained_from=trained_from,
        )


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

    Each is the layer :func:`~lstmem_peft.tuner.layer.memory_layer` builds for its decoder layer (the
    one the PEFT tuner and the vLLM plugin build), float32 on the CPU, with its depth input as
    injection sets it, then ``load_state_dict(strict=True)`` of its tensors: the values
    ``PeftModel.from_pretrained`` gives it (PEFT casts the adapter to float32; the layer's load hooks
    convert older files and refuse NaN).

    Args:
        config: the adapter's :class:`~lstmem_peft.LSTMemConfig`.
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
    from lstmem_peft.tuner.layer import memory_layer

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
) -> LoadedModel:
    """Load the embedded demo (no arguments) or a backbone + LSTMem adapter (local folders or Hub ids).

    Args:
        model: backbone, Hub id or local folder; ``None`` with ``adapter=None``: the embedded demo.
        adapter: LSTMem adapter folder or Hub id (required with ``model``).
        name: the model id served at ``/v1/models`` (default: ``lstmem-demo`` or the adapter's name).
        device: ``cpu`` or ``cuda`` (default: cuda when available); with ``engine="vllm"`` only ``cpu``
            (session memories stay on the CPU; vLLM places the model itself).
        dtype: backbone dtype (``auto``, ``float32``, ``bfloat16``, ``float16``).
        engine: ``hf`` (answers from the library model's ``generate``) or ``vllm`` (answers,
            log-probabilities and memory writes from a vLLM engine over the same backbone and adapter;
            needs ``model`` and ``adapter``; no library model is loaded: :meth:`LoadedModel.of_files`).
        vllm_options: more keyword arguments of ``vllm.LLM`` (``engine="vllm"``).
    """
    if engine not in ("hf", "vllm"):
        raise ValueError(f"engine must be 'hf' or 'vllm', got {engine!r}")
    if engine == "vllm":
        if model is None or adapter is None:
            raise ValueError(
                "--engine vllm needs --model and --adapter (a Qwen3 or Llama backbone and its LSTMem adapter); the "
                "embedded demo runs with the default engine"
            )
        from lstmem_peft.integrations.vllm.serve import VLLMAnswers, require_vllm

        require_vllm()  # before anything loads
        if device not in (None, "cpu"):
            raise ValueError(
                f"--device {device} applies to the default engine's model; with --engine vllm, vLLM places the "
                "model itself and session memories stay on the CPU: drop --device"
            )
        check_saved_memory_id(adapter)
        served = LoadedModel.of_files(
            model, adapter, load_tokenizer(model, adapter), _served_name(name, adapter)
        )
        served.engine = VLLMAnswers(
            model, adapter, served.block_size, dtype=dtype, top_logprobs=MAX_LOGPROBS, **(vllm_options or {})
        )
        # the engine holds a prompt and the token it samples (a scored prompt samples one)
        engine_limit = served.engine.max_model_len - 1
        served.max_positions = min(served.max_positions or engine_limit, engine_limit)
        return served
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
    path = os.path.join(adapter, "adapter_config.json")
    if not os.path.isfile(path):
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(adapter, "adapter_config.json")
    with open(path) as fh:
        saved = json.load(fh)
    if not saved.get("memory_id"):
        raise ValueError(
            f"{path} has no memory_id, so the adapter gets a new identity at every load and stored session "
            "memory could not be reloaded after a restart; load it once and save it again "
            "(PeftModel.from_pretrained(...).save_pretrained(...)) to give it a fixed memory_id"
        )


# ---------------------------------------------------------------------- messages in a record
def message_hash(role: str, content: str) -> str:
    """The identity of a chat message in a session's record (role and exact content)."""
    return hashlib.sha256(json.dumps([role, content]).encode()).hexdigest()[:32]


def tokens_after(tokenizer, ids: list[int], chars: int) -> list[int] | None:
    """The tokens of ``ids`` after its first ``chars`` characters of decoded text, or ``None`` when
    no token boundary falls exactly there (a token-id prompt that extends a text written before)."""
    lo, hi = 0, len(ids)
    while lo < hi:  # the fewest leading tokens whose text reaches ``chars``
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=False)) >= chars:
            hi = mid
        else:
            lo = mid + 1
    if len(tokenizer.decode(ids[:lo], skip_special_tokens=False)) != chars:
        return None
    return ids[lo:]


# ---------------------------------------------------------------------- gathering and scattering rows
def fresh_memory(layout: MemoryLayout, device: torch.device) -> MemoryCache:
    """A one-row memory with zero states (a session that has written nothing yet)."""
    cache = MemoryCache(layout)
    cache.ensure(1, device)
    return cache


def gather(rows: list[MemoryCache]) -> MemoryCache:
    """One batch cache whose row ``i`` is ``rows[i]`` (each a one-row cache of the same layout)."""
    batch = rows[0].clone()
    batch.batch_repeat_interleave(len(rows))
    for i, row in enumerate(rows[1:], start=1):
        batch.update_rows(torch.tensor([i]), row)
    return batch


def scatter(batch: MemoryCache, index: int) -> MemoryCache:
    """Row ``index`` of a batch cache as an independent one-row cache."""
    row = batch.clone()
    row.batch_select_indices(torch.tensor([index]))
    return row


# ---------------------------------------------------------------------- gate statistics
class GateProbe:
    """Per-row means of the output gate ``o_t`` and depth gate ``g_t`` of every memory layer while
    :func:`~lstmem_peft.write_history` writes a batch (forward hooks on the memory layers; the
    memory math is untouched).

    ``write_history`` on a padded batch runs block ``k`` on the rows that still have tokens
    (:func:`~lstmem_peft.tuner.history.row_blocks`, the one definition of that rule); the probe reads
    the same rule to attribute each block's rows, and each forward's ``valid`` mask to leave padding
    out. Use as a context manager around one ``write_history`` call.

    Args:
        model: the served model.
        lengths: valid tokens of each batch row.
        block_size: the ``block_size`` passed to ``write_history``.
    """

    def __init__(self, model, lengths: list[int], block_size: int) -> None:
        self.layers = memory_layers(model)
        self.blocks = row_blocks(lengths, block_size)
        num = len(self.layers)
        self.sums = torch.zeros(len(lengths), num, 2, dtype=torch.float64)  # (rows, layers, [o, g])
        self.counts = torch.zeros(len(lengths), num, dtype=torch.float64)
        self._forward = [0] * num
        self._handles = []

    def __enter__(self) -> GateProbe:
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_hook(self._hook(index), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, index: int):
        def hook(module, args, kwargs, output) -> None:
            k = self._forward[index]
            self._forward[index] += 1
            if output.out_gate is None or output.depth_gate is None:
                return
            rows = self.blocks[k] if k < len(self.blocks) else []
            if len(rows) != output.out_gate.shape[0]:
                return  # not the scheme this probe follows: no statistics rather than wrong ones
            valid = kwargs.get("valid")
            o = output.out_gate.detach().double().mean(dim=(-1, -2))  # (B, T)
            g = output.depth_gate.detach().double().mean(dim=(-1, -2))
            w = torch.ones_like(o) if valid is None else valid.to(o.dtype)
            index_rows = torch.tensor(rows)
            self.sums[index_rows, index, 0] += (o * w).sum(dim=1).cpu()
            self.sums[index_rows, index, 1] += (g * w).sum(dim=1).cpu()
            self.counts[index_rows, index] += w.sum(dim=1).cpu()

        return hook

    def row(self, b: int) -> dict[str, list[float]] | None:
        """``{"out_gate": [...], "depth_gate": [...]}`` (one mean per layer) for row ``b``, or
        ``None`` when nothing was observed for it."""
        counts = self.counts[b]
        if not bool((counts > 0).all()):
            return None
        means = self.sums[b] / counts[:, None]
        return {"out_gate": means[:, 0].tolist(), "depth_gate": means[:, 1].tolist()}


def state_norms(cache: MemoryCache) -> dict[str, list[float]]:
    """Frobenius norms of ``C`` and ``D`` of every memory layer (row 0), for the record and page."""
    if not cache.is_initialized:
        return {"cell": [], "hidden": []}
    return {
        "cell": [float(layer.cell[0].double().norm()) for layer in cache.layers],
        "hidden": [float(layer.hidden[0].double().norm()) for layer in cache.layers],
    }


def write_rows(
    loaded: LoadedModel, rows: list[MemoryCache], tokens: list[list[int]]
) -> tuple[list[MemoryCache], list[dict | None]]:
    """Write ``tokens[i]`` into ``rows[i]`` as history (blocks + feedback) in one batched call.

    Args:
        loaded: the served model.
        rows: one-row caches (not modified).
        tokens: token ids per row; rows with none are returned as they are.

    Returns:
        new one-row caches (same order) and the gate statistics of each row's write (or ``None``;
        always ``None`` when a vLLM engine writes: it reports no gates).
    """
    out = list(rows)
    gates: list[dict | None] = [None] * len(rows)
    active = [i for i, t in enumerate(tokens) if t]
    if not active:
        return out, gates
    if loaded.engine is not None:  # lstmem serve --engine vllm: history requests inside vLLM
        written = loaded.engine.write_rows(
            [rows[i] for i in active], [tokens[i] for i in active], loaded.block_size
        )
        for i, memory in zip(active, written, strict=True):
            out[i] = memory.to(loaded.device)
        return out, gates
    pad = loaded.tokenizer.pad_token_id
    pad = 0 if pad is None else pad
    ids, mask = left_pad([tokens[i] for i in active], pad, loaded.device)
    batch = gather([rows[i] for i in active])
    lengths = [len(tokens[i]) for i in active]
    model = loaded.library_model()
    with torch.no_grad(), GateProbe(model, lengths, loaded.block_size) as probe:
        write_history(model, ids, batch, attention_mask=mask, block_size=loaded.block_size, progress=False)
    for j, i in enumerate(active):
        out[i] = scatter(batch, j)
        gates[i] = probe.row(j)
    return out, gates
