"""The paper's two-stage schedule (App. C.4) with LSTMemTrainer.

Stage 1: QASPER, histories capped at 8,192 tokens, gradients through memory writing and feedback,
70 updates at 2e-4. Stage 2: the Long dataset (long-document QA), histories up to 131,072 tokens
written in 2,048-token blocks without gradients, 26 updates at 5e-5 with a fresh optimizer. Both:
global batch 32, AdamW, cosine decay with 10% warm-up, bf16, seed 42.

    # the paper's setting: 8 GPUs, micro-batch 1, accumulation 4, ZeRO-2
    accelerate launch --config_file examples/accelerate_zero2.yaml examples/train_two_stage.py \\
        --model Qwen/Qwen3-4B-Instruct-2507 --qasper allenai/qasper --long data/long.jsonl \\
        --output-dir runs/lstmem-qwen3-4b --push-to-hub user/lstmem-qwen3-4b

    # a CPU smoke test on the offline tiny model and local fixtures
    python examples/train_two_stage.py --tiny --qasper qasper.json --long long.jsonl --output-dir /tmp/run \\
        --stage1-steps 2 --stage2-steps 2 --global-batch 2
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from datasets import Dataset
from peft import get_peft_model

from lstmem_peft import LSTMemConfig
from lstmem_peft.memory import constants as K
from lstmem_peft.training.card import push_to_hub, record_training, write_model_card
from lstmem_peft.training.data import load_episodes, tokenize_episode
from lstmem_peft.training.trainer import LSTMemTrainer, LSTMemTrainingConfig


def load_model(args):
    if args.tiny:
        from lstmem_peft.utils.offline import char_tokenizer, tiny_qwen3

        tok = char_tokenizer()
        return tiny_qwen3(len(tok)), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype), tok


def stage(model, tok, episodes, args, name, mode, lr, steps, history_cap):
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen/Qwen3-4B-Instruct-2507")
    ap.add_argument("--tiny", action="store_true", help="use the offline tiny model (smoke test)")
    ap.add_argument("--qasper", required=True, help="QASPER file or Hub id")
    ap.add_argument("--long", required=True, help="long-document QA JSONL (context + qas)")
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--stage1-steps", type=int, default=70)
    ap.add_argument("--stage2-steps", type=int, default=26)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--deepspeed", default=None, help="DeepSpeed config (examples/deepspeed_zero2.json)")
    ap.add_argument("--report-to", nargs="*", default=[])
    ap.add_argument("--push-to-hub", default=None, help="publish the adapter as this repo id")
    args = ap.parse_args()

    base, tok = load_model(args)
    model = get_peft_model(base, LSTMemConfig())  # n_h 4, r 8, alpha 16, all layers, feedback on
    model.print_trainable_parameters()
    qasper = load_episodes(args.qasper, "qasper")
    long_docs = load_episodes(args.long, "long_qa")
    stage(model, tok, qasper, args, "stage1", "stage1", 2e-4, args.stage1_steps, K.STAGE1_HISTORY_CAP)
    trainer = stage(
        model, tok, long_docs, args, "stage2", "stage2", 5e-5, args.stage2_steps, K.STAGE2_HISTORY_CAP
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
    final = os.path.join(args.output_dir, "adapter")
    model.save_pretrained(final)
    write_model_card(model, final)  # settings, the training facts above, the citation
    with open(os.path.join(final, "training.json"), "w") as fh:
        json.dump(
            {
                "base_model": "tiny-offline" if args.tiny else args.model,
                "qasper": args.qasper,
                "long": args.long,
                "stage1_updates": args.stage1_steps,
                "stage2_updates": args.stage2_steps,
                "global_batch": args.global_batch,
            },
            fh,
            indent=2,
        )
    if args.push_to_hub and trainer.is_world_process_zero():
        push_to_hub(model, args.push_to_hub)  # the adapter with its LSTMem card


if __name__ == "__main__":
    main()
