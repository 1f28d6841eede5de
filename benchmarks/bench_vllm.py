"""LSTMem on vLLM against the plain backbone: same vLLM, same checkpoint, same run.

Run in the vLLM environment (``.ci/run-vllm`` builds one; ``pip install "lstmem-peft[vllm]"`` on a GPU)::

    python benchmarks/bench_vllm.py throughput            # CPU: random Qwen3, 16 requests at once
    python benchmarks/bench_vllm.py sweep --model Qwen/Qwen3-4B-Instruct-2507 --adapter user/lstmem-qwen3-4b \\
        --kv 8192 16384 32768 65536 131072 --dtype bfloat16   # GPU: decode speed against KV length

``throughput``: ``--requests`` greedy requests (``--prompt`` random tokens each, ``--new`` tokens
generated, EOS ignored) through one ``LLM.generate`` call, on the plain backbone and on its LSTMem
model (an adapter attached to the same random checkpoint, memory on every layer): both engines are
started first, then ``--repeats`` rounds alternate between them; reported: generated tokens/s over
the median wall time of the call (prefill included), the min-max, and the ratio.

``sweep``: for each KV length ``L``, one request with an ``L``-token prompt, timed with 1 and with
``1 + --new`` generated tokens; decode tokens/s = ``--new`` / the difference. Plain and LSTMem.

Each run writes a JSON record (device, versions, date, settings, figures) to ``--out`` (default
``benchmarks/vllm``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path


def environment() -> dict:
    import torch
    import transformers
    import vllm

    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    )
    return dict(
        device=device,
        vllm=vllm.__version__,
        torch=torch.__version__,
        transformers=transformers.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        load_average=os.getloadavg(),
    )


def random_checkpoint(folder: Path, hidden: int, layers: int) -> tuple[str, str]:
    """A random Qwen3 (head_dim 64) and an LSTMem adapter on every layer, saved under ``folder``."""
    import torch
    from peft import get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lstmem_peft import LSTMemConfig

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        max_position_embeddings=4096,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    base = Qwen3ForCausalLM(config).eval()
    base.save_pretrained(folder / "base")
    get_peft_model(base, LSTMemConfig(memory_id="bench-vllm")).save_pretrained(folder / "adapter")
    return str(folder / "base"), str(folder / "adapter")


def make_llm(model: str, adapter: str | None, args):
    from vllm import LLM

    from lstmem_peft.integrations.vllm import engine_args

    kwargs = dict(
        dtype=args.dtype,
        enforce_eager=not args.compile,
        seed=0,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.requests, 1),
        skip_tokenizer_init=True,
    )
    if args.kv_cache_bytes:
        kwargs.update(gpu_memory_utilization=0.3, kv_cache_memory_bytes=args.kv_cache_bytes)
    start = time.perf_counter()
    if adapter is None:
        llm = LLM(model=model, enable_prefix_caching=False, **kwargs)
    else:
        llm = LLM(**engine_args(model, adapter, **kwargs))
    return llm, time.perf_counter() - start


def graph_mode(llm, lstmem: bool) -> str:
    """The CUDA graph mode of an engine (``NONE`` on CPU and with ``enforce_eager``): as the LSTMem
    workers resolved it against the attention and state backends, or as the plain engine was asked
    for (its default worker reports nothing)."""
    if lstmem:
        return ",".join(sorted(set(llm.collective_rpc("lstmem_graph_mode"))))
    return f"{llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name} (requested)"


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def timed_generate(llm, prompts: list[list[int]], new: int) -> tuple[float, int]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def throughput(args) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 8192) for _ in range(args.prompt)] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        model, adapter = (
            (args.model, args.adapter)
            if args.model
            else random_checkpoint(Path(tmp), args.hidden, args.layers)
        )
        engines, rows, runs = {}, {}, {"plain": [], "lstmem": []}
        try:
            for name, which in (("plain", None), ("lstmem", adapter)):
                engines[name], started = make_llm(model, which, args)
                timed_generate(engines[name], prompts[:2], 4)  # warm-up
                rows[name] = dict(
                    engine_start_s=round(started, 1),
                    cudagraph_mode=graph_mode(engines[name], which is not None),
                )
            # rounds alternate between the two engines, so that a change in the machine's load
            # (other processes on shared cores) falls on both
            for _ in range(args.repeats):
                for name in ("plain", "lstmem"):
                    runs[name].append(timed_generate(engines[name], prompts, args.new))
        finally:
            for llm in engines.values():
                close(llm)
        for name, timed in runs.items():
            seconds = sorted(t for t, _ in timed)
            tokens = timed[0][1]
            rows[name].update(
                seconds_median=round(seconds[len(seconds) // 2], 3),
                seconds_min_max=[round(seconds[0], 3), round(seconds[-1], 3)],
                generated_tokens_per_s=round(tokens / seconds[len(seconds) // 2], 1),
            )
            print(name, rows[name], flush=True)
    ratio = rows["lstmem"]["generated_tokens_per_s"] / rows["plain"]["generated_tokens_per_s"]
    return dict(
        bench="vllm-throughput",
        settings=dict(
            requests=args.requests,
            prompt_tokens=args.prompt,
            new_tokens=args.new,
            hidden=args.hidden,
            layers=args.layers,
            dtype=args.dtype,
            compile=args.compile,
            repeats=args.repeats,
            model=args.model or "random Qwen3",
            rounds="alternating (plain, lstmem) x repeats, both engines started first",
            note=args.note,
        ),
        results=rows,
        lstmem_over_plain=round(ratio, 3),
    )


def sweep(args) -> dict:
    if bool(args.model) != bool(args.adapter):
        raise SystemExit("sweep needs both --model and --adapter (or neither: a random Qwen3)")
    rng = random.Random(0)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        model, adapter = (
            (args.model, args.adapter)
            if args.model
            else random_checkpoint(Path(tmp), args.hidden, args.layers)
        )
        for name, which in (("plain", None), ("lstmem", adapter)):
            llm, started = make_llm(model, which, args)
            rows[name] = {
                "engine_start_s": round(started, 1),
                "cudagraph_mode": graph_mode(llm, which is not None),
            }
            for length in args.kv:
                prompt = [[rng.randrange(3, 8192) for _ in range(length)]]
                first, _ = timed_generate(llm, prompt, 1)
                full, _ = timed_generate(llm, prompt, 1 + args.new)
                rows[name][str(length)] = round(args.new / (full - first), 2)
                print(name, length, rows[name][str(length)], "decode tok/s", flush=True)
            close(llm)
    return dict(
        bench="vllm-decode-sweep",
        settings=dict(
            model=args.model or f"random Qwen3 (hidden {args.hidden}, {args.layers} layers)",
            adapter=args.adapter,
            kv=args.kv,
            new_tokens=args.new,
            dtype=args.dtype,
        ),
        decode_tokens_per_s=rows,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["throughput", "sweep"])
    parser.add_argument("--model", help="backbone (local folder or Hub id); default: a random Qwen3")
    parser.add_argument("--adapter", help="LSTMem adapter for --model")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--compile", action="store_true", help="let vLLM compile the model (default: eager)")
    parser.add_argument(
        "--kv-cache-bytes", type=int, default=None, help="vLLM's kv_cache_memory_bytes (CPU: e.g. 1073741824)"
    )
    parser.add_argument("--note", default="", help="free text kept in the record (what code was measured)")
    parser.add_argument("--out", default="benchmarks/vllm")
    args = parser.parse_args(argv)
    if args.mode == "sweep":
        args.requests = 1
        args.max_model_len = max(args.max_model_len, max(args.kv) + args.new + 8)
    record = {
        **(throughput(args) if args.mode == "throughput" else sweep(args)),
        "environment": environment(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    device = "cuda" if "CPU" not in record["environment"]["device"] else "cpu"
    path = out / f"{record['bench']}-{device}-{stamp}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    print(f"written to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
