"""What one step of the GPU acceptance run (:mod:`.acceptance`) may spend: its time
(:func:`time_limit`, an alarm that raises :class:`StepTimeout` inside the step) and the memory it
leaves behind (:func:`release`, called after each step)."""

from __future__ import annotations

import contextlib
import gc
import signal
import threading
import time

import torch


class StepTimeout(BaseException):
    """Raised inside a step when its time is up: a ``BaseException``, so that a step's own ``except
    Exception`` (one failing length of a sweep) does not swallow it and run on past the limit."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise :class:`StepTimeout` in the main thread after ``seconds`` (``SIGALRM``); an alarm set by
    the caller (e.g. pytest-timeout) is restored after. Elsewhere (another thread, no ``setitimer``) the
    limit is only checked after the step: yields whether it is enforced."""
    usable = (
        seconds is not None
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield False
        return

    def on_alarm(signum, frame):
        raise StepTimeout(f"time budget of {seconds:.0f} s spent")

    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay:
            left = max(outer_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


def release(device: torch.device) -> None:
    """Free what a step left behind: Python's garbage, then (on CUDA) the allocator's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
