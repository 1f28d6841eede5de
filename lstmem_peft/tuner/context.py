"""What carries memory through one forward: a single context variable.

A forward, drawn::

    model(input_ids, memory_cache=cache, memory_write=True, memory_feedback=False, past_key_values=kv)
      pre-hook (outermost hooked module): pop the memory_* kwargs, open a ModelPass over a staged copy
          of the cache's states and set ACTIVE = Active(owner=hooks, module, pass, session)
      q_proj wrapper of decoder layer l:  base(x) + Δq, out = pass.query(l, x): memory layer l reads,
          writes -> u, whose corrections are Δq and Δo (D_t of layer l waits in the pass for layer l+1;
          out waits for the o_proj wrapper)
      o_proj wrapper of decoder layer l:  base(x) + Δo, out = pass.output(l)
      (memory_only=True: the topmost memory layer raises MemoryWritten; the rest of the backbone is skipped)
      (gradient checkpointing, non-reentrant: a checkpointed decoder layer runs its memory once, its
          saved tensors kept outside the checkpoint; when backward recomputes the layer, ACTIVE holds a
          CheckpointReplay that hands the wrappers the corrections of that forward: see MemoryCheckpoint)
      post-hook (same module, also on error): commit the pass (feedback at block ends) or drop it,
          reset ACTIVE (a KeyboardInterrupt skips the post-hook: write_history drops the uncommitted
          pass as the interrupt passes through it; after a bare forward, the module's next forward
          drops it)

``generate`` sets ``ACTIVE`` to an ``Active`` with a :class:`~lstmem_peft.tuner.generation.GenerateSession`
and no pass; each forward of the call then opens its pass against that session. Context variables are
per thread (and per asyncio task), so two threads running one model with their own caches never see
each other's pass, and nothing about a forward is ever stored on a module.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from typing import TYPE_CHECKING, NamedTuple

import torch

from lstmem_peft.memory.cache import MemoryLayout
from lstmem_peft.memory.engine import MemoryPass
from lstmem_peft.memory.layer import LayerOutput, LSTMemLayer

if TYPE_CHECKING:
    from .generation import GenerateSession


class Active(NamedTuple):
    """The memory context of the running call.

    Attributes:
        owner: the :class:`~lstmem_peft.tuner.hooks.MemoryHooks` of the backbone whose memory runs (a
            forward of another model, e.g. an assistant, ignores it).
        module: the hooked module whose forward opened ``model_pass`` (only it closes the pass).
        model_pass: the open :class:`ModelPass`, or ``None`` between the forwards of a ``generate``.
        session: the ``generate`` call in progress, or ``None``.
    """

    owner: object
    module: object | None
    model_pass: ModelPass | None
    session: GenerateSession | None


class ActiveSlot:
    """Where the running call's :class:`Active` lives, with the interface of a context variable
    (:meth:`get`; :meth:`set` returns a token; :meth:`reset` puts back what was there before).

    By default a ``contextvars.ContextVar``: one value per thread and asyncio task.
    ``torch.compile`` cannot trace one, so a compiled forward breaks its graph once, where the pass
    opens, and each projection wrapper hands its memory to an opaque operation (:mod:`.layer`).

    Inside :func:`traceable_memory` the value is a plain attribute, which ``torch.compile`` traces:
    the pass opens, runs and commits inside the captured graph, so a decode step compiles with
    ``fullgraph=True``, and the memory's math is in the graph (states in, new states out) where a
    compiler can fuse it and a CUDA graph can hold it. One value then serves the whole process, so
    while it is on, the model runs in the thread that turned it on (eager forwards of another thread
    are refused).
    """

    def __init__(self) -> None:
        self._var: contextvars.ContextVar[Active | None] = contextvars.ContextVar(
            "lstmem_active", default=None
        )
        self.shared = False  # inside traceable_memory()
        self.value: Active | None = None  # the value while shared
        self.thread: int | None = None  # the thread that turned sharing on

    def get(self) -> Active | None:
        if self.shared:
            return self.value
        return self._var.get()

    def set(self, value: Active | None):
        """Store ``value``; returns the token for :meth:`reset`."""
        if not self.shared:
            return self._var.set(value)
        if not torch.compiler.is_compiling() and threading.get_ident() != self.thread:
            raise RuntimeError(
                "an LSTMem forward ran in another thread while traceable_memory() is on: the traceable "
                "memory context is one per process. Run the model in the thread that entered "
                "traceable_memory(), or leave it to run forwards in several threads"
            )
        previous, self.value = self.value, value
        return _SharedToken(previous)

    def reset(self, token) -> None:
        """Undo the :meth:`set` that returned ``token``."""
        if isinstance(token, _SharedToken):
            self.value = token.previous
        else:
            self._var.reset(token)


class _SharedToken(NamedTuple):
    previous: Active | None


#: the memory context of the running call (see :class:`ActiveSlot`)
ACTIVE = ActiveSlot()


@contextlib.contextmanager
def traceable_memory():
    """Let ``torch.compile`` trace LSTMem's memory pass, for graphs without a break.

    Inside it, a forward with memory (``model(input_ids, memory_cache=cache, past_key_values=kv)``,
    one decode step or a block) compiles with ``torch.compile(..., fullgraph=True)``: the pass that
    carries memory through the forward is read from a plain attribute that the compiler traces
    instead of a context variable it cannot (:class:`ActiveSlot`), so the memory's math is part of
    the graph. ``generate(cache_implementation="static", compile_config=...)`` compiles its decoding
    steps the same way (their positions are the static cache's device count). The memory layers'
    cached weights are graph inputs (:meth:`~lstmem_peft.memory.layer.LSTMemLayer.derived_weights`
    says how they stay current). The model must run in the thread that entered it.

    Example::

        with lstmem_peft.traceable_memory():
            step = torch.compile(lambda ids: model(input_ids=ids, memory_cache=cache,
                                                   past_key_values=kv, use_cache=True).logits,
                                 fullgraph=True)
            for ids in tokens:
                logits = step(ids)
    """
    if ACTIVE.shared:
        if threading.get_ident() != ACTIVE.thread:
            raise RuntimeError("traceable_memory() is already on in another thread")
        yield
        return
    if ACTIVE._var.get() is not None:
        raise RuntimeError("traceable_memory() must be entered outside a forward or generate() call")
    ACTIVE.shared, ACTIVE.value, ACTIVE.thread = True, None, threading.get_ident()
    try:
        yield
    finally:
        ACTIVE.shared, ACTIVE.value, ACTIVE.thread = False, None, None


class MemoryWritten(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by a forward called with ``memory_only=True`` once its topmost memory layer has run:
    the rest of the backbone (the layers above, the head) cannot change memory, so it is skipped.
    When it reaches the caller, the pass has been committed (feedback included); ``error`` holds what
    committing raised instead, which the caller must re-raise (:func:`run_memory_only` does)."""

    def __init__(self) -> None:
        super().__init__("the forward stopped after its topmost memory layer (memory_only=True)")
        self.committed = False
        self.error: BaseException | None = None


def run_memory_only(model, **kwargs) -> None:
    """``model(**kwargs, memory_only=True)``: write memory and skip what cannot change it. Returns
    when the pass is committed; raises what the forward or the commit raised."""
    try:
        model(**kwargs, memory_only=True)
    except MemoryWritten as stop:
        if stop.error is not None:
            raise stop.error from None
        if not stop.committed:  # the pass never reached its closing hook
            raise RuntimeError(
                "the memory-only forward stopped but its memory pass was not committed"
            ) from None
        return
    raise RuntimeError("a memory_only=True forward ran to its end: no LSTMem memory layer ran in it")


@contextlib.contextmanager
def closing_interrupted_passes():
    """Around library calls that run forwards (``write_history``): whatever interrupts them
    (``KeyboardInterrupt`` included, which skips torch's closing hooks) leaves no memory pass open in
    :data:`ACTIVE`. The uncommitted pass is dropped; the cache keeps the states it had before it."""
    before = ACTIVE.get()
    try:
        yield
    except BaseException:
        if ACTIVE.get() is not before:
            ACTIVE.set(before)
        raise


def current_pass() -> ModelPass | None:
    """The memory pass of the forward in progress in this thread or task, or ``None``."""
    active = ACTIVE.get()
    return None if active is None else active.model_pass


class AdapterPlan(NamedTuple):
    """Where an adapter's memory sits in the backbone (built once per adapter by the hooks).

    Attributes:
        layout: the :class:`~lstmem_peft.memory.cache.MemoryLayout` its caches must have.
        depth_index: decoder layer index -> memory layer index (depth order).
        memories: the :class:`~lstmem_peft.memory.layer.LSTMemLayer` modules in depth order.
        queries: their query projection wrappers, in the same order.
    """

    layout: MemoryLayout
    depth_index: dict[int, int]
    memories: list[LSTMemLayer]
    queries: list


class ModelPass:
    """A :class:`~lstmem_peft.memory.engine.MemoryPass` seen from the model's decoder layers: the
    projection wrappers ask it for their layer's memory output (:meth:`query`, :meth:`output`).

    Args:
        adapter_name: the adapter whose memory runs.
        plan: where that adapter's memory layers sit.
        memory_pass: the engine pass over the cache.
        record_inputs: keep each memory layer's input ``x`` (``(B, T, d)``) after the forward, so
            that states at any position of this forward can be recomputed (generation that may crop
            its KV cache back into this forward).
        draft: an early-exit draft of a ``generate`` call (read-only; the call's memory does not advance).
        memory_only: stop the forward (:class:`MemoryWritten`) once the topmost memory layer has run.
    """

    def __init__(
        self,
        adapter_name: str,
        plan: AdapterPlan,
        memory_pass: MemoryPass,
        record_inputs: bool = False,
        draft: bool = False,
        memory_only: bool = False,
    ) -> None:
        self.adapter_name = adapter_name
        self.plan = plan
        self.memory_pass = memory_pass
        self.inputs: list[torch.Tensor] | None = [] if record_inputs else None
        self.draft = draft
        self.stop = MemoryWritten() if memory_only else None
        self.length = 0  # tokens of the forward (set by the opener)
        self.token = None  # restores ACTIVE when the pass closes
        self._outputs: dict[int, LayerOutput] = {}
        self._replay: CheckpointReplay | None = None  # the checkpointed decoder layer running now

    def query(self, layer_idx: int, x: torch.Tensor) -> LayerOutput | None:
        """Run the memory of decoder layer ``layer_idx`` on its attention input ``x`` ``(B, T, d)``
        and keep its output for :meth:`output`; ``None`` when that layer has no memory."""
        index = self.plan.depth_index.get(layer_idx)
        if index is None:
            return None
        memory = self.plan.memories[index]
        replay = self._replay
        if replay is None:
            out = self.memory_pass.run(index, memory, x)
        else:
            # inside a checkpointed decoder layer: the memory's saved tensors stay in its graph (the
            # recompute does not run memory again), and the replay keeps the output for the recompute
            with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                out = self.memory_pass.run(index, memory, x)
            replay.outputs[layer_idx] = _replayed(out)
        if self.inputs is not None:
            self.inputs.append(x.detach())
        self._outputs[layer_idx] = out
        if self.stop is not None and self.memory_pass.all_layers_run:
            raise self.stop  # nothing after the topmost memory layer changes memory
        return out

    def output(self, layer_idx: int) -> LayerOutput | None:
        """The memory output of decoder layer ``layer_idx`` (for its ``Δo``), once."""
        return self._outputs.pop(layer_idx, None)

    def close(self, completed: bool) -> None:
        """Finish the pass when the forward completed (feedback, then commit to the cache); otherwise
        drop everything it computed: the cache keeps the states it had before the forward."""
        self._outputs.clear()
        if completed:
            self.memory_pass.finish()


# ---------------------------------------------------------------------- gradient checkpointing
REENTRANT_REFUSED = (
    "LSTMem does not support gradient checkpointing with use_reentrant=True (torch's choice when use_reentrant "
    "is not given, as with PEFT's prepare_model_for_kbit_training defaults): the recomputed layers would run "
    "memory a second time and memory gradients would be wrong. Use non-reentrant checkpointing, which is exact: "
    'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}) (transformers\' '
    'default), prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False}), '
    'with TRL gradient_checkpointing_kwargs={"use_reentrant": False}; or disable it '
    "(model.gradient_checkpointing_disable())"
)


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    """Saved-tensor hooks that keep a tensor in the graph (over the checkpoint's own hooks). Detached:
    a tensor saved by its own node would otherwise hold that node, a cycle through autograd that
    the garbage collector cannot see (the graph would outlive a forward that never runs backward)."""
    return tensor.detach()


class CheckpointReplay:
    """The memory of one checkpointed decoder layer as its wrappers see it while backward recomputes
    that layer: the corrections its memory produced in the forward, detached (nothing runs or is
    written again, and the recomputed activations are those of the forward)."""

    draft = False

    def __init__(self, adapter_name: str, layers) -> None:
        self.adapter_name = adapter_name
        self.layers = layers  # the decoder layers with memory
        self.outputs: dict[int, LayerOutput] = {}

    def query(self, layer_idx: int, x: torch.Tensor) -> LayerOutput | None:
        if layer_idx not in self.layers:
            return None
        out = self.outputs.get(layer_idx)
        if out is None:
            raise RuntimeError(
                f"gradient checkpointing recomputed decoder layer {layer_idx}, whose memory did not run "
                "in that layer's forward"
            )
        return out

    def output(self, layer_idx: int) -> LayerOutput | None:
        return self.outputs.get(layer_idx)


def checkpoint_kwargs(func) -> dict | None:
    """The keyword arguments a decoder layer's ``_gradient_checkpointing_func`` passes to
    ``torch.utils.checkpoint.checkpoint`` (transformers sets a ``functools.partial``), or ``None``
    when they cannot be read."""
    if isinstance(func, MemoryCheckpoint):
        func = func.func
    if isinstance(func, functools.partial):
        return dict(func.keywords)
    return None


class MemoryCheckpoint:
    """A decoder layer's ``_gradient_checkpointing_func`` (non-reentrant), made exact for LSTMem memory.

    Set by :class:`~lstmem_peft.tuner.hooks.MemoryHooks` over the function transformers set. Outside a memory
    pass it is that function. Inside one it adds a ``context_fn`` (composed with the user's): while the
    layer runs forward, its memory's saved tensors are kept (not dropped for the recompute) and its
    corrections are recorded; while backward recomputes the layer, :data:`ACTIVE` holds a
    :class:`CheckpointReplay` that hands the wrappers those outputs. The recomputed graph then sees the
    forward's corrections, and the memory (run once, written once) gets its gradients through the
    forward's graph.
    """

    def __init__(self, func) -> None:
        self.func = func

    def __call__(self, function, *args, **kwargs):
        active = ACTIVE.get()
        model_pass = None if active is None else active.model_pass
        if not isinstance(model_pass, ModelPass) or not torch.is_grad_enabled():
            return self.func(function, *args, **kwargs)
        options = {**(checkpoint_kwargs(self.func) or {}), **kwargs}
        if options.get("use_reentrant") is not False:
            raise RuntimeError(REENTRANT_REFUSED)
        user_context = kwargs.pop("context_fn", None) or options.get("context_fn")
        # the checkpoint keeps the recompute context in the layer's graph: nothing it holds may reach
        # the graph or the pass (a cycle through autograd's nodes, which the garbage collector cannot
        # see, would keep the graph alive whenever no backward runs). The replay holds detached values.
        replay = CheckpointReplay(model_pass.adapter_name, model_pass.plan.depth_index)
        owner = active.owner

        @contextlib.contextmanager
        def forward():
            model_pass._replay = replay
            try:
                yield
            finally:
                model_pass._replay = None

        @contextlib.contextmanager
        def recompute():
            token = ACTIVE.set(Active(owner, None, replay, None))
            try:
                yield
            finally:
                ACTIVE.reset(token)

        def context_fn():
            if user_context is None:
                return forward(), recompute()
            outer_forward, outer_recompute = user_context()
            return _both(outer_forward, forward()), _both(outer_recompute, recompute())

        return self.func(function, *args, context_fn=context_fn, **kwargs)


def _replayed(out: LayerOutput) -> LayerOutput:
    """What a recomputed layer's wrappers need of ``out``: its correction factors, detached
    from the memory's graph (the recompute only refills the layer's saved activations; gradients flow
    through the forward's graph) and requiring gradients as they did, so that the recompute saves
    exactly what the forward saved."""

    def value(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().requires_grad_(t.requires_grad)

    return LayerOutput(value(out.read), tuple(value(t) for t in out.corr), None, None)


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield
