"""How ``lstmem bench gpu`` times one decode variant at one KV length (:func:`.gpu_suite.hf_decode_sweep`
runs the sweep): the caches filled from the prompt (:func:`prefill`), then LSTMem and the plain backbone
interleaved from the same restored KV cache and memory (:func:`measure_variant`: ``forward``, one
single-token step; ``generate``, greedy and eager; ``generate-static-compile``, from a static cache
with transformers' compiled decode step, counting graph breaks and CUDA-graph skips), and the row
that records it (:func:`variant_row`: tokens per second each, their ratio, the speed retained).

``kv`` is a dict ``{True: the LSTMem run's KV cache, False: the plain run's}``; ``memory`` the
prefilled ``MemoryCache`` each LSTMem repetition starts from a copy of.
"""

from __future__ import annotations

import torch

from lstmem_peft.tuner.kv_argument import kv_kwargs

from . import command as bench


@torch.no_grad()
def prefill(model, prompt: torch.Tensor, kv, memory, block_size: int) -> None:
    """Fill ``kv`` (and ``memory``) with ``prompt`` in blocks: the memory of a ``block_size`` forward."""
    kw = {} if memory is None else {"memory_cache": memory}
    with bench.adapter_off(model)(memory is not None):
        for start in range(0, prompt.shape[1], block_size):
            model(
                input_ids=prompt[:, start : start + block_size],
                **kv_kwargs(model, kv),
                use_cache=True,
                logits_to_keep=1,
                **kw,
            )


def _restore(kv, length: int) -> None:
    """Back to the prompt's ``length`` tokens: a dynamic cache is cropped, a static one rewound."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    if isinstance(kv, StaticCache):
        if not all(type(layer) is StaticLayer for layer in kv.layers):
            kinds = sorted({type(layer).__name__ for layer in kv.layers})
            raise NotImplementedError(f"rewinding a static cache with {kinds} layers (only StaticLayer)")
        for layer in kv.layers:  # in place (a static address): the next token is written at ``length``
            layer.cumulative_length.fill_(length)
        return
    extra = int(kv.get_seq_length()) - length
    if extra > 0:
        kv.crop(-extra)  # transformers 5: a negative crop drops that many tokens


def variant_row(result: dict, length: int, variant: str, tokens: int, **extra) -> dict:
    lm, pl = result["lstmem"]["median"], result["plain"]["median"]
    result.update(
        kv_length=length,
        variant=variant,
        tokens_per_call=tokens,
        lstmem_tok_s=tokens / lm,
        plain_tok_s=tokens / pl,
        ratio=lm / pl,  # time ratio, as every other record: > 1 is slower
        speed_retained=pl / lm,  # the paper's figure: LSTMem's speed over the plain backbone's
        **extra,
    )
    return result


def _time_forward(model, kv, memory, length, token, s, device) -> dict:
    def setup(with_memory):
        _restore(kv[with_memory], length)
        return memory.clone() if with_memory else None

    def run(with_memory, state):
        if with_memory:
            model(input_ids=token, **kv_kwargs(model, kv[True]), use_cache=True, memory_cache=state)
        else:
            model(input_ids=token, **kv_kwargs(model, kv[False]), use_cache=True)

    return bench._alternate(run, s["reps"], s["warmup"], device, setup, context=bench.adapter_off(model))


def _time_generate(model, kv, memory, length, ids, s, device, reps, warmup, **gen_extra) -> dict:
    n = s["new_tokens"]
    gen = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **gen_extra)

    def setup(with_memory):
        _restore(kv[with_memory], length)
        return memory.clone() if with_memory else None

    def run(with_memory, state):
        if with_memory:
            model.generate(input_ids=ids, **kv_kwargs(model, kv[True]), memory_cache=state, **gen)
        else:
            model.generate(input_ids=ids, **kv_kwargs(model, kv[False]), **gen)

    return bench._alternate(run, reps, warmup, device, setup, context=bench.adapter_off(model))


def _compile_config(dry_run: bool):
    """transformers' compile settings for ``generate``'s decode step; a dry run compiles on CPU too,
    with the ``eager`` backend (the same capture, no code generation: seconds)."""
    from transformers import CompileConfig

    if not dry_run:
        return CompileConfig()  # transformers' defaults: inductor, reduce-overhead (CUDA graphs)
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True
    return config


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


def _cudagraph_skips() -> int:
    """Compiled graphs inductor ran without recording a CUDA graph (``reduce-overhead`` mode)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def measure_variant(model, variant, kv, memory, length, token, ids, s, dry_run) -> tuple[dict, int, dict]:
    """Time one variant from the prefilled caches: (timings, tokens per call, what the row adds)."""
    base = model.get_base_model()
    extra = dict(cache=type(kv[True]).__name__, compiled=False)
    if variant == "forward":
        return _time_forward(model, kv, memory, length, token, s, model.device), 1, extra
    n = s["new_tokens"]
    if variant == "generate":
        reps, warmup = s["generate_reps"], s["generate_warmup"]
        return _time_generate(model, kv, memory, length, ids, s, model.device, reps, warmup), n, extra
    torch._dynamo.reset()  # a fresh compile per length: the recompile limit is never reached
    if hasattr(base, "_compiled_call"):
        del base._compiled_call
    config, breaks, skips = _compile_config(dry_run), _graph_breaks(), _cudagraph_skips()
    reps, warmup = s["generate_reps"], s["compile_warmup"]
    result = _time_generate(
        model, kv, memory, length, ids, s, model.device, reps, warmup, compile_config=config
    )
    extra.update(
        compiled=hasattr(base, "_compiled_call"),  # transformers compiled generate's decode step
        compile_config={
            k: v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)
            for k, v in config.to_dict().items()
        },
        graph_breaks=_graph_breaks() - breaks,
        cudagraph_skips=_cudagraph_skips() - skips,
    )
    return result, n, extra
