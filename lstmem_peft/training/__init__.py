"""Training: episodes and their formats (:mod:`.data`), the TRL trainer (:mod:`.trainer`) and the
adapter's model card (:mod:`.card`). Imports ``tuner``, ``memory`` and ``utils``."""
