"""Memory through ``generate``: exact in every decoding mode, or refused before anything is touched.

The contract, for every ``generate`` call on a model with an active LSTMem adapter:

(a) the logits of each generated token equal the last-position logits of one forward over prompt +
    tokens generated so far, from the starting memory;
(b) afterwards, each row of the ``memory_cache`` equals the starting memory fed, once and in order,
    exactly the tokens generate kept for that row: the prompt's valid tokens and the generated tokens
    it forwarded while the row was unfinished; never padding, tokens forwarded after the row
    finished, or draft tokens the verifier rejected.

How (one :class:`GenerateSession` per call):

* **The user's cache is not touched until the call succeeds.** The session decodes on a working copy
  and commits it into the user's :class:`~lstmem_peft.memory.cache.MemoryCache` object at the end; a call
  that raises leaves the user's cache as it was. ``num_return_sequences`` / beam expansion happens at
  the first forward, after transformers validated the configuration.
* **Memory follows the KV cache's length.** Memory is a function of the position the KV cache has
  reached: a forward that starts at KV position ``P`` runs from the memory at ``P``. A crop
  (assisted decoding, the deferred stop check) or a re-forward of the whole sequence
  (``use_cache=False``) rolls memory back to its checkpoint at ``P``: the state at the start of the
  call, or any position inside the last forward (recomputed from that forward's memory inputs,
  kept for forwards of at most :data:`RECORD_LIMIT` tokens).
* **Row moves follow the KV cache.** For the call, ``reorder_cache``, ``batch_select_indices`` and
  ``batch_repeat_interleave`` of the KV cache object generate decodes with also move memory rows
  (beam search). After beam search the memory of each returned hypothesis is recomputed from the
  starting memory with one forward over the hypothesis, because the running beams transformers
  keeps are not the hypotheses it returns.
* **Finished rows stop writing.** A stopping criterion of the session evaluates the EOS and
  stop-string criteria (and wraps the user's own criteria, so they run once) and marks from which
  position each row must no longer write.

* **Drafts read, never write.** Self-speculative early exit drafts with this same model, its stack
  cut at layer ``assistant_early_exit``, on a KV cache of its own. A draft forward (recognised by
  the cut: ``num_hidden_layers`` below the model's) reads the working memory as verified so far and
  writes nothing; only the memory layers below the exit run. The verifier's full forwards write, and
  are rolled back with the KV crop like any assisted decoding. An assistant model with its own
  LSTMem adapter keeps its own memory; it never touches this one.

Modes that cannot be made exact raise before the call starts: classifier-free guidance (its
unconditional branch runs the model without the caller's memory), paged / continuous batching
(which drops ``memory_cache``), the model as its own ``assistant_model`` (use
``assistant_early_exit``), and beam search on a KV cache the caller passes in.
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from lstmem_peft.memory.cache import MemoryCache, MemoryLayout
from lstmem_peft.memory.engine import MemoryPass

from .kv_argument import stale_cache_message

#: Larger than any position: "this row never stops writing".
_NEVER = torch.iinfo(torch.long).max

#: Forwards of at most this many tokens keep their memory inputs until the next forward, so that a
#: crop of the KV cache back into them (draft tokens of assisted decoding, the deferred stop check's
#: extra step) can be followed; longer ones (a prompt) are never cropped into by transformers.
RECORD_LIMIT = 64


def resolve_generation_config(model, kwargs: dict) -> GenerationConfig:
    """The generation config ``generate`` will use: the one passed (or the model's), updated with
    the keyword arguments that name its fields (transformers' own precedence)."""
    base = kwargs.get("generation_config") or getattr(model, "generation_config", None) or GenerationConfig()
    config = copy.deepcopy(base)
    fields = {k: v for k, v in kwargs.items() if k != "generation_config" and hasattr(config, k)}
    if fields:
        config.update(**fields)
    return config


def refuse_inexact_modes(model, config: GenerationConfig, kwargs: dict, kv=None) -> None:
    """Raise for the decoding modes whose memory cannot follow the tokens exactly (see module doc);
    ``kv`` is the KV cache the caller passed (:func:`~lstmem_peft.tuner.kv_argument.kv_cache_in`)."""
    if config.guidance_scale is not None and config.guidance_scale != 1:
        raise NotImplementedError(
            "classifier-free guidance (guidance_scale) is not supported with LSTMem memory: transformers runs its "
            "unconditional branch without the caller's memory, so the two branches would see different memories. "
            "Generate without guidance_scale, or call model.disable_adapter() for a guided generation of the base model"
        )
    if config.cache_implementation == "paged" or kwargs.get("use_continuous_batching"):
        raise NotImplementedError(
            "paged attention / continuous batching is not supported with LSTMem memory: that path drops "
            "memory_cache. Use the default or a static cache (cache_implementation='static')"
        )
    assistant = kwargs.get("assistant_model")
    if isinstance(assistant, torch.nn.Module) and _same_model(assistant, model):
        raise NotImplementedError(
            "the model cannot be its own assistant_model with LSTMem memory: its drafts would run a second KV cache "
            "against the same memory. For self-speculative decoding pass assistant_early_exit=<layer> instead"
        )
    if (config.num_beams or 1) > 1 and kv is not None:
        raise NotImplementedError(
            "beam search (num_beams > 1) with a KV cache you pass in (cache= or past_key_values=) is not supported "
            "with LSTMem memory: the memory of the returned hypotheses is recomputed from the prompt. Generate "
            "without a KV cache "
            "(put the whole context in input_ids), or use sampling / greedy decoding with your KV cache"
        )
    if (config.num_beams or 1) > 1 and prompt_ids(kwargs) is None:
        raise NotImplementedError(
            "beam search (num_beams > 1) from inputs_embeds is not supported with LSTMem memory: the memory of the "
            "returned hypotheses is recomputed from token ids. Pass input_ids, or decode greedily / by sampling"
        )


def _same_model(a, b) -> bool:
    """Whether ``a`` and ``b`` are one model (any PEFT wrapper around it): they share parameters."""
    first = next(iter(a.parameters()), None)
    return first is not None and first is next(iter(b.parameters()), None)


def stack_config(model):
    """The config whose ``num_hidden_layers`` transformers lowers while early exit drafts (that of the
    module under ``base_model_prefix``)."""
    return getattr(getattr(model, model.base_model_prefix, model), "config", model.config)


def prompt_ids(kwargs: dict) -> torch.Tensor | None:
    """The prompt token ids of a ``generate`` call (``inputs`` or ``input_ids``), if any."""
    ids = kwargs.get("input_ids", kwargs.get("inputs"))
    return ids if isinstance(ids, torch.Tensor) and not ids.is_floating_point() else None


def prompt_mask(model, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The prompt's attention mask as ``generate`` uses it: the one passed, else inferred from padding
    (transformers' rule: padding is the pad token, when it differs from EOS and occurs in the prompt)."""
    if mask is not None:
        return mask.long()
    config = model.generation_config
    pad, eos = config.pad_token_id, config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
    if pad is not None and pad not in eos and bool((ids == pad).any()):
        return (ids != pad).long()
    return torch.ones_like(ids)


class _States:
    """The memory of every row at one KV position: references to immutable state tensors."""

    __slots__ = ("layers", "tokens")

    def __init__(self, cache: MemoryCache) -> None:
        self.layers = [(s.cell, s.hidden) for s in cache.layers]
        self.tokens = cache.tokens_written

    def restore(self, cache: MemoryCache) -> None:
        for state, (cell, hidden) in zip(cache.layers, self.layers, strict=True):
            state.cell, state.hidden = cell, hidden
        cache.tokens_written = self.tokens

    def map(self, fn) -> None:
        self.layers = [(fn(c), fn(h)) for c, h in self.layers]
        self.tokens = fn(self.tokens)


class _LastForward:
    """What is needed to recompute the memory at any position inside the last forward."""

    __slots__ = ("before", "inputs", "position", "valid")

    def __init__(
        self, position: int, before: _States, inputs: list[torch.Tensor], valid: torch.Tensor | None
    ):
        self.position, self.before, self.inputs, self.valid = position, before, inputs, valid


class _RowStop(StoppingCriteria):
    """Marks the rows that finished, for the memory (returns only what the user's criteria say).

    Evaluates the EOS and stop-string criteria transformers builds from the generation config (pure
    functions of the tokens, so evaluating them twice is harmless) and calls the user's criteria
    once, on generate's behalf.
    """

    def __init__(self, session: GenerateSession, own: list, user: list) -> None:
        self.session, self.own, self.user = session, own, user

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for criterion in self.own:
            done = done | criterion(input_ids, scores, **kwargs)
        user = torch.zeros_like(done)
        for criterion in self.user:
            user = user | criterion(input_ids, scores, **kwargs)
        self.session.rows_finished(done | user, input_ids.shape[1])
        return user


class GenerateSession:
    """The memory of one ``generate`` call (see the module docstring).

    Args:
        hooks: the backbone's :class:`~lstmem_peft.tuner.hooks.MemoryHooks`.
        adapter: the active adapter's name.
        cache: the caller's :class:`MemoryCache` (written only by :meth:`commit`).
        config: the resolved generation config.
        kwargs: the call's keyword arguments (the prompt, for beam search).
        write: whether the call writes memory (``False``: every forward only reads it).
    """

    def __init__(
        self, hooks, adapter: str, cache: MemoryCache, config: GenerationConfig, kwargs: dict, write: bool
    ) -> None:
        self.hooks = hooks
        self.adapter = adapter
        self.user_cache = cache
        self.expand = max(config.num_beams or 1, config.num_return_sequences or 1)
        self.beams = (config.num_beams or 1) > 1
        self.return_sequences = config.num_return_sequences or 1
        self.write = write
        self.work: MemoryCache | None = None
        self.kv = None
        self._kv_methods: dict[str, object] = {}
        self.position = 0  # KV position the working memory corresponds to
        #: whether compiled decoding steps ran: they leave ``position`` behind (the static cache's
        #: count is the position then; :meth:`commit` reads it once)
        self.compiled_steps = False
        self._compiled_start: torch.Tensor | None = None
        self.start: _States | None = None
        self.start_position = 0
        self.last: _LastForward | None = None
        self.stop_at: torch.Tensor | None = None  # (B,) first position a row no longer writes
        self._offset: int | None = None  # KV position of input_ids[:, 0] as the stopping criteria see it
        self.prompt: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, mask) before expansion (beams)
        if self.beams:
            ids = prompt_ids(kwargs)
            self.prompt = (ids, prompt_mask(hooks.model, ids, kwargs.get("attention_mask")))
        self.stack = stack_config(hooks.model)
        self.num_layers = self.stack.num_hidden_layers  # early exit lowers it while it drafts
        self.pad_token_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id

    # ------------------------------------------------------------------ set-up
    def stopping_criteria(self, config: GenerationConfig, user, tokenizer) -> StoppingCriteriaList | None:
        """The criteria list to pass to transformers' ``generate`` in place of ``user``."""
        if self.beams or not self.write:
            return user
        own = []
        eos = config.eos_token_id
        if eos is not None:
            own.append(EosTokenCriteria(eos_token_id=eos))
        if config.stop_strings is not None and tokenizer is not None:
            own.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=config.stop_strings))
        user = list(user or [])
        if not own and not user:
            return None
        return StoppingCriteriaList([_RowStop(self, own, user)])

    # ------------------------------------------------------------------ per forward
    def memory_for(self, layout: MemoryLayout, kv, batch: int, length: int, device) -> MemoryCache:
        """The working memory for a forward of ``length`` tokens starting at the position of ``kv``,
        the forward's KV cache (``None``: the forward re-feeds the whole sequence)."""
        if torch.compiler.is_compiling() and self.work is not None and kv is not None and kv is self.kv:
            # a decoding step torch.compile traces (transformers compiles them on a static cache): the
            # cache is never cropped within the call, and the position the step starts at is the
            # cache's own device count, so no host integer enters the graph (it would recompile the
            # step at every token)
            self._compiled_start = kv.get_seq_length()
            self.compiled_steps = True
            return self.work
        position = self._kv_position(kv)
        if kv is None and self.work is not None and length < self.position:
            # without a KV cache every forward re-feeds the sequence so far; a shorter one continues a
            # cache the hooks did not see (a transformers release that passes it another way)
            raise RuntimeError(
                stale_cache_message(
                    f"a forward inside generate() fed {length} tokens after memory had reached position "
                    f"{self.position}, as if it continued a KV cache"
                )
            )
        if self.work is None:
            self._begin(layout, kv, position, batch, device)
        elif kv is not self.kv:
            raise RuntimeError(
                "a forward inside generate() used another KV cache than the call's own; LSTMem memory follows one "
                "KV cache per call (classifier-free guidance and similar second branches are not supported)"
            )
        if position != self.position:
            self.rollback(position)
        self._forward_start = position
        self._forward_before = _States(self.work)
        return self.work

    @property
    def forward_position(self) -> int | torch.Tensor:
        """The KV position the running forward starts at (set by :meth:`memory_for`); in a compiled
        decoding step, the static cache's 0-d device count."""
        return self._compiled_start if torch.compiler.is_compiling() else self._forward_start

    def _kv_position(self, kv) -> int:
        """How many tokens the KV cache holds. A static cache keeps that count on its device, where
        reading it would synchronise every decoding step (and break a CUDA graph); transformers never
        crops one, so after the call's first forward its count is the position memory tracked
        (checked once, at the end of the call)."""
        if kv is None:
            return 0
        length = kv.get_seq_length()
        if isinstance(length, torch.Tensor) and self.work is not None and kv is self.kv:
            return self.position
        return int(length)

    def drafting(self) -> bool:
        """Whether the forward about to run is an early-exit draft (its stack is cut)."""
        return self.stack.num_hidden_layers < self.num_layers

    def draft_memory(self, layout: MemoryLayout, batch: int, device) -> MemoryCache:
        """The memory an early-exit draft reads (read-only): the working memory as verified so far, or
        the starting memory before the first verifying forward."""
        work = self.work if self.work is not None else self._working_copy(layout, batch, device)
        if work.batch_size != batch:
            raise RuntimeError(
                f"an early-exit draft ran {batch} sequences against a memory of {work.batch_size}; assisted decoding "
                "drafts one sequence at a time: generate with batch size 1"
            )
        return work

    def extra_valid(self, length: int, device) -> torch.Tensor | None:
        """``(B, length)`` bool: ``False`` where a finished row must not write; ``None`` when all may."""
        if self.stop_at is None:
            return None
        pos = self.forward_position + torch.arange(length, device=device)
        return pos[None, :] < self.stop_at.to(device)[:, None]

    def forward_done(
        self, length: int, inputs: list[torch.Tensor] | None, valid: torch.Tensor | None
    ) -> None:
        """The forward completed and its pass committed to the working memory."""
        if torch.compiler.is_compiling():  # positions stay on the device (memory_for); no rollback
            self.last = None
            return
        self.position = self._forward_start + length
        self.last = (
            None if inputs is None else _LastForward(self._forward_start, self._forward_before, inputs, valid)
        )

    def _begin(self, layout, kv, position, batch, device) -> None:
        self.work = self._working_copy(layout, batch, device)
        self.position = self.start_position = position
        self.start = _States(self.work)
        if kv is not None:
            self.bind_kv(kv)

    def _working_copy(self, layout: MemoryLayout, batch: int, device) -> MemoryCache:
        """A copy of the caller's memory with one row per sequence generate runs, on ``device``."""
        cache = self.user_cache
        cache.check_layout(layout)
        work = cache.clone() if cache.layout is not None else MemoryCache()
        work.bind(layout)
        if work.batch_size is None:
            work.ensure(batch, device)
        elif batch != work.batch_size:
            if batch != work.batch_size * self.expand:
                raise ValueError(
                    f"MemoryCache holds {work.batch_size} sequences but generate() runs {batch} "
                    f"(expected {work.batch_size} x {self.expand} for num_beams / num_return_sequences); pass a "
                    "memory_cache with one row per input sequence"
                )
            work.batch_repeat_interleave(self.expand)
        if work.device != device:
            work.to(device)
        return work

    # ------------------------------------------------------------------ the KV cache's operations
    def bind_kv(self, kv) -> None:
        """For this call, make the KV cache's row operations move the memory's rows too.

        The one place LSTMem sets attributes on an object it does not own, and why: transformers'
        ``generate`` creates the cache itself and calls its ``reorder_cache`` /
        ``batch_select_indices`` / ``batch_repeat_interleave`` directly, with no callback, so the
        memory's rows can only follow through the cache object. The methods are set on this one
        instance (the class is untouched) and :meth:`unbind` restores it at the end of the call,
        whether the call succeeded or raised (docs/design-choices.md, "The KV cache's row operations").
        """
        self.kv = kv
        for name, fn in (
            ("reorder_cache", self._select),
            ("batch_select_indices", self._select),
            ("batch_repeat_interleave", self._repeat),
        ):
            original = getattr(kv, name, None)
            if original is None:
                continue
            self._kv_methods[name] = kv.__dict__.get(name)

            def moved(arg, _original=original, _fn=fn):
                result = _original(arg)
                _fn(arg)
                return result

            setattr(kv, name, moved)

    def unbind(self) -> None:
        """Give the KV cache its own methods back (end of the call)."""
        if self.kv is None:
            return
        for name, previous in self._kv_methods.items():
            if previous is None:
                self.kv.__dict__.pop(name, None)
            else:
                setattr(self.kv, name, previous)
        self._kv_methods = {}

    def _select(self, index: torch.Tensor) -> None:
        index = self.work.row_index(index)  # indices or a boolean mask, checked against the current rows
        self.work.batch_select_indices(index)
        self._move_saved_rows(lambda t: t.index_select(0, index.to(t.device)))

    def _repeat(self, repeats: int) -> None:
        self.work.batch_repeat_interleave(repeats)
        self._move_saved_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def _move_saved_rows(self, fn) -> None:
        """Move the rows of what the session keeps beside the working memory like its rows."""
        self.start.map(fn)
        if self.stop_at is not None:
            self.stop_at = fn(self.stop_at)
        self.last = None  # a crop after a row move would need the moved inputs too; none happens

    # ------------------------------------------------------------------ rows that finished
    def rows_finished(self, done: torch.Tensor, length: int) -> None:
        """``done`` rows finished with the token just appended (``input_ids`` now ``length`` long):
        that token and everything after it are not written into their memory."""
        if self._offset is None:  # the KV cache holds every token but the one just appended
            cached = length - 1 if self.kv is None else int(self.kv.get_seq_length())
            self._offset = cached - (length - 1)
        position = length - 1 + self._offset
        if self.stop_at is None:
            self.stop_at = torch.full_like(done, _NEVER, dtype=torch.long)
        self.stop_at = torch.where(done & (self.stop_at == _NEVER), position, self.stop_at)

    # ------------------------------------------------------------------ rollback
    def rollback(self, position: int) -> None:
        """Return the working memory to KV position ``position`` (a crop or a re-forward)."""
        if not self.write:  # a read-only call never changed the memory: every position has the start's
            self.position = position
            return
        if position == self.start_position:
            self.start.restore(self.work)
        elif self.last is not None and self.last.position <= position < self.position:
            last = self.last
            last.before.restore(self.work)
            self._replay(last, position - last.position)
        else:
            where = (
                "the start of the call"
                if self.last is None
                else (
                    f"the start of the call ({self.start_position}) or inside the last forward "
                    f"([{self.last.position}, {self.position}])"
                )
            )
            raise RuntimeError(
                f"the KV cache is at position {position} but LSTMem memory is at {self.position} and can only return "
                f"to {where}; the KV cache was changed in a way memory cannot follow"
            )
        self.position = position

    def _replay(self, last: _LastForward, count: int) -> None:
        """Recompute the memory after the first ``count`` tokens of the last forward from its inputs."""
        if count == 0:
            return
        config = self.hooks.config(self.adapter)
        layers = self.hooks.memory_layers(self.adapter)
        valid = None if last.valid is None else last.valid[:, :count]
        step = MemoryPass(self.work, valid, write=True, depth_coupling=config.depth_coupling)
        with torch.no_grad():
            for i, (layer, x) in enumerate(zip(layers, last.inputs, strict=True)):
                step.run(i, layer, x[:, :count])
            step.finish()

    # ------------------------------------------------------------------ the end
    def commit(self, output) -> None:
        """The call succeeded: bring the working memory to its final state and hand it to the caller."""
        if self.work is None:  # no forward ran
            return
        if self.kv is not None:
            length = self.kv.get_seq_length()
            final = int(length)
            if self.compiled_steps:  # memory followed the static cache on the device, step by step
                self.position = final
            if final != self.position:
                if isinstance(length, torch.Tensor):
                    raise RuntimeError(
                        f"the static KV cache holds {final} tokens but LSTMem memory followed it to {self.position}: "
                        "it changed length in a way memory could not see (a crop?); the MemoryCache was not "
                        "written. Generate with the default (dynamic) cache for modes that crop the KV cache"
                    )
                self.rollback(final)  # the deferred stop check cropped one step
        if self.beams:
            self._recompute_hypotheses(output)
        self.user_cache.adopt(self.work)

    def _recompute_hypotheses(self, output) -> None:
        """Memory of the returned beam hypotheses: starting memory + prompt + each hypothesis's tokens."""
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        rows = self.start.tokens.shape[0] // self.expand
        first = torch.arange(rows, device=self.start.tokens.device) * self.expand  # one start row per input
        self.start.restore(self.work)
        self.work.batch_select_indices(first.repeat_interleave(self.return_sequences))
        if not self.write:
            return
        ids, mask = (t.repeat_interleave(self.return_sequences, dim=0) for t in self.prompt)
        generated = sequences[:, ids.shape[1] :].to(ids.device)
        pad = self.pad_token_id
        pad = pad[0] if isinstance(pad, (list, tuple)) else pad
        # a hypothesis's tokens end where the padding after it starts; its last token was never forwarded
        steps = torch.arange(1, generated.shape[1] + 1, device=generated.device)
        real = generated != pad if pad is not None else torch.ones_like(generated, dtype=torch.bool)
        length = (real * steps).amax(dim=1) if generated.shape[1] else generated.new_zeros(generated.shape[0])
        kept = (steps[None, :] < length[:, None]).long()
        n = int(kept.sum(dim=1).max()) if kept.numel() else 0
        full_ids = torch.cat([ids, generated[:, :n]], dim=1)
        full_mask = torch.cat([mask.to(ids.device), kept[:, :n]], dim=1)
        positions = (full_mask.cumsum(dim=1) - 1).clamp_min(0)
        with torch.no_grad():
            self.hooks.model(
                input_ids=full_ids,
                attention_mask=full_mask,
                position_ids=positions,
                use_cache=False,
                memory_cache=self.work,
                memory_write=True,
                memory_feedback=False,
            )
