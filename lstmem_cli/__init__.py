"""The ``lstmem`` command's front: what runs before the library loads.

:func:`main` parses the command line (:mod:`.parser`: ``--version``, ``--help`` and every
subcommand's ``--help`` answer there, with neither torch, PEFT, transformers nor ``lstmem_peft``
imported), sets the command's warning and log filters (:mod:`.quiet`: they must be in place before
PEFT's import, which makes the quantisation backends log), then imports the library's
:mod:`lstmem_peft.cli.commands` and runs the subcommand. This package imports nothing of
``lstmem_peft`` at module level (tests/test_startup.py holds this).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The ``lstmem`` command: ``argv`` without the program name (default: ``sys.argv[1:]``) -> exit
    status (usage errors, ``--help`` and ``--version`` exit through argparse's ``SystemExit``)."""
    from .parser import build_parser
    from .quiet import quiet_command

    args = build_parser().parse_args(argv)
    quiet_command(loads_models=loads_models(args))
    from lstmem_peft.cli.commands import run  # the library: torch, PEFT and transformers load here

    return run(args)


#: The subcommands that load a model with transformers (``lstmem bench report`` aside): its loading bars off.
LOADS_MODELS = frozenset({"demo", "bench", "eval", "serve"})


def loads_models(args) -> bool:
    """Whether the command loads a model with transformers (``lstmem models prepare`` checks the one it
    converts by loading it): only then are transformers' loading bars turned off (importing it)."""
    if args.command == "models":
        return args.action == "prepare"
    return args.command in LOADS_MODELS and getattr(args, "kind", None) != "report"
