"""``LSTMemScheduler``: vLLM's scheduler, with history requests' prompt chunks cut at block ends.

Block-end feedback of a history request (:mod:`lstmem_peft.integrations.vllm.history`) needs every
memory layer's terminal states of a block before the next block's first token runs, and a forward
runs each layer over its whole chunk before the layer above it. So a chunk must never run past a
block end: this scheduler cuts a history request's chunk where its block ends
(:func:`~lstmem_peft.integrations.vllm.history.cap_history_chunk`), after vLLM has applied its own
limits (token budget, ``long_prefill_token_threshold``, ``max_model_len``). Everything else is
vLLM's scheduler, unchanged; other requests are never cut.

The cut is made in ``Scheduler._reserve_prefill_lookahead``, the last step of vLLM's choice of a
chunk's length for running and for waiting requests alike (its own rule, for multi-token drafters,
runs first). Selected by :func:`lstmem_peft.integrations.vllm.engine_args` (``scheduler_cls``), or
``--scheduler-cls lstmem_peft.integrations.vllm.scheduler.LSTMemScheduler`` for ``vllm serve``; the
model refuses to start without it.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

from lstmem_peft.memory.spec import read_memory_spec

from .history import cap_history_chunk
from .sessions import is_history


def adapter_block_size(hf_config) -> int | None:
    """The history block size of the LSTMem adapter an engine serves (``None``: not an LSTMem model)."""
    name = getattr(hf_config, "lstmem_adapter", None)
    if not name:
        return None
    return int(read_memory_spec(name).block_size)


class LSTMemScheduler(Scheduler):
    """vLLM's :class:`~vllm.v1.core.sched.scheduler.Scheduler`; a history request's prompt chunk ends
    at the latest where its block ends."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.lstmem_block_size = adapter_block_size(vllm_config.model_config.hf_config)

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if self.lstmem_block_size and is_history(getattr(request.sampling_params, "extra_args", None)):
            num_new_tokens = cap_history_chunk(
                num_computed_tokens, num_new_tokens, request.num_prompt_tokens, self.lstmem_block_size
            )
        return num_new_tokens
