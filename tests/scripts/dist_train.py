"""Worker for tests/test_distributed.py: a few LSTMemTrainer updates on a tiny model, one process or
several, with the same global batch; writes what the test compares.

    python tests/scripts/dist_train.py OUT --backend single [--half-batch-too]
    torchrun --nproc_per_node 2 tests/scripts/dist_train.py OUT --backend ddp
    accelerate launch --config_file examples/accelerate_zero2_cpu.yaml \\
        --deepspeed_config_file tests/configs/deepspeed_zero2_sgd.json \\
        tests/scripts/dist_train.py OUT --backend deepspeed
    torchrun --nproc_per_node 2 tests/scripts/dist_train.py OUT --backend fsdp2 --history-mode stage2

The update is SGD with momentum, whose result is linear in the gradients, so that the test can
bound the difference float32 summation order makes (tests/test_distributed.py).

Every process writes ``OUT/rank{r}.json`` (world size, accelerate's distributed type, the logged
loss, gradient norm and learning rate per update, and for FSDP2 the fraction of the backbone's
weights this process holds) and ``OUT/rank{r}.pt`` (its own copy of the adapter weights); the
adapter is saved once with ``trainer.save_model(OUT/adapter)``. ``--half-batch-too`` (one process)
also trains, into ``OUT/half``, on half the global batch: what each process of a launch that
silently trains alone would do, the run the tolerance must tell apart.
"""

import argparse
import json
import os

import torch
from datasets import Dataset
from peft import get_peft_model

from lstmem_peft import LSTMemConfig
from lstmem_peft.training.data import synthetic_recall_episodes, tokenize_episode
from lstmem_peft.training.distributed import shard_backbone
from lstmem_peft.training.trainer import LSTMemTrainer, LSTMemTrainingConfig
from lstmem_peft.utils.offline import demo_tokenizer, tiny_qwen3

LEARNING_RATE = 0.5  # SGD: large enough that 3 updates move the adapter far beyond the tolerance
MOMENTUM = 0.9


def train(out, backend, history_mode, steps, global_batch, micro_batch, deepspeed=None, use_cpu=None):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if global_batch % (world * micro_batch):
        raise SystemExit(f"global batch {global_batch} is not a multiple of {world} x {micro_batch}")
    tok = demo_tokenizer()
    model = get_peft_model(
        tiny_qwen3(len(tok), hidden_size=64, num_layers=2, seed=0), LSTMemConfig(block_size=8)
    )
    # same-length episodes (4 facts: 13 history tokens, 2 blocks of 8): no padding, so a batch split
    # over processes computes exactly the per-example terms of the whole batch
    data = Dataset.from_list([tokenize_episode(tok, e) for e in synthetic_recall_episodes(64, 4, seed=0)])
    args = LSTMemTrainingConfig(
        output_dir=os.path.join(out, "run"),
        history_mode=history_mode,
        max_steps=steps,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=global_batch // (world * micro_batch),
        optim="sgd",
        optim_args=f"momentum={MOMENTUM}",
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        context_dropout=0.0,
        seed=42,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=backend != "deepspeed" if use_cpu is None else use_cpu,  # DeepSpeed: its CPU accelerator
        ddp_backend="gloo" if backend in ("ddp", "fsdp2") else None,
        deepspeed=deepspeed,
    )
    total = sum(p.numel() for n, p in model.named_parameters() if "lstmem_memory" not in n)
    if backend == "fsdp2":
        model = shard_backbone(model)
    local = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel()  # an FSDP2 shard: this process's part
        for n, p in model.named_parameters()
        if "lstmem_memory" not in n
    )
    trainer = LSTMemTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    trainer.save_model(os.path.join(out, "adapter"))
    rank = trainer.args.process_index
    logs = [h for h in trainer.state.log_history if "loss" in h]
    record = {
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "deepspeed": trainer.is_deepspeed_enabled,
        "losses": [h["loss"] for h in logs],
        "grad_norms": [h["grad_norm"] for h in logs],
        "learning_rates": [h["learning_rate"] for h in logs],
        "momentum": MOMENTUM,
        "max_grad_norm": args.max_grad_norm,
        "backbone_fraction_held": local / total,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(record, fh)
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if "lstmem_memory" in n}
    torch.save(weights, os.path.join(out, f"rank{rank}.pt"))
    trainer.accelerator.wait_for_everyone()  # no process leaves while a peer may still talk to it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--backend", choices=["single", "ddp", "deepspeed", "fsdp2"], required=True)
    ap.add_argument("--history-mode", default="stage1", choices=["stage1", "stage2"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument(
        "--micro-batch", type=int, default=None, help="default: the global batch over the processes"
    )
    ap.add_argument("--deepspeed", default=None, help="DeepSpeed config file")
    ap.add_argument("--half-batch-too", action="store_true")
    ap.add_argument("--no-use-cpu", action="store_true", help="leave use_cpu off (a launch mistake on CPU)")
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro = a.micro_batch or a.global_batch // world
    use_cpu = False if a.no_use_cpu else None
    train(a.out, a.backend, a.history_mode, a.steps, a.global_batch, micro, a.deepspeed, use_cpu)
    if a.half_batch_too:
        half = a.global_batch // 2
        train(os.path.join(a.out, "half"), a.backend, a.history_mode, a.steps, half, half, a.deepspeed)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # by every process together, after the last run


if __name__ == "__main__":
    main()
