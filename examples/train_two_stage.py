"""The paper's two-stage schedule (App. C.4) with LSTMemTrainer.

Stage 1: QASPER, histories capped at 8,192 tokens, gradients through memory writing and feedback,
70 updates at 2e-4. Stage 2: the Long dataset (long-document QA), histories up to 131,072 tokens
written in 2,048-token blocks without gradients, 26 updates at 5e-5 with a fresh optimizer. Both:
global batch 32, AdamW, cosine decay with 10% warm-up, bf16, seed 42.

    # the paper's setting: 8 GPUs, micro-batch 1, accumulation 4, ZeRO-2
    accelerate launch --config_file examples/accelerate_zero2.yaml examples/train_two_stage.py \\
        --model Qwen/Qwen3-4B-Instruct-2507 --qasper allenai/qasper --long data/long.jsonl \\
        --output-dir runs/lstmem-qwen3-4b --push-to-hub user/lstmem-qwen3-4b

    # how much memory each GPU needs (only the model's config is read), and fitting it to 24 GB
    python examples/train_two_stage.py --model Qwen/Qwen3-4B-Instruct-2507 --memory-table \\
        --plan-dtype bfloat16 --plan-processes 8 --deepspeed examples/deepspeed_zero2.json
    accelerate launch ... examples/train_two_stage.py ... --fit-memory 24GB

    # a CPU smoke test on the offline tiny model, one process or two (ZeRO-2): --tiny reads the small
    # QASPER and Long files shipped in examples/data/ unless --qasper / --long name others
    python examples/train_two_stage.py --tiny --output-dir /tmp/run --stage1-steps 2 --stage2-steps 2 \\
        --global-batch 2
    accelerate launch --config_file examples/accelerate_zero2_cpu.yaml examples/train_two_stage.py --tiny ...

Training needs the ``train`` extra (TRL, datasets); without it the script stops at once, naming it.

``--memory-table`` prints the memory one process needs (backbone, adapter, gradients, AdamW state,
activations per history length with and without gradient checkpointing, for the launch's processes
and micro-batch; lstmem_peft/training/memory_plan.py says how it is computed and how close it came
to measurements). ``--fit-memory SIZE`` turns gradient checkpointing on for a stage whose estimate
does not fit SIZE per process without it, and stops before training when even checkpointing does
not fit, naming the history cap or micro-batch that would.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lstmem_cli.quiet import quiet_command

# What `lstmem` keeps off the terminal (README "Warnings"): transformers' weight-loading bars, the one
# deprecation PEFT's own code triggers (transformers' is_gradient_checkpointing) and what the
# quantisation backends log while PEFT imports them: set before the imports below, which import PEFT
# (``import lstmem_peft`` registers LSTMem with it).
quiet_command(loads_models=True)

from lstmem_peft.memory import constants as K  # noqa: E402
from lstmem_peft.training.memory_plan import (  # noqa: E402
    AdapterDims,
    ModelDims,
    Setting,
    choose_checkpointing,
    memory_table,
    parse_size,
)

if TYPE_CHECKING:
    from lstmem_peft import LSTMemConfig

#: Small files in the official layouts (QASPER's JSON release; the Long dataset's JSONL of context + qas)
#: that ``--tiny`` trains on unless ``--qasper`` / ``--long`` name others.
TINY_DATA = {
    "qasper": Path(__file__).resolve().parent / "data" / "qasper_tiny.json",
    "long": Path(__file__).resolve().parent / "data" / "long_tiny.jsonl",
}


def adapter_config() -> LSTMemConfig:
    from lstmem_peft import LSTMemConfig

    return LSTMemConfig()  # n_h 4, r 8, alpha 16, all layers, feedback on


def load_model(args):
    if args.tiny:
        from lstmem_peft.utils.offline import char_tokenizer, tiny_qwen3

        tok = char_tokenizer()
        return tiny_qwen3(len(tok)), tok
    from lstmem_peft.tuner.loading import load_model_and_adapter

    # on the CPU: the trainer places it on each process's device
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    model, tok = load_model_and_adapter(args.model, dtype=dtype, device="cpu")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def model_config(args):
    """The backbone's config alone (no weights): for the memory plan."""
    if args.tiny:
        from lstmem_peft.utils.offline import char_tokenizer, tiny_qwen3

        return tiny_qwen3(len(char_tokenizer())).config
    from transformers import AutoConfig

    from lstmem_peft.tuner.backbones import resolve_model

    return AutoConfig.from_pretrained(resolve_model(args.model))  # a short name: its converted folder


def plan_setting(args, stage: str) -> Setting:
    """The memory plan's view of one stage: this launch's processes, ZeRO-2 and dtypes, or the ones
    ``--plan-processes`` / ``--plan-dtype`` name (to plan GPUs from another machine)."""
    world = args.plan_processes or int(os.environ.get("WORLD_SIZE", "1"))
    deepspeed = bool(args.deepspeed) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    dtype = args.plan_dtype
    if dtype == "auto":  # what load_model and LSTMemTrainingConfig choose on this machine
        cuda = torch.cuda.is_available()
        dtype = "bfloat16" if cuda and torch.cuda.is_bf16_supported() else "float32"
    return Setting(
        stage=stage,
        history_tokens=args.stage1_history_cap if stage == "stage1" else K.STAGE2_HISTORY_CAP,
        micro_batch=args.micro_batch,
        backbone_dtype=dtype,
        activation_dtype=dtype,
        processes=world,
        zero2=deepspeed,
    )


def stage(model, tok, episodes, args, name, mode, lr, steps, history_cap, checkpointing):
    from datasets import Dataset

    from lstmem_peft.training.data import tokenize_episode
    from lstmem_peft.training.trainer import ACTIVATION_CHECKPOINTING, LSTMemTrainer, LSTMemTrainingConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro = args.micro_batch
    accumulation = max(1, args.global_batch // (world * micro))
    if accumulation * world * micro != args.global_batch:
        raise ValueError(
            f"global batch {args.global_batch} is not a multiple of {world} workers x micro-batch {micro}"
        )
    data = Dataset.from_list([tokenize_episode(tok, e, history_max_tokens=history_cap) for e in episodes])
    config = LSTMemTrainingConfig(
        output_dir=os.path.join(args.output_dir, name),
        history_mode=mode,
        history_max_tokens=history_cap,
        learning_rate=lr,
        max_steps=steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        **{ACTIVATION_CHECKPOINTING: checkpointing},  # activation_checkpointing from transformers 5.24
        lr_scheduler_type="cosine",
        warmup_steps=0.1,  # a float below 1 is a fraction of the run
        optim="adamw_torch",
        seed=42,
        logging_steps=1,
        save_strategy="no",
        report_to=args.report_to,
        deepspeed=args.deepspeed,
    )
    trainer = LSTMemTrainer(model=model, args=config, train_dataset=data, processing_class=tok)
    trainer.train()  # a new trainer per stage: a fresh optimizer, as in the paper
    return trainer


def checkpointing_for(args, dims: ModelDims, adapter: AdapterDims, name: str) -> bool:
    """Gradient checkpointing for one stage: ``--gradient-checkpointing``, or what ``--fit-memory``
    needs (stops the run, naming the fix, when nothing fits)."""
    if args.fit_memory is None:
        return args.gradient_checkpointing
    setting = plan_setting(args, name)
    try:
        needed = choose_checkpointing(dims, adapter, setting, parse_size(args.fit_memory))
    except ValueError as err:
        raise SystemExit(f"--fit-memory {args.fit_memory}: {err}") from err
    on = needed or args.gradient_checkpointing
    why = "needed to fit" if needed else "not needed to fit"
    print(f"{name}: gradient checkpointing {'on' if on else 'off'} ({why} {args.fit_memory} per process)")
    return on


def require_train_extra() -> None:
    """Stop at once, naming the ``train`` extra, when TRL or datasets is missing."""
    from lstmem_peft.utils.extras import missing_extra

    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ModuleNotFoundError as err:
        raise SystemExit(f"error: {missing_extra(err, 'train', 'examples/train_two_stage.py')}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default="Qwen/Qwen3-4B-Instruct-2507",
        help="backbone: Hub id, local folder, or a short name of `lstmem models` (e.g. smollm2-135m)",
    )
    ap.add_argument("--tiny", action="store_true", help="use the offline tiny model (smoke test)")
    ap.add_argument("--qasper", help="QASPER file or Hub id (required to train; --tiny: examples/data/)")
    ap.add_argument(
        "--long", help="long-document QA JSONL, context + qas (required to train; --tiny: examples/data/)"
    )
    ap.add_argument("--output-dir", help="where the stages and the adapter go (required to train)")
    ap.add_argument("--stage1-steps", type=int, default=70)
    ap.add_argument("--stage2-steps", type=int, default=26)
    ap.add_argument("--stage1-history-cap", type=int, default=K.STAGE1_HISTORY_CAP)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--deepspeed", default=None, help="DeepSpeed config (examples/deepspeed_zero2.json)")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="checkpoint the decoder layers")
    ap.add_argument("--memory-table", action="store_true", help="print the memory plan and exit")
    ap.add_argument(
        "--fit-memory",
        default=None,
        metavar="SIZE",
        help="memory per process, e.g. 24GB: checkpoint if needed",
    )
    ap.add_argument("--plan-dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    ap.add_argument(
        "--plan-processes", type=int, default=None, help="plan for N processes (default: this launch)"
    )
    ap.add_argument("--report-to", nargs="*", default=[])
    ap.add_argument("--push-to-hub", default=None, help="publish the adapter as this repo id")
    args = ap.parse_args()

    dims = ModelDims.from_config(model_config(args))
    adapter = AdapterDims.from_config(adapter_config(), dims.num_layers)
    if args.memory_table:
        print(memory_table(dims, adapter, plan_setting(args, "stage1")))
        return
    if args.tiny:  # the shipped small files, unless others are named
        args.qasper = args.qasper or str(TINY_DATA["qasper"])
        args.long = args.long or str(TINY_DATA["long"])
    missing = [
        f"--{n.replace('_', '-')}" for n in ("qasper", "long", "output_dir") if getattr(args, n) is None
    ]
    if missing:
        ap.error(f"training needs {', '.join(missing)}")
    require_train_extra()
    ckpt1 = checkpointing_for(args, dims, adapter, "stage1")
    ckpt2 = checkpointing_for(args, dims, adapter, "stage2")

    from peft import get_peft_model

    from lstmem_peft.training.card import record_training
    from lstmem_peft.training.data import load_episodes

    base, tok = load_model(args)
    model = get_peft_model(base, adapter_config())
    model.print_trainable_parameters()
    qasper = load_episodes(args.qasper, "qasper")
    long_docs = load_episodes(args.long, "long_qa")
    first = stage(
        model, tok, qasper, args, "stage1", "stage1", 2e-4, args.stage1_steps, args.stage1_history_cap, ckpt1
    )
    trainer = stage(
        model, tok, long_docs, args, "stage2", "stage2", 5e-5, args.stage2_steps, K.STAGE2_HISTORY_CAP, ckpt2
    )
    record_training(
        model,
        base_model="tiny-offline" if args.tiny else args.model,
        training_data=(
            f"stage 1: {args.qasper} ({len(qasper)} episodes); "
            f"stage 2: {args.long} ({len(long_docs)} episodes)"
        ),
        updates=f"{args.stage1_steps} at 2e-4, then {args.stage2_steps} at 5e-5",
    )
    if trainer.is_world_process_zero():  # every process holds the same adapter; the first one writes it
        write_adapter(model, trainer, first, args, ckpt1, ckpt2)
    # No process leaves while another may still be talking to it (a peer that exits mid-collective
    # makes gloo abort the others), and the process group is taken down by all of them together.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


def write_adapter(model, trainer, first, args, ckpt1: bool, ckpt2: bool) -> None:
    """The trained adapter, its model card and ``training.json`` under ``<output-dir>/adapter``;
    pushed to the Hub with ``--push-to-hub``."""
    from lstmem_peft.training.card import push_to_hub, write_model_card

    final = os.path.join(args.output_dir, "adapter")
    model.save_pretrained(final)
    write_model_card(model, final)  # settings, the training facts above, the citation

    def losses(t):
        return [h["loss"] for h in t.state.log_history if "loss" in h]

    with open(os.path.join(final, "training.json"), "w") as fh:
        json.dump(
            {
                "base_model": "tiny-offline" if args.tiny else args.model,
                "qasper": args.qasper,
                "long": args.long,
                "stage1_updates": args.stage1_steps,
                "stage2_updates": args.stage2_steps,
                "global_batch": args.global_batch,
                "processes": trainer.accelerator.num_processes,
                "distributed_type": str(trainer.accelerator.distributed_type.value),
                "gradient_checkpointing": {"stage1": ckpt1, "stage2": ckpt2},
                "stage1_losses": losses(first),
                "stage2_losses": losses(trainer),
            },
            fh,
            indent=2,
        )
    if args.push_to_hub:
        push_to_hub(model, args.push_to_hub)  # the adapter with its LSTMem card


if __name__ == "__main__":
    main()
