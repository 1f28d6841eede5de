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

from lstmem_peft.utils.chat import ChatFormat

from .conversation import message_hash, tokens_after
from .protocol import DEFAULT_WRITE, ServeError
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
        rollback: the kept version the turn continues from, when it is not the version the plan
            was made on (an edited or regenerated conversation: :func:`plan_chat`; a completions
            prompt that extends an older version's text: :func:`plan_completion`); ``None``: that
            version. ``before``, ``after`` and ``new_messages`` are relative to the version continued.
        kept: what the request shares with the version continued: chat, its first ``kept`` messages
            (the rest are the new messages); completions, the characters of the prompt's text.
    """

    before: list[int]
    prompt: list[int]
    after: list[int] = field(default_factory=list)
    new_messages: list[dict] = field(default_factory=list)
    text_chain: str | None = None
    write: str = DEFAULT_WRITE
    rollback: int | None = None
    kept: int = 0

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
    pinned: bool = False,
) -> Plan:
    """Which messages are new, and the prompt, for a chat turn under the write policy ``write``.

    The session's record lists the messages taken in so far (hash of role and content), written or,
    by a turn with ``write="none"``, only read: either way a request that sends them again skips
    them, so a read-only turn's messages are never written later by surprise. If the
    request's messages start with that list and add at least one, only the rest is new. If they
    share no first message with it, all of them are new (a client that sends only its latest turn);
    so is one message alone while the record holds more, even when it repeats the record's first
    message (the same client asking that again: never a rollback, which would drop later versions).

    Otherwise the turn **rolls back** (``Plan.rollback``): the request shares its first ``k``
    messages with the record and then differs (an edited message), or adds nothing to it (a
    regenerated answer: the conversation sent again without the answer, or cut shorter). Memory
    cannot un-write, but the session keeps versions (:mod:`.store`): the turn continues from the
    newest kept version whose messages are a prefix of the request's, holding at most
    ``min(k, len(messages) - 1)`` of them, so at least the last message is new; the request's
    messages after that version's are the turn's new messages, exactly as if the later turns had
    never happened. If no kept version qualifies (pruned), the request is refused (409, naming the
    oldest kept version and the fixes: fork a kept version, or reset).

    ``pinned``: the client named the version its conversation continues (``lstmem_version``) and
    ``session`` is that version (:meth:`~.store.SessionStore.at_version`), so ``messages`` is the whole
    conversation: one that differs from the record from its first message on rolls back too (to the
    empty session, version 0, when it is kept), and one message alone is never taken as a newest-only
    client's. Rollback targets are then the versions up to the pinned one.

    The prompt is the latest messages that fit ``window - max_tokens`` with what the chat template
    adds once (:meth:`~lstmem_peft.utils.chat.ChatFormat.fit`: the conversation's start, the generation
    prompt);
    the latest message must fit, or the request is refused (400). New messages before the prompt
    are written before answering (``before``), new messages in it after (``after``).
    """
    written = [m["hash"] for m in session.messages]
    hashes = [message_hash(m["role"], m["content"]) for m in messages]
    k = 0
    while k < min(len(written), len(hashes)) and written[k] == hashes[k]:
        k += 1
    if len(hashes) == 1 and len(written) > 1 and not pinned:
        # one message that repeats the record's first, which holds more: a client that sends only its
        # newest message asks that again. It is new; rolling back would drop every later version
        k = 0
    rollback = None
    if (k > 0 or pinned) and (k < len(written) or k == len(hashes)):  # edited, or nothing new: roll back
        rollback, k = _rollback_target(session, k, len(hashes))
    new = list(range(k, len(messages)))
    laid = fmt.fit(messages, window - max_tokens)
    _fit(laid.budget, "prompt")
    encoded, first = laid.encoded, laid.first  # the first message in the prompt
    if first == len(encoded):
        reserved = window - max_tokens - laid.budget
        raise ServeError(
            400,
            f"the latest message is {len(encoded[-1])} tokens but the context window leaves {laid.budget} for the "
            f"prompt (window {window} - max_tokens {max_tokens} - {reserved} tokens the chat template adds once: "
            "the conversation's start and the generation prompt); write long text into memory with "
            "POST /v1/memory/{session}/write, shorten the message, or lower max_tokens",
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
    return Plan(before, laid.tokens, after, new_messages, write=write, rollback=rollback, kept=k)


def _rollback_target(session: Session, shared: int, sent: int) -> tuple[int, int]:
    """The version a chat turn rolls back to and how many messages it holds: the newest rollback
    target (:meth:`~.store.Session.targets`) holding at most ``min(shared, sent - 1)`` messages;
    none: 409 naming the oldest kept version and the fixes."""
    bound = min(shared, sent - 1)
    fits = [t for t in session.targets() if t["messages"] <= bound]
    if fits:
        return fits[-1]["version"], fits[-1]["messages"]
    taken = len(session.messages)
    how = (
        f"differs from what session {session.session!r} has taken in from message {shared} on"
        if shared < taken and shared < sent
        else f"sends no message that session {session.session!r} has not taken in (a regenerated answer)"
    )
    raise _diverged(
        f"the conversation {how}, and no kept version holds a prefix of it to roll back to",
        session,
        "messages",
    )


def _diverged(what: str, session: Session, param: str) -> ServeError:
    """409 ``conversation_diverged``: ``what`` happened, the oldest kept version, and the fixes."""
    oldest = session.versions[0] if session.versions else None
    kept = (
        f"its oldest kept version, {oldest['version']}, holds {oldest['messages']} of its "
        f"{len(session.messages)} messages"
        if oldest is not None
        else "it keeps no version"
    )
    return ServeError(
        409,
        f"{what}: {kept} (older versions were pruned: lstmem serve --session-versions / "
        "--session-version-bytes keep more). Fork a kept version into a new session "
        "(POST /v1/memory/{session}/fork) and continue there, send the conversation as it is plus new "
        "messages, or DELETE /v1/memory/{session} to reset",
        code="conversation_diverged",
        param=param,
    )


def plan_completion(
    fmt: ChatFormat,
    session: Session,
    prompt: str | list[int],
    window: int,
    max_tokens: int,
    write: str = DEFAULT_WRITE,
    pinned: bool = False,
) -> Plan:
    """Which part of a completions prompt is new, and what stays in context, under ``write``.

    If the text taken in by earlier completions of the session (prompts, written or only read under
    ``write="none"``, and completions written with them) is a prefix of ``prompt``, only the rest is
    new. Otherwise, if the non-empty text of an older kept version is (the newest such: an edited
    continuation), the turn rolls back to that version (``Plan.rollback``) and the rest is new; else
    the whole prompt is. (A prompt equal to the newest text adds nothing and is answered from the
    newest version: unlike chat, completions do not roll back to regenerate.) The context gets the prompt's
    last ``window - max_tokens`` tokens (the rest lives in memory). Of the new text's tokens, the
    last ones, as many as the context holds, are written after answering (``after``); any before
    them are written before answering (``before``).

    A prompt of token ids is taken as it is (never re-tokenized); its decoded text is what the
    record's text chain sees.

    ``pinned``: ``session`` is the version the client named (``lstmem_version``): the prompt
    continues the newest version up to it whose text it extends, an empty text included (so the
    whole prompt is new only on a version without completions text); none such (pruned) is 409.
    """
    tokens = None if isinstance(prompt, str) else list(prompt)
    if tokens is not None:
        prompt = fmt.tokenizer.decode(tokens, skip_special_tokens=False)
    rollback, length = None, 0
    if _extends(prompt, session.completion_text, pinned):
        length = session.completion_text["length"]
    else:
        older = [t for t in session.targets()[:-1] if _extends(prompt, t["completion_text"], pinned)]
        if older:
            rollback, length = older[-1]["version"], older[-1]["completion_text"]["length"]
        elif pinned:
            raise _diverged(
                f"the prompt does not extend the text of version {session.version} of session "
                f"{session.session!r}, and no kept version before it holds a text that the prompt extends",
                session,
                "prompt",
            )
    new_text = prompt[length:]
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
    return Plan(
        new_ids[:split],
        context,
        new_ids[split:],
        text_chain=prompt,
        write=write,
        rollback=rollback,
        kept=length,
    )


def _extends(prompt: str, chain: dict, empty: bool = False) -> bool:
    """Whether ``prompt`` starts with the text ``chain`` (``{"length", "sha256"}``) names; an empty
    text counts only with ``empty``."""
    length = chain["length"]
    if not length:
        return empty
    return len(prompt) >= length and hashlib.sha256(prompt[:length].encode()).hexdigest() == chain["sha256"]
