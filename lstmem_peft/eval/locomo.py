"""LoCoMo scoring, following the official LoCoMo scorer's rules.

* normalisation: commas removed, lower-cased, punctuation removed, the words ``a``, ``an``,
  ``the`` and ``and`` removed, whitespace folded;
* tokens Porter-stemmed (nltk, a hard dependency so a score never depends on an optional import);
* token F1 between prediction and gold;
* category 1 (multi-hop) is multi-answer: prediction and gold are split on commas, and the score is
  the mean over gold parts of the best F1 against any predicted part;
* category 3 (open-domain) scores against the gold text before the first ``;``;
* categories 2 (temporal) and 4 (single-hop): plain token F1. Category 5 is not scored.
"""

from __future__ import annotations

from functools import lru_cache

from nltk.stem import PorterStemmer

from .text import squad_normalize, token_f1, tokens

SCORED_CATEGORIES = (1, 2, 3, 4)
CATEGORY_NAMES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
_STEMMER = PorterStemmer()


@lru_cache(maxsize=65536)
def _stem(word: str) -> str:
    return _STEMMER.stem(word)


def normalize(text: str) -> str:
    """LoCoMo's answer normalisation (commas and the words a/an/the/and removed)."""
    return squad_normalize(str(text).replace(",", ""), articles=("a", "an", "the", "and"))


def f1(prediction: str, gold: str) -> float:
    """Token F1 of Porter-stemmed, normalised tokens."""
    return token_f1(tokens(prediction, normalize, _stem), tokens(gold, normalize, _stem))


def score_answer(prediction: str, answer: str, category: int) -> float:
    """Score one LoCoMo answer (categories 1-4) in [0, 1]."""
    if category not in SCORED_CATEGORIES:
        raise ValueError(f"LoCoMo category {category} is not scored (categories 1-4; 5 is adversarial)")
    prediction, answer = str(prediction), str(answer)
    if category == 1:
        predictions = [p.strip() for p in prediction.split(",")]
        golds = [g.strip() for g in answer.split(",")]
        return sum(max(f1(p, g) for p in predictions) for g in golds) / len(golds)
    if category == 3:
        answer = answer.split(";")[0].strip()
    return f1(prediction, answer)


def aggregate(scores: list[tuple[int, float]]) -> dict:
    """Question-weighted means per category and overall from ``(category, score)`` pairs."""
    by_category: dict[int, list[float]] = {}
    for category, score in scores:
        by_category.setdefault(category, []).append(score)
    result = {
        CATEGORY_NAMES[c]: {"score": sum(v) / len(v), "questions": len(v)} for c, v in sorted(by_category.items())
    }
    total = sum(len(v) for v in by_category.values())
    result["overall"] = {"score": sum(s for _, s in scores) / total if total else 0.0, "questions": total}
    return result
