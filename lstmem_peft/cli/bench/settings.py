"""``lstmem bench``'s sizes when none are given (:data:`DEFAULTS`) and its progress bars
(:func:`progress_bar`, on stderr: the records go to stdout and their files)."""

from __future__ import annotations

import sys

#: Each benchmark's sizes when none are given. ``cpu``: about a minute per kind on a 2-core CPU with the
#: ``cpu-small`` preset (docs/benchmarks.md has the times); ``cpu-long``: the sizes of the CPU records in
#: benchmarks/results (minutes per kind: ``scan`` at 2,048 tokens alone takes about 4), passed as options
#: (docs/benchmarks.md "Defaults and longer runs"); ``cuda``: the paper's sizes.
DEFAULTS = {
    "cpu": dict(
        kv_lengths=[128, 256],
        histories=[256],
        answer_tokens=8,
        write_tokens=256,
        prompt_tokens=64,
        generate_tokens=8,
        scan_lengths=[63, 256],
        scan_batches=[1, 4],
        reps=dict(decode=5, generate=2, write=2, e2e=2, scan=3),
    ),
    "cpu-long": dict(
        kv_lengths=[256, 1024, 2048],
        histories=[2048, 4096],
        answer_tokens=32,
        write_tokens=4096,
        prompt_tokens=256,
        generate_tokens=32,
        scan_lengths=[63, 2048],
        scan_batches=[1, 4],
        reps=dict(decode=10, generate=6, write=3, e2e=3, scan=5),
    ),
    "cuda": dict(
        kv_lengths=[8192 * i for i in (1, 2, 4, 8, 16)],
        histories=[8192, 32768, 131072],
        answer_tokens=2048,
        write_tokens=32768,
        prompt_tokens=2048,
        generate_tokens=256,
        scan_lengths=[63, 2048],
        scan_batches=[1, 4],
        reps=dict(decode=10, generate=6, write=3, e2e=3, scan=5),
    ),
}
#: Whether the benchmarks show progress bars (on stderr; the records go to stdout and their files).
SHOW_PROGRESS = True


def progress_bar(total: int, desc: str):
    """A progress bar on stderr (tqdm: elapsed time and an estimate of what is left), one tick a run."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, disable=not SHOW_PROGRESS, leave=True)
