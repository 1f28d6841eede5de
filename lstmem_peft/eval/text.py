"""Answer normalisation and token F1 shared by the QA scorers."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Iterable

_PUNCTUATION = set(string.punctuation)


def squad_normalize(text: str, articles: Iterable[str] = ("a", "an", "the")) -> str:
    """Lower-case, drop punctuation, drop the given articles as whole words, fold whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    words = r"\b(" + "|".join(map(re.escape, articles)) + r")\b"
    text = re.sub(words, " ", text)
    return " ".join(text.split())


def token_f1(prediction_tokens: list[str], gold_tokens: list[str]) -> float:
    """Harmonic mean of token precision and recall (multiset overlap); 0 when nothing overlaps."""
    common = Counter(prediction_tokens) & Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def tokens(
    text: str, normalize: Callable[[str], str], transform: Callable[[str], str] | None = None
) -> list[str]:
    words = normalize(text).split()
    return [transform(w) for w in words] if transform else words
