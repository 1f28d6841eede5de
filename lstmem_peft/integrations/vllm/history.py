"""History requests on vLLM: the scheduler's rule that keeps a history block's end a chunk's end.

A history request (``extra_args["lstmem_history"] = True``) has its prompt written into memory the
way :func:`lstmem_peft.write_history` writes a history: in blocks of the adapter's ``block_size``
tokens (the last one may be shorter), every token reading and then writing memory, and block-end
feedback (:func:`lstmem_peft.memory.feedback.block_feedback`) after every block, the last included.
Block ``b`` is the prompt's positions ``[b * block_size, min((b + 1) * block_size, prompt_len))``.

vLLM runs a prompt in chunks (chunked prefill); a chunk of a history request never runs past the
end of its block (:class:`~lstmem_peft.integrations.vllm.scheduler.LSTMemScheduler` caps it with
:func:`cap_history_chunk`), so a block's end is always a chunk's end, where feedback can run before
the next block's first token. The block arithmetic itself, which tokens of a chunk are feedback
samples (:func:`~lstmem_peft.memory.chunks.plan_chunk`) and the samples kept across a block's
chunks (:class:`~lstmem_peft.memory.chunks.BlockSamples`), is the library's
(:mod:`lstmem_peft.memory.chunks`).

No vLLM import: this module's rule is tested on its own.
"""

from __future__ import annotations

from lstmem_peft.memory.chunks import block_end


def cap_history_chunk(num_computed: int, num_new: int, prompt_len: int, block_size: int) -> int:
    """The length of a history request's next chunk: ``num_new`` (what vLLM's scheduler chose), cut
    at the end of the current block. Chunks past the prompt (generated tokens) are not cut."""
    if num_computed >= prompt_len or num_new <= 0:
        return num_new
    return min(num_new, block_end(num_computed, prompt_len, block_size) - num_computed)
