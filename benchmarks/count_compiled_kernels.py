"""Kernels per decode step in inductor's generated code: LSTMem inside ``traceable_memory()`` vs the
plain backbone (adapter disabled), both compiled with ``fullgraph=True``.

    python benchmarks/count_compiled_kernels.py            # tiny Qwen3, 3 layers, memory on all

Compiles a one-token ``model(...)`` step and counts, in the ``call`` function inductor generates,
its fused kernels (``cpp_fused_*`` on CPU; Triton kernels on a GPU) and its calls of library kernels
(``extern_kernels.mm/addmm/bmm``). The difference divided by the number of memory layers is what
each memory layer adds to a compiled step: on a GPU each is one launch. Inductor on CPU groups
operators as it would for Triton in most cases, but the count is the CPU code's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re

import torch
import torch._dynamo as dynamo
from torch._inductor.utils import run_and_get_code
from transformers import DynamicCache

from lstmem_peft import LSTMemConfig, MemoryCache, traceable_memory
from lstmem_peft.utils.offline import tiny_qwen3


def count(model, memory: bool, prompt: torch.Tensor, steps: torch.Tensor) -> dict:
    """Fused and library kernels in the generated code of one compiled decode step."""
    dynamo.reset()
    kv, kw = DynamicCache(), {"memory_cache": MemoryCache()} if memory else {}
    plain = contextlib.nullcontext() if memory else model.disable_adapter()
    with torch.no_grad(), traceable_memory(), plain:
        model(input_ids=prompt, past_key_values=kv, use_cache=True, **kw)

        def step(ids):
            return model(input_ids=ids, past_key_values=kv, use_cache=True, **kw).logits

        compiled = torch.compile(step, fullgraph=True)
        compiled(steps[:, :1])  # the first step's graph, then the one for a growing KV length
        _, codes = run_and_get_code(compiled, steps[:, 1:2])
    code = codes[-1]
    body = code[code.index("def call(") :]
    return {
        "fused": len(re.findall(r"^\s+(cpp_fused_\w+|triton_\w+)\(", body, re.M)),
        "extern": len(re.findall(r"extern_kernels\.\w+\(", body)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=3)
    args = ap.parse_args()
    base = tiny_qwen3(vocab_size=96, num_layers=args.layers, seed=0)
    from peft import get_peft_model

    model = get_peft_model(base, LSTMemConfig(r=4, num_heads=2)).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 90, (2, 8), generator=g)
    steps = torch.randint(3, 90, (2, 4), generator=g)
    counts = {name: count(model, name == "lstmem", prompt, steps) for name in ("plain", "lstmem")}
    extra = {k: (counts["lstmem"][k] - counts["plain"][k]) / args.layers for k in ("fused", "extern")}
    print(
        json.dumps(
            {"torch": torch.__version__, "memory_layers": args.layers, **counts, "per_memory_layer": extra}
        )
    )


if __name__ == "__main__":
    main()
