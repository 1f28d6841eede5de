"""What an LSTMem layer checks and converts when an adapter file (or a checkpoint) is loaded into it:
the paper's full matrices of older files become the effective maps the layer registers, and weights
that hold NaN or inf are refused; and how an adapter file's tensors are found by decoder layer when
they are loaded without PEFT (the vLLM plugin, the server's fingerprint)."""

from __future__ import annotations

import re

import torch

#: Adapter files written before the layer stored the effective maps carry the paper's full matrices
#: under these names: ``w_pred_full = [P_time | P_dep]`` ``(d_s, 2 d_s)`` and ``w_gate_full = [G_z |
#: G_time | G_dep | G_e]`` ``(4 d_s, 4 d_s)``.
FULL_MATRICES = {"w_pred_full": "w_pred", "w_gate_full": "w_gate"}


def effective_from_full(name: str, full: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The parameter name and value a full matrix of an older adapter file becomes: ``P_dep`` of
    ``w_pred_full``, ``[G_z | G_dep | G_e]`` of ``w_gate_full``. ``P_time`` and ``G_time`` only ever
    multiplied zeros (App. C.2), so the layer computes the same function."""
    if name == "w_pred_full":
        ds = full.shape[0]
        return "w_pred", full[:, ds:]
    ds = full.shape[0] // 4
    return "w_gate", torch.cat([full[:, :ds], full[:, 2 * ds :]], dim=1)


def from_full_matrices(layer, state_dict: dict, prefix: str, *args) -> None:
    """Before a state dict is loaded into ``layer``: the full matrices of an older file become the
    effective maps (:func:`effective_from_full`); ``w_pred`` is dropped in a layer without depth input."""
    for old in FULL_MATRICES:
        full = state_dict.pop(prefix + old, None)
        if full is None:
            continue
        name, value = effective_from_full(old, full)
        if name == "w_pred" and layer.w_pred is None:
            continue
        state_dict.setdefault(prefix + name, value)


def refuse_nonfinite_weights(layer, incompatible_keys) -> None:
    """After a state dict is loaded into ``layer`` (an adapter file, a checkpoint): every weight finite."""
    bad = [name for name, p in layer.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise ValueError(
            f"the LSTMem weights loaded for decoder layer {layer.layer_idx} hold NaN or inf in {bad}: the adapter "
            "file is damaged or was saved from a diverged run; load another checkpoint"
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
    for layer in layers:
        if layer not in by_layer:
            raise ValueError(f"{source} holds no memory weights for decoder layer {layer}")
    extra = sorted(set(by_layer) - set(layers))
    if extra:
        raise ValueError(
            f"{source} holds memory weights for decoder layers {extra}, which the adapter config does not "
            "choose (layers_to_transform)"
        )
    return by_layer
