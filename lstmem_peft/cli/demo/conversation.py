"""Recall over a conversation: the demo's facts, then questions in later turns (issue 36).

A chat user writes the facts as the first turn and asks about them in later turns; every turn is
written into memory as ``lstmem serve`` writes it (the questions too, under the default write
policy ``messages``). :func:`evaluate_conversation` measures recall at each question position,
through the library, by the server's own turn rule
(:class:`~lstmem_peft.training.data.ServedConversation`), for the two kinds of chat client:

* ``newest``: sends only its newest message (the served window: :data:`WINDOW`);
* ``resend``: re-sends the whole conversation into a window too short for it
  (:data:`RESEND_WINDOW` tokens: the facts alone are 25), so the facts leave the prompt after the
  first turn and the earlier questions and answers fill it.

``lstmem demo`` prints the table (:func:`format_conversation`); ``tests/test_serve_conversation.py``
measures the same through the server and holds the two to each other.
"""

from __future__ import annotations

import torch

from lstmem_peft.memory.cache import MemoryCache
from lstmem_peft.training.data import CLIENTS, ServedConversation, left_pad, synthetic_conversation_episodes
from lstmem_peft.tuner.history import write_history
from lstmem_peft.utils.offline import demo_tokenizer

from .recall import NUM_PAIRS, SEEDS_DOC, WINDOW, _pad_id, caption, standard_error

#: Questions asked after the facts, each in its own turn.
QUESTIONS = 4
#: The re-sending client's window: the facts (25 tokens) fit the first turn, the conversation does not.
RESEND_WINDOW = 32
#: ``max_tokens`` of every request (a demo answer is one value and the end of sequence).
MAX_TOKENS = 4
#: Each client's window.
CLIENT_WINDOWS = {"newest": WINDOW, "resend": RESEND_WINDOW}
#: The seed of the measured conversations (held out: training draws its own).
CONVERSATION_SEED = 31337


def _write(model, rows: list[list[int]], cache: MemoryCache, pad: int) -> None:
    """One ``write_history`` call over the batch; empty rows are left as they are."""
    if any(rows):
        ids, mask = left_pad(rows, pad)
        write_history(model, ids, cache, attention_mask=mask, progress=False)


@torch.no_grad()
def _answers(model, tok, prompts: list[list[int]], cache: MemoryCache, max_tokens: int) -> list[str]:
    """Greedy answers of left-padded ``prompts`` with memory read-only, cut at EOS, as text."""
    pad = _pad_id(tok)
    ids, mask = left_pad(prompts, pad)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        memory_cache=cache,
        memory_write=False,
        max_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=pad,
    )[:, ids.shape[1] :].tolist()
    texts = []
    for row in out:
        row = row[: row.index(tok.eos_token_id)] if tok.eos_token_id in row else row
        texts.append(tok.decode(row, skip_special_tokens=True).strip())
    return texts


@torch.no_grad()
def evaluate_conversation(
    model,
    tokenizer=None,
    client: str = "newest",
    write: str = "messages",
    window: int | None = None,
    num_sessions: int = 256,
    num_pairs: int = NUM_PAIRS,
    questions: int = QUESTIONS,
    max_tokens: int = MAX_TOKENS,
    seed: int = CONVERSATION_SEED,
    batch_size: int = 64,
) -> dict:
    """Recall at each question position of conversations run by the server's turn rule.

    Each session: the ``num_pairs`` facts as the first chat turn, then ``questions`` turns each
    asking a different fact (``? k07``); an answer is right when its first word is the fact's value.
    Sessions run ``batch_size`` at a time (memory rows of one batch; a session's memory is its own).

    Args:
        model: the demo model (a PeftModel with an LSTMem adapter).
        tokenizer: default: the demo tokenizer.
        client: ``"newest"`` or ``"resend"`` (:class:`~lstmem_peft.training.data.ServedConversation`).
        write: the write policy, ``"messages"`` (the server's default) or ``"messages_and_answer"``.
        window: the context window; default: :data:`CLIENT_WINDOWS` of the client.
        num_sessions, num_pairs, questions, max_tokens, seed: the conversations.
        batch_size: sessions per batch.

    Returns:
        ``{"recall_by_position": [float] * questions, "answers": [[str] * questions] per session,
        "client", "write", "window", "num_sessions"}``.
    """
    if client not in CLIENTS:
        raise ValueError(f"client must be one of {CLIENTS}, got {client!r}")
    tok = tokenizer or demo_tokenizer()
    window = CLIENT_WINDOWS[client] if window is None else window
    pad = _pad_id(tok)
    episodes = synthetic_conversation_episodes(num_sessions, num_pairs, questions, seed=seed)
    answers: list[list[str]] = []
    for start in range(0, num_sessions, batch_size):
        part = episodes[start : start + batch_size]
        sessions = [ServedConversation(tok, client, write, window, max_tokens) for _ in part]
        cache, after = MemoryCache(), [[] for _ in part]
        got: list[list[str]] = [[] for _ in part]
        for turn in range(len(part[0]["turns"])):
            asked = [s.ask(e["turns"][turn]["prompt"]) for s, e in zip(sessions, part, strict=True)]
            _write(model, after, cache, pad)  # the previous turn's writes, as its commit made them
            _write(model, [before for before, _ in asked], cache, pad)
            texts = _answers(model, tok, [prompt for _, prompt in asked], cache, max_tokens)
            after = [s.answered(text) for s, text in zip(sessions, texts, strict=True)]
            if turn:  # the first turn gives the facts
                for g, text in zip(got, texts, strict=True):
                    g.append(text)
        answers += got
    gold = [[t["answer"].strip() for t in e["turns"][1:]] for e in episodes]
    hits = [
        sum(a[q].split()[:1] == [g[q]] for a, g in zip(answers, gold, strict=True)) / num_sessions
        for q in range(questions)
    ]
    return {
        "recall_by_position": hits,
        "answers": answers,
        "client": client,
        "write": write,
        "window": window,
        "num_sessions": num_sessions,
    }


def format_conversation(results: dict[str, dict]) -> str:
    """Rows: ``"adapter, client"``; columns: recall at each question position. The caption above says
    what the rows and columns are; the one below, why a figure may be lower than another."""
    first = next(iter(results.values()))
    n, sessions = len(first["recall_by_position"]), first["num_sessions"]
    head = f"{'conversation (memory, written as served)':<44}" + "".join(
        f"{'Q' + str(q + 1):>7}" for q in range(n)
    )
    lines = [
        caption(
            f"Conversations: {NUM_PAIRS} facts as the first chat turn, then {n} questions in later turns, "
            f"each written into memory after it is answered (lstmem_write={first['write']}); {sessions} "
            f"sessions. Qn: recall from memory at the n-th question. newest: the client sends its newest "
            f"message only ({CLIENT_WINDOWS['newest']}-token window); resend: it re-sends the conversation "
            f"into a {CLIENT_WINDOWS['resend']}-token window."
        ),
        head,
        "-" * len(head),
    ]
    for name, r in results.items():
        lines.append(f"{name:<44}" + "".join(f"{x:>7.3f}" for x in r["recall_by_position"]))
    every = [x for r in results.values() for x in r["recall_by_position"]]
    se = standard_error(sum(every) / len(every), sessions)
    lines.append(
        caption(
            f"One standard error of a figure: {se:.3f} at {sessions} sessions. A later question's figure is "
            "lower where the turns written before it (the earlier questions and answers) overwrote some "
            "of the facts. Differences between rows within two standard errors are noise; each row is one "
            "trained adapter (the training seed alone moves the demo's figures by a few hundredths: "
            f"{SEEDS_DOC})."
        )
    )
    return "\n".join(lines)
