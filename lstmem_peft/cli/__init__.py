"""The ``lstmem`` command (:mod:`.commands`, its arguments in :mod:`.parser`) and what only it runs,
one subpackage an application: the demo (:mod:`.demo`: the command, recall, conversation, training
and sweep), the benchmarks (:mod:`.bench`: the benchmarks, the GPU suite with its decode variants,
their records and report, their default sizes and progress bars) and the GPU acceptance run
(:mod:`.gpu`: the runner, its kernel and model checks, cases, timings, step limits and table).
Beside them: :mod:`.eval_rows` (``lstmem eval ... --rows``) and :mod:`.quiet`, which keeps upstream
deprecations and loading bars off the terminal (the command and the examples only). Nothing else of
the package imports this folder.

Building the parser imports neither torch nor PEFT (``lstmem --version`` and ``--help`` answer at
once); each subcommand imports what it runs when it runs (tests/test_startup.py holds this)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The ``lstmem`` command (:func:`lstmem_peft.cli.commands.main`): ``argv`` without the program
    name (default: ``sys.argv[1:]``) -> exit status."""
    from .commands import main as run

    return run(argv)
