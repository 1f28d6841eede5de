"""``MemoryCache``: the LSTMem states of one batch of sessions, held next to ``past_key_values``.

A cache is a list of per-layer :class:`LayerState` objects (cell ``C`` and hidden ``D``, each
``(batch, n_h, r, r)``) in depth order, plus a per-row count of tokens written. Like the KV caches of
transformers, batch operations are per-layer methods that the container fans out, states are
allocated lazily from the first input, and nothing is ever silently reset: a cache bound to one
adapter layout refuses another, and a batch-size mismatch is an error.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

import torch
from safetensors.torch import load_file, save_file

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class MemoryLayout:
    """The shape of the memory an adapter expects; its fingerprint guards saved caches.

    Attributes:
        layer_indices: backbone decoder layers that carry memory, in depth order.
        num_heads: ``n_h``.
        head_dim: ``r``.
        state_dtype: ``"float32"`` or ``"bfloat16"``.
        identity: free text that names the adapter (base model, adapter config and the adapter's
            ``memory_id``), part of the fingerprint so that a cache from another adapter is refused,
            even one with the same shapes.
    """

    layer_indices: tuple[int, ...]
    num_heads: int
    head_dim: int
    state_dtype: str = "float32"
    identity: str = ""

    @classmethod
    def of_adapter(cls, config, layer_indices, base_config=None, base_name: str = "") -> MemoryLayout:
        """The layout of an LSTMem adapter (an :class:`~lstmem_peft.LSTMemConfig`) on a backbone.

        Args:
            config: the adapter's config.
            layer_indices: the decoder layers that carry memory, in depth order.
            base_config: the backbone's transformers config (its ``model_type`` and ``hidden_size``
                name the backbone in the identity), or ``None``.
            base_name: what names the backbone when ``base_config`` has no ``model_type``.
        """
        identity = "|".join(
            str(x)
            for x in (
                getattr(base_config, "model_type", base_name),
                getattr(base_config, "hidden_size", ""),
                getattr(config, "base_model_name_or_path", "") or "",
                f"alpha={config.alpha}",
                f"depth_coupling={config.depth_coupling}",
                f"memory_id={getattr(config, 'memory_id', None) or ''}",
            )
        )
        return cls(
            layer_indices=tuple(layer_indices),
            num_heads=config.num_heads,
            head_dim=config.r,
            state_dtype=config.state_dtype,
            identity=identity,
        )

    @property
    def num_layers(self) -> int:
        return len(self.layer_indices)

    @property
    def torch_dtype(self) -> torch.dtype:
        return STATE_DTYPES[self.state_dtype]

    def fingerprint(self) -> str:
        payload = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def nonfinite_rows(states) -> list[int]:
    """Batch rows whose states hold NaN or inf, from ``(cell, hidden)`` pairs ``(B, n_h, r, r)``
    (one host read). The pairs may sit on several devices (a sharded backbone); meta tensors hold no
    values and are skipped."""
    bad = None
    for pair in states:
        for t in pair:
            if t.is_meta:
                continue
            row_bad = ~torch.isfinite(t).flatten(1).all(dim=1)
            bad = row_bad if bad is None else bad | row_bad.to(bad.device)
    return [] if bad is None else bad.nonzero().flatten().tolist()


class LayerState:
    """Cell and hidden state of one memory layer: ``(batch, n_h, r, r)`` each, or ``None``."""

    def __init__(self, cell: torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> None:
        self.cell = cell
        self.hidden = hidden

    @property
    def is_initialized(self) -> bool:
        return self.cell is not None

    def _map(self, fn) -> None:
        if self.cell is not None:
            self.cell = fn(self.cell)
            self.hidden = fn(self.hidden)

    def reorder(self, index: torch.Tensor) -> None:
        self._map(lambda t: t.index_select(0, index.to(t.device)))

    def repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def detach_(self) -> None:
        self._map(torch.Tensor.detach)

    def to(self, *args, **kwargs) -> None:
        self._map(lambda t: t.to(*args, **kwargs))

    def clone(self) -> LayerState:
        if self.cell is None:
            return LayerState()
        return LayerState(self.cell.clone(), self.hidden.clone())

    def __repr__(self) -> str:
        if self.cell is None:
            return "LayerState(empty)"
        return f"LayerState(shape={tuple(self.cell.shape)}, dtype={self.cell.dtype})"


class MemoryCache:
    """LSTMem memory for a batch of sessions.

    Create one per batch of independent histories and pass it to every forward/generate call of
    those sessions; ``clone()`` it to answer several questions from one snapshot.

    Args:
        layout: optional :class:`MemoryLayout`; normally bound by the model on first use.

    Attributes:
        layers: one :class:`LayerState` per memory layer, shallow to deep;
            ``cache.layers[i].cell`` is ``C``, ``cache.layers[i].hidden`` is ``D``.
        tokens_written: ``(batch,)`` long, valid tokens written into each row so far.

    Example:
        >>> cache = MemoryCache()
        >>> cache.is_initialized
        False
    """

    def __init__(self, layout: MemoryLayout | None = None) -> None:
        self.layout: MemoryLayout | None = None
        self.layers: list[LayerState] = []
        self.tokens_written: torch.Tensor | None = None
        if layout is not None:
            self.bind(layout)

    # ------------------------------------------------------------------ layout and allocation
    def bind(self, layout: MemoryLayout) -> None:
        """Attach the cache to an adapter layout; a cache bound to another layout is refused."""
        self.check_layout(layout)
        if self.layout is None:
            self.layout = layout
            self.layers = [LayerState() for _ in range(layout.num_layers)]

    def check_layout(self, layout: MemoryLayout) -> None:
        """Raise unless the cache is unbound or bound to ``layout`` (changes nothing)."""
        if self.layout is not None and self.layout != layout:
            raise ValueError(
                "this MemoryCache belongs to another adapter layout "
                f"({self._describe(self.layout)}) but the model expects {self._describe(layout)}; "
                "create a new MemoryCache() for this model or adapter"
            )

    def adopt(self, other: MemoryCache) -> None:
        """Take over ``other``'s layout, states and counts (this object stays the one the caller holds)."""
        self.check_layout(other.layout)
        self.layout = other.layout
        self.layers = other.layers
        self.tokens_written = other.tokens_written

    @staticmethod
    def _describe(layout: MemoryLayout) -> str:
        return (
            f"{layout.num_layers} memory layers at {list(layout.layer_indices)}, n_h={layout.num_heads}, "
            f"r={layout.head_dim}, state_dtype={layout.state_dtype}, fingerprint={layout.fingerprint()}"
        )

    @property
    def is_initialized(self) -> bool:
        return bool(self.layers) and all(layer.is_initialized for layer in self.layers)

    @property
    def batch_size(self) -> int | None:
        return None if self.tokens_written is None else int(self.tokens_written.shape[0])

    @property
    def device(self) -> torch.device | None:
        return None if self.tokens_written is None else self.tokens_written.device

    def ensure(self, batch_size: int, device: torch.device) -> None:
        """Allocate zero states for ``batch_size`` rows on ``device`` on first use; check the batch size
        after. (A forward moves each layer's states to the device its layer computes on, where they stay:
        with a ``device_map`` over several devices the layers of one cache live on different devices.)"""
        if self.layout is None:
            raise RuntimeError("MemoryCache is not bound to a model yet; pass it to the model first")
        if self.tokens_written is None:
            shape = (batch_size, self.layout.num_heads, self.layout.head_dim, self.layout.head_dim)
            dtype = self.layout.torch_dtype
            for layer in self.layers:
                layer.cell = torch.zeros(shape, dtype=dtype, device=device)
                layer.hidden = torch.zeros(shape, dtype=dtype, device=device)
            self.tokens_written = torch.zeros(batch_size, dtype=torch.long, device=device)
            return
        if batch_size != self.batch_size:
            raise ValueError(
                f"MemoryCache holds {self.batch_size} sequences but the input has batch size "
                f"{batch_size}; use one cache per batch of sessions (cache.batch_select_indices / "
                "batch_repeat_interleave change its rows explicitly)"
            )

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        """Forget everything: states are reallocated (zeros) on next use, at any batch size."""
        for layer in self.layers:
            layer.cell = layer.hidden = None
        self.tokens_written = None

    def clone(self) -> MemoryCache:
        """An independent snapshot (questions on one history start from the same state)."""
        new = MemoryCache(self.layout)
        new.layers = [layer.clone() for layer in self.layers]
        new.tokens_written = None if self.tokens_written is None else self.tokens_written.clone()
        return new

    def detach_(self) -> MemoryCache:
        """Cut the states from the autograd graph in place (stage-2 training between blocks)."""
        for layer in self.layers:
            layer.detach_()
        return self

    def to(self, *args, **kwargs) -> MemoryCache:
        """Move the states to another device in place; returns ``self``.

        The states' dtype is the adapter's ``state_dtype`` (part of the layout every saved file and
        model checks), so a dtype other than the layout's is refused rather than silently breaking
        that agreement: choose the dtype with ``LSTMemConfig(state_dtype=...)``.
        """
        dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
        if dtype is not None and self.layout is not None and dtype != self.layout.torch_dtype:
            raise ValueError(
                f"MemoryCache.to({dtype}) would store states in another dtype than the adapter's state_dtype "
                f"({self.layout.state_dtype}); set LSTMemConfig(state_dtype=...) to change it, and move caches "
                "between devices only"
            )
        for layer in self.layers:
            layer.to(*args, **kwargs)
        if self.tokens_written is not None:
            device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
            if device is not None:
                self.tokens_written = self.tokens_written.to(device)
        return self

    # ------------------------------------------------------------------ batch / beam operations
    def row_index(self, index: torch.Tensor) -> torch.Tensor:
        """Row indices (long) from indices or a boolean mask over the rows, checked against the batch size."""
        index = torch.as_tensor(index)
        if index.dtype == torch.bool:  # a mask, as transformers' caches take it
            if index.shape != (self.batch_size,):
                raise IndexError(
                    f"boolean mask of shape {tuple(index.shape)} for a MemoryCache of batch size {self.batch_size}"
                )
            return index.nonzero().flatten()
        index = index.long()
        if (
            self.batch_size is not None
            and index.numel()
            and (index.min() < 0 or index.max() >= self.batch_size)
        ):
            raise IndexError(f"row index out of range for a MemoryCache of batch size {self.batch_size}")
        return index

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Reorder rows like ``past_key_values.reorder_cache(beam_idx)`` (beam search)."""
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep (and reorder to) the given rows: indices, or a boolean mask over the rows."""
        if self.tokens_written is None:
            return
        indices = self.row_index(indices)
        for layer in self.layers:
            layer.reorder(indices)
        self.tokens_written = self.tokens_written.index_select(0, indices.to(self.tokens_written.device))

    def update_rows(self, index: torch.Tensor, rows: MemoryCache) -> None:
        """Replace rows ``index`` with the rows of ``rows`` (same layout, ``len(index)`` rows), as
        new tensors: a snapshot taken before stays as it was."""
        self.check_layout(rows.layout)
        index = self.row_index(index)
        for state, new in zip(self.layers, rows.layers, strict=True):  # on the rows' device (their layer's)
            at = new.cell.device
            state.cell = state.cell.to(at).index_copy(0, index.to(at), new.cell)
            state.hidden = state.hidden.to(at).index_copy(0, index.to(at), new.hidden)
        self.tokens_written = self.tokens_written.index_copy(
            0, index.to(self.tokens_written.device), rows.tokens_written
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (``num_return_sequences``, beam expansion)."""
        if self.tokens_written is None:
            return
        for layer in self.layers:
            layer.repeat_interleave(repeats)
        self.tokens_written = self.tokens_written.repeat_interleave(repeats, dim=0)

    # ------------------------------------------------------------------ introspection
    @property
    def nbytes(self) -> int:
        """Bytes held by the states (cells and hiddens, all layers and rows)."""
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            if layer.is_initialized
            for t in (layer.cell, layer.hidden)
        )

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int) -> LayerState:
        if not -len(self.layers) <= index < len(self.layers):
            raise IndexError(f"memory layer index {index} out of range [0, {len(self.layers)})")
        return self.layers[index]

    def __repr__(self) -> str:
        if self.layout is None:
            return "MemoryCache(unbound)"
        return (
            f"MemoryCache(layers={len(self.layers)}, batch={self.batch_size}, "
            f"n_h={self.layout.num_heads}, r={self.layout.head_dim}, dtype={self.layout.state_dtype}, "
            f"nbytes={self.nbytes})"
        )

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike) -> None:
        """Write the states to a safetensors file with the layout and its fingerprint."""
        if self.layout is None or not self.is_initialized:
            raise ValueError("nothing to save: the MemoryCache has not been written yet")
        rows = nonfinite_rows((layer.cell, layer.hidden) for layer in self.layers)
        if rows:
            raise FloatingPointError(
                f"refusing to save {path}: the memory of batch row(s) {rows} holds NaN or inf; select the finite rows "
                "first (cache.batch_select_indices(...)) or restore the rows from a snapshot"
            )
        tensors = {"tokens_written": self.tokens_written.contiguous()}
        for i, layer in enumerate(self.layers):
            tensors[f"layers.{i}.cell"] = layer.cell.detach().contiguous()
            tensors[f"layers.{i}.hidden"] = layer.hidden.detach().contiguous()
        metadata = {
            "format": "lstmem-memory-cache",
            "version": "1",
            "layout": json.dumps(asdict(self.layout)),
            "fingerprint": self.layout.fingerprint(),
        }
        save_file(tensors, os.fspath(path), metadata=metadata)

    @classmethod
    def load(
        cls, path: str | os.PathLike, layout: MemoryLayout | None = None, device: str | torch.device = "cpu"
    ) -> MemoryCache:
        """Read a cache written by :meth:`save`.

        Args:
            path: the safetensors file.
            layout: the layout the caller's model expects (``lstmem_peft.memory_layout(model)``);
                a file written for another layout is refused.
            device: where to put the states.
        """
        from safetensors import safe_open

        try:
            with safe_open(os.fspath(path), framework="pt") as fh:
                metadata = fh.metadata() or {}
        except Exception as err:
            raise ValueError(f"{path} is not a readable safetensors file: {err}") from err
        if metadata.get("format") != "lstmem-memory-cache":
            raise ValueError(f"{path} is not a MemoryCache file (written by MemoryCache.save)")
        try:
            stored = json.loads(metadata.get("layout", ""))
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path}: the layout metadata is not valid JSON ({err}); the file is damaged"
            ) from err
        fields = set(MemoryLayout.__dataclass_fields__)
        if not isinstance(stored, dict) or set(stored) != fields:
            got = sorted(stored) if isinstance(stored, dict) else type(stored).__name__
            raise ValueError(
                f"{path}: the layout metadata has fields {got}, expected {sorted(fields)}; the file is damaged"
            )
        stored["layer_indices"] = tuple(stored["layer_indices"])
        stored_layout = MemoryLayout(**stored)
        if stored_layout.state_dtype not in STATE_DTYPES:
            raise ValueError(
                f"{path}: unknown state_dtype {stored_layout.state_dtype!r} in the layout metadata"
            )
        if stored_layout.fingerprint() != metadata.get("fingerprint"):
            raise ValueError(
                f"{path}: the layout fingerprint does not match its contents; the file is corrupt"
            )
        if layout is not None and layout != stored_layout:
            raise ValueError(
                f"{path} was saved for {cls._describe(stored_layout)} but the model expects "
                f"{cls._describe(layout)}; load it with the adapter it was written by"
            )
        tensors = load_file(os.fspath(path), device=str(device))
        expected = {"tokens_written"} | {
            f"layers.{i}.{name}" for i in range(stored_layout.num_layers) for name in ("cell", "hidden")
        }
        for name in sorted(expected - set(tensors)):
            raise ValueError(f"{path}: missing tensor {name!r}; the file is damaged")
        for name in sorted(set(tensors) - expected):
            raise ValueError(
                f"{path}: unexpected tensor {name!r} for a layout of {stored_layout.num_layers} layers"
            )
        tokens = tensors["tokens_written"]
        rows = tensors["layers.0.cell"].shape[0] if tensors["layers.0.cell"].dim() else -1
        if tokens.dim() != 1 or tokens.dtype != torch.long or tokens.shape[0] != rows:
            raise ValueError(
                f"{path}: tokens_written has {tokens.shape[0] if tokens.dim() else 0} rows ({tokens.dtype}) but the "
                f"states have {rows}; the file is damaged"
            )
        cache = cls(stored_layout)
        shape = (rows, stored_layout.num_heads, stored_layout.head_dim, stored_layout.head_dim)
        for i, layer in enumerate(cache.layers):
            layer.cell, layer.hidden = tensors[f"layers.{i}.cell"], tensors[f"layers.{i}.hidden"]
            for name, t in (("cell", layer.cell), ("hidden", layer.hidden)):
                if tuple(t.shape) != shape or t.dtype != stored_layout.torch_dtype:
                    raise ValueError(
                        f"{path}: layers.{i}.{name} is {tuple(t.shape)} {t.dtype}, expected {shape} "
                        f"{stored_layout.torch_dtype}"
                    )
        bad = nonfinite_rows((layer.cell, layer.hidden) for layer in cache.layers)
        if bad:
            raise ValueError(f"{path}: the memory of row(s) {bad} holds NaN or inf")
        cache.tokens_written = tokens
        return cache
