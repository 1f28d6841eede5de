"""``LSTMemModel``: the PEFT tuner that injects LSTMem memory into a causal LM.

For every chosen decoder layer, the query projection is wrapped by
:class:`~lstmem_peft.tuner.layer.LSTMemQueryLayer` (which owns the memory parameters) and the output
projection by :class:`~lstmem_peft.tuner.layer.LSTMemOutputLayer`. Injection writes each adapter's
configuration and depth index on its query wrappers (PEFT's per-adapter dict idiom) and attaches the
backbone's one :class:`~lstmem_peft.tuner.hooks.MemoryHooks`, which carries memory through every forward
whichever door (``PeftModel``, ``inject_adapter_in_model``, transformers' ``load_adapter``) the
adapter came in by. ``LSTMemModel.generate`` is that controller's ``generate``; no class of peft or
transformers is patched (the one instance-level binding, the KV cache's row operations for the
length of one ``generate`` call, is explained in :meth:`~lstmem_peft.tuner.generation.GenerateSession.bind_kv`).
``unload()`` removes the wrappers and the hooks.
"""

from __future__ import annotations

from contextlib import contextmanager

from peft.tuners.tuners_utils import BaseTuner
from torch import nn

from lstmem_peft.memory.adapter_files import MemoryWidths, refuse_weights_of_another_shape
from lstmem_peft.memory.cache import MemoryCache, MemoryLayout

from .attention import (
    check_output_projection,
    find_attention_projections,
    layer_index,
    projection_shape,
    query_columns,
)
from .config import LSTMemConfig, expect_first_weights, take_first_weights_mark
from .hooks import ADAPTER_NAMES_REFUSED, MemoryHooks
from .layer import LSTMemOutputLayer, LSTMemQueryLayer, LSTMemTunerLayer
from .peft_gate import name_the_gate
from .quant import check_projection, dense_weight


def _with_output_siblings(state_dict: dict, config: LSTMemConfig) -> dict:
    """``state_dict`` plus one placeholder key per output projection whose query sibling has tensors
    in it (for PEFT's module matching only: the placeholders are never loaded)."""
    marker = f".{config.query_module}.{LSTMemModel.prefix}"
    extra = {}
    for key in state_dict:
        if marker in key:
            parent = key.split(marker, 1)[0]
            extra[f"{parent}.{config.output_module}.{LSTMemModel.prefix}"] = None
    return {**state_dict, **extra}


def _discard_created_adapter(model: nn.Module, adapter_name: str) -> None:
    """Undo what PEFT's loader did before its weights were refused: the adapter it added to a
    ``PeftModel`` (``load_adapter``) is deleted; the only adapter (``PeftModel.from_pretrained``) is
    unloaded, which gives the backbone the caller passed back its plain projections and no hooks."""
    peft_config = getattr(model, "peft_config", None)
    tuner = getattr(model, "base_model", None)
    if (
        not isinstance(peft_config, dict)
        or adapter_name not in peft_config
        or not isinstance(tuner, BaseTuner)
    ):
        return
    if len(peft_config) == 1:
        tuner.unload()
    else:
        model.delete_adapter(adapter_name)


class LSTMemModel(BaseTuner):
    """Creates an LSTMem model from a pretrained causal LM.

    Example:
        >>> import torch
        >>> from transformers import Qwen3Config, Qwen3ForCausalLM
        >>> from peft import get_peft_model
        >>> from lstmem_peft import LSTMemConfig, MemoryCache
        >>> base = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
        >>> model = get_peft_model(base, LSTMemConfig())
        >>> cache = MemoryCache()
        >>> out = model(input_ids=torch.tensor([[1, 2, 3]]), memory_cache=cache)
        >>> cache.tokens_written.tolist()
        [3]
    """

    prefix: str = "lstmem_"
    tuner_layer_cls = LSTMemTunerLayer
    target_module_mapping: dict[str, list[str]] = {}  # targets are found by structure (inject_adapter)

    # ------------------------------------------------------------------ injection
    def _prepare_adapter_config(self, peft_config: LSTMemConfig, model_config: dict) -> LSTMemConfig:
        """Every door injects through here: validate the config again (its fields may have been
        changed since it was built). The target modules, when not given, were found from the model's
        structure by :meth:`inject_adapter` before."""
        if not isinstance(peft_config, LSTMemConfig):
            raise TypeError(f"LSTMemModel needs an LSTMemConfig, got {type(peft_config).__name__}")
        peft_config.__post_init__()
        if peft_config.target_modules is None:
            raise ValueError(
                "LSTMem has no target modules for this model: pass target_modules=[<query projection name>, "
                "<output projection name>] (for most decoder models ['q_proj', 'o_proj'])"
            )
        return peft_config

    @classmethod
    def _remap_adapter_state_dict_for_load(cls, model, config, adapter_name: str, state_dict: dict) -> dict:
        """PEFT's key remapping, after weights saved for another base model, rank or head count are
        refused (:meth:`_refuse_weights_that_do_not_fit`)."""
        cls._refuse_weights_that_do_not_fit(model, config, adapter_name, state_dict)
        return super()._remap_adapter_state_dict_for_load(model, config, adapter_name, state_dict)

    @classmethod
    def _refuse_weights_that_do_not_fit(cls, model, config, adapter_name: str, state_dict: dict) -> None:
        """Before any weight is copied: refuse weights saved for another base model, rank or head count
        (:func:`~lstmem_peft.memory.adapter_files.refuse_weights_of_another_shape`).

        PEFT loads an adapter in a known order: it builds the config, adds the adapter, then hands
        its weights to this check. Weights for an adapter that a load in progress added (its config
        marked by :func:`~lstmem_peft.tuner.config.expect_first_weights`: read by PEFT's loaders
        through :class:`~lstmem_peft.tuner.config.PeftLoaderConfig`, or the frozen adapter a tuner was
        created with, see :meth:`inject_adapter`) are its first: a refusal names where they came from
        and removes that adapter again, so that the refused call leaves the model as it was (the
        backbone ``PeftModel.from_pretrained`` was given; the adapters ``PeftModel.load_adapter``
        found). Weights for any other adapter are the user's own load into a model the user holds:
        refused, with the model left as it is."""
        saved: dict[int, dict] = {}
        for key, value in state_dict.items():
            head, _, leaf = key.rpartition(".")
            idx = cls._layer_index(key)
            if idx is not None and head.endswith(f".{config.query_module}.lstmem_memory"):
                saved.setdefault(idx, {})[leaf] = value
        ours = {
            m.layer_idx: m.lstmem_memory[adapter_name]
            for m in model.modules()
            if isinstance(m, LSTMemQueryLayer) and adapter_name in m.lstmem_memory
        }
        source = take_first_weights_mark(config)  # checked once: a later load is the user's own
        base_config = getattr(model, "config", None)
        try:
            refuse_weights_of_another_shape(
                {idx: MemoryWidths.of_weights(weights) for idx, weights in saved.items()},
                {idx: MemoryWidths(m.hidden_size, m.query_size, m.state_size) for idx, m in ours.items()},
                source=f"the LSTMem adapter {source or adapter_name!r}",
                saved_base=config.base_model_name_or_path,
                model_name=getattr(base_config, "name_or_path", None),
                model_layers=getattr(base_config, "num_hidden_layers", None),
                r=config.r,
                num_heads=config.num_heads,
            )
        except ValueError:
            if source is not None:  # the adapter is this load's own
                _discard_created_adapter(model, adapter_name)
            raise

    @staticmethod
    def _layer_index(key: str) -> int | None:
        return layer_index(key)

    def _check_target_module_exists(self, peft_config: LSTMemConfig, key: str) -> bool:
        """Whether ``key`` is a query projection, or an output projection beside one, in a decoder
        layer that gets memory (GPT-2's MLP has a ``c_proj`` too, which is not the attention's)."""
        parent_key, _, name = key.rpartition(".")
        if name not in (peft_config.query_module, peft_config.output_module):
            return False
        idx = self._layer_index(key)
        if idx is None or not peft_config.carries_memory(idx):
            return False
        if name == peft_config.query_module:
            return True
        try:
            parent = self.model.get_submodule(parent_key)
        except AttributeError:
            return True
        return hasattr(parent, peft_config.query_module)

    def _create_and_replace(
        self, peft_config, adapter_name, target, target_name, parent, current_key, parameter_name=None
    ):
        idx = self._layer_index(current_key)
        if target_name == peft_config.query_module:
            output = getattr(parent, peft_config.output_module, None)
            if output is None:
                raise ValueError(
                    f"{current_key}: found the query projection but no sibling {peft_config.output_module!r}; "
                    "LSTMem needs both projections of one attention block: set target_modules=[query, output]"
                )
            output_key = f"{current_key.rsplit('.', 1)[0]}.{peft_config.output_module}"
            output_base = output.get_base_layer() if isinstance(output, LSTMemTunerLayer) else output
            self._check_linear(output_base, output_key)
            if not isinstance(target, LSTMemQueryLayer):
                self._check_linear(target, current_key)
                target = self._wrap_query(target, target_name, parent, current_key, idx)
            hidden = projection_shape(target.get_base_layer())[1]
            check_output_projection(
                output_key, *projection_shape(output_base), hidden, target.query_columns.query_size
            )
            output_weight = dense_weight(output_base)  # (d, d_q) float32, dequantised if quantised
            target.update_layer(adapter_name, peft_config, output_weight)
            if not isinstance(output, LSTMemOutputLayer):
                # the query projection brings its output projection along: an adapter state dict
                # (inject_adapter_in_model(..., state_dict=...)) names only the query wrappers
                self._replace_module(
                    parent, peft_config.output_module, LSTMemOutputLayer(output, idx), output
                )
        elif not isinstance(target, LSTMemOutputLayer):
            self._check_linear(target, current_key)
            self._replace_module(parent, target_name, LSTMemOutputLayer(target, idx), target)

    def _wrap_query(self, target: nn.Module, target_name: str, parent: nn.Module, key: str, idx: int):
        """Wrap the query projection ``target``, with where the query sits in its output
        (:func:`~lstmem_peft.tuner.attention.query_columns`: all of it, or a fused projection's query
        features; an unknown fused layout is refused here)."""
        config = getattr(self.model, "config", None)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        columns = query_columns(text_config, key, projection_shape(target)[0])
        new = LSTMemQueryLayer(target, idx, columns)
        self._replace_module(parent, target_name, new, target)
        return new

    @staticmethod
    def _check_linear(module: nn.Module, key: str) -> None:
        """Refuse a projection whose dense weight LSTMem cannot read (see :mod:`lstmem_peft.tuner.quant`)."""
        check_projection(module, key)

    def inject_adapter(self, model: nn.Module, adapter_name: str, *args, **kwargs) -> None:
        """PEFT's injection (every door comes through here: the tuner's creation, ``add_adapter``,
        ``load_adapter``, ``inject_adapter_in_model``, transformers' ``load_adapter``), then
        :meth:`_finish_injection`. A config without ``target_modules`` gets the attention projections
        found in the model's structure (:func:`~lstmem_peft.tuner.attention.find_attention_projections`).

        With a ``state_dict`` (``inject_adapter_in_model(..., state_dict=...)``) PEFT targets the
        modules whose names carry adapter tensors and warns about config targets that carry none. The
        output projections hold no tensors (the query wrapper owns the memory), so each query
        projection's output sibling is named to PEFT as targeted too: a normal call warns about nothing.

        The adapter a tuner is created with, created frozen (``inference_mode``), is marked as a load in
        progress until its first weights are checked (:func:`~lstmem_peft.tuner.config.expect_first_weights`):
        PEFT's loaders create the adapter they load that way (``is_trainable=False``, their default),
        also from a config passed in (``PeftModel.from_pretrained(model, path, config=config)``), and a
        frozen adapter that has held no weights holds nothing anyone trained, so weights refused for it
        remove it again (:meth:`_refuse_weights_that_do_not_fit`). That holds for a frozen adapter built
        with ``get_peft_model`` too (from a config read from a saved adapter, which is saved frozen):
        weights refused for it give its backbone back plain, as ``PeftModel.from_pretrained`` does.
        """
        config = self.peft_config[adapter_name]
        if isinstance(config, LSTMemConfig) and config.target_modules is None:
            config.target_modules = find_attention_projections(model)
        state_dict = kwargs.get("state_dict")
        if state_dict is not None:
            config = self._prepare_adapter_config(
                self.peft_config[adapter_name], self.get_model_config(model)
            )
            kwargs["state_dict"] = _with_output_siblings(state_dict, config)
        super().inject_adapter(model, adapter_name, *args, **kwargs)
        config = self.peft_config[adapter_name]
        self._finish_injection(model, config, adapter_name)
        if config.inference_mode and list(self.peft_config) == [adapter_name]:
            expect_first_weights(config, adapter_name)

    def _finish_injection(self, model: nn.Module, config: LSTMemConfig, adapter_name: str) -> None:
        """Check the placement, write each query wrapper's depth index for the adapter (memory layers
        in decoder-layer order), and attach the backbone's memory hooks."""
        queries = sorted(
            (
                m
                for m in model.modules()
                if isinstance(m, LSTMemQueryLayer) and adapter_name in m.lstmem_memory
            ),
            key=lambda m: m.layer_idx,
        )
        outputs = {m.layer_idx for m in model.modules() if isinstance(m, LSTMemOutputLayer)}
        if not queries:
            raise ValueError(
                f"LSTMem found no {config.query_module!r}/{config.output_module!r} projections in decoder layers "
                f"{config.layers_to_transform or 'all'}; check target_modules and layers_to_transform"
            )
        missing = [q.layer_idx for q in queries if q.layer_idx not in outputs]
        if missing:
            raise ValueError(
                f"decoder layers {missing} have a query projection but no {config.output_module!r}"
            )
        if self._num_layers(model) is not None:
            config.memory_layer_indices(self._num_layers(model))  # refuses layers the model does not have
        absent = sorted(set(config.layers_to_transform or ()) - {q.layer_idx for q in queries})
        if absent:
            raise ValueError(
                f"layers_to_transform names decoder layers {absent} that have no {config.query_module!r} / "
                f"{config.output_module!r} projections"
            )
        for depth, query in enumerate(queries):
            query.lstmem_depth[adapter_name] = depth
            query.lstmem_memory[adapter_name].set_depth_input(config.receives_depth(depth))
        MemoryHooks.attach(model)
        name_the_gate(model)  # transformers' adapter methods that refuse this PEFT say why, and what works

    @staticmethod
    def _num_layers(model: nn.Module) -> int | None:
        return getattr(getattr(model, "config", None), "num_hidden_layers", None)

    # ------------------------------------------------------------------ the memory controller
    @property
    def memory_hooks(self) -> MemoryHooks:
        """The backbone's :class:`~lstmem_peft.tuner.hooks.MemoryHooks` (shared by every adapter)."""
        hooks = MemoryHooks.of(self.model)
        if hooks is None:
            raise RuntimeError("this LSTMem model was unloaded; create it again with get_peft_model")
        return hooks

    def memory_layout(self, adapter_name: str | None = None) -> MemoryLayout:
        """The :class:`~lstmem_peft.memory.cache.MemoryLayout` of ``adapter_name`` (default: the active one)."""
        return self.memory_hooks.memory_layout(adapter_name)

    def memory_layers(self, adapter_name: str | None = None):
        """The adapter's :class:`~lstmem_peft.memory.layer.LSTMemLayer` modules in depth order."""
        return self.memory_hooks.memory_layers(adapter_name)

    def generate(
        self, *args, memory_cache: MemoryCache | None = None, memory_write: bool | None = None, **kwargs
    ):
        """``generate`` of the backbone with LSTMem memory (:meth:`MemoryHooks.generate
        <lstmem_peft.tuner.hooks.MemoryHooks.generate>`); ``PeftModel.generate`` calls it."""
        return self.memory_hooks.generate(
            *args, memory_cache=memory_cache, memory_write=memory_write, **kwargs
        )

    @contextmanager
    def _enable_peft_forward_hooks(self, *args, **kwargs):
        """``PeftModel`` enters this around every forward and ``generate``: refuse ``adapter_names``
        (mixed-adapter batches), which PEFT would otherwise drop silently for this method."""
        if kwargs.get("adapter_names") is not None:
            raise ValueError(ADAPTER_NAMES_REFUSED)
        yield

    # ------------------------------------------------------------------ merging and unloading
    def merge_and_unload(self, *args, **kwargs):
        raise NotImplementedError(
            "merge_and_unload() cannot apply to LSTMem: the adapter is a stateful memory whose corrections depend "
            "on the history written so far, so there are no fixed weights to merge. Use model.unload() to get the "
            "plain base model back, or keep the adapter and pass a MemoryCache"
        )

    def merge_adapter(self, *args, **kwargs):
        self.merge_and_unload()

    def unload(self) -> nn.Module:
        """Remove every LSTMem layer and hook; returns the plain base model."""
        return self._unload_and_optionally_merge(merge=False)

    def _unload_and_optionally_merge(
        self, merge=True, progressbar=False, safe_merge=False, adapter_names=None
    ):
        if merge:
            self.merge_and_unload()
        hooks = MemoryHooks.of(self.model)
        if hooks is not None:
            hooks.detach()
        return super()._unload_and_optionally_merge(merge=False, progressbar=progressbar)

    def delete_adapter(self, adapter_name: str) -> None:
        super().delete_adapter(adapter_name)
        hooks = MemoryHooks.of(self.model)
        if hooks is not None:
            hooks.refresh()
