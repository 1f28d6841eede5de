"""``lstmem bench gpu --acceptance``, the GPU acceptance run (docs/gpu.md): the runner in
:mod:`.acceptance`, its checks in :mod:`.kernel_checks` and :mod:`.model_checks`, how a case passes
in :mod:`.cases`, timings in :mod:`.timings`, a step's time limit in :mod:`.step_limits` and the
closing table in :mod:`.table`. Import the module that holds a name; this file imports nothing, so
the parser stays light."""
