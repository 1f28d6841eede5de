"""Answer scorers of each benchmark under its two protocols, ``official`` and ``paper``.

``official`` is the benchmark's own released evaluation code; ``paper`` is the code the LSTMem paper
names for its numbers (δ-Mem's evaluation code, which the paper says it left unchanged). Every
function here is a pure function of the reply and the gold answer(s): the rules are restated below
in our own words, and ``tests/test_scorers.py`` checks each against values worked out by hand from
the rules.

MemoryAgentBench, official (``utils/eval_other_utils.py`` of HUST-AI-HYZ/MemoryAgentBench):

* normalisation (:func:`mab_normalize`): lower-case, drop ASCII punctuation, drop the words
  a/an/the, fold whitespace;
* the *parsed* reply (:func:`mab_parse_reply`): the rest of the line after the first
  ``Answer:`` (any case), else the reply's first line; stripped, one more leading ``Answer:``
  removed;
* per-source field (:func:`mab_official_score`): RULER QA, LongMemEval and FactConsolidation score
  ``substring_exact_match`` (the normalised gold is a *character* substring of the normalised
  reply), the better of the whole reply and the parsed reply; EventQA the same on the parsed reply
  only; in-context classification strict exact match on the parsed reply only; Detective QA strict
  exact match, the better of whole and parsed; InfiniteBench summarisation token F1 (with the
  SQuAD rule that yes/no/noanswer must match exactly), the better of whole and parsed;
  ReDial ``recsys_recall@5`` (:func:`redial_recall_at_5`). Several golds: the best over them.
* ReDial: the reply is split after its first ``1.``; every line of the rest (blank ones
  included) is cleaned (parenthesised parts, leading numbering) and snapped to the catalogue title
  at the smallest edit distance (lower-cased); duplicates are kept; recall@5 is the fraction of
  gold titles among the first five snapped titles, each gold counted as often as it is listed.

MemoryAgentBench, paper (``deltamem/eval/benchmark_compare.py`` of declare-lab/delta-Mem):

* normalisation (:func:`span_normalize`): lower-case, drop the words a/an/the, replace every
  non-word, non-space character with a space, fold whitespace;
* accuracy (:func:`mab_paper_correct`): an alias is matched when its normalised form equals the
  normalised first non-blank line or the normalised reply, or is a character substring of the
  normalised reply; aliases are de-duplicated by normalised form and empty ones dropped;
* F1 (:func:`span_f1`, InfiniteBench summarisation): the best over the reply and its first line,
  rounded to 4 decimals; ReDial uses the official recall@5 on the de-duplicated gold ids.

LoCoMo, official (``task_eval/evaluation.py`` of snap-research/locomo): commas removed, lower-case,
punctuation removed, the words a/an/the/and removed with the ``regex`` module's (Unicode) word
boundaries, whitespace folded, Porter stems, token F1; category 1 splits both sides on commas and
averages over gold parts the best F1 against any predicted part; category 3 scores against the gold
before its first ``;``. LoCoMo, paper (``deltamem/eval/locomo_protocol.py``): the reply is cut to its
first non-blank line, lower-cased, ``(a)``/``(b)``/``a)``/``b)``/``answer:`` removed; the text is
NFD-normalised before the same normalisation; empty sides score 0; empty comma parts are dropped; each
question's score is rounded to 4 decimals.

HotpotQA, official (``hotpot_evaluate_v1.py`` of hotpotqa/hotpot): SQuAD normalisation, exact match,
token F1 where a yes/no/noanswer on either side must match exactly. HotpotQA, paper
(``benchmark_compare.py``): the reply's first non-blank line, :func:`span_normalize`, exact match and
token F1 (both sides empty: 1, one empty: 0), F1 rounded to 4 decimals.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from typing import Any

from lstmem_peft.utils.extras import missing_extra

try:
    import regex
    from nltk.stem import PorterStemmer
except ModuleNotFoundError as err:
    raise missing_extra(err, "eval", "LSTMem evaluation (lstmem_peft.eval)") from err

PROTOCOLS = ("official", "paper")
_PUNCTUATION = frozenset(string.punctuation)
_SPECIAL = ("yes", "no", "noanswer")


def check_protocol(protocol: str) -> str:
    """``protocol`` if it is one of :data:`PROTOCOLS`, else a ValueError naming them."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    return protocol


def _f1_of(pred: list[str], gold: list[str]) -> float:
    common = Counter(pred) & Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def flatten_golds(golds: Any) -> list[str]:
    """Gold answers as a flat list of strings (a string, a list, or a list of lists)."""
    if isinstance(golds, str):
        return [golds]
    out: list[str] = []
    for item in golds or []:
        out.extend(flatten_golds(item) if isinstance(item, (list, tuple)) else [str(item)])
    return out


def first_line(text: str) -> str:
    """The first non-blank line, stripped (the whole text stripped when every line is blank)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else text.strip()


# ====================================================================== MemoryAgentBench, official
def mab_normalize(text: str) -> str:
    """MemoryAgentBench's normalisation: lower-case, no punctuation, no a/an/the, folded spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


_ANSWER_LINE = re.compile(r"Answer:(.*)", re.IGNORECASE)
_LEADING_ANSWER = re.compile(r"^Answer:", re.IGNORECASE)


def mab_parse_reply(reply: str) -> str:
    """The *parsed* reply: the rest of the line after the first ``Answer:`` (any case), else the
    first line (possibly empty); stripped, then one leading ``Answer:`` and spaces removed."""
    found = _ANSWER_LINE.search(reply)
    text = found.group(1) if found else reply.split("\n", 1)[0]
    return _LEADING_ANSWER.sub("", text.strip()).strip()


def mab_exact_match(reply: str, gold: str) -> float:
    return float(mab_normalize(reply) == mab_normalize(gold))


def mab_substring_match(reply: str, gold: str) -> float:
    """1.0 when the normalised gold is a character substring of the normalised reply."""
    return float(mab_normalize(gold) in mab_normalize(reply))


def mab_f1(reply: str, gold: str) -> float:
    """SQuAD token F1 on :func:`mab_normalize` tokens; yes/no/noanswer must match exactly."""
    pred, ref = mab_normalize(reply), mab_normalize(gold)
    if (pred in _SPECIAL or ref in _SPECIAL) and pred != ref:
        return 0.0
    return _f1_of(pred.split(), ref.split())


def _best(metric: Callable[[str, str], float], replies: Sequence[str], golds: Any) -> float:
    golds = flatten_golds(golds)
    if not golds:
        raise ValueError("a MemoryAgentBench question needs at least one gold answer")
    return max(metric(reply, gold) for reply in replies for gold in golds)


MAB_OFFICIAL_FIELDS = {  # source prefix -> (official metric field, which replies are scored)
    "eventqa": ("substring_exact_match", "parsed"),
    "icl_": ("exact_match", "parsed"),
    "detective_qa": ("exact_match", "both"),
    "infbench_sum": ("f1", "both"),
    "recsys_redial": ("recsys_recall@5", "list"),
    "ruler_qa": ("substring_exact_match", "both"),
    "longmemeval": ("substring_exact_match", "both"),
    "factconsolidation": ("substring_exact_match", "both"),
}
_MAB_METRICS = {"substring_exact_match": mab_substring_match, "exact_match": mab_exact_match, "f1": mab_f1}


def mab_official_field(source: str) -> tuple[str, str]:
    """``(metric field, replies scored)`` of a source, by its longest matching prefix."""
    prefixes = [p for p in MAB_OFFICIAL_FIELDS if source.startswith(p)]
    if not prefixes:
        raise ValueError(f"unknown MemoryAgentBench source {source!r}")
    return MAB_OFFICIAL_FIELDS[max(prefixes, key=len)]


def mab_official_score(
    source: str, reply: str, golds: Any, catalogue: Sequence[str] | None = None, gold_titles=None
) -> float:
    """The official per-source score of one reply (see the module docstring).

    Args:
        source: the row's ``metadata.source`` (e.g. ``"eventqa_full"``).
        reply: the model's reply.
        golds: accepted answers (str, list or list of lists); unused for ReDial.
        catalogue: ReDial only: every movie title (the snapping targets).
        gold_titles: ReDial only: the gold movie titles, one per gold id (duplicates kept).
    """
    field, which = mab_official_field(source)
    if field == "recsys_recall@5":
        if catalogue is None or gold_titles is None:
            raise ValueError("ReDial scoring needs the movie catalogue and the gold titles")
        return redial_recall_at_5(reply, gold_titles, catalogue)
    replies = {"parsed": [mab_parse_reply(reply)], "both": [reply, mab_parse_reply(reply)]}[which]
    return _best(_MAB_METRICS[field], replies, golds)


# ---------------------------------------------------------------------- ReDial
_PARENS = re.compile(r"\([^()]*\)")
_NUMBERING = re.compile(r"^(?:\d+[.)、]?\s*[-—–]?\s*)?")


def redial_clean(item: str) -> str:
    """A recommended line cleaned as the official scorer does: parenthesised parts, a leading
    number (``3.``, ``3)``, ``3、`` and a dash) removed, whitespace folded."""
    item = _NUMBERING.sub("", _PARENS.sub("", item))
    return " ".join(item.split())


def redial_entity_title(uri: str) -> str:
    """Official catalogue title of a ReDial entity URI: the last path part, ``_``/``-``/``>`` as spaces,
    parenthesised parts removed, whitespace folded (``<.../Spider-Man_(2002_film)>`` -> ``Spider Man``)."""
    name = uri.split("/")[-1].replace("_", " ").replace("-", " ").replace(">", " ")
    return " ".join(_PARENS.sub("", name).split())


def redial_items(reply: str) -> list[str]:
    """The reply's recommended lines, cleaned, duplicates and blank lines kept: the text after the
    first ``1.`` split on line breaks, or (no ``1.``) the whole reply with commas as line breaks."""
    head, sep, rest = reply.partition("1.")
    text = rest if sep else reply.replace(",", "\n")
    return [redial_clean(line.strip()) for line in text.split("\n")]


class _Catalogue:
    """Distinct titles in first-seen order, lower-cased once, for nearest-title lookups."""

    def __init__(self, titles: Iterable[str]) -> None:
        self.titles = list(dict.fromkeys(titles))
        if not self.titles:
            raise ValueError("the ReDial catalogue is empty")
        self.lower = [t.lower() for t in self.titles]

    @lru_cache(maxsize=65536)  # noqa: B019  (one catalogue per benchmark, kept for its lifetime)
    def nearest(self, item: str) -> str:
        try:
            import editdistance
        except ModuleNotFoundError as err:
            raise missing_extra(
                err, "eval", "MemoryAgentBench ReDial scoring (edit-distance title matching)"
            ) from err

        target = item.lower()
        distances = [editdistance.eval(target, title) for title in self.lower]
        return self.titles[min(range(len(distances)), key=distances.__getitem__)]


_CATALOGUES: dict[int, _Catalogue] = {}


def _catalogue(titles: Sequence[str]) -> _Catalogue:
    key = id(titles)
    found = _CATALOGUES.get(key)
    if found is None or found.titles != list(dict.fromkeys(titles)):
        found = _CATALOGUES[key] = _Catalogue(titles)
    return found


def redial_snap(reply: str, catalogue: Sequence[str]) -> list[str]:
    """Every recommended line snapped to its nearest catalogue title (edit distance, lower-cased;
    ties: the title listed first)."""
    cat = _catalogue(catalogue)
    return [cat.nearest(item) for item in redial_items(reply)]


def redial_recall_at_5(reply: str, gold_titles: Sequence[str], catalogue: Sequence[str]) -> float:
    """Fraction of gold titles (each counted as often as listed) among the first five snapped lines."""
    if not gold_titles:
        raise ValueError("recall@5 needs at least one gold title")
    top = redial_snap(reply, catalogue)[:5]
    return sum(title in top for title in gold_titles) / len(gold_titles)


# ====================================================================== MemoryAgentBench, paper
def span_normalize(text: str) -> str:
    """δ-Mem's normalisation: lower-case, a/an/the removed, other non-word characters as spaces."""
    text = re.sub(r"\b(a|an|the)\b", " ", text.lower())
    return " ".join(re.sub(r"[^\w\s]", " ", text).split())


def paper_aliases(golds: Any) -> list[str]:
    """Gold strings stripped, empty ones and repeats (same normalised form) dropped, order kept."""
    seen: set[str] = set()
    out = []
    for gold in flatten_golds(golds):
        text = gold.strip()
        key = span_normalize(text)
        if text and key and key not in seen:
            seen.add(key)
            out.append(text)
    return out


def mab_paper_correct(reply: str, golds: Any) -> float:
    """1.0 when some alias equals the normalised first line or reply, or is a substring of the reply."""
    whole, line = span_normalize(reply), span_normalize(first_line(reply))
    if not whole and not line:
        return 0.0
    for alias in paper_aliases(golds):
        key = span_normalize(alias)
        if key == line or key == whole or key in whole:
            return 1.0
    return 0.0


def span_f1(reply: str, gold: str) -> float:
    """Token F1 on :func:`span_normalize` tokens; both empty: 1.0, one empty: 0.0."""
    pred, ref = span_normalize(reply).split(), span_normalize(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    return _f1_of(pred, ref)


def mab_paper_f1(reply: str, golds: Any) -> float:
    """The best :func:`span_f1` over the reply and its first line and every alias, rounded to 4."""
    best = 0.0
    for candidate in (reply, first_line(reply)):
        if candidate.strip():
            for alias in paper_aliases(golds):
                best = max(best, span_f1(candidate, alias))
    return round(best, 4)


# ====================================================================== LoCoMo
_STEMMER = PorterStemmer()


@lru_cache(maxsize=65536)
def _stem(word: str) -> str:
    return _STEMMER.stem(word)


def locomo_normalize(text: str) -> str:
    """LoCoMo's normalisation: commas out, lower-case, punctuation out, the words a/an/the/and out
    (``regex`` module word boundaries, which are Unicode-aware), whitespace folded."""
    text = "".join(ch for ch in text.replace(",", "").lower() if ch not in _PUNCTUATION)
    return " ".join(regex.sub(r"\b(a|an|the|and)\b", " ", text).split())


def locomo_f1(reply: str, gold: str, nfd: bool = False) -> float:
    """Token F1 of Porter-stemmed :func:`locomo_normalize` tokens (``nfd``: NFD-normalise first)."""
    if nfd:
        reply, gold = unicodedata.normalize("NFD", reply), unicodedata.normalize("NFD", gold)
    pred = [_stem(w) for w in locomo_normalize(reply).split()]
    ref = [_stem(w) for w in locomo_normalize(gold).split()]
    if not pred or not ref:
        return 0.0
    return _f1_of(pred, ref)


def locomo_official_score(reply: str, gold: str, category: int) -> float:
    """Official LoCoMo score of one reply (categories 1-4), not rounded."""
    gold = str(gold)
    if category == 3:
        gold = gold.split(";")[0].strip()
    if category == 1:
        preds = [p.strip() for p in reply.split(",")]
        refs = [g.strip() for g in gold.split(",")]
        return sum(max(locomo_f1(p, g) for p in preds) for g in refs) / len(refs)
    return locomo_f1(reply, gold)


def locomo_adversarial_answer(reply: str, options: dict[str, str]) -> str:
    """The official code's reading of a category-5 reply (``get_cat_5_answer``): a reply of one
    character, or of three such as ``(a)``, is the option it names (``a`` when it holds ``a`` /
    ``(a)``, else ``b``); any other reply is itself, stripped and lower-cased."""
    text = reply.strip().lower()
    if len(text) == 1:
        return options["a"] if "a" in text else options["b"]
    if len(text) == 3:
        return options["a"] if "(a)" in text else options["b"]
    return text


def locomo_adversarial_score(reply: str, options: dict[str, str]) -> float:
    """Official LoCoMo score of a category-5 reply (``evaluation.py``): 1 when the reply, read as
    :func:`locomo_adversarial_answer` reads it, says "no information available" or "not mentioned"."""
    answer = locomo_adversarial_answer(reply, options).lower()
    return 1.0 if "no information available" in answer or "not mentioned" in answer else 0.0


def locomo_paper_answer(reply: str) -> str:
    """δ-Mem's post-processing: first non-blank line, lower-cased, option markers and ``answer:`` out."""
    text = reply.replace('\\"', "'").strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    text = (lines[0] if lines else text).lower()
    for marker in ("(a)", "(b)", "a)", "b)", "answer:"):
        text = text.replace(marker, "")
    return text.strip()


def locomo_paper_score(reply: str, gold: str, category: int) -> float:
    """Paper LoCoMo score of one reply (categories 1-4): post-processed, NFD, rounded to 4."""
    answer, gold = locomo_paper_answer(reply), str(gold)
    if category == 3:
        gold = gold.split(";")[0].strip()
    if category == 1:
        preds = [p.strip() for p in answer.split(",") if p.strip()]
        refs = [g.strip() for g in gold.split(",") if g.strip()]
        if not preds or not refs:
            return 0.0
        score = sum(max(locomo_f1(p, g, nfd=True) for p in preds) for g in refs) / len(refs)
    else:
        score = locomo_f1(answer.strip(), gold, nfd=True)
    return round(score, 4)


# ====================================================================== HotpotQA
def hotpot_official_scores(reply: str, gold: str) -> dict[str, float]:
    """``hotpot_evaluate_v1.py``: SQuAD-normalised exact match and F1 (yes/no/noanswer exact)."""
    pred, ref = mab_normalize(reply), mab_normalize(gold)  # the same SQuAD normalisation
    f1 = 0.0 if (pred in _SPECIAL or ref in _SPECIAL) and pred != ref else _f1_of(pred.split(), ref.split())
    return {"em": float(pred == ref), "f1": f1}


def hotpot_paper_scores(reply: str, gold: str) -> dict[str, float]:
    """δ-Mem: the first line of the reply, :func:`span_normalize`, exact match, F1 rounded to 4."""
    line, gold = first_line(reply), str(gold).strip()
    return {"em": float(span_normalize(line) == span_normalize(gold)), "f1": round(span_f1(line, gold), 4)}
