"""What the serving classes hand the scheduler's worker (:mod:`.scheduler`): a :class:`Job` per
request, carrying one typed request (:data:`Request`) and the thread-safe channel its events
(:mod:`.events`) come back through, and the incremental text of a streamed choice
(:class:`StreamState`), which sends only text a later token can no longer change.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import ClassVar

from lstmem_peft.memory.cache import MemoryCache

from .decoding import Sampling, find_stop
from .events import Delta, Event
from .protocol import DEFAULT_WRITE


# ---------------------------------------------------------------------- requests
@dataclass(frozen=True)
class ChatTurn:
    """A chat completion: the conversation as the client sent it (:func:`.planning.plan_chat`).

    Attributes:
        messages: ``[{"role", "content"}]``, oldest first.
        display: the text shown for the turn in the session's record (the newest message).
        write: the write policy (``lstmem_write``).
        version: the session version the conversation continues (``lstmem_version``); ``None``: the
            record's prefix rule decides.
    """

    kind: ClassVar[str] = "turn"
    mode: ClassVar[str] = "chat"
    messages: list[dict]
    display: str
    write: str = DEFAULT_WRITE
    version: int | None = None


@dataclass(frozen=True)
class CompletionTurn:
    """A completion of one prompt (:func:`.planning.plan_completion`).

    Attributes:
        prompt: the prompt, text or token ids.
        display: the text shown for the turn in the session's record (the prompt's end).
        write: the write policy (``lstmem_write``).
        version: the session version the prompt continues (``lstmem_version``); ``None``: the
            text-chain rule decides.
    """

    kind: ClassVar[str] = "turn"
    mode: ClassVar[str] = "completion"
    prompt: str | list[int]
    display: str
    write: str = DEFAULT_WRITE
    version: int | None = None


@dataclass(frozen=True)
class ScorePrompt:
    """A completion with ``max_tokens`` 0: the prompt's log-probabilities, read from memory; nothing
    is written or committed."""

    kind: ClassVar[str] = "score"
    prompt: str | list[int]


@dataclass(frozen=True)
class WriteMemory:
    """``POST /v1/memory/{session}/write``: ``text`` as it is, or ``messages`` in the chat format
    (then recorded as written, so a chat that re-sends them does not write them again)."""

    kind: ClassVar[str] = "write"
    display: str
    messages: list[dict] | None = None
    text: str | None = None


@dataclass(frozen=True)
class ResetSession:
    """``DELETE /v1/memory/{session}``: the session and its versions removed."""

    kind: ClassVar[str] = "reset"


@dataclass(frozen=True)
class ImportMemory:
    """``POST /v1/memory/{session}/import``: the session replaced by ``memory`` (a new line of versions)."""

    kind: ClassVar[str] = "import"
    memory: MemoryCache


@dataclass(frozen=True)
class ForkSession:
    """A new session ``to`` from the kept version ``version`` of the job's session."""

    kind: ClassVar[str] = "fork"
    version: int
    to: str


@dataclass(frozen=True)
class PruneVersion:
    """The kept version ``version`` of the job's session dropped (never the newest)."""

    kind: ClassVar[str] = "prune"
    version: int


#: What a job asks of the scheduler.
Request = (
    ChatTurn
    | CompletionTurn
    | ScorePrompt
    | WriteMemory
    | ResetSession
    | ImportMemory
    | ForkSession
    | PruneVersion
)

#: Requests that jobs of different sessions may share a batch with (when their keys agree).
BATCHABLE = (ChatTurn, CompletionTurn, ScorePrompt, WriteMemory)


# ---------------------------------------------------------------------- jobs
@dataclass
class Job:
    """One queued request.

    Attributes:
        request: what is asked (:data:`Request`).
        namespace, session: the session (``session=None``: a fresh memory that is not stored).
        sampling: decoding parameters (turns and scores).
        stream: send token deltas as they come.
    """

    request: Request
    namespace: str
    session: str | None
    sampling: Sampling | None = None
    stream: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue[Event] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)

    @property
    def kind(self) -> str:
        """The request's kind, as metrics and logs name it (``turn``, ``score``, ``write``, ...)."""
        return self.request.kind

    def emit(self, event: Event) -> None:
        """Send an event (:mod:`.events`) to the request's coroutine (thread-safe)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def key(self) -> tuple:
        """Jobs with equal keys may share a batch: requests of one type, turns with one decoding
        setting."""
        if isinstance(self.request, (ChatTurn, CompletionTurn)):
            return (type(self.request), self.sampling.batch_key())
        return (type(self.request),)

    def batchable(self) -> bool:
        return isinstance(self.request, BATCHABLE) and not (
            self.sampling is not None and self.sampling.seed is not None
        )


class StreamState:
    """Incremental text of one streamed choice: emits only text that can no longer change.

    The answer ends where :func:`~.generation.cut_answer` ends it: at a token of ``eos_ids`` (empty
    with ``ignore_eos``), or at a stop string that ends past the text of the first ``min_tokens``
    tokens."""

    def __init__(self, job: Job, choice: int, tokenizer, stops: tuple[str, ...], min_tokens: int = 0) -> None:
        self.job, self.choice, self.tok, self.stops = job, choice, tokenizer, stops
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.sent = ""
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.closed = False
        self._head: int | None = None  # characters of the first min_tokens tokens, once generated

    def push(self, token: int, eos_ids: frozenset[int]) -> None:
        if self.closed:
            return
        if token in eos_ids:
            self.closed = True
            return
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if self._head is None and len(self.ids) >= self.min_tokens:
            head = self.ids[: self.min_tokens]
            self._head = len(self.tok.decode(head, skip_special_tokens=True)) if head else 0
        if self._head is not None and self.stops and find_stop(text, self.stops, self._head) >= 0:
            self.closed = True
            return
        safe = text[: len(text) - self.hold] if self.hold else text
        if safe.endswith("\ufffd"):
            return
        if safe.startswith(self.sent) and len(safe) > len(self.sent):
            self.job.emit(Delta(self.choice, safe[len(self.sent) :]))
            self.sent = safe

    def finish(self, final: str) -> None:
        if final.startswith(self.sent) and len(final) > len(self.sent):
            self.job.emit(Delta(self.choice, final[len(self.sent) :]))
        self.sent = final
