"""Peak RSS (KiB) after writing a history of N tokens without a KV cache: python write_peak_rss.py N"""

import resource
import sys

import torch
from peft import get_peft_model

from lstmem_peft import LSTMemConfig, MemoryCache, write_history
from lstmem_peft.utils.offline import tiny_qwen3

torch.manual_seed(0)
model = get_peft_model(tiny_qwen3(64, hidden_size=64), LSTMemConfig(block_size=512)).eval()
ids = torch.randint(3, 64, (1, int(sys.argv[1])))
with torch.no_grad():
    write_history(model, ids[:, :512], MemoryCache(), progress=False)  # warm-up: allocator and kernels
    write_history(model, ids, MemoryCache(), progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
