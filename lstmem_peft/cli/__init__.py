"""The ``lstmem`` command (:mod:`.commands`, its arguments in :mod:`.parser`) and what only it runs:
the demo (:mod:`.demo`, with :mod:`.demo_recall`, :mod:`.demo_conversation`, :mod:`.demo_training`
and :mod:`.demo_sweep`), the benchmarks (:mod:`.bench`, :mod:`.bench_gpu` with
:mod:`.gpu_decode_variants`, their records and report in :mod:`.bench_records`, their default sizes
and progress bars in :mod:`.bench_settings`) and the GPU
acceptance (:mod:`.gpu_acceptance`, its checks in :mod:`.gpu_kernel_checks` and
:mod:`.gpu_model_checks`, with :mod:`.gpu_cases`, :mod:`.gpu_timings`, :mod:`.gpu_step_limits` and
:mod:`.gpu_table`). :mod:`.quiet` keeps upstream deprecations and loading bars off the terminal
(the command and the examples only). Nothing else of the package imports this folder.

Building the parser imports neither torch nor PEFT (``lstmem --version`` and ``--help`` answer at
once); each subcommand imports what it runs when it runs (tests/test_startup.py holds this)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The ``lstmem`` command (:func:`lstmem_peft.cli.commands.main`): ``argv`` without the program
    name (default: ``sys.argv[1:]``) -> exit status."""
    from .commands import main as run

    return run(argv)
