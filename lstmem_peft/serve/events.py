"""What comes back from a queued job (:class:`~.jobs.Job`) to the request's coroutine: text deltas of
a streamed choice, then the job's result or its error. The worker thread sends them
(:meth:`~.jobs.Job.emit`); the serving classes dispatch on their type (:mod:`.serving_base`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .protocol import ServeError


@dataclass(frozen=True)
class Delta:
    """Text that choice ``choice`` of a streamed job gained (text no later token can change)."""

    choice: int
    text: str


@dataclass(frozen=True)
class Done:
    """The job's result: the last event of a job that succeeded (a dict whose keys depend on the
    request: ``choices``, ``written``, ``tokens_written``, ...)."""

    result: dict


@dataclass(frozen=True)
class Failed:
    """The job's error: the last event of a job that failed or was cancelled."""

    error: ServeError


#: One event of a job.
Event = Delta | Done | Failed
