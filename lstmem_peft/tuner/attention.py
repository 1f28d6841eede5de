"""Where LSTMem meets a backbone's attention: which projections it wraps, and where the query sits
in a projection that computes more than the query.

LSTMem wraps two projections of every attention block it gives memory (Sec. 3): the **query
projection**, whose input is the attention input ``x`` (after the layer's input norm) and to whose
output ``Δq`` is added before q-norm and RoPE, and the **output projection**, to whose output ``Δo``
is added. Decoder families name them differently, and some compute the query together with the keys
and values in one fused projection:

=====================  ===================  ====================================================
query, output          families             where the query sits in the query projection's output
=====================  ===================  ====================================================
``q_proj``, ``o_proj``  Llama, Qwen2/3,      all of it
                       Mistral, Mixtral,
                       Qwen3-MoE, Gemma
                       1-3, SmolLM3, OLMo2
``q_proj``,            OPT                  all of it
``out_proj``
``q_proj``, ``dense``  Phi-1/2              all of it
``qkv_proj``,          Phi-3                the first ``n_h * head_dim`` columns, then k, then v
``o_proj``
``query_key_value``,   GPT-NeoX, BLOOM      per head: ``head_dim`` query columns, then its key
``dense``                                   and value (``(n_h, 3, head_dim)``)
``query_key_value``,   Falcon               by the config: per head (``(n_h, 3, head_dim)``),
``dense``                                   all queries first (multi-query), or per key/value
                                            group (``new_decoder_architecture``)
``c_attn``, ``c_proj``  GPT-2                the first ``hidden_size`` columns (a ``Conv1D``)
=====================  ===================  ====================================================

:func:`find_attention_projections` picks the pair by the model's structure (the names its decoder
layers' attention blocks have), so ``target_modules`` is needed only for other names.
:func:`query_columns` reads from the model's config where the query sits in a fused projection;
``Δq`` is added to those columns only, and the keys and values stay the backbone's. A projection
that computes more than the query in a layout LSTMem does not know is refused when the adapter is
created, never corrected as a whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

#: ``(query projection, output projection)`` names, in the order they are preferred when an
#: attention block has more than one pair.
ATTENTION_PROJECTIONS: tuple[tuple[str, str], ...] = (
    ("q_proj", "o_proj"),
    ("q_proj", "out_proj"),
    ("q_proj", "dense"),
    ("qkv_proj", "o_proj"),
    ("query_key_value", "dense"),
    ("c_attn", "c_proj"),
)

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(key: str) -> int | None:
    """The decoder layer index in a module name (the last number between dots), or ``None``."""
    found = _LAYER_INDEX.findall(f".{key}.")
    return int(found[-1]) if found else None


def find_attention_projections(model: nn.Module) -> list[str]:
    """``[query projection, output projection]`` names of ``model``'s attention blocks, found by
    structure: the pairs of :data:`ATTENTION_PROJECTIONS` that are children of one module inside a
    numbered decoder layer.

    Raises:
        ValueError: no decoder layer has such a pair, or the decoder layers have more than one
            (a multimodal model whose vision tower names its projections otherwise); the message names
            what was found and says to pass ``target_modules``.
    """
    found: dict[tuple[str, str], str] = {}  # pair -> the first module that has it
    for name, module in model.named_modules():
        if layer_index(name) is None:
            continue
        children = dict(module.named_children())
        for pair in ATTENTION_PROJECTIONS:
            if all(part in children for part in pair):
                found.setdefault(pair, name)
                break  # the preferred pair of this module
    if len(found) == 1:
        return list(next(iter(found)))
    known = ", ".join(f"{q}/{o}" for q, o in ATTENTION_PROJECTIONS)
    if not found:
        raise ValueError(
            f"LSTMem found no attention block with a query and an output projection by the usual names ({known}) "
            f"in the decoder layers of this {type(model).__name__}; pass target_modules=[<query projection name>, "
            "<output projection name>], the names of the two projections inside one attention block"
        )
    seen = "; ".join(f"{q}/{o} (e.g. {where})" for (q, o), where in found.items())
    raise ValueError(
        f"this {type(model).__name__} has attention blocks with different projection names: {seen}. LSTMem cannot "
        "tell which decoder gets memory; pass target_modules=[<query projection>, <output projection>] of the "
        "language model's attention"
    )


def projection_shape(module: nn.Module) -> tuple[int, int]:
    """``(out_features, in_features)`` of a projection: a Linear (plain or quantised) or a
    transformers ``Conv1D`` (GPT-2's, whose weight is stored ``(in, out)``)."""
    if hasattr(module, "out_features") and hasattr(module, "in_features"):
        return int(module.out_features), int(module.in_features)
    if hasattr(module, "nf") and hasattr(module, "nx"):  # transformers.pytorch_utils.Conv1D
        return int(module.nf), int(module.nx)
    raise ValueError(f"{type(module).__name__} is not a projection LSTMem knows the sizes of")


@dataclass(frozen=True)
class QueryColumns:
    """Where the query sits in a query projection's output of ``groups * stride`` features: the first
    ``width`` of each of ``groups`` consecutive groups of ``stride`` features.

    A projection that computes the query alone is one group with ``width == stride``. Phi-3's
    ``qkv_proj`` is one group whose first ``n_h * head_dim`` features are the query; GPT-NeoX's
    ``query_key_value`` is ``n_h`` groups of ``3 * head_dim`` with the query first in each.
    """

    groups: int
    stride: int
    width: int

    @classmethod
    def whole(cls, out_features: int) -> QueryColumns:
        """The projection computes the query alone."""
        return cls(groups=1, stride=out_features, width=out_features)

    @property
    def out_features(self) -> int:
        """Output features of the projection."""
        return self.groups * self.stride

    @property
    def query_size(self) -> int:
        """``d_q``: features of the query (``n_h * head_dim``)."""
        return self.groups * self.width

    @property
    def fused(self) -> bool:
        """Whether the projection computes more than the query."""
        return self.width != self.stride

    def query_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """The query's rows ``(d_q, d)`` of the projection's dense weight ``(out_features, d)``, in
        the order the model reads the query (head by head)."""
        if not self.fused:
            return weight
        return weight.reshape(self.groups, self.stride, -1)[:, : self.width].reshape(self.query_size, -1)

    def add(self, result: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``result`` ``(..., out_features)`` with ``delta`` ``(..., d_q)`` added to the query's
        features; the other features (keys, values) are returned unchanged. A new tensor."""
        if not self.fused:
            return result + delta
        delta = F.pad(delta.unflatten(-1, (self.groups, self.width)), (0, self.stride - self.width))
        return result + delta.flatten(-2)


def _heads(config) -> tuple[int, int] | None:
    """``(n_h, head_dim)`` of the attention, from the (text) config, or ``None`` if it does not say."""
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(heads, int) or heads < 1:
        return None
    head_dim = getattr(config, "head_dim", None)
    if not isinstance(head_dim, int):
        if not isinstance(hidden, int) or hidden % heads:
            return None
        head_dim = hidden // heads
    return heads, head_dim


def _fused_layout(config, heads: int, head_dim: int) -> QueryColumns | str:
    """The query's columns in the fused query/key/value projection of ``config``'s family, or why
    they cannot be known."""
    model_type = getattr(config, "model_type", None)
    if model_type in ("phi3", "gpt2"):  # [q | k | v], the query first
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return QueryColumns(groups=1, stride=(heads + 2 * kv_heads) * head_dim, width=heads * head_dim)
    if model_type in ("gpt_neox", "bloom"):  # (n_h, [q, k, v], head_dim)
        return QueryColumns(groups=heads, stride=3 * head_dim, width=head_dim)
    if model_type == "falcon":
        if getattr(config, "new_decoder_architecture", False):  # (n_kv, [q x n_h/n_kv, k, v], head_dim)
            kv_heads = getattr(config, "num_kv_heads", None) or heads
            per_group = heads // kv_heads
            return QueryColumns(
                groups=kv_heads, stride=(per_group + 2) * head_dim, width=per_group * head_dim
            )
        if getattr(config, "multi_query", False):  # (n_h + 2, head_dim): the queries, one key, one value
            return QueryColumns(groups=1, stride=(heads + 2) * head_dim, width=heads * head_dim)
        return QueryColumns(groups=heads, stride=3 * head_dim, width=head_dim)
    return (
        f"LSTMem does not know how model type {model_type!r} lays out the query, keys and values in it "
        "(it knows Phi-3's qkv_proj, the query_key_value of GPT-NeoX, Falcon and BLOOM, and GPT-2's c_attn)"
    )


def query_columns(config, key: str, out_features: int) -> QueryColumns:
    """Where the query sits in the output of the query projection ``key`` (``out_features`` wide)
    of a model with (text) config ``config``.

    A projection exactly ``n_h * head_dim`` wide computes the query alone. A wider one holds keys and
    values too; its layout comes from the config of the families that fuse them (see the module
    docstring), checked against ``out_features``.

    Raises:
        ValueError: the projection is wider than the query and its layout is unknown, or the known
            layout does not match its width: the adapter would add ``Δq`` to keys and values.
    """
    heads = _heads(config)
    if heads is None:
        return QueryColumns.whole(out_features)  # no head count to check against: the query alone
    n_h, head_dim = heads
    if out_features == n_h * head_dim:
        return QueryColumns.whole(out_features)
    layout = _fused_layout(config, n_h, head_dim)
    problem = layout if isinstance(layout, str) else None
    if problem is None and layout.out_features != out_features:
        problem = f"its layout for this config has {layout.out_features} features"
    if problem is None:
        return layout
    raise ValueError(
        f"{key} has {out_features} output features, but the query is num_attention_heads x head_dim = {n_h} x "
        f"{head_dim} = {n_h * head_dim}: the projection computes more than the query (a fused query/key/value "
        f"projection), and {problem}. LSTMem will not add its query correction to keys and values: target a "
        "projection that computes the query alone (target_modules=[<query projection>, <output projection>]), or "
        "load the model with its query, key and value projections split"
    )


def check_output_projection(key: str, out_features: int, in_features: int, hidden: int, query: int) -> None:
    """Refuse an output projection that does not map the attention's ``query``-wide output back to
    the ``hidden``-wide residual stream (``Δo`` is added to all of its output)."""
    if (out_features, in_features) != (hidden, query):
        raise ValueError(
            f"{key} maps {in_features} features to {out_features}, but an output projection must map the attention's "
            f"output (n_h x head_dim = {query}) back to the hidden size {hidden}: LSTMem adds its output correction "
            "to all of it. target_modules=[<query projection>, <output projection>] must name the attention block's "
            "output projection"
        )
