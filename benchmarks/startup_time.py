"""Wall time of a fresh start: ``import peft``, ``import lstmem_peft`` (alone, then with PEFT, which
registers LSTMem), ``lstmem --version`` and ``lstmem --help`` (the console script, and ``python -m
lstmem_cli``, which needs no reinstall), each in a new process run from the repository's root, where the
README's commands run.

    python benchmarks/startup_time.py              # 3 runs of each, rounds in turn
    python benchmarks/startup_time.py --runs 5

Prints each start's median, min and max seconds and the lines it wrote to stderr (warnings). The
first round pays for cold disk caches; the machine's load moves every figure. tests/test_startup.py
holds the module sets these starts load, which do not depend on the load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

STARTS = {
    "python -c 'import peft'": [sys.executable, "-c", "import peft"],
    "python -c 'import lstmem_peft'": [sys.executable, "-c", "import lstmem_peft"],
    "python -c 'import lstmem_peft, peft'": [sys.executable, "-c", "import lstmem_peft, peft"],
    "lstmem --version": ["lstmem", "--version"],
    "lstmem --help": ["lstmem", "--help"],
    "python -m lstmem_cli --version": [sys.executable, "-m", "lstmem_cli", "--version"],
    "python -m lstmem_cli data long --help": [sys.executable, "-m", "lstmem_cli", "data", "long", "--help"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh starts of each command (default 3)")
    args = parser.parse_args()
    script = shutil.which("lstmem", path=os.path.dirname(sys.executable)) or shutil.which("lstmem")
    if script is None:
        raise SystemExit("no lstmem console script found: pip install -e . installs it")
    times: dict[str, list[float]] = {name: [] for name in STARTS}
    warnings: dict[str, int] = {}
    for _ in range(args.runs):
        for name, command in STARTS.items():
            command = [script, *command[1:]] if command[0] == "lstmem" else command
            start = time.perf_counter()
            result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
            times[name].append(time.perf_counter() - start)
            warnings[name] = len(result.stderr.splitlines())
    print(f"{'start':<38} {'median s':>9} {'min s':>7} {'max s':>7}  stderr lines")
    for name, seconds in times.items():
        row = f"{statistics.median(seconds):9.2f} {min(seconds):7.2f} {max(seconds):7.2f}"
        print(f"{name:<38} {row}  {warnings[name]}")


if __name__ == "__main__":
    main()
