"""English memory episodes: facts about people stated once among chatter, some later updated, and
questions asked when the history is no longer in the prompt (issue 45, "adapters trained on English").

A history is notes (one sentence a line) or a group chat (``"Maria: I live in Lisbon these days."``):
people, where they live, their jobs, pets, ages, favourite foods and colours, partners, plans (who
meets whom where, appointments), numbers (hotel rooms, phone extensions, prices) and places (where a
thing is kept), each fact stated once, some replaced later (``"Actually, Maria moved from Lisbon to
Oslo."``: the later value is the gold), between lines of chatter that state no fact. The question
asks one fact; the answer is its value alone.

:func:`english_episodes` returns the project's text episodes (:mod:`.data`), with what evaluation needs
beside them (:func:`~.data.tokenize_episode` and :func:`~.data.tokenize_conversation` read only their
own keys)::

    {"history": str, "prompt": "Question: Where does Maria live?\\nAnswer:", "answer": " Oslo",
     "question": "Where does Maria live?", "gold": "Oslo",
     "choices": ["Lisbon", "Oslo", "Bergen", "Cairo"],   # the history's values of the gold's kind, and more
     "history_choices": 3,                               # how many of the choices the history states
     "kind": "city", "relation": "city", "subject": "Maria", "updated": True, "superseded": "Lisbon",
     "split": "train", "style": "notes", "facts": [{"relation", "kind", "subject", "value", "old", "key"}, ...]}

:func:`as_conversation` turns one into a conversation episode for a chat model (the question as the user
message, the value as the answer); :func:`english_conversations` states the facts in chat turns and
asks several questions in later turns.

**Splits.** ``split="train"`` and ``split="heldout"`` share nothing but the number ranges, the dates
and the words that complete a question's key (the pet's animal, the kept thing, the appointment, the
bought item): the names, the other values (cities, jobs, pet names, foods, colours, venues, places),
the sentence forms that state and update facts, the question forms, the chatter and the assistant's
acknowledgements are disjoint (:mod:`.english_words`, :mod:`.english_forms`), and the relations
``birthplace`` and ``instrument`` are asked only in held-out episodes. A held-out score is then
recall, not a match of forms seen in training; the forced choice among the history's own values
(:func:`lstmem_peft.eval.forced_choice.forced_choice`) tells it from a learned prior.

**Difficulty** (the curriculum, :data:`CURRICULUM`): ``num_facts`` per history, ``chatter`` lines per
fact, the fraction of facts ``updates`` replaces, ``history_tokens`` (chatter is added until the
history reaches that many tokens of ``tokenizer``; words without one), ``same_relation`` (how often
the other facts share the asked relation, so the choices are the history's own values).
Generation is deterministic: episode ``i`` of a seed and split is the same whatever ``num_episodes``.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Sequence
from typing import Any

from .english_forms import ACKNOWLEDGEMENTS, CHATTER, HELDOUT_RELATIONS, RELATIONS, REPLIES
from .english_words import ANIMALS, EVENTS, ITEMS, MONTHS, NUMBER_RANGES, POOLS, THINGS

SPLITS = ("train", "heldout")
STYLES = ("notes", "chat", "mixed")
#: Training relations; held-out episodes may also ask :data:`HELDOUT_RELATIONS`.
TRAIN_RELATIONS = tuple(r for r in RELATIONS if r not in HELDOUT_RELATIONS)
KEY_WORDS = {"animal": ANIMALS, "thing": THINGS, "event": EVENTS, "item": ITEMS}

#: A curriculum: knobs of :func:`english_episodes` from easy to hard (``english_episodes(n, **CURRICULUM[k])``).
CURRICULUM: list[dict[str, Any]] = [
    {"num_facts": (1, 2), "chatter": 0.0, "updates": 0.0, "same_relation": 1.0},
    {"num_facts": (2, 4), "chatter": (0.0, 1.0), "updates": 0.0, "same_relation": 0.5},
    {"num_facts": (4, 8), "chatter": (0.5, 2.0), "updates": 0.2, "same_relation": 0.5},
    {
        "num_facts": (8, 16),
        "chatter": (1.0, 3.0),
        "updates": 0.3,
        "same_relation": 0.3,
        "history_tokens": 1024,
    },
    {
        "num_facts": (16, 32),
        "chatter": (1.0, 4.0),
        "updates": 0.3,
        "same_relation": 0.3,
        "history_tokens": 4096,
    },
]


def _word_in(word: str, text: str) -> bool:
    """``word`` in ``text`` as whole words, any case (``"Ada"`` is not in ``"Adam"``)."""
    return re.search(r"(?<![\w'])" + re.escape(word) + r"(?![\w])", text, re.IGNORECASE) is not None


def _stochastic_round(rng: random.Random, x: float) -> int:
    whole = int(x)
    return whole + (rng.random() < x - whole)


def _draw(rng: random.Random, value) -> float | int:
    """A knob: a number, or a ``(low, high)`` range drawn from (integers for integer bounds)."""
    if isinstance(value, (tuple, list)):
        low, high = value
        if isinstance(low, int) and isinstance(high, int):
            return rng.randint(low, high)
        return rng.uniform(low, high)
    return value


def _article(word: str) -> str:
    return ("an " if word[0].lower() in "aeiou" else "a ") + word


class _History:
    """One history as it is drawn: its facts, its lines and every word a value may not clash with."""

    def __init__(self, rng: random.Random, split: str, style: str) -> None:
        self.rng, self.split, self.style = rng, split, style
        self.used: list[str] = []  # every value and name the history holds
        self.people: list[str] = []
        self.facts: list[dict[str, Any]] = []
        self.speakers: list[str] = []

    def value(self, kind: str) -> str | None:
        """A value of ``kind`` that clashes with nothing the history holds (None: the pool ran out)."""
        if kind in NUMBER_RANGES:
            low, high = NUMBER_RANGES[kind]
            tries = (str(self.rng.randint(low, high)) for _ in range(200))
        elif kind == "date":
            tries = (f"{self.rng.choice(MONTHS)} {self.rng.randint(1, 28)}" for _ in range(200))
        else:
            pool = POOLS[kind][self.split]
            tries = iter(self.rng.sample(pool, len(pool)))
        for value in tries:
            if not any(_word_in(value, u) or _word_in(u, value) for u in self.used):
                self.used.append(value)
                return value
        return None

    def person(self, relation: str) -> str | None:
        """The subject of a new fact: a new person, or (half the time) one the relation is not about yet."""
        free = [
            p
            for p in self.people
            if not any(f["subject"] == p and f["relation"] == relation for f in self.facts)
        ]
        if free and self.rng.random() < 0.5:
            return self.rng.choice(free)
        name = self.value("name")
        if name is not None:
            self.people.append(name)
        return name if name is not None else (self.rng.choice(free) if free else None)

    def add_fact(self, relation: str, updated: bool) -> bool:
        """Draw a fact of ``relation`` (False: its pools ran out for this history)."""
        spec = RELATIONS[relation]
        subject = self.person(relation)
        if subject is None:
            return False
        key = {}
        if "key" in spec:
            key[spec["key"]] = (
                self.value("name") if spec["key"] == "other" else self.rng.choice(KEY_WORDS[spec["key"]])
            )
        old = self.value(spec["kind"]) if updated else None
        value = self.value(spec["kind"])
        if value is None or None in key.values() or (updated and old is None):
            return False
        fact = {"relation": relation, "kind": spec["kind"], "subject": subject, "value": value, "old": old}
        self.facts.append({**fact, "key": key})
        return True

    def line(self, fact: dict[str, Any], update: bool) -> str:
        """One statement of ``fact`` (its first value, or its update), as notes or as a chat line."""
        forms = RELATIONS[fact["relation"]][self.split]
        first = fact["old"] if fact["old"] is not None and not update else fact["value"]
        slots = {"name": fact["subject"], "value": first, "a_value": _article(first), **fact["key"]}
        if update:
            slots.update(old=fact["old"], a_old=_article(fact["old"]))
        said, own = ("update", "update_self") if update else ("said", "self")
        if self.style == "chat" and self.rng.random() < 0.5:
            return f"{fact['subject']}: " + self.rng.choice(forms[own]).format(**slots)
        text = self.rng.choice(forms[said]).format(**slots)
        if self.style == "chat":
            others = [s for s in self.speakers if s != fact["subject"]]
            if others:
                return f"{self.rng.choice(others)}: {text}"
            return f"{fact['subject']}: " + self.rng.choice(forms[own]).format(**slots)
        return text

    def chatter(self) -> str:
        words = CHATTER[self.split]
        if self.rng.random() < 0.3:
            text = self.rng.choice(words["talk"])
        else:
            text = f"{self.rng.choice(words['when'])} {self.rng.choice(words['what'])}."
        return f"{self.rng.choice(self.speakers)}: {text}" if self.style == "chat" else text


def _check(split: str, style: str, relations: Sequence[str] | None) -> tuple[str, ...]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    allowed = tuple(RELATIONS) if split == "heldout" else TRAIN_RELATIONS
    chosen = tuple(relations) if relations is not None else allowed
    wrong = [r for r in chosen if r not in allowed]
    if wrong or not chosen:
        raise ValueError(f"relations of the {split} split are {allowed}; got {list(chosen)}")
    return chosen


def _count(tokenizer, text: str) -> int:
    """Tokens of ``text`` (no special tokens); whitespace words without a tokenizer."""
    if tokenizer is None:
        return len(text.split())
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _fill(h: _History, lines: list[str], target: int, tokenizer) -> list[str]:
    """Chatter added at random places until the history would pass ``target`` tokens."""
    total = _count(tokenizer, "\n".join(lines))
    added: list[str] = []
    misses = 0
    while misses < 8:
        text = h.chatter()
        cost = _count(tokenizer, text) + (1 if lines and tokenizer is not None else 0)  # the newline
        if total + cost > target:
            misses += 1  # a shorter line may still fit
            continue
        at = h.rng.randint(0, len(lines))
        lines.insert(at, text)
        added.append(text)
        total += cost
    # the sum of the lines' counts is close to the whole text's; make sure the target holds
    while added and _count(tokenizer, "\n".join(lines)) > target:
        lines.remove(added.pop())
    return lines


# the whole drawing of one history, in order: knobs, facts, updates, lines, chatter, length
def _draw_history(
    rng: random.Random,
    split: str,
    relations: tuple[str, ...],
    *,
    num_facts,
    chatter,
    updates: float,
    history_tokens: int | None,
    tokenizer,
    same_relation: float,
    style: str,
    ask_updated: float | None,
) -> tuple[_History, list[str]]:
    """A history whose first fact (``h.facts[0]``) is the one asked about; returns it and its lines."""
    n = int(_draw(rng, num_facts))
    if n < 1:
        raise ValueError(f"num_facts must be at least 1, got {num_facts!r}")
    if not 0.0 <= updates <= 1.0 or not 0.0 <= same_relation <= 1.0:
        raise ValueError(f"updates and same_relation must be in [0, 1], got {updates} and {same_relation}")
    style = rng.choice(STYLES[:2]) if style == "mixed" else style
    h = _History(rng, split, style)
    k = _stochastic_round(rng, updates * n)
    if ask_updated is None:
        again = set(rng.sample(range(n), k))
    elif rng.random() < ask_updated:
        again = {0, *rng.sample(range(1, n), max(0, min(k, n) - 1))}
    else:
        again = set(rng.sample(range(1, n), min(k, n - 1)))
    asked = rng.choice(relations)
    for i in range(n):
        relation = asked if i == 0 or rng.random() < same_relation else rng.choice(relations)
        fallbacks = rng.sample([r for r in relations if r != relation], len(relations) - 1)
        if not any(h.add_fact(r, i in again) for r in ([relation] if i == 0 else [relation, *fallbacks])):
            raise ValueError(f"the {split} pools ran out of values for a history of {n} facts; ask for fewer")
    if style == "chat":
        subjects = list(dict.fromkeys(f["subject"] for f in h.facts))
        h.speakers = subjects + [s for s in (h.value("name"), h.value("name")) if s is not None]
    order = [(i, False) for i in range(n)]
    rng.shuffle(order)
    for i in sorted(again):
        start = order.index((i, False)) + 1
        order.insert(rng.randint(start, len(order)), (i, True))
    lines = [h.line(h.facts[i], update) for i, update in order]
    for _ in range(_stochastic_round(rng, float(_draw(rng, chatter)) * n)):
        lines.insert(rng.randint(0, len(lines)), h.chatter())
    if history_tokens is not None:
        lines = _fill(h, lines, history_tokens, tokenizer)
    return h, lines


def _question(h: _History, fact: dict[str, Any], min_choices: int, history: str) -> dict[str, Any]:
    """The question about ``fact``, its gold, and the forced choice: the history's values of its kind
    (superseded ones included; for a person, also the other people ``history`` names), then fresh values."""
    forms = RELATIONS[fact["relation"]][h.split]
    question = h.rng.choice(forms["ask"]).format(name=fact["subject"], **fact["key"])
    stated = [
        v for f in h.facts if f["kind"] == fact["kind"] for v in (f["value"], f["old"]) if v is not None
    ]
    if fact["kind"] == "name":
        named = [f["subject"] for f in h.facts] + h.speakers + [f["key"].get("other") for f in h.facts]
        stated += [p for p in named if p and not _word_in(p, question) and _word_in(p, history)]
    choices = list(dict.fromkeys(stated))
    in_history = len(choices)
    while len(choices) < min_choices:
        more = h.value(fact["kind"])
        if more is None:
            break
        choices.append(more)
    h.rng.shuffle(choices)
    return {
        "question": question,
        "gold": fact["value"],
        "choices": choices,
        "history_choices": in_history,
        "kind": fact["kind"],
        "relation": fact["relation"],
        "subject": fact["subject"],
        "updated": fact["old"] is not None,
        "superseded": fact["old"],
    }


def english_episodes(
    num_episodes: int,
    split: str = "train",
    seed: int = 0,
    *,
    num_facts: int | tuple[int, int] = (1, 2),
    chatter: float | tuple[float, float] = 0.0,
    updates: float = 0.0,
    history_tokens: int | None = None,
    tokenizer=None,
    same_relation: float = 0.5,
    min_choices: int = 4,
    style: str = "mixed",
    relations: Sequence[str] | None = None,
    ask_updated: float | None = None,
) -> list[dict[str, Any]]:
    """English memory episodes, one question each (see the module docstring for their fields).

    Args:
        num_episodes: how many.
        split: ``"train"`` or ``"heldout"`` (disjoint names, values, forms, chatter; held-out relations).
        seed: episode ``i`` depends only on ``(split, seed, i)``.
        num_facts: facts per history, or a ``(low, high)`` range (both included) drawn per history.
        chatter: lines of chatter per fact (a number or a ``(low, high)`` range), placed at random.
        updates: the fraction of facts stated again later with a new value (rounded at random per
            history, so it holds on average); the question then wants the new value.
        history_tokens: then more chatter until the history would pass this many tokens of
            ``tokenizer`` (whitespace words without one); facts are never dropped to fit.
        tokenizer: counts ``history_tokens``.
        same_relation: the chance that each other fact has the asked fact's relation (other people's
            cities when the question asks a city), so the choices are the history's own values.
        min_choices: fresh values of the gold's kind are added to the history's until there are this
            many choices (fewer only when a held-out pool runs out).
        style: ``"notes"``, ``"chat"`` (a group chat) or ``"mixed"`` (each history one of them).
        relations: the relations to draw from; default: all of the split's.
        ask_updated: the chance that the asked fact is an updated one (at least one fact is then
            updated); default ``None``: the asked fact is updated as often as any other.

    Returns:
        a list of episode dicts: ``history``, ``prompt``, ``answer`` (the text episode), and the
        evaluation fields ``question``, ``gold``, ``choices``, ``history_choices``, ``kind``,
        ``relation``, ``subject``, ``updated``, ``superseded``, ``split``, ``style``, ``facts``.
    """
    chosen = _check(split, style, relations)
    episodes = []
    for i in range(num_episodes):
        rng = random.Random(f"english:{split}:{seed}:{i}")
        h, lines = _draw_history(
            rng,
            split,
            chosen,
            num_facts=num_facts,
            chatter=chatter,
            updates=updates,
            history_tokens=history_tokens,
            tokenizer=tokenizer,
            same_relation=same_relation,
            style=style,
            ask_updated=ask_updated,
        )
        history = "\n".join(lines)
        asked = _question(h, h.facts[0], min_choices, history)
        episodes.append(
            {
                "history": history,
                "prompt": f"Question: {asked['question']}\nAnswer:",
                "answer": " " + asked["gold"],
                **asked,
                "split": split,
                "style": h.style,
                "facts": h.facts,
            }
        )
    return episodes


def near_misses(value: str, n: int, rng: random.Random) -> list[str]:
    """Up to ``n`` distinct strings that differ from ``value`` only in its digits, of two kinds taken
    in turn (each drawn by ``rng``): the digits in another order (``"1482"`` -> ``"1842"``) and one
    digit changed (``"1564"`` -> ``"1464"``); when one kind runs out, the other. Every other character
    stays, so ``"May 19"`` gives ``"May 91"``, ``"May 18"``; a value without digits gives none.

    These are the wrong answers a memory that holds a number's digits but not their order (or one
    digit blurred) gives, the misses greedy recall on SmolLM2 showed; training can score the gold
    against them (``examples/train_english.py --near-miss-weight``), which the history's other
    values, all far from the gold, do not teach.
    """
    at = [i for i, c in enumerate(value) if c.isdigit()]
    if not at or n <= 0:
        return []
    digits = [value[i] for i in at]

    def put(new_digits) -> str:
        chars = list(value)
        for i, d in zip(at, new_digits, strict=True):
            chars[i] = d
        return "".join(chars)

    reordered = sorted({put(p) for p in itertools.permutations(digits)} - {value})
    changed = sorted(
        {put(digits[:k] + [d] + digits[k + 1 :]) for k in range(len(at)) for d in "0123456789"}
        - {value}
        - set(reordered)
    )
    rng.shuffle(reordered)
    rng.shuffle(changed)
    turns = itertools.zip_longest(reordered, changed)
    return [v for pair in turns for v in pair if v is not None][:n]


def as_conversation(episode: dict[str, Any]) -> dict[str, Any]:
    """A text episode as a conversation episode for a chat model (:func:`~.data.tokenize_conversation`):
    the history written first, then the question as the user's message, the value as the answer."""
    return {
        "history": episode["history"],
        "turns": [{"prompt": episode["question"], "answer": episode["gold"]}],
    }


def english_conversations(
    num_episodes: int,
    split: str = "train",
    seed: int = 0,
    *,
    questions: int = 2,
    facts_in: str = "turns",
    lines_per_turn: tuple[int, int] = (1, 3),
    num_facts: int | tuple[int, int] = (2, 4),
    chatter: float | tuple[float, float] = 0.0,
    updates: float = 0.0,
    history_tokens: int | None = None,
    tokenizer=None,
    same_relation: float = 0.5,
    min_choices: int = 4,
    style: str = "notes",
    relations: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Conversation episodes (:mod:`.data`): the facts told to the assistant, then questions.

    ``facts_in="turns"``: the history's lines are user turns (``lines_per_turn`` lines each, a range),
    each answered with an acknowledgement (a turn with a fact) or a short reply (chatter);
    ``"history"``: they are the history, written before the chat. Then ``questions`` turns (at most
    one per fact) each ask a different fact, answered with its value. The other arguments are
    :func:`english_episodes`'.

    Returns:
        ``[{"history": str, "turns": [{"prompt", "answer"}, ...], "questions": [per question turn:
        the evaluation fields of :func:`english_episodes`], "split", "style", "facts"}, ...]``.
    """
    if facts_in not in ("turns", "history"):
        raise ValueError(f"facts_in must be 'turns' or 'history', got {facts_in!r}")
    chosen = _check(split, style, relations)
    episodes = []
    for i in range(num_episodes):
        rng = random.Random(f"english-conversation:{split}:{seed}:{i}")
        h, lines = _draw_history(
            rng,
            split,
            chosen,
            num_facts=num_facts,
            chatter=chatter,
            updates=updates,
            history_tokens=history_tokens,
            tokenizer=tokenizer,
            same_relation=same_relation,
            style=style,
            ask_updated=None,
        )
        asked = [0, *rng.sample(range(1, len(h.facts)), min(questions, len(h.facts)) - 1)]
        told = "\n".join(lines)
        asks = [_question(h, h.facts[j], min_choices, told) for j in asked]
        turns = []
        if facts_in == "turns":
            stated = [f["value"] for f in h.facts] + [f["old"] for f in h.facts if f["old"]]
            while lines:
                size = rng.randint(*lines_per_turn)
                text, lines = "\n".join(lines[:size]), lines[size:]
                says_fact = any(_word_in(v, text) for v in stated)
                answer = rng.choice((ACKNOWLEDGEMENTS if says_fact else REPLIES)[split])
                turns.append({"prompt": text, "answer": answer})
        turns += [{"prompt": a["question"], "answer": a["gold"]} for a in asks]
        history = "\n".join(lines) if facts_in == "history" else ""
        episodes.append(
            {
                "history": history,
                "turns": turns,
                "questions": asks,
                "split": split,
                "style": h.style,
                "facts": h.facts,
            }
        )
    return episodes
