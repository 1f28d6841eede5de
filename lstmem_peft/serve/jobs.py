"""What the serving classes hand the scheduler's worker (:mod:`.scheduler`): a :class:`Job` per
request, with the thread-safe channel its events come back through, and the incremental text of a
streamed choice (:class:`StreamState`), which sends only text a later token can no longer change.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from .generation import Sampling


@dataclass
class Job:
    """One queued request.

    Attributes:
        kind: ``turn`` (chat or completion), ``score`` (a completion with ``max_tokens=0``: reads
            memory, writes nothing), ``write``, ``reset``, ``import``, ``fork`` or ``prune``.
        namespace, session: the session (``session=None``: a fresh memory that is not stored).
        payload: kind-specific (see the ``_run_*`` methods).
        sampling: decoding parameters (turns).
        stream: send token deltas as they come.
    """

    kind: str
    namespace: str
    session: str | None
    payload: dict
    sampling: Sampling | None = None
    stream: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)

    def emit(self, event: tuple) -> None:
        """Send an event to the request's coroutine (thread-safe)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def key(self) -> tuple:
        """Jobs with equal keys may share a batch."""
        if self.kind == "turn":
            return ("turn", self.payload["mode"], self.sampling.batch_key())
        return (self.kind,)

    def batchable(self) -> bool:
        return self.kind in ("turn", "score", "write") and not (
            self.sampling is not None and self.sampling.seed is not None
        )


class StreamState:
    """Incremental text of one streamed choice: emits only text that can no longer change."""

    def __init__(self, job: Job, choice: int, tokenizer, stops: tuple[str, ...]) -> None:
        self.job, self.choice, self.tok, self.stops = job, choice, tokenizer, stops
        self.ids: list[int] = []
        self.sent = ""
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.closed = False

    def push(self, token: int, eos_ids: frozenset[int]) -> None:
        if self.closed:
            return
        if token in eos_ids:
            self.closed = True
            return
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if any(s in text for s in self.stops):
            self.closed = True
            return
        safe = text[: len(text) - self.hold] if self.hold else text
        if safe.endswith("\ufffd"):
            return
        if safe.startswith(self.sent) and len(safe) > len(self.sent):
            self.job.emit(("delta", self.choice, safe[len(self.sent) :]))
            self.sent = safe

    def finish(self, final: str) -> None:
        if final.startswith(self.sent) and len(final) > len(self.sent):
            self.job.emit(("delta", self.choice, final[len(self.sent) :]))
        self.sent = final
