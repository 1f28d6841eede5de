"""English memory episodes (lstmem_peft.training.english) and the forced-choice check
(lstmem_peft.eval.forced_choice), issue 45 item 2.

The generator: deterministic by seed; train and held-out splits disjoint in names, values, sentence
forms, question forms and relations (by construction, and by reading the generated text back against
every form); updates make the later value the gold; the gold is in the history and among the choices;
chatter states no value; each difficulty knob does what it says. The scorer: right counts and
accuracies on a tiny random model, each candidate's score equal to the log-likelihood worked out
with plain forwards, and the pick its argmax (a model made certain of one answer picks it).
"""

from __future__ import annotations

import itertools
import random
import re
import string

import pytest
import torch
from tiny_models import make

from lstmem_peft import MemoryCache, write_history
from lstmem_peft.eval.forced_choice import choice_rows, forced_choice, swap_histories
from lstmem_peft.training.data import tokenize_conversation, tokenize_episode
from lstmem_peft.training.english import (
    CURRICULUM,
    TRAIN_RELATIONS,
    as_conversation,
    english_conversations,
    english_episodes,
    near_misses,
)
from lstmem_peft.training.english_forms import (
    ACKNOWLEDGEMENTS,
    CHATTER,
    HELDOUT_RELATIONS,
    RELATIONS,
    REPLIES,
)
from lstmem_peft.training.english_words import POOLS
from lstmem_peft.utils.chat import ChatFormat
from lstmem_peft.utils.offline import char_tokenizer

#: Enough knobs turned that every kind of line shows up: notes and chat, updates, chatter.
WIDE = dict(num_facts=(1, 6), chatter=(0.0, 2.0), updates=0.4, same_relation=0.5)
STATEMENT_FORMS = ("said", "self", "update", "update_self")
SPEAKER = r"(?:[A-Z][a-z]+: )?"


def word_in(word: str, text: str, case: bool = False) -> bool:
    flags = 0 if case else re.IGNORECASE
    return re.search(r"(?<!\w)" + re.escape(word) + r"(?!\w)", text, flags) is not None


def form_regex(form: str) -> re.Pattern:
    """A sentence form as a regex: a person's slot is one capitalised word, any other slot any text;
    a chat line's ``"Name: "`` in front is optional."""
    out = []
    for part in re.split(r"(\{\w+\})", form):
        slot = re.fullmatch(r"\{(\w+)\}", part)
        out.append(
            ("[A-Z][a-z]+" if slot.group(1) in ("name", "other") else ".+?") if slot else re.escape(part)
        )
    return re.compile(SPEAKER + "".join(out))


def forms(split: str, which: tuple[str, ...]) -> list[re.Pattern]:
    return [
        form_regex(f) for spec in RELATIONS.values() for w in which for f in spec.get(split, {}).get(w, [])
    ]


def chatter_regex(split: str) -> re.Pattern:
    words = CHATTER[split]
    when = "|".join(map(re.escape, words["when"]))
    what = "|".join(map(re.escape, words["what"]))
    talk = "|".join(map(re.escape, words["talk"]))
    return re.compile(f"{SPEAKER}(?:(?:{when}) (?:{what})\\.|{talk})")


def all_values() -> list[str]:
    return [v for pool in POOLS.values() for part in pool.values() for v in part]


@pytest.fixture(scope="module")
def generated():
    """Train and held-out episodes with every kind of line in them (both styles)."""
    return {
        split: english_episodes(150, split, seed=7, **WIDE)
        + english_episodes(30, split, seed=8, style="chat", **WIDE)
        + english_episodes(30, split, seed=9, style="notes", **WIDE)
        for split in ("train", "heldout")
    }


def tokenizer96():
    """A character tokenizer with the tiny models' 96 ids (three rare characters dropped)."""
    return char_tokenizer("".join(c for c in string.printable[:95] if c not in "`~^") + "\n")


# ---------------------------------------------------------------------- determinism
def test_the_same_seed_gives_the_same_episodes_and_episode_i_does_not_depend_on_how_many():
    a = english_episodes(20, "train", seed=3, **WIDE)
    assert a == english_episodes(20, "train", seed=3, **WIDE)
    assert a[:5] == english_episodes(5, "train", seed=3, **WIDE)
    assert [e["history"] for e in a] != [e["history"] for e in english_episodes(20, "train", seed=4, **WIDE)]
    c = english_conversations(5, "heldout", seed=1, chatter=1.0)
    assert c == english_conversations(5, "heldout", seed=1, chatter=1.0)


# ---------------------------------------------------------------------- the split
def test_the_splits_are_disjoint_by_construction():
    for kind, pool in POOLS.items():
        assert not set(pool["train"]) & set(pool["heldout"]), kind
    for name, spec in RELATIONS.items():
        train = {f for w in (*STATEMENT_FORMS, "ask") for f in spec.get("train", {}).get(w, [])}
        heldout = {f for w in (*STATEMENT_FORMS, "ask") for f in spec["heldout"].get(w, [])}
        assert not train & heldout, name
        assert heldout and (bool(train) == (name not in HELDOUT_RELATIONS)), name
    assert set(TRAIN_RELATIONS).isdisjoint(HELDOUT_RELATIONS)
    for split_words in (CHATTER, ACKNOWLEDGEMENTS, REPLIES):
        train, heldout = split_words["train"], split_words["heldout"]
        if isinstance(train, dict):
            for part in train:
                assert not set(train[part]) & set(heldout[part])
        else:
            assert not set(train) & set(heldout)
    with pytest.raises(ValueError, match="relations of the train split"):
        english_episodes(1, "train", relations=["birthplace"])


def test_no_value_of_one_pool_is_a_word_of_another():
    """A value is recognisable as itself: no value of one kind hides inside another kind's."""
    for (k1, p1), (k2, p2) in itertools.permutations(POOLS.items(), 2):
        values2 = [v for part in p2.values() for v in part]
        for v in (v for part in p1.values() for v in part):
            assert not any(word_in(v, w) for w in values2), (k1, v, k2)


def test_the_generated_text_of_one_split_reads_as_no_form_of_the_other(generated):
    assert any(
        r.fullmatch("Tom: Agnes lives in Trondheim.") for r in forms("train", STATEMENT_FORMS)
    )  # control
    for split, other in (("train", "heldout"), ("heldout", "train")):
        own = forms(split, STATEMENT_FORMS) + [chatter_regex(split)]
        foreign = forms(other, STATEMENT_FORMS) + [chatter_regex(other)]
        own_asks, foreign_asks = forms(split, ("ask",)), forms(other, ("ask",))
        for e in generated[split]:
            for line in e["history"].split("\n"):
                assert any(r.fullmatch(line) for r in own), line  # the regexes do recognise their forms
                assert not any(r.fullmatch(line) for r in foreign), line
            assert any(r.fullmatch(e["question"]) for r in own_asks), e["question"]
            assert not any(r.fullmatch(e["question"]) for r in foreign_asks), e["question"]


def test_the_generated_text_of_one_split_holds_no_name_value_or_relation_of_the_other(generated):
    for split, other in (("train", "heldout"), ("heldout", "train")):
        names = POOLS["name"][other]
        values = [v for kind, pool in POOLS.items() if kind != "name" for v in pool[other]]
        for e in generated[split]:
            text = "\n".join([e["history"], e["question"], *e["choices"]])
            assert not [n for n in names if word_in(n, text, case=True)], e["history"]
            assert not [v for v in values if word_in(v, text)], e["history"]
    assert {e["relation"] for e in generated["train"]} == set(TRAIN_RELATIONS)
    assert {f["relation"] for e in generated["train"] for f in e["facts"]} <= set(TRAIN_RELATIONS)
    heldout_asked = {e["relation"] for e in generated["heldout"]}
    assert set(HELDOUT_RELATIONS) <= heldout_asked


# ---------------------------------------------------------------------- golds, updates, choices
def test_the_gold_is_in_the_history_and_the_choices_and_only_stated_choices_count(generated):
    for e in generated["train"] + generated["heldout"]:
        assert word_in(e["gold"], e["history"])
        assert e["gold"] in e["choices"] and len(set(e["choices"])) == len(e["choices"]) >= 4
        stated = [c for c in e["choices"] if word_in(c, e["history"])]
        assert len(stated) == e["history_choices"] >= 1
        assert e["answer"] == " " + e["gold"] and e["prompt"] == f"Question: {e['question']}\nAnswer:"
        assert not word_in(e["gold"], e["question"])


def test_an_update_makes_the_later_value_the_gold():
    for e in english_episodes(60, "train", seed=2, num_facts=(1, 5), updates=1.0, chatter=1.0):
        assert all(f["old"] is not None and f["old"] != f["value"] for f in e["facts"])
        assert e["updated"] and e["superseded"] in e["choices"] and e["gold"] != e["superseded"]
        lines = e["history"].split("\n")
        first = min(i for i, line in enumerate(lines) if word_in(e["superseded"], line))
        gold = [i for i, line in enumerate(lines) if word_in(e["gold"], line)]
        assert len(gold) == 1 and gold[0] > first  # stated once, after the old value


def test_chatter_states_no_value():
    sentences = [
        f"{a} {b}." for split in CHATTER.values() for a, b in itertools.product(split["when"], split["what"])
    ]
    sentences += [t for split in CHATTER.values() for t in split["talk"]]
    sentences += [t for words in (ACKNOWLEDGEMENTS, REPLIES) for split in words.values() for t in split]
    any_value = re.compile(r"(?<!\w)(?:" + "|".join(map(re.escape, all_values())) + r")(?!\w)", re.IGNORECASE)
    for sentence in sentences:
        assert not re.search(r"\d", sentence) and not any_value.search(sentence), sentence


def test_chatter_lines_in_histories_hold_none_of_the_history_values(generated):
    for split, episodes in generated.items():
        chatter = chatter_regex(split)
        for e in episodes:
            values = [v for f in e["facts"] for v in (f["value"], f["old"]) if v]
            for line in e["history"].split("\n"):
                if chatter.fullmatch(line):  # a chat line's speaker is a person, never a fact's value
                    said = re.sub("^" + SPEAKER, "", line)
                    assert not [v for v in values if word_in(v, line)], line
                    assert not [v for v in e["choices"] if word_in(v, said)], line


# ---------------------------------------------------------------------- difficulty knobs
def test_num_facts_chatter_and_updates_do_what_they_say():
    for e in english_episodes(20, "train", seed=0, num_facts=3, chatter=0.0, updates=0.0):
        assert len(e["facts"]) == 3 and len(e["history"].split("\n")) == 3 and not e["updated"]
    for e in english_episodes(20, "train", seed=0, num_facts=3, chatter=2.0, updates=0.0):
        lines = e["history"].split("\n")
        assert len(lines) == 3 + 6 and sum(bool(chatter_regex("train").fullmatch(x)) for x in lines) == 6
    for e in english_episodes(20, "train", seed=0, num_facts=4, updates=0.5):
        assert sum(f["old"] is not None for f in e["facts"]) == 2 and len(e["history"].split("\n")) == 6
    sizes = {len(e["facts"]) for e in english_episodes(100, "train", seed=0, num_facts=(2, 5))}
    assert sizes == {2, 3, 4, 5}
    rate = [
        f["old"] is not None
        for e in english_episodes(200, "train", seed=0, num_facts=1, updates=0.3)
        for f in e["facts"]
    ]
    assert 0.2 < sum(rate) / len(rate) < 0.4  # rounded at random: holds on average


def test_same_relation_ask_updated_min_choices_style_and_relations():
    for e in english_episodes(20, "train", seed=1, num_facts=5, same_relation=1.0):
        assert {f["relation"] for f in e["facts"]} == {e["relation"]}
        assert (
            e["history_choices"] == 5 if e["kind"] != "name" else e["history_choices"] >= 5
        )  # + people named
    for e in english_episodes(20, "train", seed=1, num_facts=4, ask_updated=1.0):
        assert e["updated"]
    for e in english_episodes(20, "train", seed=1, num_facts=4, updates=0.5, ask_updated=0.0):
        assert not e["updated"]
    assert all(len(e["choices"]) >= 7 for e in english_episodes(20, "heldout", seed=1, min_choices=7))
    own = english_episodes(20, "heldout", seed=1, num_facts=8, same_relation=1.0, min_choices=1)
    assert all(len(e["choices"]) == e["history_choices"] >= 8 for e in own)  # the history's values alone
    for e in english_episodes(10, "train", seed=1, num_facts=3, chatter=1.0, style="chat"):
        assert e["style"] == "chat" and all(re.match(r"[A-Z][a-z]+: ", x) for x in e["history"].split("\n"))
    assert {e["relation"] for e in english_episodes(20, "heldout", relations=["instrument"])} == {
        "instrument"
    }
    assert [e["style"] for e in english_episodes(40, "train")].count("chat") not in (0, 40)


def test_history_tokens_fills_the_history_with_chatter_up_to_the_target():
    tok = char_tokenizer()
    for e in english_episodes(10, "train", seed=5, num_facts=(2, 4), history_tokens=1500, tokenizer=tok):
        n = len(tok(e["history"], add_special_tokens=False)["input_ids"])
        assert 1500 - 200 < n <= 1500
    for e in english_episodes(
        5, "train", seed=5, num_facts=2, history_tokens=300
    ):  # words without a tokenizer
        assert 300 - 40 < len(e["history"].split()) <= 300
    few = english_episodes(3, "train", seed=5, num_facts=20, history_tokens=10, tokenizer=tok)
    assert all(len(e["facts"]) == 20 for e in few)  # facts are never dropped to fit


def test_the_curriculum_stages_grow():
    stages = [english_episodes(30, "train", seed=0, **stage) for stage in CURRICULUM]
    facts = [sum(len(e["facts"]) for e in s) / len(s) for s in stages]
    words = [sum(len(e["history"].split()) for e in s) / len(s) for s in stages]
    assert facts == sorted(facts) and words == sorted(words)
    assert not any(e["updated"] for e in stages[0]) and max(len(e["facts"]) for e in stages[0]) <= 2


# ---------------------------------------------------------------------- the project's formats
def test_episodes_and_conversations_tokenize_in_the_projects_formats():
    tok = char_tokenizer()
    for e in english_episodes(5, "heldout", seed=0, **WIDE):
        row = tokenize_episode(tok, e)  # the evaluation fields are ignored
        assert tok.decode(row["input_ids"], skip_special_tokens=True) == e["prompt"] + e["answer"]
        tokenize_conversation(tok, as_conversation(e))
    for facts_in in ("turns", "history"):
        for c in english_conversations(
            5, "train", seed=0, questions=3, num_facts=4, chatter=1.0, facts_in=facts_in
        ):
            asked = c["turns"][-len(c["questions"]) :]
            assert len(c["questions"]) == 3 and [t["answer"] for t in asked] == [
                q["gold"] for q in c["questions"]
            ]
            assert len({q["subject"] + q["relation"] for q in c["questions"]}) == 3
            assert (c["history"] == "") == (facts_in == "turns") and (len(c["turns"]) > 3) == (
                facts_in == "turns"
            )
            told = "\n".join([c["history"], *(t["prompt"] for t in c["turns"])])
            assert all(word_in(q["gold"], told) for q in c["questions"])
            row = tokenize_conversation(tok, c, client="resend", window=256)
            assert len(row["turn_input_ids"]) == len(c["turns"]) - 1


# ---------------------------------------------------------------------- the forced-choice scorer
@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return make("llama", block_size=32).float()  # the Llama architecture of SmolLM2; 96 ids


def test_forced_choice_counts_and_accuracies(tiny):
    tok = tokenizer96()
    episodes = english_episodes(6, "heldout", seed=0, num_facts=3, chatter=0.5, updates=0.3)
    result = forced_choice(tiny, tok, episodes, conditions=("memory", "empty", "no_adapter"), batch_size=4)
    assert result["num_episodes"] == 6
    assert result["chance"] == pytest.approx(sum(1 / len(e["choices"]) for e in episodes) / 6)
    for condition in ("memory", "empty", "no_adapter"):
        scores = result["scores"][condition]
        assert [len(s) for s in scores] == [len(e["choices"]) for e in episodes]
        assert result["picked"][condition] == [max(range(len(s)), key=s.__getitem__) for s in scores]
        hits = [p == g for p, g in zip(result["picked"][condition], result["gold_index"], strict=True)]
        assert 0.0 <= result[condition] == sum(hits) / 6 <= 1.0
    assert result["gold_index"] == [e["choices"].index(e["gold"]) for e in episodes]
    assert result["scores"]["memory"] != result["scores"]["empty"]  # memory changes the reads
    assert sum(g["num_episodes"] for g in result["by"]["relation"].values()) == 6
    with pytest.raises(ValueError, match="conditions"):
        forced_choice(tiny, tok, episodes, conditions=("in_context",))


def _by_hand(model, history, reads, n_answer, memory: bool) -> list[float]:
    """Each read alone (no padding), after the history written alone: the answer tokens' log-probs."""
    out = []
    for read, n in zip(reads, n_answer, strict=True):
        cache = MemoryCache()
        if memory:
            write_history(model, torch.tensor([history]), cache, progress=False)
        logits = model(input_ids=torch.tensor([read]), memory_cache=cache, memory_write=False).logits[0]
        logp = logits[:-1].log_softmax(-1).gather(-1, torch.tensor(read[1:])[:, None])[:, 0]
        out.append(logp[-n:].sum().item())
    return out


@pytest.mark.parametrize("layout", ["chat", "text", "conversation"])
def test_each_score_is_the_log_likelihood_of_the_answer_tokens(tiny, layout):
    tok = tokenizer96()
    tok.chat_template = (
        "{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    episodes = english_episodes(3, "train", seed=4, num_facts=2, chatter=1.0)
    result = forced_choice(tiny, tok, episodes, layout=layout, batch_size=3, conditions=("memory", "empty"))
    with torch.no_grad():
        for i, e in enumerate(episodes):
            history, rows = choice_rows(tok, e, layout)
            reads, n_answer = [r for r, _ in rows], [n for _, n in rows]
            if layout == "conversation":  # each line a chat client's message, as the server writes it
                fmt = ChatFormat(tok)
                lines = e["history"].split("\n")
                assert history == [t for line in lines for t in fmt.message("user", line)]
            else:
                assert (
                    history == [tok.bos_token_id] + tok(e["history"], add_special_tokens=False)["input_ids"]
                )
            for condition in ("memory", "empty"):
                expected = _by_hand(tiny, history, reads, n_answer, memory=condition == "memory")
                assert result["scores"][condition][i] == pytest.approx(expected, abs=2e-4)
    e = episodes[0]
    _, rows = choice_rows(tok, e, layout)
    if layout != "text":  # the question through the chat template, then the value and EOS
        fmt = ChatFormat(tok)
        prompt = fmt.message("user", e["question"]) + fmt.generation_prompt()
        expected = [prompt + fmt.encode_text(c) + [tok.eos_token_id] for c in e["choices"]]
    else:
        expected = [tokenize_episode(tok, {**e, "answer": " " + c})["input_ids"] for c in e["choices"]]
    assert [r for r, _ in rows] == expected
    assert [n for _, n in rows] == [len(c) + (layout == "text") + 1 for c in e["choices"]]


def test_a_conversation_writes_each_line_as_a_message_and_the_default_system_prompt_never():
    """The ``conversation`` layout as SmolLM2's kind of template lays it out (a default system prompt
    when the conversation has none): the prompt starts with it once, memory holds each history line
    as a user message of its own and never the system prompt, as ``lstmem serve`` writes a chat
    client's turns."""
    tok = tokenizer96()
    tok.chat_template = (
        "{% if messages[0]['role'] != 'system' %}<s>[system] Be brief.\n{% endif %}"
        "{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    fmt = ChatFormat(tok)
    e = english_episodes(1, "train", seed=5, num_facts=2, chatter=1.0)[0]
    history, rows = choice_rows(tok, e, "conversation")
    system = tok("<s>[system] Be brief.\n", add_special_tokens=False)["input_ids"]
    assert fmt.preamble() == system
    lines = e["history"].split("\n")
    assert len(lines) >= 3 and history == [t for line in lines for t in fmt.message("user", line)]
    assert tok.decode(history).count("[user]") == len(lines) and "[system]" not in tok.decode(history)
    prompt = system + fmt.message("user", e["question"]) + fmt.generation_prompt()
    assert [r for r, _ in rows] == [prompt + fmt.encode_text(c) + [tok.eos_token_id] for c in e["choices"]]


def test_the_pick_is_the_likeliest_choice(tiny):
    """A model made certain of the letter Z (its logit raised by 50 everywhere) picks "ZZZ" whatever
    the memory: right when it is the gold, wrong when it is not; the mean per token and the sum agree."""
    tok = tokenizer96()
    z = tok.convert_tokens_to_ids("Z")
    episode = {"history": "Ada keeps the key in the attic.", "question": "Where is the key?", "prompt": "Q:"}
    sure = {**episode, "choices": ["abc", "ZZZ", "de"], "gold": "ZZZ"}
    wrong = {**episode, "choices": ["abc", "ZZZ", "de"], "gold": "de"}

    def favour_z(module, args, output):
        output[..., z] += 50.0
        return output

    handle = tiny.get_base_model().lm_head.register_forward_hook(favour_z)
    try:
        for per_token in (False, True):
            result = forced_choice(
                tiny, tok, [sure, wrong], conditions=("memory", "empty"), per_token=per_token
            )
            assert result["memory"] == result["empty"] == 0.5 and result["picked"]["memory"] == [1, 1]
        plain = forced_choice(tiny, tok, [sure], add_eos=False)["scores"]["memory"][0]
        mean = forced_choice(tiny, tok, [sure], add_eos=False, per_token=True)["scores"]["memory"][0]
        assert plain[1] > -1e-3 and plain[1] > max(plain[0], plain[2]) + 90  # Z is certain, a and d are not
        assert mean == pytest.approx(
            [s / len(c) for s, c in zip(plain, sure["choices"], strict=True)], abs=1e-5
        )
    finally:
        handle.remove()
    with pytest.raises(ValueError, match="not among the choices"):
        forced_choice(tiny, tok, [{**sure, "gold": "nope"}])


def test_swap_histories_gives_each_question_another_history_of_its_relation():
    episodes = english_episodes(
        12, "heldout", seed=5, num_facts=(1, 1), relations=["age", "room"], same_relation=1.0, style="notes"
    )
    swapped = swap_histories(episodes)
    assert len(swapped) == len(episodes)
    for before, after in zip(episodes, swapped, strict=True):
        assert {k: v for k, v in after.items() if k != "history"} == {
            k: v for k, v in before.items() if k != "history"
        }
        donor = next(e for e in episodes if e["history"] == after["history"])
        assert donor is not before and donor["relation"] == before["relation"]
        assert donor["gold"] != before["gold"] and before["gold"] not in after["history"]
    alone = swap_histories(episodes[:1])  # nothing to swap with: its own history, not an error
    assert alone[0]["history"] == episodes[0]["history"]


def test_near_misses_change_only_digits_and_alternate_order_and_one_digit():
    rng = random.Random(0)
    misses = near_misses("1482", 6, rng)
    assert len(misses) == len(set(misses)) == 6 and "1482" not in misses
    reordered = [m for m in misses if sorted(m) == sorted("1482")]
    changed = [m for m in misses if sum(a != b for a, b in zip(m, "1482", strict=True)) == 1]
    assert set(reordered) | set(changed) == set(misses)
    assert misses[0::2] == reordered[:3] and misses[1::2] == changed[:3]  # the two kinds in turn
    # every character that is not a digit stays where it was
    for value in ["May 19", "January 3", "811"]:
        for miss in near_misses(value, 8, random.Random(1)):
            assert len(miss) == len(value) and miss != value
            assert all(a == b for a, b in zip(miss, value, strict=True) if not b.isdigit())
    # one kind runs out: the other fills; no digits, or none asked: nothing
    assert len(near_misses("January 3", 4, rng)) == 4  # one digit: no other order
    assert near_misses("Oslo", 3, rng) == [] and near_misses("29", 0, rng) == []
    assert near_misses("29", 3, random.Random(7)) == near_misses("29", 3, random.Random(7))
