"""The memory itself, independent of PEFT and transformers: the paper's constants, one memory
layer's math (:mod:`.layer`, whose decode step is the kernel family's ``lstmem_decode_step``; the
weights and outputs its paths share, :mod:`.layer_common`)
and its float64 reference (:mod:`.reference`), block-end feedback, the states
(:class:`~lstmem_peft.memory.cache.MemoryCache`) and the two kinds of storage a forward reads and
writes them in (:mod:`.storage`: a cache's dense rows, a serving engine's slot tables), one forward
of the memory stack (:class:`~lstmem_peft.memory.engine.MemoryPass`; over slot tables it keeps the
feedback samples of history blocks that span several forwards, :mod:`.chunks`), the adapter's saved
files and the memory stack its config describes (:class:`~lstmem_peft.memory.spec.MemorySpec`, with
:func:`~lstmem_peft.memory.spec.memory_layer`, the one factory of a memory layer), and the rule for
naming a session's memory on disk with the one atomic, fsynced writer both servers use
(:mod:`.sessions`). Imports only ``lstmem_kernels`` and ``utils``."""
