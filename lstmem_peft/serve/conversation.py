"""Message identity in a session's record: the hash a chat message is recorded under, and the
tokens of a prompt after the text a session already took in (:mod:`.planning` matches requests
against the record with them)."""

from __future__ import annotations

import hashlib
import json


def message_hash(role: str, content: str) -> str:
    """The identity of a chat message in a session's record (role and exact content)."""
    return hashlib.sha256(json.dumps([role, content]).encode()).hexdigest()[:32]


def tokens_after(tokenizer, ids: list[int], chars: int) -> list[int] | None:
    """The tokens of ``ids`` after its first ``chars`` characters of decoded text, or ``None`` when
    no token boundary falls exactly there (a token-id prompt that extends a text written before)."""
    lo, hi = 0, len(ids)
    while lo < hi:  # the fewest leading tokens whose text reaches ``chars``
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=False)) >= chars:
            hi = mid
        else:
            lo = mid + 1
    if len(tokenizer.decode(ids[:lo], skip_special_tokens=False)) != chars:
        return None
    return ids[lo:]
