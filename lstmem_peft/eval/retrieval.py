"""The retrieval baseline of the ``bm25`` row: BM25 over a history's turns, with ``bm25s``.

Each history's turns (:attr:`~lstmem_peft.eval.protocol.History.turns`) are one small index; a
question retrieves its ``top_k`` turns by BM25 score (Lucene's variant, bm25s's defaults ``k1=1.5``,
``b=0.75``). Words are lower-cased, split on ``\\b\\w\\w+\\b``, English stop words dropped and Porter
stems taken (nltk's stemmer, which the scorers already use). Turns that share no word with the
question (score 0) are not returned, so fewer than ``top_k`` may come back.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from lstmem_peft.utils.extras import missing_extra


@lru_cache(maxsize=1)
def _stemmer():
    from nltk.stem import PorterStemmer

    stem = PorterStemmer().stem
    return lambda words: [stem(word) for word in words]


def _tokens(texts: Sequence[str]) -> list[list[str]]:
    import bm25s

    return bm25s.tokenize(
        list(texts), stopwords="en", stemmer=_stemmer(), return_ids=False, show_progress=False
    )


class TurnIndex:
    """A BM25 index over one history's turns.

    Args:
        turns: the turns' texts; :meth:`top` returns indices into this list.
    """

    def __init__(self, turns: Sequence[str]) -> None:
        try:
            import bm25s
        except ModuleNotFoundError as err:
            raise missing_extra(err, "eval", "The bm25 row (BM25 over a history's turns)") from err
        self.size = len(turns)
        self.retriever = bm25s.BM25()
        if self.size:
            self.retriever.index(_tokens(turns), show_progress=False)

    def top(self, query: str, k: int) -> list[tuple[int, float]]:
        """The ``k`` best turns for ``query`` as ``(index, score)``, best first, scores above 0 only
        (ties: the earlier turn first)."""
        if k < 1 or self.size == 0:
            return []
        query_tokens = _tokens([query])
        if not query_tokens[0]:
            return []
        scores = self.retriever.get_scores(query_tokens[0])
        ranked = sorted(range(self.size), key=lambda i: (-float(scores[i]), i))
        return [(i, float(scores[i])) for i in ranked[:k] if scores[i] > 0]
