"""What the ``lstmem`` command runs once :func:`lstmem_cli.main` has parsed its command line and set
its filters: :mod:`.commands` (each subcommand, :data:`.commands.RUNNERS`) and, one subpackage an
application, the demo (:mod:`.demo`: the command, recall, conversation, training and sweep), the
benchmarks (:mod:`.bench`: the benchmarks, the GPU suite with its decode variants, their records and
report, their default sizes and progress bars) and the GPU acceptance run (:mod:`.gpu`: the runner,
its kernel and model checks, cases, timings, step limits and table). Beside them: :mod:`.eval_rows`
(``lstmem eval ... --rows``) and :mod:`.models` (``lstmem models``). Nothing else of the package
imports this folder.

The command's front (its parser, ``--version`` and the warning filters) is the top-level
:mod:`lstmem_cli`, which imports this folder only to run a subcommand."""
