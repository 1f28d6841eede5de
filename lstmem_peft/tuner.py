"""``LSTMemModel``: the PEFT tuner that injects LSTMem memory into a causal LM.

For every chosen decoder layer, the query projection is wrapped by
:class:`~lstmem_peft.layer.LSTMemQueryLayer` (which owns the memory parameters) and the output
projection by :class:`~lstmem_peft.layer.LSTMemOutputLayer`. Two hooks on the backbone open and close
a memory pass around each forward; ``generate`` and ``prepare_inputs_for_generation`` are wrapped on
the backbone instance so that ``memory_cache=`` reaches every step. ``unload()`` removes all of it.
"""

from __future__ import annotations

import re

import torch
from peft.tuners.tuners_utils import BaseTuner
from torch import nn

from .cache import MemoryCache, MemoryLayout
from .config import DEFAULT_TARGET_MODULES, LSTMemConfig
from .context import ACTIVE, Active, ModelPass
from .engine import MemoryPass
from .generation import RECORD_LIMIT, GenerateSession, refuse_inexact_modes, resolve_generation_config
from .layer import LSTMemOutputLayer, LSTMemQueryLayer, LSTMemTunerLayer

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def valid_from_attention_mask(mask, batch: int, length: int, past: int = 0) -> torch.Tensor | None:
    """Which of the current ``length`` tokens are real (not padding), from any transformers mask.

    Args:
        mask: ``None``; 2-D ``(B, S)`` with 1 for tokens (the last ``length`` columns are the
            current tokens); 4-D ``(B, 1, T, S)`` boolean (``True`` = attend) or float (0 = attend),
            where a token is valid when it may attend to itself; or a dict of such masks (``None``
            values: no padding).
        past: tokens already in the KV cache. In a 4-D mask token ``t``'s own column is ``past + t``
            (static caches have ``S`` = their capacity), or ``S - length + t`` when the mask is
            narrower than that (sliding windows keep only the last columns).
    Returns:
        ``(B, length)`` bool, or ``None`` when every token is valid. On CPU tensors the "every
        token" check is a cheap host read; on accelerators it would synchronise the device on every
        forward, so the mask is returned as it is (padding is applied with ``torch.where``, which
        is exact for an all-valid mask too).
    """
    if isinstance(mask, dict):
        mask = next((m for m in mask.values() if m is not None), None)
    if mask is None:
        return None
    if mask.dim() == 2:
        valid = mask[:, -length:]
        host = valid.shape == (batch, length) and valid.device.type == "cpu" and not valid.is_floating_point()
        if host and valid.numpy().all():  # the common case, read on the host: no tensor ops
            return None
        if valid.dtype != torch.bool:
            valid = valid != 0
    elif mask.dim() == 4:
        S = mask.shape[-1]
        t = torch.arange(length, device=mask.device)
        own = past + t if S >= past + length else S - length + t
        diag = mask[:, 0, -length:, :][:, t, own]
        valid = diag if diag.dtype == torch.bool else diag == 0
        if valid.shape[0] == 1 and batch > 1:
            valid = valid.expand(batch, length)
    else:
        raise ValueError(f"cannot read token validity from an attention mask of shape {tuple(mask.shape)}")
    if valid.shape != (batch, length):
        raise ValueError(
            f"attention mask gives validity {tuple(valid.shape)} for inputs of shape {(batch, length)}"
        )
    if valid.device.type != "cpu":
        return valid  # no host synchronisation on an accelerator: an all-True mask costs a few selects
    return None if bool(valid.all()) else valid


def _refuse_partial_adapter_weights(tuner: LSTMemModel, incompatible_keys) -> None:
    """After a state dict is loaded (an adapter file, a checkpoint): an adapter whose memory weights
    are partly missing (a damaged file, renamed keys, another version's layout) is an error, where
    PEFT would only warn and leave those weights at their initialisation. An adapter with none of
    its weights in the file is another adapter that this file does not carry."""
    missing = set(incompatible_keys.missing_keys)
    if not missing:
        return
    for adapter in tuner.peft_config:
        ours = [n for n, _ in tuner.named_parameters() if f".lstmem_memory.{adapter}." in n]
        lost = [n for n in ours if any(key.endswith(n) for key in missing)]
        if lost and len(lost) < len(ours):
            names = sorted({n.rsplit(".", 1)[-1] for n in lost})
            raise ValueError(
                f"the weights loaded for LSTMem adapter {adapter!r} lack {len(lost)} of its {len(ours)} tensors "
                f"(e.g. {lost[0]}; parameters {names}): the adapter file is damaged, was renamed, or comes from "
                "another version of lstmem-peft. Re-save it, or load the checkpoint it was saved from"
            )


def _refuse_packed(kwargs: dict, length: int) -> None:
    """Packed (padding-free) batches restart positions inside a row; memory would carry one example
    into the next. Refuse them clearly (one host read per multi-token forward with ``position_ids``
    and no attention mask; decode steps and padded batches are never packed)."""
    packed = any(kwargs.get(k) is not None for k in ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"))
    position_ids = kwargs.get("position_ids")
    if not packed and length > 1 and position_ids is not None and kwargs.get("attention_mask") is None:
        pos = position_ids.reshape(-1, position_ids.shape[-1])
        packed = bool((pos[:, 1:] <= pos[:, :-1]).any())
    if packed:
        raise ValueError(
            "LSTMem memory got a packed batch (positions restart inside a row): memory would carry one example into "
            "the next. Train without packing (TRL: SFTConfig(packing=False, padding_free=False)) or write each "
            "example with its own MemoryCache"
        )


def _and(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a & b.to(a.device)


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
    target_module_mapping = DEFAULT_TARGET_MODULES

    # ------------------------------------------------------------------ injection
    def _prepare_adapter_config(self, peft_config: LSTMemConfig, model_config: dict) -> LSTMemConfig:
        if peft_config.target_modules is None:
            model_type = model_config.get("model_type")
            if model_type not in DEFAULT_TARGET_MODULES:
                raise ValueError(
                    f"LSTMem has no default target modules for model type {model_type!r}; pass "
                    "target_modules=[<query projection name>, <output projection name>] (for most decoder "
                    "models ['q_proj', 'o_proj'])"
                )
            peft_config.target_modules = list(DEFAULT_TARGET_MODULES[model_type])
        return peft_config

    @staticmethod
    def _layer_index(key: str) -> int | None:
        found = _LAYER_INDEX.findall(f".{key}.")
        return int(found[-1]) if found else None

    @staticmethod
    def _check_target_module_exists(peft_config: LSTMemConfig, key: str) -> bool:
        name = key.rsplit(".", 1)[-1]
        if name not in (peft_config.query_module, peft_config.output_module):
            return False
        idx = LSTMemModel._layer_index(key)
        if idx is None:
            return False
        return peft_config.layers_to_transform is None or idx in peft_config.layers_to_transform

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
            output_weight = (
                output.get_base_layer().weight if isinstance(output, LSTMemTunerLayer) else output.weight
            )
            if not isinstance(target, LSTMemQueryLayer):
                self._check_linear(target, current_key)
                new = LSTMemQueryLayer(target, idx)
                self._replace_module(parent, target_name, new, target)
                target = new
            target.update_layer(adapter_name, peft_config, output_weight)
        elif not isinstance(target, LSTMemOutputLayer):
            self._check_linear(target, current_key)
            self._replace_module(parent, target_name, LSTMemOutputLayer(target, idx), target)

    @staticmethod
    def _check_linear(module: nn.Module, key: str) -> None:
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"LSTMem wraps torch.nn.Linear projections, but {key} is {type(module).__name__}; "
                "quantised or fused projections are not supported"
            )

    def _post_injection_hook(self, model: nn.Module, config: LSTMemConfig, adapter_name: str) -> None:
        self._forget_layers()
        queries = self._query_layers(adapter_name)
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
        if config.layers_to_transform is not None:
            absent = sorted(set(config.layers_to_transform) - {q.layer_idx for q in queries})
            if absent:
                raise ValueError(
                    f"layers_to_transform names decoder layers {absent} that the model does not have "
                    f"(it has {self._num_layers(model)} layers)"
                )
        self._install_hooks()

    @staticmethod
    def _num_layers(model: nn.Module) -> int | None:
        return getattr(getattr(model, "config", None), "num_hidden_layers", None)

    # ------------------------------------------------------------------ memory layout
    def _query_layers(self, adapter_name: str | None = None) -> list[LSTMemQueryLayer]:
        """The adapter's query wrappers in depth order (cached: forwards must not walk the model)."""
        adapter_name = adapter_name or self._single_active_adapter()
        cache = self.__dict__.setdefault("_lstmem_query_layers", {})
        if adapter_name not in cache:
            layers = [
                m
                for m in self.model.modules()
                if isinstance(m, LSTMemQueryLayer) and adapter_name in m.lstmem_memory
            ]
            cache[adapter_name] = sorted(layers, key=lambda m: m.layer_idx)
        return cache[adapter_name]

    def _forget_layers(self) -> None:
        self.__dict__.pop("_lstmem_query_layers", None)
        self.__dict__.pop("_lstmem_plans", None)

    def _pass_plan(self, adapter_name: str) -> tuple[MemoryLayout, dict[int, int], list]:
        """The adapter's memory layout, decoder-layer -> depth index map and memory layers in depth
        order (cached like the layers: a forward does no model walk and no layout building)."""
        plans = self.__dict__.setdefault("_lstmem_plans", {})
        if adapter_name not in plans:
            queries = self._query_layers(adapter_name)
            depth_index = {q.layer_idx: i for i, q in enumerate(queries)}
            layers = [q.lstmem_memory[adapter_name] for q in queries]
            plans[adapter_name] = (self.memory_layout(adapter_name), depth_index, layers)
        return plans[adapter_name]

    def _single_active_adapter(self) -> str:
        active = self.active_adapters
        if len(active) != 1:
            raise ValueError(f"LSTMem runs one adapter at a time; set_adapter() one of {active}")
        return active[0]

    def memory_layout(self, adapter_name: str | None = None) -> MemoryLayout:
        """The :class:`~lstmem_peft.cache.MemoryLayout` of the (active) adapter."""
        adapter_name = adapter_name or self._single_active_adapter()
        config = self.peft_config[adapter_name]
        base = getattr(self.model, "config", None)
        identity = "|".join(
            str(x)
            for x in (
                getattr(base, "model_type", type(self.model).__name__),
                getattr(base, "hidden_size", ""),
                getattr(config, "base_model_name_or_path", "") or "",
                f"alpha={config.alpha}",
                f"depth_coupling={config.depth_coupling}",
                f"memory_id={getattr(config, 'memory_id', None) or ''}",
            )
        )
        return MemoryLayout(
            layer_indices=tuple(q.layer_idx for q in self._query_layers(adapter_name)),
            num_heads=config.num_heads,
            head_dim=config.r,
            state_dtype=config.state_dtype,
            identity=identity,
        )

    def memory_layers(self, adapter_name: str | None = None):
        """The adapter's :class:`~lstmem_peft.memory.LSTMemLayer` modules in depth order."""
        adapter_name = adapter_name or self._single_active_adapter()
        return [q.lstmem_memory[adapter_name] for q in self._query_layers(adapter_name)]

    def _adapters_disabled(self) -> bool:
        if not self.peft_config:
            return True
        layers = self._query_layers(next(iter(self.peft_config)))  # PEFT toggles every wrapper together
        return bool(layers) and layers[0].disable_adapters

    # ------------------------------------------------------------------ hooks around the backbone
    def _hook_targets(self) -> list[nn.Module]:
        targets = [self.model]
        decoder = getattr(self.model, "model", None)
        if isinstance(decoder, nn.Module):
            targets.append(decoder)
        return targets

    def _install_hooks(self) -> None:
        if getattr(self, "_lstmem_handles", None):
            return
        handles = [self.register_load_state_dict_post_hook(_refuse_partial_adapter_weights)]
        for target in self._hook_targets():
            handles.append(target.register_forward_pre_hook(self._open_pass, with_kwargs=True))
            handles.append(target.register_forward_hook(self._close_pass, with_kwargs=True, always_call=True))
        self._lstmem_handles = handles

    def _remove_hooks(self) -> None:
        for handle in getattr(self, "_lstmem_handles", []):
            handle.remove()
        self._lstmem_handles = []
        self._forget_layers()

    def _checkpointing(self) -> bool:
        for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            if hasattr(type(self.model), name):
                return bool(getattr(self.model, name))
        return False

    def _open_pass(self, module: nn.Module, args, kwargs):
        """Forward pre-hook: pop ``memory_cache`` / ``memory_write`` / ``memory_feedback`` and open the pass."""
        cache = kwargs.pop("memory_cache", None)
        write = kwargs.pop("memory_write", None)
        feedback = kwargs.pop("memory_feedback", None)
        active = ACTIVE.get()
        if active is not None and active.owner is self and active.model_pass is not None:
            if active.module is not module:  # the inner decoder of the forward that opened the pass
                if cache is not None:
                    raise RuntimeError(
                        "memory_cache was passed to a nested forward of a model whose memory pass is already open"
                    )
                return args, kwargs
            # the same module opens again: its last forward was interrupted (KeyboardInterrupt skips the
            # closing hook). That pass never committed, so its cache is as it was; drop it for good.
            active = None if active.session is None else Active(self, None, None, active.session)
            ACTIVE.set(active)
        if self._adapters_disabled():
            return args, kwargs
        adapter = self._single_active_adapter()
        config = self.peft_config[adapter]
        if self.model.training and torch.is_grad_enabled() and self._checkpointing():
            raise RuntimeError(
                "LSTMem does not support gradient checkpointing: the recomputed layers would run outside the "
                "memory pass and memory gradients would be wrong. Call model.gradient_checkpointing_disable() "
                "(with TRL: gradient_checkpointing=False in the trainer config)"
            )
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        ref = ids if ids is not None else embeds
        if ref is None:
            raise ValueError("LSTMem needs input_ids or inputs_embeds to size the memory pass")
        batch, length = ref.shape[0], ref.shape[1]
        _refuse_packed(kwargs, length)
        kv = kwargs.get("past_key_values")
        past = 0 if kv is None or not hasattr(kv, "get_seq_length") else int(kv.get_seq_length())
        layout, depth_index, layers = self._pass_plan(adapter)
        session = active.session if active is not None and active.owner is self and cache is None else None
        if session is not None:
            memory = session.memory_for(layout, kwargs, batch, length, ref.device)
            write = session.write if write is None else write
        else:
            if cache is None:
                if past:
                    raise ValueError(
                        f"past_key_values holds {past} tokens but no memory_cache was passed: LSTMem memory would "
                        "start empty while attention sees that context. Pass the MemoryCache that was written "
                        "with those tokens (memory_cache=...), or no past_key_values"
                    )
                cache = MemoryCache()  # a fresh memory for this call only
            if not isinstance(cache, MemoryCache):
                raise TypeError(f"memory_cache must be a lstmem_peft.MemoryCache, got {type(cache).__name__}")
            cache.bind(layout)
            cache.ensure(batch, ref.device)
            memory = cache
        write = True if write is None else bool(write)
        feedback = bool(feedback) and config.block_feedback
        if feedback and not write:
            raise ValueError(
                "memory_feedback=True needs memory_write=True (feedback corrects states a block wrote)"
            )
        valid = valid_from_attention_mask(kwargs.get("attention_mask"), batch, length, past)
        if session is not None:
            valid = _and(valid, session.extra_valid(length, ref.device))
        memory_pass = MemoryPass(
            memory,
            valid,
            write=write,
            feedback=feedback,
            depth_coupling=config.depth_coupling,
            feedback_positions=config.feedback_positions,
            backend=config.scan_backend,
            weights=self._layer_weights(layers, session),
        )
        model_pass = ModelPass(
            adapter, depth_index, memory_pass, record_inputs=session is not None and length <= RECORD_LIMIT
        )
        model_pass.length = length
        model_pass.token = ACTIVE.set(Active(self, module, model_pass, session))
        return args, kwargs

    @staticmethod
    def _layer_weights(layers: list, session: GenerateSession | None) -> list | None:
        """The memory layers' :class:`~lstmem_peft.memory.LayerWeights` for a forward of a
        ``generate`` call, derived on its first forward (the parameters cannot change within a
        call); ``None`` elsewhere (each layer derives its own, differentiably)."""
        if session is None:
            return None
        if session.weights is None:
            with torch.no_grad():
                session.weights = [layer.weights(step=True) for layer in layers]
        return session.weights

    def _close_pass(self, module: nn.Module, args, kwargs, output):
        """Forward hook (also called when the forward raised): commit the pass, or drop it."""
        active = ACTIVE.get()
        if (
            active is None
            or active.owner is not self
            or active.module is not module
            or active.model_pass is None
        ):
            return output
        model_pass = active.model_pass
        ACTIVE.reset(model_pass.token)
        completed = output is not None and model_pass.memory_pass.layers_run > 0
        model_pass.close(completed)
        if completed and active.session is not None:
            active.session.forward_done(model_pass.length, model_pass.inputs, model_pass.memory_pass.valid)
        return output

    # ------------------------------------------------------------------ generate
    def generate(self, *args, memory_cache: MemoryCache | None = None, **kwargs):
        """``generate`` of the backbone with LSTMem memory (see :mod:`lstmem_peft.generation`).

        Args:
            memory_cache: the sessions' memory; updated in place when the call succeeds (with
                ``update_during_generation``), untouched when it raises. Without it the call uses a
                fresh memory.
            *args, **kwargs: as for ``transformers.GenerationMixin.generate``.
        """
        generate = self.model.generate
        if self._adapters_disabled():
            return generate(*args, **kwargs)
        if args:  # generate(inputs, ...): the prompt is the first positional argument
            kwargs["inputs"], args = args[0], args[1:]
        adapter = self._single_active_adapter()
        config = resolve_generation_config(self.model, kwargs)
        refuse_inexact_modes(config, kwargs)
        cache = MemoryCache() if memory_cache is None else memory_cache
        if not isinstance(cache, MemoryCache):
            raise TypeError(f"memory_cache must be a lstmem_peft.MemoryCache, got {type(cache).__name__}")
        cache.check_layout(self._pass_plan(adapter)[0])
        session = GenerateSession(self, adapter, cache, config, kwargs=kwargs)
        criteria = session.stopping_criteria(
            config, kwargs.pop("stopping_criteria", None), kwargs.get("tokenizer")
        )
        if criteria is not None:
            kwargs["stopping_criteria"] = criteria
        token = ACTIVE.set(Active(self, None, None, session))
        try:
            output = generate(*args, **kwargs)
        finally:
            ACTIVE.reset(token)
            session.unbind()
        session.commit(output)
        return output

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
        self._remove_hooks()
        return self._unload_and_optionally_merge(merge=False)

    def _unload_and_optionally_merge(
        self, merge=True, progressbar=False, safe_merge=False, adapter_names=None
    ):
        if merge:
            self.merge_and_unload()
        self._remove_hooks()
        return super()._unload_and_optionally_merge(merge=False, progressbar=progressbar)

    def delete_adapter(self, adapter_name: str) -> None:
        super().delete_adapter(adapter_name)
        self._forget_layers()
