"""Worker for the DDP test: a few LSTMemTrainer steps on gloo; each rank saves its adapter weights.

torchrun --nproc_per_node 2 tests/scripts/ddp_train.py OUT_DIR
"""

import os
import sys

import torch
from datasets import Dataset
from peft import get_peft_model

from lstmem_peft import LSTMemConfig
from lstmem_peft.training.data import synthetic_recall_episodes, tokenize_episode
from lstmem_peft.training.trainer import LSTMemTrainer, LSTMemTrainingConfig
from lstmem_peft.utils.offline import demo_tokenizer, tiny_qwen3

out = sys.argv[1]
rank = int(os.environ["RANK"])
tok = demo_tokenizer()
model = get_peft_model(
    tiny_qwen3(len(tok), hidden_size=64, num_layers=2, seed=0), LSTMemConfig(block_size=32)
)
data = Dataset.from_list([tokenize_episode(tok, e) for e in synthetic_recall_episodes(64, 4, seed=rank)])
args = LSTMemTrainingConfig(
    output_dir=os.path.join(out, "run"),
    max_steps=3,
    per_device_train_batch_size=4,
    learning_rate=1e-2,
    report_to=[],
    save_strategy="no",
    use_cpu=True,
    logging_steps=1,
    disable_tqdm=True,
    ddp_backend="gloo",
)
trainer = LSTMemTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
assert trainer.accelerator.num_processes == 2, (
    f"expected 2 processes, got {trainer.accelerator.num_processes}"
)
trainer.train()
weights = {k: v.detach().clone() for k, v in model.named_parameters() if "lstmem_memory" in k}
torch.save(
    {"weights": weights, "world_size": trainer.accelerator.num_processes}, os.path.join(out, f"rank{rank}.pt")
)
