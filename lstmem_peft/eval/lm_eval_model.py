"""LSTMem models in EleutherAI's lm-evaluation-harness: the ``lstmem`` model type.

General capabilities (paper: IFEval strict prompt-level accuracy, GPQA-Diamond accuracy) are measured
with lm-evaluation-harness's own tasks. Importing this module registers the model type ``lstmem``, a
subclass of the harness's ``HFLM`` that loads the backbone and the LSTMem adapter (the harness's PEFT
path; importing :mod:`lstmem_peft` registers the method with PEFT) and gives every request a fresh
memory, as the paper does ("every IFEval and GPQA-Diamond prompt starts from an empty memory"):

* generation (``generate_until``: IFEval, GPQA's generative and chain-of-thought tasks): per request,
  a fresh :class:`~lstmem_peft.MemoryCache`; the prompt but its last token is written into memory and
  the KV cache in ``block_size`` blocks with block-end feedback (:func:`~lstmem_peft.write_history`,
  as :func:`lstmem_peft.eval.evaluate` writes a history); then generation prefills the last token and
  decodes, reading and updating memory token by token. Requests are processed one at a time (no
  padding reaches the memory).
* log-likelihood (multiple-choice tasks such as ``gpqa_diamond_zeroshot``): the harness's own forward
  on context + continuation; with no ``memory_cache`` passed, each call and each batch row starts from
  a fresh memory that the tokens read and write as they go (one pass, no block-end feedback).

Use (the model type exists once this module is imported, hence ``python -m``)::

    python -m lstmem_peft.eval.lm_eval_model run --model lstmem \\
        --model_args pretrained=Qwen/Qwen3-4B-Instruct-2507,adapter=user/lstmem-qwen3-4b \\
        --tasks ifeval --apply_chat_template --seed 42 --batch_size 1 \\
        --gen_kwargs max_gen_toks=1500,do_sample=True,temperature=0.4,top_p=0.9,top_k=10

IFEval's "prompt_level_strict_acc" is the paper's metric. The plain backbone: ``--model hf
--model_args pretrained=...``. From Python: ``import lstmem_peft.eval.lm_eval_model`` and then
``lm_eval.simple_evaluate(model="lstmem", model_args=..., tasks=[...])``.
"""

from __future__ import annotations

import torch

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils_hf import stop_sequences_criteria
except ModuleNotFoundError as err:
    raise ImportError(
        f"the lstmem model type for lm-evaluation-harness needs {err.name!r}: pip install 'lm-eval>=0.4.13,<0.5'",
        name=err.name,
    ) from err

from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.tuner.history import write_history
from lstmem_peft.tuner.kv_argument import kv_kwargs


@register_model("lstmem")
class LSTMemLM(HFLM):
    """The harness's ``HFLM`` with an LSTMem adapter and a fresh memory per request.

    Args:
        pretrained: the backbone (Hub id or local folder), as for ``hf``.
        adapter: the LSTMem adapter (Hub id or local folder); loaded through the harness's ``peft``
            option. ``None``: ``peft=`` must name it instead.
        block_size: history block length for the prompt written into memory; default the adapter's.
        **kwargs: any other ``hf`` model argument (``dtype``, ``device`` (default: cuda when available,
            else cpu), ``batch_size``, ...).
    """

    def __init__(self, pretrained, adapter: str | None = None, block_size: int | None = None, **kwargs):
        if adapter is not None and kwargs.get("peft") is not None:
            raise ValueError("give the LSTMem adapter once: adapter= or peft=, not both")
        if adapter is None and kwargs.get("peft") is None:
            raise ValueError("the lstmem model needs adapter=<LSTMem adapter path or Hub id>")
        kwargs["peft"] = adapter if adapter is not None else kwargs["peft"]
        kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(pretrained=pretrained, **kwargs)
        self.block_size = None if block_size is None else int(block_size)
        self.requests_written = 0  # prompts written into a fresh memory (one per generation request)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        """``(B, context + new)`` token ids, each row generated from its own fresh memory."""
        from transformers import DynamicCache

        mask = generation_kwargs.pop("attention_mask", None)
        generation_kwargs["temperature"] = generation_kwargs.get("temperature", 0.0)
        if generation_kwargs["temperature"] == 0.0 and generation_kwargs.get("do_sample") is None:
            generation_kwargs["do_sample"] = False
        if generation_kwargs.get("do_sample") is False:
            generation_kwargs.pop("temperature", None)
        new_tokens = max_length - context.shape[1]
        pad = self.tokenizer.pad_token_id
        rows = []
        for i in range(context.shape[0]):
            ids = context[i : i + 1]
            if mask is not None:
                ids = ids[:, mask[i].bool()]
            memory, kv = MemoryCache(), DynamicCache(config=self.model.config)
            if ids.shape[1] > 1:
                write_history(
                    self.model,
                    ids[:, :-1],
                    memory,
                    block_size=self.block_size,
                    past_key_values=kv,
                    progress=False,
                )
            self.requests_written += 1
            criteria = stop_sequences_criteria(self.tokenizer, stop, ids.shape[1], 1)
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                **kv_kwargs(self.model, kv),
                memory_cache=memory,
                max_new_tokens=new_tokens,
                stopping_criteria=criteria,
                pad_token_id=pad,
                **generation_kwargs,
            )
            rows.append(out[0, ids.shape[1] :])
        width = max(len(r) for r in rows)
        result = torch.full((context.shape[0], context.shape[1] + width), pad, dtype=context.dtype)
        result[:, : context.shape[1]] = context
        for i, row in enumerate(rows):
            result[i, context.shape[1] : context.shape[1] + len(row)] = row
        return result.to(context.device)


def main() -> None:
    """lm-evaluation-harness's command line, with the ``lstmem`` model type registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
