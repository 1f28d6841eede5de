"""The recall-by-length table (lstmem_peft.eval.english_recall): what each condition puts in the prompt
and in memory, the window's cut, scoring, resuming, and the Markdown table."""

from __future__ import annotations

import string

import pytest
import torch
from tiny_models import make

from lstmem_peft import MemoryCache, write_history
from lstmem_peft.eval import english_recall as er
from lstmem_peft.training.english import english_episodes
from lstmem_peft.utils.offline import char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer("".join(c for c in string.printable[:95] if c not in "`~^") + "\n")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return make("llama", block_size=32).float()


def episodes(tok, n=3, length=120):
    return english_episodes(
        n, "heldout", seed=3, num_facts=1, chatter=(1.0, 2.0), history_tokens=length, tokenizer=tok
    )


@pytest.mark.parametrize(
    ("answer", "gold", "hit"),
    [
        ("Calgary", "Calgary", True),
        (" calgary, in Canada", "Calgary", True),
        ("April 4th", "April 4", False),  # "4th" is not "4"
        ("April 4 at noon", "April 4", True),
        ("42", "4", False),
        ("", "Oslo", False),
        ("New York", "York", False),
    ],
)
def test_a_hit_is_the_gold_at_the_start_of_the_answer_at_a_word_boundary(answer, gold, hit):
    assert er.recall_hit(answer, gold) is hit


def test_each_condition_gets_the_tokens_it_names(tok):
    e = episodes(tok, 1, length=200)[0]
    body = tok(e["history"], add_special_tokens=False)["input_ids"]
    question = tok(e["prompt"], add_special_tokens=False)["input_ids"]
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    roomy = er.episode_inputs(tok, e, window=4096, max_new_tokens=8)
    assert roomy["history"] == bos + body  # written into memory as write_history writes histories
    assert roomy["prompt"] == bos + question  # memory and no history: the question alone
    assert roomy["context"] == bos + body + newline + question == roomy["window"]
    assert roomy["history_tokens"] == roomy["window_tokens"] == len(body)
    window = len(question) + len(newline) + len(bos) + 8 + 50  # room for the last 50 history tokens
    tight = er.episode_inputs(tok, e, window=window, max_new_tokens=8)
    assert tight["context"] is None  # the whole history no longer fits
    assert tight["window"] == bos + body[-50:] + newline + question
    assert len(tight["window"]) + 8 == window and tight["window_tokens"] == 50
    with pytest.raises(ValueError, match="raise --window"):
        er.episode_inputs(tok, e, window=len(question) + 8, max_new_tokens=8)


def test_the_memory_and_plain_answers_are_the_models_own(tiny, tok):
    e = episodes(tok, 1, length=90)[0]
    record = er.answer_episode(tiny, tok, e, window=4096, max_new_tokens=4)
    inputs = er.episode_inputs(tok, e, 4096, 4)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def text(out, ids):
        return tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True).strip()

    with torch.no_grad():
        memory = MemoryCache()
        write_history(tiny, torch.tensor([inputs["history"]]), memory, progress=False)
        ids = torch.tensor([inputs["prompt"]])
        out = tiny.generate(
            input_ids=ids,
            memory_cache=memory,
            memory_write=False,
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=pad,
        )
        assert record["answers"]["memory"] == text(out, ids)
        with tiny.disable_adapter():
            ids = torch.tensor([inputs["context"]])
            out = tiny.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=pad)
        assert record["answers"]["context"] == text(out, ids)
    assert record["fits"] and set(record["hits"]) == set(er.CONDITIONS)
    with pytest.raises(ValueError, match="unknown conditions"):
        er.answer_episode(tiny, tok, e, conditions=("in_context",), window=4096)


def test_a_fact_the_window_cuts_off_is_missed_where_the_whole_history_would_answer(monkeypatch, tok):
    """An oracle that answers with the gold exactly when the gold is in its prompt (or, for memory,
    in what was written): the window misses a fact stated before its cut, and memory does not."""
    written: list[list[int]] = []

    def oracle(model, ids, pad_id, max_new_tokens, memory):
        seen = tok.decode(ids) + (tok.decode(written[-1]) if memory is not None else "")
        gold = current["gold"]
        return tok(" " + gold if gold in seen else " nothing", add_special_tokens=False)["input_ids"]

    monkeypatch.setattr(er, "_greedy", oracle)
    monkeypatch.setattr(er, "write_history", lambda model, ids, memory, **kw: written.append(ids[0].tolist()))
    e = english_episodes(1, "heldout", seed=1, num_facts=1, chatter=0.0, history_tokens=600, tokenizer=tok)[0]
    e = {**e, "history": e["gold"] + " is the answer.\n" + e["history"].replace(e["gold"], "it")}
    current = e
    inputs = er.episode_inputs(tok, e, window=4096, max_new_tokens=8)
    cut = len(inputs["prompt"]) + 8 + 100  # the window holds the last 99 or so history tokens
    record = er.answer_episode(torch.nn.Linear(1, 1), tok, e, window=cut, max_new_tokens=8)
    assert record["hits"] == {"window": False, "none": False, "memory": True}  # "context" does not fit
    assert not record["fits"]
    record = er.answer_episode(torch.nn.Linear(1, 1), tok, e, window=4096, max_new_tokens=8)
    assert record["hits"] == {"context": True, "window": True, "none": False, "memory": True}


def test_the_table_resumes_without_answering_twice(monkeypatch, tok):
    calls = []

    def fake(model, tokenizer, episode, **kw):
        calls.append(episode["question"])
        hit = len(calls) % 2 == 0
        return {
            "question": episode["question"],
            "history_tokens": 10,
            "fits": True,
            "hits": {"memory": hit, "none": False},
            "answers": {},
            "seconds": {},
        }

    monkeypatch.setattr(er, "answer_episode", fake)
    journal = []
    first = er.recall_by_length(
        None,
        tok,
        lambda n: episodes(tok, 4, n),
        [60, 120],
        conditions=("memory", "none"),
        window=512,
        progress=False,
        on_record=lambda n, r: journal.append((n, r)),
    )
    assert len(calls) == 8 and len(journal) == 8
    done = {60: [r for n, r in journal if n == 60], 120: [r for n, r in journal if n == 120][:1]}
    calls.clear()
    again = er.recall_by_length(
        None,
        tok,
        lambda n: episodes(tok, 4, n),
        [60, 120],
        conditions=("memory", "none"),
        window=512,
        progress=False,
        done=done,
    )
    assert len(calls) == 3  # only the missing answers
    assert [row["conditions"]["memory"]["n"] for row in again["rows"]] == [4, 4]
    row = first["rows"][0]["conditions"]
    assert row["memory"]["recall"] == 0.5 and row["none"]["recall"] == 0.0
    low, high = row["memory"]["ci"]
    assert 0.0 <= low <= 0.5 <= high <= 1.0
    table = er.markdown_table(first)
    assert table.splitlines()[0] == "| history (tokens) | memory | none |"
    assert "0.50 [" in table and "(n=4)" in table


def test_a_condition_no_episode_ran_reads_as_not_fitting():
    result = {
        "conditions": ["context"],
        "rows": [{"history_tokens": 9000, "conditions": er.summarise([], ["context"])}],
    }
    assert "does not fit" in er.markdown_table(result)


def test_a_prompt_two_conditions_share_is_answered_once(monkeypatch, tok):
    """Where the history fits, "context" and "window" are one prompt: one greedy decode, one answer."""
    e = episodes(tok, 1, length=200)[0]
    calls = []

    def greedy(model, ids, pad, max_new_tokens, memory):
        calls.append(list(ids))
        return tok(" " + e["gold"], add_special_tokens=False)["input_ids"]

    monkeypatch.setattr(er, "_greedy", greedy)
    record = er.answer_episode(object(), tok, e, conditions=("context", "window", "none"), window=4096)
    assert len(calls) == 2 and calls[0] != calls[1]  # context (= window), then the question alone
    assert record["answers"]["context"] == record["answers"]["window"] and all(record["hits"].values())
