"""Registers, spills, shared memory and occupancy of every distinct Triton launch at the paper's sizes,
compiled ahead of time for sm_90a and sm_80 on the CPU (``lstmem_kernels.aot``), for one or more
Python environments (one Triton each), as the Markdown section of ``docs/benchmarks.md``.

    python benchmarks/compile_report.py --python python \
        --python /tmp/lstmem-triton-floor-venv/bin/python --write docs/benchmarks.md

Each ``--python`` runs ``python -m lstmem_kernels.aot --set paper`` in a child process without
``TRITON_INTERPRET`` (the floor environment is the one ``.ci/run-triton-floor`` makes). Without
``--write`` the section is printed. With ``--write`` it replaces the text between the markers
``<!-- compile-report:start -->`` and ``<!-- compile-report:end -->`` (appended with them when absent).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from lstmem_kernels.aot import kernel_resources

START, END = "<!-- compile-report:start -->", "<!-- compile-report:end -->"
TARGETS = ("sm_90a", "sm_80")


def compile_with(python: str, which: str) -> dict:
    """The ``lstmem_kernels.aot`` report of ``python`` for the set ``which``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [python, "-m", "lstmem_kernels.aot", "--set", which, "--json", str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if not out.exists():
            sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        print(proc.stdout, file=sys.stderr)
        return json.loads(out.read_text())


def short(kernel: str) -> str:
    module, name = kernel.split(":")
    return f"`{module.removeprefix('lstmem_kernels.')}.{name}`"


def cell(res: dict | None) -> str:
    if res is None:
        return "—"
    if res["error"]:
        return "error"
    spill = res["spill_stores"] + res["spill_loads"]
    text = f"{res['registers']} / {spill} / {res['smem']} / {res['blocks_per_sm']}"
    return f"**{text}**" if spill or res["blocks_per_sm"] < 1 else text


def section(reports: list[dict], command: str) -> str:
    """The Markdown section: conditions, a per-kernel summary, then every distinct launch."""
    columns = [(r["triton"], t) for r in reports for t in TARGETS]
    by_version = {r["triton"]: r for r in reports}
    lines = [
        START,
        "## Triton kernels compiled ahead of time for sm_90a and sm_80",
        "",
        f"Made by `{command}` on {reports[0]['machine']}, {reports[0]['date']}, torch {reports[0]['torch']}, "
        + ", ".join(f"Triton {r['triton']}" for r in reports)
        + ". Each Triton compiles with the `ptxas` its wheel ships. `lstmem_kernels.aot` drives the public "
        "entry points (`lstmem_scan` forward and backward, `lstmem_step`, `lstmem_decode_step`) through their "
        "real host code at the paper's sizes (n_h 4, r 8, d 2,560, T 2,048; batch 1 and 4 for the scan, "
        "1 and 8 for the steps) over every pair of flag and dtype values, captures each launch, and "
        "compiles every distinct one (kernel, signature, constexprs, attributes, options) to a cubin. "
        "No GPU ran anything: these are the compiler's figures, not measurements of a run. "
        "`tests/test_gpu_compile.py` fails on a compile error, a spill at these sizes, shared memory over "
        "the per-block limit (227 KiB on sm_90, 163 KiB on sm_80) or no block resident per SM.",
        "",
    ]
    for r in reports:
        where = sorted({short(p.split(" [")[0]) for p in r["problems"]})
        lines.append(
            f"- Triton {r['triton']}: {r['calls']} calls, {r['launches']} launches, {r['distinct']} distinct "
            f"binaries ({r['distinct_coarse']} by kernel, signature, constexprs and num_warps); "
            f"{len(r['problems'])} problems" + (f" ({', '.join(where)}; in bold below)" if where else "")
        )
    lines += [
        "",
        "Per kernel: distinct launches, registers per thread (least–most), the largest spill (bytes "
        "stored + loaded per thread), the most shared memory per block (bytes, static + dynamic) and the "
        "fewest resident blocks per SM.",
        "",
        "| kernel | Triton | target | launches | registers | spill | shared memory | blocks/SM |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    kernels = sorted({row["kernel"] for r in reports for row in r["results"]})
    for kernel in kernels:
        for version, target in columns:
            n, k = kernel_resources(by_version[version], kernel, target)
            if k is None:
                lines.append(f"| {short(kernel)} | {version} | {target} | {n} | error | | | |")
                continue
            lines.append(
                f"| {short(kernel)} | {version} | {target} | {n} | {k['registers'][0]}–{k['registers'][1]} | "
                f"{k['spill']} | {k['smem']} | {k['blocks_per_sm']} |"
            )
    header = " | ".join(f"{t} {v}" for v, t in columns)
    lines += [
        "",
        "<details><summary>Every distinct launch: registers / spill bytes / shared memory bytes / blocks per "
        "SM</summary>",
        "",
        "A launch is named by its pointer dtypes, its true flags, its other integer constexprs (Triton turns "
        "an integer argument equal to 1, such as a unit stride, into one) and its warps; the call that first "
        "made it is its example. — : that Triton made no such launch.",
        "",
        f"| kernel | launch | first made by | {header} |",
        "| --- | --- | --- | " + " | ".join("---:" for _ in columns) + " |",
    ]
    keyed: dict[tuple[str, str], dict] = {}
    for r in reports:
        for row in r["results"]:
            entry = keyed.setdefault((row["kernel"], row["describe"]), {"label": row["label"]})
            for target in TARGETS:
                entry[(r["triton"], target)] = row["targets"][target]
    for (kernel, describe), entry in sorted(keyed.items()):
        cells = " | ".join(cell(entry.get(col)) for col in columns)
        lines.append(f"| {short(kernel)} | {describe} | {entry['label']} | {cells} |")
    lines += ["", "</details>", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", help="an interpreter to compile with (repeatable)")
    parser.add_argument("--set", dest="which", default="paper", choices=("fast", "paper", "edge", "full"))
    parser.add_argument("--write", help="the Markdown file whose marked section is replaced")
    args = parser.parse_args(argv)
    pythons = args.python or [sys.executable]
    reports = [compile_with(py, args.which) for py in pythons]
    command = "python benchmarks/compile_report.py " + " ".join(f"--python {p}" for p in pythons)
    if args.which != "paper":
        command += f" --set {args.which}"
    if args.write:
        command += f" --write {args.write}"
    text = section(reports, command)
    if not args.write:
        print(text)
        return 0
    path = Path(args.write)
    doc = path.read_text()
    if START in doc and END in doc:
        doc = doc[: doc.index(START)] + text + doc[doc.index(END) + len(END) :]
    else:
        doc = doc.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(doc)
    print(f"wrote the section of {path} ({datetime.date.today()}, {platform.node()})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
