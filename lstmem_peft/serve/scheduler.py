"""The batching scheduler: one worker thread owns the model; requests queue up as jobs.

Rules:

* Jobs on **different** sessions that are waiting together, of the same kind and with the same
  decoding parameters, run as one batch: the sessions' memory rows are gathered into one cache,
  prompts are left-padded, and rows are scattered back after the forward(s).
* Jobs on the **same** session run one after another, in arrival order (a session appears at most
  once per batch, and a job is never taken ahead of an earlier job of its session).
* A request with a ``seed`` runs alone (one RNG stream per ``generate`` call), so the seed alone
  fixes its tokens.

What a batch does (a turn's four steps, the write policies, versions and rollbacks, failures) is
the :class:`~.runner.JobRunner`'s, by the type of its requests (:mod:`.jobs`): the scheduler is handed
one (:class:`BatchRunner`) and only decides which jobs run together.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Protocol

from .events import Failed
from .jobs import Job
from .protocol import ServeError
from .store import SessionStore

log = logging.getLogger("lstmem.serve")


# ---------------------------------------------------------------------- the scheduler
class BatchRunner(Protocol):
    """What runs a batch on the worker thread (:class:`~.runner.JobRunner`): each job of ``jobs`` (one
    request type) gets its result or its error through its events.

    Attributes:
        store: the session store the jobs read and commit.
        window: the context window (tokens) of the prompt policy.
    """

    store: SessionStore
    window: int

    def run(self, jobs: list[Job]) -> None: ...


class Scheduler:
    """Owns the model: takes jobs from a queue and runs them in batches on one worker thread.

    Args:
        runner: what runs each batch (:class:`~.runner.JobRunner`: the served model, the session
            store and the context window).
        max_batch: most sessions per batch.
        batch_wait: seconds to wait for more jobs after the first one of a batch arrives.
        batching: ``False`` runs one job at a time (the benchmark's baseline).
        metrics: optional :class:`~lstmem_peft.serve.metrics.Metrics`.
    """

    def __init__(
        self,
        runner: BatchRunner,
        max_batch: int = 32,
        batch_wait: float = 0.005,
        batching: bool = True,
        metrics=None,
    ) -> None:
        self.runner = runner
        self.max_batch = max_batch if batching else 1
        self.batch_wait = batch_wait
        self.metrics = metrics
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="lstmem-serve-worker", daemon=True)

    @property
    def store(self) -> SessionStore:
        """The session store (the runner's)."""
        return self.runner.store

    @property
    def window(self) -> int:
        """The context window in tokens (the runner's)."""
        return self.runner.window

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def submit(self, job: Job) -> Job:
        """Queue a job; its events arrive on ``job.events`` of the calling event loop."""
        job.loop = asyncio.get_running_loop()
        job.events = asyncio.Queue()
        with self._cond:
            self._queue.append(job)
            self._cond.notify_all()
        return job

    @property
    def queued(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ batching
    def _next_batch(self) -> list[Job] | None:
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            first = self._queue[0]
            if first.batchable() and self.max_batch > 1 and self.batch_wait > 0:
                deadline = time.monotonic() + self.batch_wait
                while len(self._queue) < self.max_batch and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(timeout=left)
            first = self._queue[0]
            chosen, taken_sessions, blocked = [], set(), set()
            for job in list(self._queue):
                sk = (job.namespace, job.session) if job.session is not None else ("", id(job))
                if sk in blocked:
                    continue
                fits = not chosen or (
                    first.batchable()
                    and job.batchable()
                    and job.key() == first.key()
                    and sk not in taken_sessions
                    and len(chosen) < self.max_batch
                )
                if fits:
                    chosen.append(job)
                    taken_sessions.add(sk)
                else:
                    blocked.add(sk)  # later jobs of this session must wait for this one
                if len(chosen) >= self.max_batch or not first.batchable():
                    break
            for job in chosen:
                self._queue.remove(job)
            return chosen

    def _loop(self) -> None:
        while True:
            jobs = self._next_batch()
            if jobs is None:
                return
            live = [j for j in jobs if not j.cancelled.is_set()]
            for j in jobs:
                if j.cancelled.is_set():
                    j.emit(Failed(ServeError(499, "request cancelled before it ran", code="cancelled")))
            if not live:
                continue
            if self.metrics is not None:
                self.metrics.batch_size.labels(kind=live[0].kind).observe(len(live))
            try:
                self.runner.run(live)
            except ServeError as err:
                for j in live:
                    j.emit(Failed(err))
            except Exception as err:  # a bug or a numerical failure: the sessions were not touched
                log.exception("batch of %d %s jobs failed", len(live), live[0].kind)
                for j in live:
                    j.emit(Failed(ServeError(500, f"{type(err).__name__}: {err}", type="server_error")))
