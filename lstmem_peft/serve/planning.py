"""Planning a turn: which of a request's messages (or text) are new to the session, which of them
go into the prompt, and which are written into memory before and after the answer.

The scheduler (:mod:`.scheduler`) runs the plan: ``before`` is written first (memory is the only
place the answer can read it), the answer is generated from ``prompt`` with memory read-only, then
``after`` is written (and the answer, with ``write="messages_and_answer"``). With ``write="none"``
``before`` goes into a copy of memory that the answer reads and that is then dropped, and nothing
is written. Pure functions of the session's record, the request, the window and the write policy:
no model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from .protocol import DEFAULT_WRITE, ServeError
from .runtime import ChatFormat, message_hash, tokens_after
from .store import Session


@dataclass
class Plan:
    """What one turn writes and prompts with.

    Attributes:
        before: token ids written into memory before answering: the new messages (or text) that are
            not in the prompt.
        prompt: token ids of the prompt in the context window.
        after: token ids written after answering, ahead of the answer: the new messages (or text)
            that are in the prompt.
        new_messages: record entries of the request's new messages (chat), in order: ``{"hash",
            "role", "tokens", "written"}``; ``written`` is ``False`` under ``write="none"`` (the
            message was read, not written: a later request that sends it again skips it all the same).
        text_chain: completions only: the text chain the record covers after the turn (the prompt's
            text; the completion joins it when a later prompt carries it, or at once with
            ``write="messages_and_answer"``).
        write: the write policy (:data:`~.protocol.WritePolicy`) the scheduler applies.
    """

    before: list[int]
    prompt: list[int]
    after: list[int] = field(default_factory=list)
    new_messages: list[dict] = field(default_factory=list)
    text_chain: str | None = None
    write: str = DEFAULT_WRITE

    @property
    def new_tokens(self) -> list[int]:
        """Every token of the request that this turn writes, in order."""
        return self.before + self.after


def _fit(budget: int, what: str) -> None:
    if budget <= 0:
        raise ServeError(
            400,
            f"max_tokens leaves no room for the {what} in the context window; lower max_tokens or raise "
            "--context-window",
            code="context_length_exceeded",
            param="max_tokens",
        )


def plan_chat(
    fmt: ChatFormat,
    session: Session,
    messages: list[dict],
    window: int,
    max_tokens: int,
    write: str = DEFAULT_WRITE,
) -> Plan:
    """Which messages are new, and the prompt, for a chat turn under the write policy ``write``.

    The session's record lists the messages taken in so far (hash of role and content), written or,
    by a turn with ``write="none"``, only read: either way a request that sends them again skips
    them, so a read-only turn's messages are never written later by surprise. If the
    request's messages start with that list, only the rest is new. If they share no first message
    with it, all of them are new (a client that sends only its latest turn). If they share a first
    part and then differ, the conversation was edited: memory cannot un-write, so this is refused
    (409): reset the session or start another.

    The prompt is the latest messages that fit ``window - max_tokens`` with the generation prompt;
    the latest message must fit, or the request is refused (400). New messages before the prompt
    are written before answering (``before``), new messages in it after (``after``).
    """
    written = [m["hash"] for m in session.messages]
    hashes = [message_hash(m["role"], m["content"]) for m in messages]
    k = 0
    while k < min(len(written), len(hashes)) and written[k] == hashes[k]:
        k += 1
    if 0 < k < len(written):
        raise ServeError(
            409,
            f"the conversation differs from what session {session.session!r} has written from message {k} on "
            f"(it wrote {len(written)} messages); memory cannot un-write a turn: send the conversation as it was "
            "written plus new messages, or DELETE /v1/memory/{session} to reset",
            code="conversation_diverged",
            param="messages",
        )
    encoded = [fmt.message(m["role"], m["content"]) for m in messages]
    new = list(range(k, len(messages)))
    opening = fmt.generation_prompt()
    budget = window - max_tokens - len(opening)
    _fit(budget, "prompt")
    prompt: list[int] = []
    first = len(encoded)  # the first message in the prompt
    for ids in reversed(encoded):
        if len(prompt) + len(ids) > budget:
            break
        prompt = ids + prompt
        first -= 1
    if not prompt:
        raise ServeError(
            400,
            f"the latest message is {len(encoded[-1])} tokens but the context window leaves {budget} for the prompt "
            f"(window {window} - max_tokens {max_tokens} - {len(opening)} generation-prompt tokens); write long "
            "text into memory with POST /v1/memory/{session}/write, shorten the message, or lower max_tokens",
            code="context_length_exceeded",
            param="messages",
        )
    new_messages = [
        {
            "hash": hashes[i],
            "role": messages[i]["role"],
            "tokens": len(encoded[i]),
            "written": write != "none",
        }
        for i in new
    ]
    before = [t for i in new if i < first for t in encoded[i]]
    after = [t for i in new if i >= first for t in encoded[i]]
    return Plan(before, prompt + opening, after, new_messages, write=write)


def plan_completion(
    fmt: ChatFormat,
    session: Session,
    prompt: str | list[int],
    window: int,
    max_tokens: int,
    write: str = DEFAULT_WRITE,
) -> Plan:
    """Which part of a completions prompt is new, and what stays in context, under ``write``.

    If the text taken in by earlier completions of the session (prompts, written or only read under
    ``write="none"``, and completions written with them) is a prefix of ``prompt``, only the rest is
    new; otherwise the whole prompt is. The context gets the prompt's
    last ``window - max_tokens`` tokens (the rest lives in memory). Of the new text's tokens, the
    last ones, as many as the context holds, are written after answering (``after``); any before
    them are written before answering (``before``).

    A prompt of token ids is taken as it is (never re-tokenized); its decoded text is what the
    record's text chain sees.
    """
    tokens = None if isinstance(prompt, str) else list(prompt)
    if tokens is not None:
        prompt = fmt.tokenizer.decode(tokens, skip_special_tokens=False)
    chain = session.completion_text
    length = chain["length"]
    if (
        length
        and len(prompt) >= length
        and hashlib.sha256(prompt[:length].encode()).hexdigest() == chain["sha256"]
    ):
        new_text = prompt[length:]
    else:
        new_text = prompt
    budget = window - max_tokens
    _fit(budget, "prompt")
    ids = fmt.encode_text(prompt) if tokens is None else tokens
    if not ids:
        raise ServeError(400, "the prompt is empty after tokenization", param="prompt")
    context = ids[-budget:]
    if tokens is None:
        new_ids = fmt.encode_text(new_text)
    else:
        new_ids = tokens if new_text == prompt else tokens_after(fmt.tokenizer, tokens, length)
        new_ids = tokens if new_ids is None else new_ids
    split = len(new_ids) - min(len(new_ids), len(context))
    return Plan(new_ids[:split], context, new_ids[split:], text_chain=prompt, write=write)
