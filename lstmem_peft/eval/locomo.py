"""LoCoMo: the ``official`` and ``paper`` protocols over the official ``locomo10.json``.

Both protocols ask the category 1-4 questions by default (1,540 in LoCoMo-10), replay each conversation
into memory one segment per session, in the order the protocol's prompt lists the sessions, and reset the
memory before every conversation. Category-2 (temporal) questions carry the official suffix "Use DATE of
CONVERSATION to answer with an approximate date." Category 5 (adversarial: 446 questions about what the
conversation never says) is asked on request (``categories``), under the ``official`` protocol, as its
code asks it: a choice between the question's trap answer and "Not mentioned in the conversation"
(:func:`adversarial_options`), scored 1 when the answer says it is not mentioned
(:func:`~lstmem_peft.eval.scorers.locomo_adversarial_score`).

* ``official`` -- LoCoMo's released QA code for API models, pinned at commit
  ``3eb6f2c585f5e1699204e3c3bdf7adc5c28cb376`` (:data:`OFFICIAL_COMMIT`) of ``snap-research/locomo``,
  ``task_eval/gpt_utils.py``. Why that commit: it is the head of ``main`` (unchanged from 2024-08-12
  to at least May 2026; ``gpt_utils.py`` is as commit ``cbfbc1d``, "Cleaned and update QA code",
  left it), and the code the repository's README tells users to run (``scripts/evaluate_gpts.sh`` ->
  ``task_eval/evaluate_qa.py`` -> ``gpt_utils.get_gpt_answers``). The older
  ``task_eval/evaluate_gpts.py`` existed only in commit ``9228632`` (2024-08-07; ``cbfbc1d`` removed
  it two days later) and reads ``clean_text`` and ``img_file`` fields the released ``locomo10.json``
  does not have.
  What the pinned code builds for one question (``get_input_context``; the batch-size-1 path, its
  ``--batch-size`` default): no system message; one user turn ``CONV_START_PROMPT + conversation +
  "\\n\\n" + QA_PROMPT``. The conversation lists the sessions **newest first**, each
  ``DATE: <session_<n>_date_time>\\nCONVERSATION:\\n`` followed by its turns in order; a turn is
  ``<speaker> said, "<text>"\\n``, then `` and shared <blip_caption>.`` when the turn has a
  ``blip_caption`` field, then ``\\n`` (so turns without an image are separated by a blank line);
  the ``"\\n\\n"`` the code adds per session all land after the oldest session, at the very end. The
  code fills a token budget (the model's window less the prompt and 50 tokens per question) from the
  first session on and leaves out what does not fit; with ``gpt-4-turbo`` (128k) no LoCoMo-10
  conversation reaches it, and histories here are never cut. The opening names ``speaker_a`` and
  ``speaker_b`` (the code takes ``session_1``'s speakers in a Python set's order, which varies between
  runs). 32 new tokens (its ``num_tokens_request``); the whole reply is scored
  (:func:`~lstmem_peft.eval.scorers.locomo_official_score`).
* ``paper`` -- δ-Mem's ``locomo_protocol.py`` ``official_prompt`` mode: its system prompt, its question
  prompt ("... write a short answer for the following question in a few words ..."), turns rendered
  ``<speaker> said, "<text>"`` plus `` and shared <caption>.``, 50 new tokens, the first line of the reply
  lower-cased with option markers and ``answer:`` removed
  (:func:`~lstmem_peft.eval.scorers.locomo_paper_score`). Unlike that code, sessions are listed oldest
  first (it lists the newest first).

Data: the official ``locomo10.json`` (a list of samples with ``conversation`` and ``qa``), or a Hub
dataset id with the same fields; anything else is refused with a
:class:`~lstmem_peft.utils.errors.DataFormatError` that names the file and what it holds. Deviations from
the released code are listed in docs/evaluation.md ("Deviations from the named code").
"""

from __future__ import annotations

import random
import re
import warnings
from collections.abc import Collection, Iterator
from typing import Any

from lstmem_peft.utils.errors import describe

from . import scorers
from .protocol import Benchmark, DataSpec, History, Question, question_weighted, read_benchmark

SCORED_CATEGORIES = (1, 2, 3, 4)  # asked by default: both protocols, the paper's tables
ADVERSARIAL = 5
ALL_CATEGORIES = (*SCORED_CATEGORIES, ADVERSARIAL)
LOCOMO10_QUESTIONS = 1540  # category 1-4 questions of the 10 LoCoMo-10 conversations (paper App. B)
#: Questions per category in the official locomo10.json (1,986 in all).
LOCOMO10_PER_CATEGORY = {1: 282, 2: 321, 3: 96, 4: 841, 5: 446}
CATEGORY_NAMES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
MAX_NEW_TOKENS = {"official": 32, "paper": 50}
TEMPORAL_SUFFIX = " Use DATE of CONVERSATION to answer with an approximate date."

# The pinned official code: snap-research/locomo at this commit (main's head), task_eval/gpt_utils.py.
OFFICIAL_COMMIT = "3eb6f2c585f5e1699204e3c3bdf7adc5c28cb376"
OFFICIAL_SOURCE = f"https://github.com/snap-research/locomo/blob/{OFFICIAL_COMMIT}/task_eval/gpt_utils.py"
#: SHA-256 of ``data/locomo10.json`` at that commit (2,805,274 bytes; the file has not changed since
#: 2024-08-09): a record whose DATA has it was measured on the official release.
OFFICIAL_DATA_SHA256 = "79fa87e90f04081343b8c8debecb80a9a6842b76a7aa537dc9fdf651ea698ff4"

# Source: snap-research/locomo @ OFFICIAL_COMMIT, task_eval/gpt_utils.py (CONV_START_PROMPT, QA_PROMPT), word
# for word, its spelling included.
CONVERSATION_START = (
    "Below is a conversation between two people: {} and {}. The conversation takes place over multiple days "
    "and the date of each conversation is wriiten at the beginning of the conversation.\n\n"
)
OFFICIAL_QA_PROMPT = (
    "\nBased on the above context, write an answer in the form of a short phrase for the following question. "
    "Answer with exact words from the context whenever possible.\n\nQuestion: {} Short answer:\n"
)
# Source: as above (QA_PROMPT_CAT_5 and the choice get_gpt_answers appends to a category-5 question), word
# for word, the trailing space included.
OFFICIAL_QA_PROMPT_ADVERSARIAL = (
    "\nBased on the above context, answer the following question.\n\nQuestion: {} Short answer:\n"
)
ADVERSARIAL_CHOICE = " Select the correct answer: (a) {} (b) {}. "
NOT_MENTIONED = "Not mentioned in the conversation"
# Source: declare-lab/delta-Mem, deltamem/eval/locomo_protocol.py (OFFICIAL_SYSTEM_PROMPT, OFFICIAL_QA_PROMPT;
# its OFFICIAL_CONV_START_PROMPT is CONVERSATION_START above).
PAPER_SYSTEM = (
    "You are a helpful, respectful and honest assistant whose job is to understand "
    "the following conversation and answer questions based on the conversation. "
    "If you don't know the answer to a question, please don't share false information."
)
PAPER_QA_PROMPT = (
    "Based on the above conversations, write a short answer for the following question "
    "in a few words. Do not write complete and lengthy sentences. "
    "Answer with exact words from the conversations whenever possible.\n\n"
    "Question: {}"
)

_SESSION = re.compile(r"^session_(\d+)$")


def _session_numbers(conversation: dict[str, Any]) -> list[int]:
    numbers = sorted(int(m.group(1)) for key in conversation if (m := _SESSION.match(key)))
    if not numbers:
        raise ValueError("a LoCoMo conversation needs session_<n> lists (the official locomo10.json schema)")
    for n in numbers:
        if f"session_{n}_date_time" not in conversation:
            raise ValueError(f"LoCoMo conversation has session_{n} but no session_{n}_date_time")
    return numbers


def _sample_problem(sample: dict[str, Any]) -> str | None:
    """What keeps a record from being a LoCoMo sample the protocols can read (``None``: nothing)."""
    conversation = sample["conversation"]
    if not isinstance(conversation, dict):
        return f'"conversation" is {describe(conversation)}, not an object of session_<n> lists'
    sessions = [key for key in conversation if _SESSION.match(key)]
    if not sessions:
        return f'"conversation" has no session_<n> list ({describe(conversation)})'
    for key in sessions:
        turns = conversation[key]
        if not isinstance(turns, list):
            return f"{key} is {describe(turns)}, not a list of turns"
        if f"{key}_date_time" not in conversation:
            return f"{key} has no {key}_date_time"
        for i, turn in enumerate(turns):
            if not (isinstance(turn, dict) and "speaker" in turn and "text" in turn):
                return f'{key} turn {i} is {describe(turn)}, not a turn with "speaker" and "text"'
    questions = sample["qa"]
    if not isinstance(questions, list):
        return f'"qa" is {describe(questions)}, not a list of questions'
    for i, qa in enumerate(questions):
        if not (isinstance(qa, dict) and "question" in qa and "category" in qa):
            return f'qa {i} is {describe(qa)}, not a question with "question", "answer" and "category"'
        try:
            category = int(qa["category"])
        except (TypeError, ValueError):
            return f"qa {i} has category {qa['category']!r}, not a number 1-5"
        if category not in (*SCORED_CATEGORIES, 5):
            return f"qa {i} has category {category}, not 1-5"
        if category in SCORED_CATEGORIES and "answer" not in qa:
            return f'qa {i} (category {category}) has no "answer"'
        if category == ADVERSARIAL and "adversarial_answer" not in qa and "answer" not in qa:
            return f'qa {i} (category 5) has no "adversarial_answer"'
    return None


DATA = DataSpec(
    expected='the LoCoMo JSON list of samples, each an object with "conversation" (session_<n> lists of turns '
    'and their session_<n>_date_time) and "qa"',
    fix="Download data/locomo10.json from https://github.com/snap-research/locomo and pass its path",
    fields=("conversation", "qa"),
    check=_sample_problem,
)


def official_turn(turn: dict[str, Any]) -> str:
    """One turn as the pinned code writes it: ``<speaker> said, "<text>"`` and a line break, then
    `` and shared <caption>.`` when the turn has a ``blip_caption`` field, then another line break."""
    line = f'{turn["speaker"]} said, "{turn["text"]}"\n'
    if "blip_caption" in turn:
        line += f" and shared {turn['blip_caption']}."
    return line + "\n"


def official_sessions(
    conversation: dict[str, Any], keep: Collection[tuple[int, int]] | None = None
) -> list[str]:
    """The pinned official code's conversation text, one string per session in prompt order: newest
    session first, the opening line on the first string, the per-session ``"\\n\\n"`` all after the
    last (oldest) one. ``"".join(...)`` is exactly what ``get_input_context`` returns after the code
    prepends ``CONV_START_PROMPT`` (with its whole token budget).

    ``keep``: only these ``(session number, turn index)`` turns, sessions without one left out (the
    ``window`` and ``bm25`` rows); ``None``: every turn."""
    numbers = [
        n for n in _session_numbers(conversation) if keep is None or _kept_turns(conversation, n, keep)
    ]
    sessions = [
        f"DATE: {conversation[f'session_{n}_date_time']}\nCONVERSATION:\n"
        + "".join(official_turn(turn) for turn in _kept_turns(conversation, n, keep))
        for n in reversed(numbers)
    ]
    opening = CONVERSATION_START.format(conversation.get("speaker_a"), conversation.get("speaker_b"))
    if not sessions:
        return [opening]
    sessions[0] = opening + sessions[0]
    sessions[-1] += "\n\n" * len(numbers)
    return sessions


def paper_sessions(
    conversation: dict[str, Any], keep: Collection[tuple[int, int]] | None = None
) -> list[str]:
    """δ-Mem's conversation text, one string per session, oldest first (δ-Mem: newest first); ``keep``
    as in :func:`official_sessions`."""
    sessions = []
    for n in _session_numbers(conversation):
        turns = []
        kept = _kept_turns(conversation, n, keep)
        if keep is not None and not kept:  # a session none of whose turns is kept
            continue
        for turn in kept:
            line = f'{turn["speaker"]} said, "{turn["text"]}"\n'
            if turn.get("blip_caption"):
                line += f" and shared {turn['blip_caption']}."
            turns.append(line + "\n")
        sessions.append(f"\nDATE: {conversation[f'session_{n}_date_time']}\nCONVERSATION:\n" + "".join(turns))
    opening = CONVERSATION_START.format(conversation.get("speaker_a"), conversation.get("speaker_b"))
    if not sessions:
        return [opening]
    sessions[0] = opening + sessions[0]
    return sessions


def _kept_turns(conversation: dict[str, Any], n: int, keep: Collection[tuple[int, int]] | None) -> list:
    """Session ``n``'s turns that ``keep`` holds (all of them when ``keep`` is ``None``)."""
    turns = conversation[f"session_{n}"]
    return list(turns) if keep is None else [t for i, t in enumerate(turns) if (n, i) in keep]


def conversation_turns(conversation: dict[str, Any]) -> tuple[list[tuple[int, int]], list[str]]:
    """Every turn, oldest first: its ``(session number, turn index)`` and its text for retrieval
    (``<speaker>: <text>``, the image caption after it, and the session's date)."""
    keys, texts = [], []
    for n in _session_numbers(conversation):
        date = conversation[f"session_{n}_date_time"]
        for i, turn in enumerate(conversation[f"session_{n}"]):
            text = f"{turn['speaker']}: {turn['text']}"
            if turn.get("blip_caption"):
                text += f" [shared {turn['blip_caption']}]"
            keys.append((n, i))
            texts.append(f"{text} ({date})")
    return keys, texts


def question_prompt(
    question: str, category: int, protocol: str = "official", options: dict[str, str] | None = None
) -> str:
    """What follows the conversation for one question (category 2 asks for the date form; category 5,
    official protocol only, offers ``options`` ``{"a": ..., "b": ...}``: :func:`adversarial_options`)."""
    if category == ADVERSARIAL:
        if protocol != "official" or options is None:
            raise ValueError("category 5 is asked under the official protocol, with its two options")
        return "\n\n" + OFFICIAL_QA_PROMPT_ADVERSARIAL.format(
            question + ADVERSARIAL_CHOICE.format(options["a"], options["b"])
        )
    if category == 2:
        question = question + TEMPORAL_SUFFIX
    template = OFFICIAL_QA_PROMPT if protocol == "official" else PAPER_QA_PROMPT
    return "\n\n" + template.format(question)


def adversarial_options(trap: str, key: str) -> dict[str, str]:
    """The two options of a category-5 question: its trap answer and :data:`NOT_MENTIONED`, in an order
    drawn with even odds, as the official code draws it. The official code draws from Python's
    unseeded global generator, so its order changes between runs; here the draw is seeded with the
    question's id (``key``), so a run, its resume and a rerun ask the same prompt."""
    if random.Random(key).random() < 0.5:
        return {"a": NOT_MENTIONED, "b": trap}
    return {"a": trap, "b": NOT_MENTIONED}


def parse_categories(text: str, protocol: str) -> tuple[int, ...]:
    """``--categories``: ``all`` or comma-separated numbers 1-5 (:func:`check_categories`)."""
    try:
        chosen = ALL_CATEGORIES if text.strip() == "all" else tuple(int(p) for p in text.split(","))
    except ValueError:
        raise ValueError(f"expected categories 1-5 or all, comma-separated; got {text!r}") from None
    return check_categories(chosen, protocol)


def check_categories(categories: Collection[int], protocol: str) -> tuple[int, ...]:
    """``categories`` sorted, each one of 1-5; category 5 only under the ``official`` protocol."""
    chosen = tuple(sorted({int(c) for c in categories}))
    unknown = [c for c in chosen if c not in ALL_CATEGORIES]
    if not chosen or unknown:
        raise ValueError(f"LoCoMo categories are 1-5 ({CATEGORY_NAMES}); got {list(categories)}")
    if ADVERSARIAL in chosen and protocol != "official":
        raise ValueError(
            "category 5 (adversarial) is asked as the official LoCoMo code asks it; the paper's protocol "
            "(δ-Mem's suite) asks categories 1-4 only. Use protocol official, or categories 1-4"
        )
    return chosen


class LoCoMo(Benchmark):
    """The LoCoMo protocols over the official ``locomo10.json`` (or a Hub dataset id in its schema).

    Args:
        source: path of ``locomo10.json`` (or a ``.jsonl``/``.parquet`` of samples, or a folder holding
            one), or a Hub dataset id ``owner/name[/folder]`` (downloaded once, then read from the cache).
        limit: evaluate only the first ``limit`` conversations (smoke runs).
        max_new_tokens: answer limit; default: the protocol's (official 32, paper 50).
        split: which data file to read when ``source`` is a folder or Hub id holding several (files
            named after the split).
        protocol: ``"official"`` or ``"paper"`` (see the module docstring).
        categories: the question categories asked (default 1-4; 5, adversarial, under ``official`` only).
    """

    name = "locomo"
    metrics = ("f1",)
    official_files = {OFFICIAL_DATA_SHA256: f"locomo10.json of snap-research/locomo at {OFFICIAL_COMMIT[:7]}"}

    def __init__(
        self,
        source: str,
        limit: int | None = None,
        max_new_tokens: int | None = None,
        split: str = "train",
        protocol: str = "official",
        categories: Collection[int] = SCORED_CATEGORIES,
    ) -> None:
        self.protocol = scorers.check_protocol(protocol)
        self.categories = check_categories(categories, self.protocol)
        self.samples = read_benchmark(source, split, DATA)[:limit]
        self.max_new_tokens = max_new_tokens or MAX_NEW_TOKENS[protocol]
        asked = sum(int(qa["category"]) in self.categories for sample in self.samples for qa in sample["qa"])
        expected = sum(LOCOMO10_PER_CATEGORY[c] for c in self.categories)
        if limit is None and len(self.samples) == 10 and asked != expected:
            first, last = self.categories[0], self.categories[-1]
            contiguous = self.categories == tuple(range(first, last + 1))
            names = f"{first}-{last}" if contiguous and last > first else ", ".join(map(str, self.categories))
            warnings.warn(
                f"{source}: {asked} category {names} questions, not LoCoMo-10's {expected}; "
                "is this the official locomo10.json?",
                stacklevel=2,
            )

    def __len__(self) -> int:
        return len(self.samples)

    def histories(self) -> Iterator[History]:
        official = self.protocol == "official"
        for n, sample in enumerate(self.samples):
            sample_id = str(sample.get("sample_id", n))
            conversation = sample["conversation"]
            sessions = official_sessions(conversation) if official else paper_sessions(conversation)
            questions = [
                self._question(f"{sample_id}/{i}", qa)
                for i, qa in enumerate(sample["qa"])
                if int(qa["category"]) in self.categories
            ]
            system = None if official else PAPER_SYSTEM
            keys, texts = conversation_turns(conversation)
            render = official_sessions if official else paper_sessions

            def select(indices, conversation=conversation, keys=keys, render=render, whole=sessions):
                kept = {keys[i] for i in indices}
                return list(whole) if len(kept) == len(keys) else render(conversation, kept)

            yield History(
                sample_id,
                "".join(sessions),
                questions,
                segments=sessions,
                system=system,
                turns=texts,
                select=select,
            )

    def _question(self, qid: str, qa: dict[str, Any]) -> Question:
        """One question of a sample: its prompt, gold answer and group (a category-5 question offers
        its trap answer and :data:`NOT_MENTIONED`, the gold)."""
        category = int(qa["category"])
        meta: dict[str, Any] = {"category": category, "question": qa["question"]}
        gold = qa.get("answer")
        if category == ADVERSARIAL:  # the released file names the trap "adversarial_answer"
            meta["options"] = adversarial_options(str(qa.get("adversarial_answer", gold)), qid)
            gold = NOT_MENTIONED
        return Question(
            id=qid,
            prompt=question_prompt(qa["question"], category, self.protocol, meta.get("options")),
            answer=str(gold),
            max_new_tokens=self.max_new_tokens,
            group=CATEGORY_NAMES[category],
            meta=meta,
        )

    def settings(self) -> dict[str, Any]:
        out = {
            **super().settings(),
            "conversations": len(self.samples),
            "max_new_tokens": self.max_new_tokens,
        }
        if self.categories != SCORED_CATEGORIES:  # recorded when not the default (older records lack it)
            out["categories"] = list(self.categories)
        return out

    def score(self, question: Question, prediction: str) -> dict[str, float]:
        """The protocol's F1 for categories 1-4; for category 5 the official rule under both protocols
        (δ-Mem's suite has none): 1 when the answer, its option letter read as the option, says the
        fact is not mentioned."""
        category = question.meta["category"]
        if category == ADVERSARIAL:
            if "options" not in question.meta:
                raise ValueError(
                    f"{question.id}: a category-5 answer is scored with the options it was asked with "
                    "(meta['options']), which this record lacks"
                )
            return {"f1": scorers.locomo_adversarial_score(prediction, question.meta["options"])}
        if category not in SCORED_CATEGORIES:
            raise ValueError(f"LoCoMo category {category} is not one of 1-5")
        if self.protocol == "official":
            return {"f1": scorers.locomo_official_score(prediction, question.answer, category)}
        return {"f1": scorers.locomo_paper_score(prediction, question.answer, category)}

    def summarize(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Question-weighted F1 per category (in category order) and overall."""
        order = {name: c for c, name in CATEGORY_NAMES.items()}
        return question_weighted(sorted(records, key=lambda r: order[r["group"]]), self.metrics)
