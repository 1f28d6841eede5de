"""How parallel the Triton block scan is: launches, programs per launch and the longest dependent
walk of one program, counted through the scan's real host code (nothing is launched or timed).

    python benchmarks/scan_parallelism.py            # markdown table on stdout

The counts are the same on any machine: they follow from the chunk plan
(``lstmem_kernels.scan.chunked.chunk_length``) and the grids the host code asks for. They say how
much of a GPU a launch can occupy (an H100 has 132 SMs) and how long its critical path is; what a
launch costs in time needs a GPU. The row "sequential" is what the scan was before the chunked
scan (2026-11-27): one program per (batch, head) walking the whole block, forward and backward.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors pass the kernels' device check

import torch  # noqa: E402

from lstmem_kernels.scan import chunked as triton_scan  # noqa: E402

KERNELS = ("_fwd_summary_kernel", "_fwd_replay_kernel", "_bwd_summary_kernel", "_bwd_replay_kernel")


def count_launches(B: int, T: int, H: int = 4, R: int = 8) -> list[tuple[str, int, int]]:
    """``(kernel, programs, longest walk)`` of each launch of one forward and backward scan."""
    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def record(*args, **kwargs):
                T_, _, _, L, NC = args[-5:]
                walk = L if "summary" in self.name else NC - 1 + L
                launches.append((self.name, grid[0] * grid[1], min(walk, T_)))

            return record

    saved = {name: getattr(triton_scan, name) for name in KERNELS}
    try:
        for name in KERNELS:
            setattr(triton_scan, name, Recorder(name))
        inputs = [torch.empty(B, T, H, R).uniform_().requires_grad_() for _ in range(5)]
        outputs = triton_scan.scan_triton(*inputs)
        torch.autograd.backward(outputs[:2], [torch.zeros_like(outputs[0]), torch.zeros_like(outputs[1])])
    finally:
        for name, kernel in saved.items():
            setattr(triton_scan, name, kernel)
    return launches


def main() -> None:
    columns = (
        "B",
        "T",
        "L",
        "chunks",
        "launches (fwd + bwd)",
        "fewest programs in a launch",
        "longest walk",
        "sequential: programs, walk",
    )
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for B in (1, 4):
        for T in (63, 2048, 8192, 32768, 131072):
            launches = count_launches(B, T)
            L = triton_scan.chunk_length(T)
            print(
                f"| {B} | {T:,} | {L} | {-(-T // L)} | {len(launches)} | {min(p for _, p, _ in launches)} "
                f"| {max(w for _, _, w in launches)} | {B * 4}, {T:,} |"
            )


if __name__ == "__main__":
    main()
