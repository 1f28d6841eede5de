"""Scan speed: naive token loop vs vectorised PyTorch (vs Triton on CUDA), forward and backward.

    python benchmarks/bench_scan.py                      # CPU defaults: T = 2048, batch 1
    python benchmarks/bench_scan.py --T 512 2048 --batch 1 4 --out benchmarks/out/scan.json

Prints a table and writes a JSON record with the device, library versions, date and every figure
(medians over repetitions after a warm-up; CUDA timings synchronised).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch

from lstmem_kernels import lstmem_scan, triton_available


def make_inputs(B, T, H, R, device, requires_grad):
    g = torch.Generator(device="cpu").manual_seed(0)
    t = lambda *s, fn=torch.randn: fn(*s, generator=g).to(device).requires_grad_(requires_grad)  # noqa: E731
    return dict(
        q=t(B, T, H, R), k=t(B, T, H, R), w=t(B, T, H, R),
        f=t(B, T, H, R, fn=torch.rand), o=t(B, T, H, R, fn=torch.rand),
        depth=t(B, T, H, R, R), initial_cell=t(B, H, R, R), initial_hidden=t(B, H, R, R),
    )


def timeit(fn, device, reps):
    times = []
    for i in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first run is a warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, nargs="+", default=[2048])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--naive-reps", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args()
    device = torch.device(args.device)
    backends = ["naive", "torch"] + (["triton"] if device.type == "cuda" and triton_available() else [])
    rows = []
    for B in args.batch:
        for T in args.T:
            for backend in backends:
                for mode in ("forward", "forward+backward"):
                    grad = mode != "forward"
                    x = make_inputs(B, T, args.heads, args.head_dim, device, grad)

                    def run():
                        with torch.set_grad_enabled(grad):
                            out = lstmem_scan(**x, backend=backend)
                            if grad:
                                sum(o.float().sum() for o in out).backward()

                    reps = args.naive_reps if backend == "naive" else args.reps
                    med, lo, hi = timeit(run, device, reps)
                    rows.append(dict(batch=B, T=T, backend=backend, mode=mode, median_s=med, min_s=lo, max_s=hi))
    for r in rows:
        base = next(x for x in rows if x["batch"] == r["batch"] and x["T"] == r["T"] and x["mode"] == r["mode"] and x["backend"] == "naive")
        r["speedup_vs_naive"] = base["median_s"] / r["median_s"]
    print(f"{'B':>3} {'T':>6} {'backend':>8} {'mode':>17} {'median ms':>10} {'min-max ms':>15} {'x naive':>8}")
    for r in rows:
        print(f"{r['batch']:>3} {r['T']:>6} {r['backend']:>8} {r['mode']:>17} {1e3 * r['median_s']:>10.2f} "
              f"{1e3 * r['min_s']:>7.2f}-{1e3 * r['max_s']:<7.2f} {r['speedup_vs_naive']:>8.1f}")
    record = dict(
        benchmark="scan",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)",
        torch=torch.__version__,
        triton=__import__("triton").__version__ if triton_available() else None,
        heads=args.heads, head_dim=args.head_dim, rows=rows,
    )
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
