"""``lstmem bench``: the benchmarks in :mod:`.command` (decode, write, e2e, generate, ops, scan),
the GPU suite in :mod:`.gpu_suite` with one decode variant timed in :mod:`.decode_variants`, the
records, ``RESULTS.md`` and plots in :mod:`.records`, default sizes and progress bars in
:mod:`.settings`. Import the module that holds a name; this file imports nothing, so the parser
stays light."""
