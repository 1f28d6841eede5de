"""Multi-process training: what launchers started, the launches that would train wrongly without an
error (refused, each with its fix), and FSDP2 sharding of the frozen backbone for stage 2.

:class:`~lstmem_peft.training.trainer.LSTMemTrainer` calls :func:`check_distributed_setup` when it is
built and :func:`_check_sharded_model` for a model sharded by :func:`shard_backbone`.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping

import torch
from accelerate.utils import DistributedType
from transformers import Trainer, TrainingArguments

from lstmem_peft.tuner.history import find_memory

#: Environment variables that launchers set to the number of processes they started.
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


# ---------------------------------------------------------------------- multi-process launches
def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() in ("1", "true", "yes")


def launched_world_size(environ: Mapping[str, str] | None = None) -> int:
    """How many processes the launcher started (``torchrun``, ``accelerate launch``, ``deepspeed``,
    ``mpirun``), read from its environment variables; 1 without a launcher."""
    environ = os.environ if environ is None else environ
    for name in WORLD_SIZE_VARIABLES:
        if environ.get(name):
            return int(environ[name])
    return 1


def _has_accelerator_device() -> bool:
    """Whether torch sees a device other than the CPU (CUDA, XPU, MPS, ...)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def check_distributed_setup(
    args: TrainingArguments, accelerator, environ: Mapping[str, str] | None = None
) -> None:
    """Refuse the launches that train wrongly without any error, each with its fix.

    Checked against what the launcher asked for (``environ``, default ``os.environ``; ``args.fsdp``)
    and what accelerate set up (``accelerator.num_processes`` and ``accelerator.distributed_type``):

    - ``accelerate launch --cpu`` (or ``use_cpu: true``) with several processes: accelerate's simple
      launcher starts one process;
    - accelerate's FSDP plugin (``distributed_type: FSDP``, TrainingArguments ``fsdp``): on CPU it
      shards nothing and each process trains alone; on GPUs it would shard the LSTMem parameters
      with their decoder layers, while memory writing and block-end feedback use them outside the
      layer's forward (sharded that way on CPU, training crashes);
    - a process that trains alone although the launcher started several (no backend on a CPU-only
      machine without ``use_cpu=True``);
    - several processes whose gradients are never averaged (a process group without DDP/DeepSpeed).

    Raises:
        RuntimeError: naming what went wrong and the fix.
    """
    environ = os.environ if environ is None else environ
    world = launched_world_size(environ)
    processes = accelerator.num_processes
    kind = accelerator.distributed_type
    if _flag(environ, "ACCELERATE_USE_CPU") and environ.get("MASTER_PORT") and world == 1:
        # accelerate's simple launcher sets MASTER_PORT only when asked for several processes
        raise RuntimeError(
            "`accelerate launch --cpu` (or `use_cpu: true` in its config) with several processes started "
            "only this one: accelerate's CPU launcher runs one process unless mpirun is set up. Launch "
            "with `torchrun --nproc_per_node N` and LSTMemTrainingConfig(use_cpu=True), or drop `--cpu` / "
            "`use_cpu` from an accelerate DeepSpeed config (examples/accelerate_zero2_cpu.yaml). (One "
            "process meant? Unset MASTER_PORT.)"
        )
    if args.fsdp or _flag(environ, "ACCELERATE_USE_FSDP"):
        where = "GPU" if _has_accelerator_device() else "CPU"
        raise RuntimeError(
            f"accelerate's FSDP plugin cannot train an LSTMem adapter here ({where}): on CPU it shards "
            "nothing and every process trains alone, without an error; on GPUs it shards the LSTMem "
            "parameters too, which memory writing and block-end feedback use outside their decoder "
            "layer's forward. Shard the frozen backbone with FSDP2 instead, under torchrun: "
            "lstmem_peft.training.distributed.shard_backbone(model) before building the trainer "
            "(history_mode='stage2'), or use DeepSpeed ZeRO-2 (examples/accelerate_zero2.yaml)"
        )
    if world > 1 and processes != world:
        raise RuntimeError(
            f"the launcher started {world} processes but this one trains as {processes} of {processes}: "
            "each process would train alone on the whole dataset. On a CPU-only machine pass "
            "LSTMemTrainingConfig(use_cpu=True) (gloo) under torchrun; with accelerate launch, use a config "
            "whose distributed_type is MULTI_GPU or DEEPSPEED"
        )
    if processes > 1 and kind == DistributedType.NO:
        raise RuntimeError(
            f"{processes} processes share a process group but accelerate set up no data parallelism "
            "(distributed_type NO): gradients would never be averaged and the processes would drift "
            "apart. On a CPU-only machine pass LSTMemTrainingConfig(use_cpu=True)"
        )


def _fsdp2_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        return None
    return FSDPModule


def fsdp2_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds modules sharded with FSDP2's ``fully_shard``."""
    kind = _fsdp2_module_type()
    return kind is not None and any(isinstance(m, kind) for m in model.modules())


def _adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if "lstmem_memory" in name}


def shard_backbone(model: torch.nn.Module, mesh=None, reshard_after_forward: bool = True) -> torch.nn.Module:
    """Shard the frozen backbone's weights across the processes with FSDP2; the adapter stays whole.

    Every decoder layer (the classes in the backbone's ``_no_split_modules``), then the whole model,
    becomes an FSDP2 unit (``torch.distributed.fsdp.fully_shard``): each process keeps ``1/N`` of
    every backbone weight and gathers a layer's weights for its forward and backward. The LSTMem
    parameters are left out (``ignored_params``): memory writing and block-end feedback use them
    outside their decoder layer's forward, where FSDP2 would have freed them. They stay whole on
    every process, and :class:`~lstmem_peft.training.trainer.LSTMemTrainer` broadcasts them from
    rank 0 and averages their gradients over the processes, so the result equals one process with
    the same global batch.

    For ``history_mode="stage2"`` only (see :class:`~lstmem_peft.training.trainer.LSTMemTrainer`).
    Call it under ``torchrun`` once the process group exists, i.e. after creating the
    ``LSTMemTrainingConfig(use_cpu=True, ...)`` on CPU (gloo), or after
    ``torch.distributed.init_process_group``; then pass the model to the trainer::

        args = LSTMemTrainingConfig(output_dir="out", history_mode="stage2", use_cpu=True)
        model = shard_backbone(get_peft_model(base, LSTMemConfig()))
        LSTMemTrainer(model=model, args=args, ...).train()

    Args:
        model: a model carrying an LSTMem adapter (``get_peft_model(base, LSTMemConfig())``).
        mesh: a 1-D ``DeviceMesh`` over the processes; default: all of them, on this process's
            device type (``"cpu"`` or ``"cuda"``).
        reshard_after_forward: FSDP2's option of the same name (free gathered weights after each
            layer's forward).

    Returns:
        ``model``, sharded in place.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard_backbone needs the process group: launch with torchrun and create the "
            "LSTMemTrainingConfig first (use_cpu=True on CPU), or call torch.distributed.init_process_group"
        )
    if "ignored_params" not in inspect.signature(fully_shard).parameters:
        raise RuntimeError("shard_backbone needs torch >= 2.7 (fully_shard's ignored_params)")
    find_memory(model)
    adapter = set(_adapter_parameters(model).values())
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in base.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(base).__name__} lists no decoder layer classes in _no_split_modules; "
            "apply torch.distributed.fsdp.fully_shard to its layers yourself, with the LSTMem "
            "parameters (names containing 'lstmem_memory') in ignored_params"
        )
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device = next(p.device for p in base.parameters()).type
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=adapter)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=adapter)
    return model


def _check_sharded_model(model: torch.nn.Module, args: TrainingArguments) -> None:
    """Refuse FSDP2-sharded models that cannot train correctly (see :func:`shard_backbone`)."""
    from torch.distributed.tensor import DTensor

    sharded = [n for n, p in model.named_parameters() if p.requires_grad and isinstance(p, DTensor)]
    if sharded:
        raise ValueError(
            f"FSDP2 sharded trainable parameters ({sharded[0]}, ...): LSTMem's memory writing and block-end "
            "feedback use them outside their decoder layer's forward, where FSDP2 has freed them. Shard "
            "with lstmem_peft.training.distributed.shard_backbone(model), which leaves the adapter whole"
        )
    if args.history_mode == "stage1":
        raise ValueError(
            "history_mode='stage1' cannot train on an FSDP2-sharded backbone: its gradient flows back "
            "through the history blocks' forwards, which read decoder-layer weights that FSDP2 frees "
            "after the layer's first backward (the process crashes or reads freed memory). Train stage 1 "
            "with DeepSpeed ZeRO-2 or DDP (backbone replicated) and shard the backbone for stage 2, "
            "whose history is written without gradients"
        )
    if not hasattr(Trainer, "_sync_replicated_trainable_parameters"):
        raise RuntimeError(
            "this transformers version cannot train a model sharded before the Trainer (no "
            "Trainer._sync_replicated_trainable_parameters); install the version pinned in "
            ".ci/constraints.txt"
        )
