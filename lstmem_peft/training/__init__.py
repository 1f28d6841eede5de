"""Training: episodes and their formats (:mod:`.data`), English memory episodes with a held-out
split and a curriculum (:mod:`.english`), the TRL trainer (:mod:`.trainer`), the
memory a training setting needs (:mod:`.memory_plan`), the adapter's model card (:mod:`.card`) and the
stage-2 Long dataset (:mod:`.long_data`). Imports ``tuner``, ``memory`` and ``utils``."""
