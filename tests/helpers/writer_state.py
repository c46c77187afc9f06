"""Whether a store's background writer sleeps, whether it has been woken, and
waiting for its next batch: read under its condition (a notified waiter
leaves ``Condition._waiters`` at once; ``progress`` counts finished batches),
so tests tell a deferred put from one that woke the writer without sleeping.
Valid while the handle has no sync thread waiting on the same condition
(entries below ``min_file_blob_size``, kept inline)."""

from __future__ import annotations

import threading

#: Safety bound (s): reached only by a broken build.
BOUND_S = 60.0


def writer_asleep(w) -> int:
    """Return once ``w``'s thread waits on its condition with nothing to do
    but deferred puts (polled under ``cv``; AssertionError after BOUND_S);
    its ``progress`` then (see :func:`asleep_since`)."""
    deadline = threading.Event()
    timer = threading.Timer(BOUND_S, deadline.set)
    timer.start()
    try:
        while not deadline.is_set():
            with w.cv:
                if w.cv._waiters and not w.busy and (not w.puts.queued or not w.write_wanted):
                    return w.progress
        raise AssertionError("the writer never went to sleep")
    finally:
        timer.cancel()


def asleep_since(w, progress: int) -> bool:
    """Whether ``w``'s thread still sleeps, not notified and with no batch
    finished, since :func:`writer_asleep` returned ``progress``."""
    with w.cv:
        return bool(w.cv._waiters) and w.progress == progress


def batch_done_since(w, progress: int) -> bool:
    """Wait (bounded by BOUND_S) until ``w`` has finished a batch since
    ``progress``, without waking it; whether it did."""
    with w.cv:
        return w.cv.wait_for(lambda: w.progress > progress, timeout=BOUND_S)
