"""Per-request memory files on vLLM: a request starts from a saved memory, its final memory is saved.

``SamplingParams(extra_args={"lstmem_memory_in": path, "lstmem_memory_out": path})``; either key may
be left out. Files are :meth:`lstmem_peft.MemoryCache.save` files of one row, checked against the
adapter's layout (its fingerprint names the adapter, so another adapter's memory is refused).

:class:`~lstmem_peft.vllm_plugin.worker.LSTMemWorker` (vLLM's worker with one step added, selected
by :func:`lstmem_peft.vllm_plugin.engine_args`, or ``vllm serve --worker-cls``) keeps a
:class:`Sessions` and, before each step it runs:

* every request that starts (new, or resumed from scratch after a preemption) and names a
  ``lstmem_memory_in`` has that memory staged for its state slot; each memory layer takes its
  ``(C, D)`` when it runs the request's first chunk (else the request starts from zeros);
* every request that finished in the previous step and names a ``lstmem_memory_out`` has its
  slot's states written there before vLLM can hand the slot to another request. The memory holds
  the prompt and every generated token but the last, as ``generate(memory_cache=...)`` leaves it;
  ``tokens_written`` is the starting memory's count plus the tokens the model ran for the request
  (counted from the scheduler's outputs).
"""

from __future__ import annotations

import os

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from ..cache import MemoryCache
from . import MEMORY_IN, MEMORY_OUT


def _extra(params, key: str) -> str | None:
    extra = getattr(params, "extra_args", None) or {}
    value = extra.get(key)
    return None if value is None else os.fspath(value)


def load_session(path: str, layout) -> MemoryCache:
    """A one-row memory for a request, checked against the model's layout (``None``: any layout)."""
    cache = MemoryCache.load(path, layout)
    if cache.batch_size != 1:
        raise ValueError(
            f"{path} holds the memory of {cache.batch_size} sequences; a request starts from one "
            "(cache.batch_select_indices([i]) selects a row before saving)"
        )
    return cache


class Sessions:
    """Per-request memory files in one vLLM worker (:class:`~lstmem_peft.vllm_plugin.worker.LSTMemWorker`
    calls :meth:`before_step` before each step it runs)."""

    def __init__(self, runner) -> None:
        model = runner.get_model()
        self.runner = runner
        self.states = model.memory_states()
        self.shared = model.lstmem_shared
        self.layout = model.lstmem_layout
        name = self.states[0].prefix
        self.group = next(
            g for g, group in enumerate(runner.kv_cache_config.kv_cache_groups) if name in group.layer_names
        )
        self.start_tokens: dict[str, int] = {}  # request id -> tokens_written of its starting memory
        self.ran: dict[str, int] = {}  # request id -> tokens the model ran for it since it (re)started
        self.staged: dict[str, int] = {}  # request id -> slot whose start is staged
        # requests started, restarted from scratch after a preemption, and memories loaded / saved
        self.counts = {"started": 0, "restarted": 0, "loaded": 0, "saved": 0}

    def before_step(self, scheduler_output) -> None:
        for request_id in scheduler_output.finished_req_ids:
            self.finish(request_id)
        for new in scheduler_output.scheduled_new_reqs:
            if new.num_computed_tokens == 0:
                self.counts["started"] += 1
                self.start(new.req_id, new.sampling_params, new.block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            if request_id in cached.resumed_req_ids and cached.num_computed_tokens[i] == 0:
                request = self.runner.requests.get(request_id)
                if request is not None and cached.new_block_ids[i] is not None:
                    self.counts["restarted"] += 1
                    self.start(request_id, request.sampling_params, cached.new_block_ids[i])
        for request_id, count in scheduler_output.num_scheduled_tokens.items():
            self.ran[request_id] = self.ran.get(request_id, 0) + count

    def start(self, request_id: str, params, block_ids) -> None:
        slot = int(block_ids[self.group][0])
        # the slot is this request's now: a memory staged there for a request that was preempted or
        # aborted before its first chunk ran is stale
        self.shared.starts.pop(slot, None)
        self.start_tokens[request_id] = 0
        self.ran[request_id] = 0
        path = _extra(params, MEMORY_IN)
        if path is None:
            return
        cache = load_session(path, self.layout)
        self.shared.starts[slot] = [(layer.cell[0], layer.hidden[0]) for layer in cache.layers]
        self.start_tokens[request_id] = int(cache.tokens_written[0])
        self.staged[request_id] = slot
        self.counts["loaded"] += 1

    def finish(self, request_id: str) -> None:
        slot = self.staged.pop(request_id, None)
        request = self.runner.requests.get(request_id)
        if slot is not None and (request is None or request.num_computed_tokens == 0):
            self.shared.starts.pop(slot, None)  # never ran (aborted): its staged memory goes
        start = self.start_tokens.pop(request_id, 0)
        ran = self.ran.pop(request_id, 0)
        if request is None:
            return
        path = _extra(request.sampling_params, MEMORY_OUT)
        if path is None:
            return
        slot = int(request.block_ids[self.group][0])
        cache = MemoryCache(self.layout)
        cache.ensure(1, torch.device("cpu"))
        for layer, state in zip(cache.layers, self.states, strict=True):
            cells, hiddens = state.kv_cache
            layer.cell = cells[slot][None].to("cpu", copy=True)
            layer.hidden = hiddens[slot][None].to("cpu", copy=True)
        cache.tokens_written = torch.tensor([start + ran])
        cache.save(path)
        self.counts["saved"] += 1


class SessionFileCheck(LogitsProcessor):
    """Checks a request's session files when vLLM admits it, in the serving process, so that a bad
    file is refused with that request's error (HTTP 400 on vLLM's server) instead of failing in a
    worker, which would stop the engine: an existing ``lstmem_memory_in`` must be a readable one-row
    :class:`~lstmem_peft.MemoryCache` file with finite states, and ``lstmem_memory_out`` a path in
    an existing folder. A ``lstmem_memory_in`` that does not exist yet is let through: it may be the
    memory of a request that has just finished, which the worker writes before it starts any request
    admitted after that one's answer (a file still missing then stops the engine). Whether a memory
    belongs to the served adapter (its layout fingerprint) is checked in the worker, which alone knows
    the adapter. Selected by :func:`lstmem_peft.vllm_plugin.engine_args` (``logits_processors``); it
    leaves logits alone."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        memory_in = _extra(sampling_params, MEMORY_IN)
        if memory_in is not None and os.path.exists(memory_in):
            load_session(memory_in, None)
        memory_out = _extra(sampling_params, MEMORY_OUT)
        if memory_out is not None:
            folder = os.path.dirname(os.path.abspath(memory_out))
            if not os.path.isdir(folder):
                raise ValueError(f"{MEMORY_OUT}: the folder {folder} does not exist")

    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass
