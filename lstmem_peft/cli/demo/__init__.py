"""``lstmem demo``, the offline recall demo: the command in :mod:`.command` (its settings, tables and
episodes), the task and its measurements in :mod:`.recall`, recall over a served conversation in
:mod:`.conversation`, how the shipped backbone and adapters were made in :mod:`.training` (``python
-m lstmem_peft.cli.demo build``, :mod:`.__main__`) and recall against history length in :mod:`.sweep`.
Import the module that holds a name; this file imports nothing, so the parser stays light."""
