"""The ``lstmem`` command (:mod:`.commands`, its arguments in :mod:`.parser`) and what only it runs:
the demo (:mod:`.demo`, with :mod:`.demo_recall`, :mod:`.demo_training` and :mod:`.demo_sweep`) and
the benchmarks (:mod:`.bench`, :mod:`.bench_gpu`, their records and report in :mod:`.bench_records`).
Nothing else of the package imports this folder."""
