"""``MemoryHooks``: the one object per backbone that carries LSTMem memory through its forwards.

PEFT offers several doors to the same injected layers: ``get_peft_model`` / ``PeftModel`` (a tuner
object), ``inject_adapter_in_model`` (no tuner kept), transformers' ``load_adapter`` /
``set_adapter`` / ``delete_adapter`` (a tuner per loaded adapter, then dropped) and
``peft.functional``. So nothing about a forward is read from a tuner: a backbone with LSTMem layers
carries exactly one ``MemoryHooks`` (found through its forward pre-hook, :meth:`MemoryHooks.of`),
and every fact a forward needs is read from the layers themselves, where PEFT keeps per-adapter
state: the active adapter and the enabled flag (:class:`~peft.tuners.tuners_utils.BaseTunerLayer`),
each adapter's configuration and depth index (``lstmem_config`` / ``lstmem_depth`` on the query
wrappers, written at injection, removed by PEFT's ``delete_adapter``).

The forward path is drawn in :mod:`lstmem_peft.tuner.context`. The hooks hold no handles and no state
about a forward (that lives in the ``ACTIVE`` context variable), so ``copy.deepcopy`` and pickling
the model carry a working, independent copy.
"""

from __future__ import annotations

import torch
from torch import nn

from lstmem_peft.memory.cache import MemoryCache, MemoryLayout
from lstmem_peft.memory.engine import MemoryPass

from .context import (
    ACTIVE,
    REENTRANT_REFUSED,
    Active,
    AdapterPlan,
    MemoryCheckpoint,
    ModelPass,
    checkpoint_kwargs,
)
from .generation import RECORD_LIMIT, GenerateSession, refuse_inexact_modes, resolve_generation_config
from .kv_argument import check_cache_seen, kv_cache_in
from .layer import LSTMemOutputLayer, LSTMemQueryLayer


def check_token_ids(ids, name: str = "input_ids") -> None:
    """Refuse token ids that are not an integer tensor of shape ``(batch, length)`` (a string, a list,
    one unbatched sequence, float ids), naming the expected type and shape and the usual fix."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of token ids with shape (batch, length), e.g. "
            f"tokenizer(texts, return_tensors='pt').input_ids or torch.tensor([ids]), got {type(ids).__name__}"
        )
    if ids.dim() != 2:
        hint = " (one sequence: ids.unsqueeze(0))" if ids.dim() == 1 else ""
        raise ValueError(f"{name} must have shape (batch, length), got {tuple(ids.shape)}{hint}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids (torch.long), got {ids.dtype}")


def valid_from_attention_mask(mask, batch: int, length: int, past=0) -> torch.Tensor | None:
    """Which of the current ``length`` tokens are real (not padding), from any transformers mask.

    Args:
        mask: ``None``; 2-D ``(B, S)`` with 1 for tokens (the last ``length`` columns are the
            current tokens); 4-D ``(B, 1, T, S)`` boolean (``True`` = attend) or float (0 = attend),
            where a token is valid when it may attend to itself; or a dict of such masks (``None``
            values: no padding).
        past: tokens already in the KV cache, or a function that returns it (called only for a 4-D
            mask, the one kind that needs it). In a 4-D mask token ``t``'s own column is ``past + t``
            (static caches have ``S`` = their capacity), or ``S - length + t`` when the mask is
            narrower than that (sliding windows keep only the last columns).
    Returns:
        ``(B, length)`` bool, or ``None`` when every token is valid. On CPU tensors the "every
        token" check is a cheap host read; on accelerators it would synchronise the device on every
        forward, and a ``torch.compile`` graph cannot depend on it, so there the mask is returned as
        it is (padding is applied with ``torch.where``, which is exact for an all-valid mask too).
    """
    if isinstance(mask, dict):
        mask = next((m for m in mask.values() if m is not None), None)
    if mask is None:
        return None
    if mask.dim() == 2:
        valid = mask[:, -length:]
        host = valid.shape == (batch, length) and _host_readable(valid) and not valid.is_floating_point()
        if host and valid.numpy().all():  # the common case, read on the host: no tensor ops
            return None
        if valid.dtype != torch.bool:
            valid = valid != 0
    elif mask.dim() == 4:
        past = past() if callable(past) else past
        S = mask.shape[-1]
        t = torch.arange(length, device=mask.device)
        if isinstance(past, torch.Tensor):  # a device count (compiled steps): no branch on its value
            own = torch.where(S >= past + length, past + t, S - length + t)
        else:
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
    if not _host_readable(valid):
        return valid  # no host synchronisation on an accelerator: an all-True mask costs a few selects
    return None if valid.numpy().all() else valid  # read on the host, as above: no tensor op


def _host_readable(t: torch.Tensor) -> bool:
    """Whether a value of ``t`` may be read on the host: a CPU tensor outside a ``torch.compile``
    trace (a graph must not depend on it, and an accelerator would synchronise)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


ADAPTER_NAMES_REFUSED = (
    "adapter_names= (a different adapter per batch row) is not supported by LSTMem: each row's memory "
    "belongs to one adapter's layout. Run one adapter per call (set_adapter(name)), or split the batch "
    "by adapter and pass each part its own MemoryCache"
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


class MemoryHooks:
    """The memory controller of one backbone: its forward hooks, its ``generate``, its layers.

    Use :meth:`of` to get (or :meth:`attach` to create) the controller of a model; ``model`` is the
    backbone (the ``*ForCausalLM`` module).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._plans: dict[str, AdapterPlan] = {}
        self._wrappers: list[nn.Module] | None = None
        self._checkpointable: list[nn.Module] | None = None
        self._handles: list = []

    # ------------------------------------------------------------------ finding and attaching
    @classmethod
    def of(cls, model: nn.Module) -> MemoryHooks | None:
        """The controller attached to backbone ``model``, or ``None``."""
        for hook in model._forward_pre_hooks.values():
            owner = getattr(hook, "__self__", None)
            if isinstance(owner, cls):
                return owner
        return None

    @classmethod
    def attach(cls, model: nn.Module) -> MemoryHooks:
        """The controller of ``model``, created and hooked in on first use (idempotent: a second
        adapter, or a second tuner over the same backbone, shares it)."""
        hooks = cls.of(model)
        if hooks is None:
            hooks = cls(model)
            handles = [model.register_load_state_dict_post_hook(hooks._refuse_partial_adapter_weights)]
            for target in hooks._targets():
                handles.append(target.register_forward_pre_hook(hooks._open_pass, with_kwargs=True))
                handles.append(
                    target.register_forward_hook(hooks._close_pass, with_kwargs=True, always_call=True)
                )
            hooks._handles = handles  # torch's handles pickle and deep-copy with the model
        hooks.refresh()
        return hooks

    def detach(self) -> None:
        """Remove every hook this controller put on the backbone (``unload``)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.refresh()

    def _targets(self) -> list[nn.Module]:
        targets = [self.model]
        decoder = getattr(self.model, "model", None)
        if isinstance(decoder, nn.Module):
            targets.append(decoder)
        return targets

    def refresh(self) -> None:
        """Forget the layer lists (an adapter was added, deleted or unloaded)."""
        self._plans = {}
        self._wrappers = None
        self._checkpointable = None

    # ------------------------------------------------------------------ what the layers say
    def wrappers(self) -> list[nn.Module]:
        """Every LSTMem wrapper of the backbone (found once, then kept until :meth:`refresh`)."""
        if self._wrappers is None:
            self._wrappers = [
                m for m in self.model.modules() if isinstance(m, (LSTMemQueryLayer, LSTMemOutputLayer))
            ]
        return self._wrappers

    def adapters(self) -> list[str]:
        """Names of the LSTMem adapters the layers hold."""
        names: dict[str, None] = {}
        for wrapper in self.wrappers():
            if isinstance(wrapper, LSTMemQueryLayer):
                names.update(dict.fromkeys(wrapper.lstmem_memory))
        return list(names)

    def enabled(self) -> bool:
        """Whether the adapter layers are enabled: all of them, or none.

        PEFT toggles every wrapper together (``disable_adapter()``, ``disable_adapter_layers()``,
        transformers' ``disable_adapters()``). Disabling single wrappers would cut the depth chain of
        the memory (and leave a ``Δo`` without its ``Δq``), so mixed states are refused. With no
        LSTMem adapter active (the last one deleted), the layers are the plain backbone's.
        """
        wrappers = self.wrappers()
        if not wrappers:
            return False
        if not self._lstmem_adapter_active(wrappers[0].active_adapters):
            # no LSTMem adapter is active: the last one was deleted (PEFT's delete_adapter, transformers'
            # delete_adapter) or none was set; the wrappers pass through, as PEFT gives the base model back
            return False
        disabled = [w.disable_adapters for w in wrappers]
        if any(disabled) and not all(disabled):
            off = sorted({w.layer_idx for w, d in zip(wrappers, disabled, strict=True) if d})
            raise RuntimeError(
                f"LSTMem adapter layers are disabled in decoder layers {off} only: memory runs through every "
                "memory layer or none. Disable the whole adapter (model.disable_adapter() as a context, "
                "disable_adapter_layers(), or transformers' disable_adapters()), or choose the memory layers "
                "with LSTMemConfig(layers_to_transform=[...])"
            )
        return not disabled[0]

    def _lstmem_adapter_active(self, active) -> bool:
        """Whether one of the ``active`` adapter names is an LSTMem adapter of these layers (without a
        walk over the wrappers when its plan is built, as on every forward of a running model)."""
        for name in active:
            plan = self._plans.get(name)
            if plan is not None and name in plan.queries[0].lstmem_memory:
                return True
        return any(name in self.adapters() for name in active)

    def active_adapter(self) -> str:
        """The one active adapter, as the layers report it (every door sets it on the layers)."""
        wrappers = self.wrappers()
        active = list(wrappers[0].active_adapters) if wrappers else []
        if len(active) == 1 and active[0] in self._plans:  # the common case: no walk over the wrappers
            return active[0]
        ours = [name for name in active if name in self.adapters()]
        if len(ours) != 1:
            raise ValueError(
                f"LSTMem runs one adapter at a time, but the active adapters are {active}; call "
                f"set_adapter() with one of {self.adapters()}"
            )
        return ours[0]

    def config(self, adapter: str | None = None):
        """The :class:`~lstmem_peft.tuner.config.LSTMemConfig` of ``adapter`` (default: the active one)."""
        adapter = adapter or self.active_adapter()
        return self.plan(adapter).queries[0].lstmem_config[adapter]

    def memory_layers(self, adapter: str | None = None) -> list:
        """The adapter's :class:`~lstmem_peft.memory.layer.LSTMemLayer` modules in depth order."""
        return list(self.plan(adapter or self.active_adapter()).memories)

    def memory_layout(self, adapter: str | None = None) -> MemoryLayout:
        """The :class:`~lstmem_peft.memory.cache.MemoryLayout` of ``adapter`` (default: the active one)."""
        return self.plan(adapter or self.active_adapter()).layout

    def plan(self, adapter: str) -> AdapterPlan:
        """Where the adapter's memory sits, built from the facts injection wrote on the layers (once
        per adapter, so a forward does no model walk; rebuilt if PEFT deleted the adapter from the
        layers)."""
        plan = self._plans.get(adapter)
        if plan is not None and adapter in plan.queries[0].lstmem_memory:
            return plan
        queries = [
            w for w in self.wrappers() if isinstance(w, LSTMemQueryLayer) and adapter in w.lstmem_memory
        ]
        if not queries:
            raise KeyError(f"no LSTMem adapter named {adapter!r}; the model has {self.adapters()}")
        queries.sort(key=lambda q: q.lstmem_depth[adapter])
        layers = [q.lstmem_memory[adapter] for q in queries]
        depth_index = {q.layer_idx: q.lstmem_depth[adapter] for q in queries}
        plan = AdapterPlan(self._layout(adapter, queries), depth_index, layers, queries)
        self._plans[adapter] = plan
        return plan

    def _layout(self, adapter: str, queries: list) -> MemoryLayout:
        return MemoryLayout.of_adapter(
            queries[0].lstmem_config[adapter],
            [q.layer_idx for q in queries],
            getattr(self.model, "config", None),
            type(self.model).__name__,
        )

    # ------------------------------------------------------------------ loading
    def _refuse_partial_adapter_weights(self, module: nn.Module, incompatible_keys) -> None:
        """After a state dict is loaded (an adapter file, a checkpoint): an adapter whose memory
        weights are partly missing (a damaged file, renamed keys, another version's layout) is an
        error, where PEFT would only warn and leave those weights at their initialisation. An
        adapter with none of its weights in the file is another adapter that this file does not
        carry."""
        missing = set(incompatible_keys.missing_keys)
        if not missing:
            return
        for adapter in self.adapters():
            ours = [n for n, _ in self.model.named_parameters() if f".lstmem_memory.{adapter}." in n]
            lost = [n for n in ours if any(key.endswith(n) for key in missing)]
            if lost and len(lost) < len(ours):
                names = sorted({n.rsplit(".", 1)[-1] for n in lost})
                raise ValueError(
                    f"the weights loaded for LSTMem adapter {adapter!r} lack {len(lost)} of its {len(ours)} "
                    f"tensors (e.g. {lost[0]}; parameters {names}): the adapter file is damaged, was renamed, "
                    "or comes from another version of lstmem-peft. Re-save it, or load the checkpoint it was "
                    "saved from"
                )

    # ------------------------------------------------------------------ one forward
    def _checkpointing(self) -> bool:
        for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            if hasattr(type(self.model), name):
                return bool(getattr(self.model, name))
        return False

    def _prepare_checkpointing(self) -> None:
        """Gradient checkpointing is on and this forward trains: make every checkpointed decoder
        layer's checkpoint function exact for memory (:class:`~lstmem_peft.tuner.context.MemoryCheckpoint`,
        set once over the function transformers set), or refuse the modes that cannot be."""
        if self._checkpointable is None:  # the layers transformers can checkpoint, found once
            self._checkpointable = [m for m in self.model.modules() if hasattr(m, "gradient_checkpointing")]
        for module in self._checkpointable:
            if not module.gradient_checkpointing:
                continue
            func = getattr(module, "_gradient_checkpointing_func", None)
            if func is None or isinstance(func, MemoryCheckpoint):
                continue
            options = checkpoint_kwargs(func)
            if options is None:
                raise RuntimeError(
                    f"{type(module).__name__}._gradient_checkpointing_func is {func!r}, not the functools.partial "
                    "of torch.utils.checkpoint that transformers sets: LSTMem cannot make it exact for memory. "
                    "Enable checkpointing with model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                    '{"use_reentrant": False}), or disable it (model.gradient_checkpointing_disable())'
                )
            if options.get("use_reentrant") is not False:
                raise RuntimeError(REENTRANT_REFUSED)
            module._gradient_checkpointing_func = MemoryCheckpoint(func)

    def _open_pass(self, module: nn.Module, args, kwargs):
        """Forward pre-hook: pop ``memory_cache`` / ``memory_write`` / ``memory_feedback`` /
        ``memory_only`` and open the pass."""
        cache = kwargs.pop("memory_cache", None)
        write = kwargs.pop("memory_write", None)
        feedback = kwargs.pop("memory_feedback", None)
        memory_only = bool(kwargs.pop("memory_only", False))
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
        if kwargs.get("adapter_names") is not None:
            raise ValueError(ADAPTER_NAMES_REFUSED)
        if not self.enabled():
            return args, kwargs
        adapter = self.active_adapter()
        config = self.config(adapter)
        if self.model.training and torch.is_grad_enabled() and self._checkpointing():
            self._prepare_checkpointing()
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        ref = ids if ids is not None else embeds
        if ref is None:
            raise ValueError("LSTMem needs input_ids or inputs_embeds to size the memory pass")
        if ids is not None:
            check_token_ids(ids)
        batch, length = ref.shape[0], ref.shape[1]
        _refuse_packed(kwargs, length)
        kv = kv_cache_in(args, kwargs)

        def past() -> int:  # read only where needed: a static cache keeps its length on the device
            return 0 if kv is None or not hasattr(kv, "get_seq_length") else int(kv.get_seq_length())

        plan = self.plan(adapter)
        session = active.session if active is not None and active.owner is self and cache is None else None
        draft = session is not None and session.drafting()
        memory, write = self._memory_of(
            cache, session, draft, write, plan.layout, kv, batch, length, ref, past
        )
        write, feedback = _pass_flags(write, feedback, memory_only, config, session, kv)
        if session is not None and not draft:
            position = session.forward_position  # tracked by the session: no read of the cache
            past = lambda: position  # noqa: E731
        valid = valid_from_attention_mask(kwargs.get("attention_mask"), batch, length, past)
        if session is not None and not draft:
            valid = _and(valid, session.extra_valid(length, ref.device))
        memory_pass = MemoryPass(
            memory,
            valid,
            write=write,
            feedback=feedback,
            depth_coupling=config.depth_coupling,
            feedback_positions=config.feedback_positions,
            every_layer=not draft,  # a draft runs only the layers below its exit
        )
        model_pass = ModelPass(
            adapter,
            plan,
            memory_pass,
            record_inputs=session is not None and not draft and length <= RECORD_LIMIT,
            draft=draft,
            memory_only=memory_only,
        )
        model_pass.length = length
        model_pass.kv = kv
        model_pass.token = ACTIVE.set(Active(self, module, model_pass, session))
        return args, kwargs

    @staticmethod
    def _memory_of(cache, session, draft, write, layout, kv, batch, length, ref, past):
        """The memory a forward runs against and whether it writes (``None``: not said): a draft's
        read-only view of its ``generate`` call's verified memory, the call's own memory, the
        ``memory_cache`` passed, or a fresh memory for this forward only."""
        if draft:  # an early-exit draft: reads the verified memory, writes nothing
            return session.draft_memory(layout, batch, ref.device), False
        if session is not None:
            return session.memory_for(layout, kv, batch, length, ref.device), (
                session.write if write is None else write
            )
        if cache is None:
            if past():
                raise ValueError(
                    f"the KV cache holds {past()} tokens but no memory_cache was passed: LSTMem memory would "
                    "start empty while attention sees that context. Pass the MemoryCache that was written "
                    "with those tokens (memory_cache=...), or no KV cache"
                )
            cache = MemoryCache()  # a fresh memory for this call only
        if not isinstance(cache, MemoryCache):
            raise TypeError(f"memory_cache must be a lstmem_peft.MemoryCache, got {type(cache).__name__}")
        cache.bind(layout)
        cache.ensure(batch, ref.device)
        return cache, write

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
        stop = model_pass.stop
        if stop is not None and model_pass.memory_pass.all_layers_run:
            # a memory-only forward stopped on purpose (MemoryWritten is on its way to the caller):
            # commit, and hand the caller what committing raises (torch silences errors in this hook)
            try:
                model_pass.close(True)
                stop.committed = True
            except BaseException as err:
                stop.error = err
            return output
        completed = output is not None and model_pass.memory_pass.layers_run > 0
        if completed:
            try:
                check_cache_seen(model_pass.kv, output, model_pass.length)
            except RuntimeError:
                model_pass.close(False)  # attention saw context memory did not follow: commit nothing
                raise
        model_pass.close(completed)
        if completed and active.session is not None and not model_pass.draft:
            active.session.forward_done(model_pass.length, model_pass.inputs, model_pass.memory_pass.valid)
        return output

    # ------------------------------------------------------------------ generate
    def generate(
        self, *args, memory_cache: MemoryCache | None = None, memory_write: bool | None = None, **kwargs
    ):
        """``generate`` of the backbone with LSTMem memory (see :mod:`lstmem_peft.tuner.generation`).

        Args:
            memory_cache: the sessions' memory; updated in place when the call succeeds (when the
                call writes), untouched when it raises. Without it the call uses a fresh memory.
            memory_write: whether the prompt and the generated tokens are written into memory
                (``True``) or only read it (``False``: the cache is left as it was); ``None`` (default)
                takes the adapter's ``update_during_generation``.
            *args, **kwargs: as for ``transformers.GenerationMixin.generate``.
        """
        generate = self.model.generate
        if kwargs.get("adapter_names") is not None:
            raise ValueError(ADAPTER_NAMES_REFUSED)
        if not self.enabled():
            return generate(*args, **kwargs)
        if args:  # generate(inputs, ...): the prompt is the first positional argument
            kwargs["inputs"], args = args[0], args[1:]
        for name in ("inputs", "input_ids"):
            if kwargs.get(name) is not None:
                check_token_ids(kwargs[name], name)
        adapter = self.active_adapter()
        config = resolve_generation_config(self.model, kwargs)
        refuse_inexact_modes(self.model, config, kwargs, kv_cache_in(args, kwargs))
        cache = MemoryCache() if memory_cache is None else memory_cache
        if not isinstance(cache, MemoryCache):
            raise TypeError(f"memory_cache must be a lstmem_peft.MemoryCache, got {type(cache).__name__}")
        cache.check_layout(self.plan(adapter).layout)
        if memory_write is not None and not isinstance(memory_write, bool):
            raise TypeError(f"memory_write must be True, False or None, got {memory_write!r}")
        write = self.config(adapter).update_during_generation if memory_write is None else memory_write
        session = GenerateSession(self, adapter, cache, config, kwargs=kwargs, write=write)
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
            # early exit cuts the stack while it drafts and does not restore it if a draft raises
            session.stack.num_hidden_layers = session.num_layers
        session.commit(output)
        return output


def _pass_flags(write, feedback, memory_only: bool, config, session, kv) -> tuple[bool, bool]:
    """``memory_write`` and ``memory_feedback`` of one forward as they apply (defaults filled, feedback
    only where the adapter has it), or the error for a combination that cannot run."""
    write = True if write is None else bool(write)
    feedback = bool(feedback) and config.block_feedback
    if feedback and not write:
        raise ValueError(
            "memory_feedback=True needs memory_write=True (feedback corrects states a block wrote)"
        )
    if memory_only and (not write or session is not None or kv is not None or torch.compiler.is_compiling()):
        raise ValueError(
            "memory_only=True stops a forward once memory is written, so it needs memory_write=True, no "
            "KV cache (the layers it skips would leave the KV cache incomplete), no generate() and no "
            "torch.compile; write histories with lstmem_peft.write_history"
        )
    return write, feedback
