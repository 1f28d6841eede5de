"""The ``lstmem`` command (:mod:`.commands`, its arguments in :mod:`.parser`) and what only it runs:
the demo (:mod:`.demo`, with :mod:`.demo_recall`, :mod:`.demo_training` and :mod:`.demo_sweep`) and
the benchmarks (:mod:`.bench`, :mod:`.bench_gpu`, their records and report in :mod:`.bench_records`).
Nothing else of the package imports this folder.

Building the parser imports neither torch nor PEFT (``lstmem --version`` and ``--help`` answer at
once); each subcommand imports what it runs when it runs (tests/test_startup.py holds this)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The ``lstmem`` command (:func:`lstmem_peft.cli.commands.main`): ``argv`` without the program
    name (default: ``sys.argv[1:]``) -> exit status."""
    from .commands import main as run

    return run(argv)
