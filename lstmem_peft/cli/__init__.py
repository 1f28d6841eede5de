"""The ``lstmem`` command (:mod:`.commands`) and what only it runs: the demo builder and sweep
(:mod:`.demo`) and the benchmarks (:mod:`.bench`, :mod:`.bench_gpu`). Nothing else of the package
imports this folder."""
