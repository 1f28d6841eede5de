"""What an LSTMem layer checks when an adapter file (or a checkpoint) is loaded into it: weights that
hold NaN or inf are refused; where an adapter's files are (:func:`adapter_file`,
:func:`adapter_weights_file`) and how its tensors are found by decoder layer when they are loaded
without PEFT (the vLLM plugin, the server's fingerprint); and the refusal of weights saved for
another base model, rank or head count, which names that cause."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from lstmem_peft.utils.shipped_adapters import resolve_adapter

#: The files of a saved adapter (PEFT's names: ``peft.utils.CONFIG_NAME``, ``SAFETENSORS_WEIGHTS_NAME``).
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


def adapter_file(adapter: str | os.PathLike, name: str) -> str:
    """The file ``name`` of the adapter ``adapter``: in a local folder (whether there or not: the
    caller says what is missing), a shipped adapter's (its short name,
    :func:`~lstmem_peft.utils.shipped_adapters.resolve_adapter`), or a Hub id's through the Hub cache
    (downloaded once)."""
    adapter = resolve_adapter(adapter)
    if os.path.isdir(adapter):
        return os.path.join(adapter, name)
    from huggingface_hub import hf_hub_download

    return hf_hub_download(adapter, name)


def adapter_weights_file(adapter: str | os.PathLike) -> str:
    """The ``adapter_model.safetensors`` of the LSTMem adapter ``adapter`` (a local folder, a shipped
    adapter's short name or a Hub id, :func:`adapter_file`), for loading it without PEFT (the vLLM
    plugin, the server's facts).

    Raises:
        FileNotFoundError: a local folder without it, with the fix.
    """
    path = adapter_file(adapter, ADAPTER_WEIGHTS_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{os.fspath(adapter)} has no {ADAPTER_WEIGHTS_NAME} (a .bin adapter cannot be loaded without PEFT); "
            "load it and save it again with save_pretrained(folder) (safetensors is its default)"
        )
    return path


def refuse_nonfinite_weights(layer, incompatible_keys) -> None:
    """After a state dict is loaded into ``layer`` (an adapter file, a checkpoint): every weight finite."""
    bad = [name for name, p in layer.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise ValueError(
            f"the LSTMem weights loaded for decoder layer {layer.layer_idx} hold NaN or inf in {bad}: the adapter "
            "file is damaged or was saved from a diverged run; load another checkpoint"
        )


@dataclass(frozen=True)
class MemoryWidths:
    """The widths one memory layer's weights fix: ``hidden`` ``d`` (the attention input and output),
    ``query`` ``d_q`` (the query projection's output) and ``state`` ``d_s = num_heads * r``."""

    hidden: int
    query: int
    state: int

    @classmethod
    def of_weights(cls, weights: dict[str, torch.Tensor]) -> MemoryWidths | None:
        """The widths of one layer's saved weights by name (``w_in`` ``(4 d_s, d)``, ``w_dq``
        ``(d_q, d_s)``); ``None`` when either is absent (a damaged file, refused elsewhere)."""
        w_in, w_dq = weights.get("w_in"), weights.get("w_dq")
        if w_in is None or w_dq is None or w_in.dim() != 2 or w_dq.dim() != 2:
            return None
        return cls(hidden=int(w_in.shape[1]), query=int(w_dq.shape[0]), state=int(w_in.shape[0]) // 4)


def _span(layers: list[int]) -> str:
    """``0-35`` for consecutive layers, else the list."""
    if layers and layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
        return f"{layers[0]}-{layers[-1]}"
    return ", ".join(map(str, layers))


def _layers(count: int) -> str:
    return f"{count} decoder layer{'' if count == 1 else 's'}"


def refuse_weights_of_another_shape(
    saved: dict[int, MemoryWidths | None],
    model: dict[int, MemoryWidths],
    *,
    source: str,
    saved_base: str | None,
    model_name: str | None,
    model_layers: int | None,
    r: int,
    num_heads: int,
) -> None:
    """Before adapter weights are loaded: refuse weights saved for another base model (other decoder
    layers, another hidden or query width) or for another rank or head count, in one sentence that
    names both sides, instead of torch's list of size mismatches or a "damaged file".

    Args:
        saved: the widths of the saved weights by decoder layer (:meth:`MemoryWidths.of_weights`;
            ``None`` for a layer whose ``w_in`` or ``w_dq`` is missing).
        model: the widths of the memory layers the adapter has on this model, by decoder layer.
        source: what the weights are (an adapter folder, "the adapter weights"), for the message.
        saved_base: the adapter config's ``base_model_name_or_path`` (``None``: not recorded).
        model_name: this model's ``name_or_path`` (``None`` or empty: unnamed).
        model_layers: this model's number of decoder layers (``None``: unknown).
        r, num_heads: the adapter config's.

    Raises:
        ValueError: the weights do not fit; the message names the cause and the fix.
    """
    known = [widths for widths in saved.values() if widths is not None]
    if not known or not model:
        return  # no memory weights at all: another adapter, refused (or warned about) by PEFT's load
    ours, theirs = next(iter(model.values())), known[0]
    saved_layers, model_chosen = sorted(saved), sorted(model)
    if saved_layers != model_chosen or (theirs.hidden, theirs.query) != (ours.hidden, ours.query):
        count = "" if model_layers is None else f", {_layers(model_layers)}"
        raise ValueError(
            f"{source} was trained on another base model ({saved_base or 'its name was not recorded'}): it holds "
            f"memory weights for {_layers(len(saved_layers))} ({_span(saved_layers)}) of hidden width "
            f"{theirs.hidden} and query width {theirs.query}, while this model ({model_name or 'unnamed'}{count}, "
            f"hidden width {ours.hidden}, query width {ours.query}) needs them for decoder layers "
            f"{_span(model_chosen)}. Load it onto the base model it was trained on, "
            "with the adapter_config.json saved beside it, or train an adapter for this model"
        )
    if theirs.state != ours.state:
        raise ValueError(
            f"{source} holds memory weights for num_heads * r = {theirs.state} (heads times rank), but the "
            f"adapter config says num_heads={num_heads} and r={r} (num_heads * r = {ours.state}): the weights "
            "were saved with another rank or head count. Load them with the r and num_heads they were saved "
            "with (the adapter_config.json written beside them), or train an adapter with this config"
        )


def memory_weights_by_layer(
    tensors: dict[str, torch.Tensor], query_module: str, layers: list[int], source: str
) -> dict[int, dict[str, torch.Tensor]]:
    """The memory weights of an adapter file by decoder layer, for loading without PEFT.

    Args:
        tensors: the file's tensors, keyed as PEFT saves them
            (``...layers.<i>.self_attn.<query_module>.lstmem_memory.<name>``).
        query_module: the adapter's ``query_module`` (the projection its memory layers sit on).
        layers: the decoder layers the adapter's config chooses (``memory_layer_indices``).
        source: the file's name, for the errors.

    Returns:
        ``{layer: {name: tensor}}`` for exactly ``layers``.

    Raises:
        ValueError: a tensor that is not a memory weight, a chosen layer without weights, or
            weights of a layer the config does not choose.
    """
    pattern = re.compile(
        rf"(?:^|\.)layers\.(\d+)\.self_attn\.{re.escape(query_module)}\.lstmem_memory\.(\w+)$"
    )
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = pattern.search(key)
        if match is None:
            raise ValueError(f"{source}: {key!r} is not an LSTMem memory weight")
        by_layer.setdefault(int(match[1]), {})[match[2]] = tensor
    held = f"it holds them for decoder layers {_span(sorted(by_layer))} of {_span(layers)} chosen"
    for layer in layers:
        if layer not in by_layer:
            raise ValueError(
                f"{source} holds no memory weights for decoder layer {layer} ({held}): the adapter was trained on "
                "another base model (its adapter_config.json names it in base_model_name_or_path); load it onto "
                "that model"
            )
    extra = sorted(set(by_layer) - set(layers))
    if extra:
        raise ValueError(
            f"{source} holds memory weights for decoder layers {extra}, which the adapter config does not "
            f"choose ({held}): the adapter was trained on another base model, or its layers_to_transform was "
            "changed; load it onto the model it was trained on, with the adapter_config.json saved beside it"
        )
    return by_layer
