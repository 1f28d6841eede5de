"""Conversation episodes in the trainer's data formats (issue 36): the JSONL format, the layout of a
conversation as the server runs it, and the loss on every answer.

The layout (:func:`tokenize_conversation`, through :class:`ServedConversation`) is checked here on
explicit conversations, token by token; ``tests/test_serve_conversation.py`` holds the same rule to
the server's stored memory bit for bit. The trainer's loss on a batch of conversation episodes is
checked against the steps written out by hand (history, read, the turn's write calls, read, ...),
and its answer-token count (which normalises the loss) includes the later turns' answers.
"""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset
from peft import get_peft_model

from lstmem_peft import LSTMemConfig, MemoryCache, write_history
from lstmem_peft.training.data import (
    ServedConversation,
    load_episodes,
    synthetic_conversation_episodes,
    synthetic_recall_episodes,
    tokenize_conversation,
    tokenize_episode,
)
from lstmem_peft.training.trainer import LSTMemTrainer, LSTMemTrainingConfig
from lstmem_peft.utils.chat import ChatFormat
from lstmem_peft.utils.offline import demo_tokenizer, tiny_qwen3

FACTS = "k07 v19 ; k12 v03 ; k01 v05 ; k02 v11 ; k30 v08 ; k04 v01 ; k09 v22 ; k10 v13 ;"
EPISODE = {
    "history": "",
    "turns": [
        {"prompt": FACTS, "answer": ""},
        {"prompt": "? k12", "answer": " v03"},
        {"prompt": "? k30", "answer": " v08"},
    ],
}


def test_conversation_jsonl_records_become_episodes(tmp_path):
    path = tmp_path / "chat.jsonl"
    record = {
        "history": "a document",
        "messages": [
            {"role": "user", "content": "first?"},
            {"role": "assistant", "content": "one"},
            {"role": "user", "content": "second?"},
            {"role": "assistant", "content": "two"},
        ],
    }
    path.write_text(json.dumps(record) + "\n")
    assert load_episodes(str(path), "conversation") == [
        {
            "history": "a document",
            "turns": [{"prompt": "first?", "answer": "one"}, {"prompt": "second?", "answer": "two"}],
        }
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": record["messages"][:3]}) + "\n")
    with pytest.raises(ValueError, match="alternating user and assistant"):
        load_episodes(str(bad), "conversation")


def test_a_newest_only_client_writes_each_message_after_its_answer():
    """Each turn reads its own message alone; what it writes (the message, and the answer under
    ``messages_and_answer``) is written before the next turn reads, in one call."""
    tok = demo_tokenizer()
    fmt = ChatFormat(tok)
    facts, q1, q2 = (fmt.message("user", t["prompt"]) for t in EPISODE["turns"])
    eos = [tok.eos_token_id]
    row = tokenize_conversation(tok, EPISODE, client="newest")
    assert row["history_input_ids"] == []
    assert row["input_ids"] == facts + eos and row["labels"] == [-100] * len(facts) + eos
    assert row["turn_writes"] == [[facts], [q1]]
    v03, v08 = fmt.encode_text(" v03"), fmt.encode_text(" v08")
    assert row["turn_input_ids"] == [q1 + v03 + eos, q2 + v08 + eos]
    assert row["turn_labels"] == [[-100] * len(q1) + v03 + eos, [-100] * len(q2) + v08 + eos]
    both = tokenize_conversation(tok, EPISODE, client="newest", write="messages_and_answer")
    answer = fmt.message("assistant", "")  # the facts turn's answer is empty: its message is BOS alone
    assert both["turn_writes"] == [[facts + answer], [q1 + fmt.message("assistant", "v03")]]


def test_a_resending_client_reads_what_fits_its_window_and_writes_only_new_messages():
    """Window 32, max_tokens 4: the facts (25 tokens) leave the prompt once the conversation grows;
    the earlier answers, sent back, are new messages (written once, in the prompt or before it)."""
    tok = demo_tokenizer()
    fmt = ChatFormat(tok)
    facts, q1, q2 = (fmt.message("user", t["prompt"]) for t in EPISODE["turns"])
    a0, a1 = fmt.message("assistant", ""), fmt.message("assistant", "v03")
    row = tokenize_conversation(tok, EPISODE, client="resend", window=32, max_tokens=4)
    assert row["turn_writes"] == [[facts], [a0 + q1]]
    prompts = [
        ids[: labels.index(next(y for y in labels if y != -100))]
        for ids, labels in zip(row["turn_input_ids"], row["turn_labels"], strict=True)
    ]
    assert prompts == [a0 + q1, a0 + q1 + a1 + q2]
    # the facts as the history and a window so short that an answer sent back falls out of it:
    # written before the read, in a call of its own
    questions = {"history": FACTS, "turns": EPISODE["turns"][1:]}
    short = tokenize_conversation(tok, questions, client="resend", window=8, max_tokens=4)
    assert short["history_input_ids"] == [tok.bos_token_id] + fmt.encode_text(FACTS)
    assert short["turn_writes"] == [[q1, a1]]
    assert short["turn_input_ids"][0][: len(q2)] == q2 and len(short["turn_input_ids"][0]) == len(q2) + 2


def test_conversations_that_cannot_be_served_are_refused():
    tok = demo_tokenizer()
    with pytest.raises(ValueError, match="does not fit"):
        tokenize_conversation(tok, EPISODE, client="newest", window=16, max_tokens=4)
    with pytest.raises(ValueError, match="client must be one of"):
        ServedConversation(tok, client="everything")
    with pytest.raises(ValueError, match="write must be one of"):
        ServedConversation(tok, write="none")
    with pytest.raises(ValueError, match="at least one turn"):
        tokenize_conversation(tok, {"history": "x", "turns": []})


def _trainer(tmp_path, rows):
    tok = demo_tokenizer()
    torch.manual_seed(0)
    model = get_peft_model(tiny_qwen3(len(tok), hidden_size=64, num_layers=2), LSTMemConfig(block_size=8))
    args = LSTMemTrainingConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=len(rows),
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        context_dropout=0.0,
    )
    data = Dataset.from_list(rows)
    return model, LSTMemTrainer(model=model, args=args, train_dataset=data, processing_class=tok)


def _mixed_rows():
    """Plain episodes and conversation episodes of both clients and policies, in one dataset."""
    tok = demo_tokenizer()
    plain = [tokenize_episode(tok, e) for e in synthetic_recall_episodes(3, 4, seed=1)]
    conversations = [
        tokenize_conversation(tok, e, client=client, write=write, window=40, max_tokens=4)
        for e, (client, write) in zip(
            synthetic_conversation_episodes(4, 6, 3, seed=2)
            + synthetic_conversation_episodes(1, 6, 2, seed=3, facts_in="history"),
            [
                ("newest", "messages"),
                ("resend", "messages"),
                ("newest", "messages_and_answer"),
                ("resend", "messages_and_answer"),
                ("resend", "messages"),
            ],
            strict=True,
        )
    ]
    return plain + conversations


def _by_hand(model, rows, block_size=8):
    """The loss written out: per row alone, the history, the first read, then each later turn's
    write calls and read; the mean cross-entropy over every answer token of all rows."""
    total, count = 0.0, 0
    for row in rows:
        memory = MemoryCache()
        if row["history_input_ids"]:
            write_history(
                model, torch.tensor([row["history_input_ids"]]), memory, block_size=block_size, progress=False
            )
        reads = [([], row["input_ids"], row["labels"])] + list(
            zip(row["turn_writes"], row["turn_input_ids"], row["turn_labels"], strict=True)
        )
        for writes, ids, labels in reads:
            for tokens in writes:
                write_history(model, torch.tensor([tokens]), memory, block_size=block_size, progress=False)
            logits = model(input_ids=torch.tensor([ids]), memory_cache=memory, memory_write=False).logits[
                0, :-1
            ]
            targets = torch.tensor(labels[1:])
            keep = targets != -100
            total = total + torch.nn.functional.cross_entropy(
                logits[keep].float(), targets[keep], reduction="sum"
            )
            count += int(keep.sum())
    return total / count, count


def test_the_loss_covers_every_answer_of_a_conversation_in_the_servers_order(tmp_path):
    rows = _mixed_rows()
    model, trainer = _trainer(tmp_path, rows)
    model.eval()
    batch = trainer.data_collator(rows)
    assert len(batch["turns"]) == 3  # the longest conversation's later turns
    with torch.no_grad():
        got = trainer.compute_loss(model, batch)
        expected, count = _by_hand(model, rows)
    # float32 sums of a few hundred terms of size ~log(vocab): a few ulps of 4 each
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (got, expected)
    samples, counted = trainer.get_batch_samples(iter([batch]), 1, torch.device("cpu"))
    assert int(counted) == count  # the loss's normaliser counts the later turns' answers too


def test_one_question_rows_and_conversations_share_a_dataset(tmp_path):
    """One-question rows first in ``Dataset.from_list`` (which takes its columns from the first
    row): the conversations keep their turns, and the one-question rows' loss in the mixed batch is
    the loss of a dataset of them alone."""
    tok = demo_tokenizer()
    plain = [tokenize_episode(tok, e) for e in synthetic_recall_episodes(3, 4, seed=1)]
    conversations = [
        tokenize_conversation(tok, e, client=client, window=40, max_tokens=4)
        for e, client in zip(
            synthetic_conversation_episodes(2, 6, 3, seed=2), ("newest", "resend"), strict=True
        )
    ]
    mixed = list(Dataset.from_list(plain + conversations))
    assert mixed[len(plain) :] == conversations  # no turn column dropped
    alone = list(Dataset.from_list(plain))
    model, trainer = _trainer(tmp_path, plain + conversations)
    model.eval()
    batch = trainer.data_collator(mixed)
    assert len(batch["turns"]) == 3  # the facts turn, then 3 questions
    for read in [batch, *batch["turns"]]:  # the one-question rows' answers alone carry the loss
        read["labels"][len(plain) :] = -100
    with torch.no_grad():
        got = trainer.compute_loss(model, batch)
        expected = trainer.compute_loss(model, trainer.data_collator(alone))
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (got, expected)


def test_a_conversation_trains_through_the_written_turns(tmp_path):
    """Stage 1: a later turn's loss reaches the write gates through the earlier turns' writes."""
    rows = _mixed_rows()
    model, trainer = _trainer(tmp_path, rows)
    batch = trainer.data_collator(rows)
    only_turns = {**batch, "labels": torch.full_like(batch["labels"], -100)}  # the first reads carry no loss
    trainer.compute_loss(model, only_turns).backward()
    gates = [p.grad for n, p in model.named_parameters() if "w_gate" in n]
    assert gates and all(g is not None and g.abs().sum() > 0 for g in gates)
