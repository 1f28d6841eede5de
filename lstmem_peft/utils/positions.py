"""How many positions a backbone was trained for: a fact of its config that serving (the context
window it may prompt with) and the demo's build (which records it) read the same way."""

from __future__ import annotations

#: The backbone config key (in its ``config.json``) that records how many positions it was trained
#: for, when ``max_position_embeddings`` says more: the embedded demo's says 64 (its config allows
#: 4,096). Set it on a backbone of your own that was trained on shorter (or, with rope scaling,
#: longer) sequences than the rest of its config tells.
TRAINED_POSITIONS_KEY = "lstmem_trained_positions"
#: Rope types that stretch a model past the length it was trained at when it runs, without training
#: at the new length (the Qwen and SmolLM3 guides add ``yarn`` to a config for long inputs): their
#: ``original_max_position_embeddings`` is what the model was trained for. ``llama3`` (Llama 3.1+)
#: and ``longrope`` (Phi-3) describe a long-context stage that was trained: there the config's
#: ``max_position_embeddings`` is.
UNTRAINED_ROPE_TYPES = frozenset({"linear", "dynamic", "yarn"})


def trained_positions(config) -> tuple[int | None, str]:
    """How many positions a backbone was trained for, and the config key that says so.

    In order:

    1. ``lstmem_trained_positions`` (:data:`TRAINED_POSITIONS_KEY`), when the config has it: a
       recorded fact beats what the architecture allows (the embedded demo's backbone: 64 of 4,096);
    2. the rope parameters' ``original_max_position_embeddings``, when the rope type is one that
       stretches a model at run time (:data:`UNTRAINED_ROPE_TYPES`) and it is below
       ``max_position_embeddings`` (the smallest over per-layer-type rope parameters);
    3. ``max_position_embeddings`` (a Hub backbone's config states the length it was trained for).

    Args:
        config: a transformers config (``model.config`` or ``AutoConfig.from_pretrained``), or ``None``.

    Returns:
        ``(positions, key)``; ``(None, "")`` when the config has none of them.

    Raises:
        ValueError: ``lstmem_trained_positions`` is not a positive integer.
    """
    if config is None:
        return None, ""
    recorded = getattr(config, TRAINED_POSITIONS_KEY, None)
    if recorded is not None:
        if isinstance(recorded, bool) or not isinstance(recorded, int) or recorded < 1:
            raise ValueError(
                f"the backbone's config.json has {TRAINED_POSITIONS_KEY}={recorded!r}; it must be a positive "
                "integer (the positions the backbone was trained for), or be left out"
            )
        return recorded, TRAINED_POSITIONS_KEY
    limit = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None) or vars(config).get("rope_scaling") or {}
    # one rope parameter dict, or one per layer type ({"full_attention": {...}, ...})
    params = (
        [rope] if "rope_type" in rope or "type" in rope else [v for v in rope.values() if isinstance(v, dict)]
    )
    stretched = [
        p["original_max_position_embeddings"]
        for p in params
        if p.get("rope_type", p.get("type")) in UNTRAINED_ROPE_TYPES
        and isinstance(p.get("original_max_position_embeddings"), int)
    ]
    if stretched and (limit is None or min(stretched) < limit):
        return min(stretched), "rope_parameters.original_max_position_embeddings"
    return (limit, "max_position_embeddings") if limit is not None else (None, "")
