"""Whether a store's background writer sleeps, and whether it has been woken:
read under its condition (a notified waiter leaves ``Condition._waiters`` at
once), so tests can tell a deferred put from one that woke the writer
without waiting for anything to happen."""

from __future__ import annotations

import threading

#: Safety bound (s): reached only by a broken build.
BOUND_S = 60.0


def writer_asleep(w) -> None:
    """Return once ``w``'s thread waits on its condition with nothing to do
    (polled under ``cv``; AssertionError after BOUND_S)."""
    deadline = threading.Event()
    timer = threading.Timer(BOUND_S, deadline.set)
    timer.start()
    try:
        while not deadline.is_set():
            with w.cv:
                if w.cv._waiters and not w.busy and not w.puts.queued:
                    return
        raise AssertionError("the writer never went to sleep")
    finally:
        timer.cancel()


def woken(w) -> bool:
    """Whether ``w``'s sleeping thread has been notified since it slept."""
    with w.cv:
        return not w.cv._waiters
