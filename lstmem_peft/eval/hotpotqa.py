"""HotpotQA answer scoring: exact match and token F1 with SQuAD-style normalisation.

As in the official HotpotQA evaluation, a yes/no/noanswer answer gets F1 0 unless the prediction
normalises to the same word.
"""

from __future__ import annotations

from .text import squad_normalize, token_f1

_SPECIAL = ("yes", "no", "noanswer")


def exact_match(prediction: str, gold: str) -> float:
    return float(squad_normalize(prediction) == squad_normalize(gold))


def f1(prediction: str, gold: str) -> float:
    pred, ref = squad_normalize(prediction), squad_normalize(gold)
    if (pred in _SPECIAL or ref in _SPECIAL) and pred != ref:
        return 0.0
    return token_f1(pred.split(), ref.split())


def score_answer(prediction: str, gold: str) -> dict[str, float]:
    """``{"em": ..., "f1": ...}`` for one question."""
    return {"em": exact_match(prediction, gold), "f1": f1(prediction, gold)}
