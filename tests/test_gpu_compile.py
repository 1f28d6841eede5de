"""Every Triton launch the kernels' host code makes, compiled ahead of time on the CPU for ``sm_90a``
and ``sm_80`` with Triton's own ``ptxas`` (:mod:`lstmem_kernels.aot`): no compile error, no spill at
the paper's sizes, shared memory within the per-block limit, at least one block resident per SM.

The compile runs in a child process without ``TRITON_INTERPRET``: ``conftest.py`` sets it for this
process, and kernels imported under the interpreter are not compilable ``JITFunction`` objects. The
fast tier compiles a representative subset (every kernel, the heaviest flags, the paper's sizes and
``T = 1``; about 30 s on 2 cores); the slow tier the whole set (the paper's sizes over every pair of
flag and dtype values, the kernel tests' edge sizes; about 3.5 minutes on 2 cores). ``.ci/run`` runs
both with the pinned Triton, ``.ci/run-triton-floor`` with the lowest one the ``triton`` extra admits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lstmem_kernels import aot, aot_drive

triton = pytest.importorskip("triton")

from lstmem_kernels import triton_common  # noqa: E402

# @triton.jit functions that the host code never launches: the probe that asks triton.jit whether the
# interpreter is on (lstmem_kernels.triton_common).
NOT_LAUNCHED = {"lstmem_kernels.triton_common:_probe"}


def _ptxas_missing() -> str | None:
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists():
        return f"Triton {triton.__version__} ships no ptxas in {bin_dir} (not a Linux x86-64/aarch64 wheel?)"
    return None


needs_ptxas = pytest.mark.skipif(_ptxas_missing() is not None, reason=str(_ptxas_missing()))


def compile_set(which: str, tmp_path: Path, timeout: int) -> dict:
    """Run ``python -m lstmem_kernels.aot --set which`` in a child without the interpreter; its report."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / f"{which}.json"
    cmd = [sys.executable, "-m", "lstmem_kernels.aot", "--set", which, "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.exists(), (
        f"{' '.join(cmd)} wrote no report (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
    report = json.loads(out.read_text())
    print(proc.stdout)  # the per-kernel summary, shown with -s or on failure
    return report


def assert_every_launch_fits(report: dict) -> None:
    assert not report["problems"], f"{len(report['problems'])} problems:\n" + "\n".join(report["problems"])
    missing = set(report["kernels_defined"]) - NOT_LAUNCHED - set(report["kernels_seen"])
    assert not missing, f"@triton.jit kernels never launched by the host code driven here: {sorted(missing)}"
    assert report["distinct"] >= len(report["kernels_seen"]) and report["launches"] >= report["distinct"]
    assert any(row["paper"] for row in report["results"])
    for row in report["results"]:
        assert set(row["targets"]) == {"sm_90a", "sm_80"}
        for target, res in row["targets"].items():
            assert res["cubin_bytes"] > 0 and res["registers"] > 0, (row["kernel"], target, res)


@needs_ptxas
def test_a_representative_subset_compiles_for_sm90a_and_sm80_without_spills(tmp_path):
    assert_every_launch_fits(compile_set("fast", tmp_path, timeout=900))


@pytest.mark.slow
@needs_ptxas
def test_every_launch_at_the_paper_and_edge_sizes_compiles_for_sm90a_and_sm80_without_spills(tmp_path):
    report = compile_set("full", tmp_path, timeout=2400)
    assert_every_launch_fits(report)
    for entry in ("scan", "step", "decode"):  # every public entry point made binaries at the paper's sizes
        assert any(row["paper"] and row["label"].startswith(f"{entry} ") for row in report["results"]), entry
    assert any(row["label"].startswith("scan B=2 T=1 ") for row in report["results"])  # the edge sizes too


# ---------------------------------------------------------------------- the checks themselves
def launch(paper: bool, num_warps: int = 4) -> aot.Launch:
    return aot.Launch(
        kernel="m:k", signature={"x": "*fp32"}, constexprs={}, attrs={}, options={"num_warps": num_warps},
        fn=None, paper=paper,
    )  # fmt: skip


def test_occupancy_counts_registers_threads_and_shared_memory():
    sm90 = aot.LIMITS["sm_90a"]
    # 64 registers x 128 threads = 8,192 per block: 8 blocks by registers, 16 by threads
    assert aot.occupancy(64, 4, 0, sm90) == (8, "registers")
    # 255 registers (rounded to 256 per thread) x 256 threads = 65,536: one block
    assert aot.occupancy(255, 8, 0, sm90) == (1, "registers")
    # 255 registers x 512 threads does not fit in 64K registers
    assert aot.occupancy(255, 16, 0, sm90)[0] == 0
    # 100 KiB of shared memory (+1 KiB reserved): two blocks on a 228 KiB SM, one on a 164 KiB one
    assert aot.occupancy(32, 1, 100 * 1024, sm90) == (2, "shared memory")
    assert aot.occupancy(32, 1, 100 * 1024, aot.LIMITS["sm_80"]) == (1, "shared memory")
    # over the per-block limit: none
    assert aot.occupancy(32, 1, 228 * 1024, sm90)[0] == 0
    assert aot.occupancy(16, 1, 0, sm90) == (32, "blocks")


def test_problems_flag_errors_spills_at_the_paper_sizes_shared_memory_and_occupancy():
    ok = aot.Compiled("sm_80", registers=40, blocks_per_sm=32)
    assert aot.problems(launch(True), ok) == []
    spill = aot.Compiled("sm_80", registers=255, spill_stores=8, spill_loads=8, blocks_per_sm=1)
    assert "spills" in aot.problems(launch(True), spill)[0]
    assert aot.problems(launch(False), spill) == []  # spills only fail at the paper's sizes
    smem = aot.Compiled("sm_80", registers=32, smem_dynamic=164 * 1024, blocks_per_sm=0)
    found = aot.problems(launch(False), smem)
    assert any("over 166912 per block" in p for p in found) and any("no block fits" in p for p in found)
    assert "compile error" in aot.problems(launch(False), aot.Compiled("sm_90a", error="boom"))[0]


def test_pairwise_covers_every_pair_of_values_and_both_extremes():
    factors = {"dtype": ["f32", "bf16", "f16"], "a": [False, True], "b": [None, "x", "y"], "c": [False, True]}
    rows = aot_drive.pairwise(factors)
    names = list(factors)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            for u in factors[first]:
                for v in factors[second]:
                    assert any(r[first] == u and r[second] == v for r in rows), (first, u, second, v)
    assert aot_drive.extremes(factors)[0] in rows and aot_drive.extremes(factors)[1] in rows
    assert len(rows) < 3 * 2 * 3 * 2  # fewer than the product


@pytest.mark.skipif(not triton_common.INTERPRETED, reason="the interpreter is off in this process")
def test_capture_refuses_kernels_imported_under_the_interpreter():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        with aot.capture_launches():
            pass
