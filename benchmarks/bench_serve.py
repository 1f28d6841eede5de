"""`lstmem serve` under concurrent sessions: batched vs one request at a time.

    python benchmarks/bench_serve.py                                  # demo model, 1/8/32 sessions
    python benchmarks/bench_serve.py --sessions 1 8 32 --turns 3 --max-tokens 8 --out benchmarks/serve

For each mode (batching on: requests on different sessions that wait together share one forward;
off: ``--no-batching``, one request at a time) a fresh server is started in a subprocess on a fresh
store (the embedded demo model, ``--threads 1``), and for each concurrency level ``C``, ``C``
sessions each hold a ``--turns``-turn greedy chat through the ``openai`` client at once (every turn
re-sends the conversation, as chat clients do). Reported per level: throughput (requests/s and
generated tokens/s over the wall time of the level) and p50/p95 request latency; plus the mean
batch size the server reported. Every request includes the memory commit to disk (fsync).

Other processes on the machine distort the figures: the JSON records the load average before and
after each mode.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

MODEL = "lstmem-demo"
FACTS = "k07 v19 ; k12 v03 ; k01 v05 ; k02 v11 ; k30 v08 ; k21 v27 ; k09 v14 ; k16 v00 ;"
QUESTIONS = ["? k07", "? k12", "? k01", "? k02", "? k30", "? k21"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(store: str, batching: bool, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "lstmem_cli",
        "serve",
        "--store",
        store,
        "--port",
        str(port),
        "--threads",
        "1",
    ]
    if not batching:
        cmd.append("--no-batching")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("server did not start in 300 s")


async def run_level(url: str, sessions: int, turns: int, max_tokens: int, tag: str) -> dict:
    latencies: list[float] = []
    tokens: list[int] = []
    batches: list[int] = []

    async def conversation(client, i: int) -> None:
        messages = [{"role": "user", "content": FACTS}]
        for t in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[(i + t) % len(QUESTIONS)]})
            start = time.perf_counter()
            reply = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=max_tokens,
                temperature=0,
                extra_headers={"X-Session-Id": f"{tag}-{i}"},
            )
            latencies.append(time.perf_counter() - start)
            tokens.append(reply.usage.completion_tokens)
            batches.append(reply.model_extra["lstmem"]["batch_size"])
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=600, max_retries=0) as client:
        start = time.perf_counter()
        await asyncio.gather(*(conversation(client, i) for i in range(sessions)))
        wall = time.perf_counter() - start
    ordered = sorted(latencies)
    return {
        "sessions": sessions,
        "requests": len(latencies),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(latencies) / wall, 3),
        "tokens_per_s": round(sum(tokens) / wall, 2),
        "p50_ms": round(1000 * statistics.median(ordered), 1),
        "p95_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 1),
        "mean_batch": round(statistics.mean(batches), 2),
    }


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("batched", "o-"), ("one_at_a_time", "s--")):
        levels = record["results"][mode]
        x = [r["sessions"] for r in levels]
        axes[0].plot(x, [r["requests_per_s"] for r in levels], style, label=mode.replace("_", " "))
        axes[1].plot(x, [r["p50_ms"] for r in levels], style, label=f"{mode.replace('_', ' ')} p50")
        axes[1].plot(
            x, [r["p95_ms"] for r in levels], style, alpha=0.4, label=f"{mode.replace('_', ' ')} p95"
        )
    axes[0].set(xlabel="concurrent sessions", ylabel="requests / s", xscale="log", title="throughput")
    axes[1].set(
        xlabel="concurrent sessions", ylabel="latency (ms)", xscale="log", yscale="log", title="latency"
    )
    for ax in axes:
        ax.set_xticks(record["sessions"], [str(s) for s in record["sessions"]])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"lstmem serve, demo model, {record['machine']} ({record['date'][:10]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/serve")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "kind": "serve",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"CPU ({platform.machine()}, {os.cpu_count()} cores), torch threads 1",
        "python": platform.python_version(),
        "sessions": args.sessions,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "results": {},
        "load_average": {},
    }
    for mode, batching in (("batched", True), ("one_at_a_time", False)):
        with tempfile.TemporaryDirectory() as store, open(out / f"server-{mode}.log", "w") as log:
            proc, url = start_server(store, batching, log)
            try:
                asyncio.run(run_level(url, 2, 1, args.max_tokens, "warmup"))
                record["load_average"][f"{mode}_before"] = os.getloadavg()
                levels = []
                for sessions in args.sessions:
                    levels.append(
                        asyncio.run(run_level(url, sessions, args.turns, args.max_tokens, f"c{sessions}"))
                    )
                    print(mode, json.dumps(levels[-1]), flush=True)
                record["results"][mode] = levels
                record["load_average"][f"{mode}_after"] = os.getloadavg()
            finally:
                proc.terminate()
                proc.wait(timeout=30)
        (out / f"server-{mode}.log").unlink()
    stamp = record["date"].replace("-", "").replace(":", "")[:15]
    path = out / f"serve-cpu-{stamp}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    plot(record, out / "serve-cpu.png")
    print(f"wrote {path} and {out / 'serve-cpu.png'}")


if __name__ == "__main__":
    main()
