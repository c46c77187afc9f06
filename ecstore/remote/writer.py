"""The remote tier's write-behind queue: one background thread, bounded by bytes.

``submit`` blocks at most ``wait_s`` (seconds) while ``max_bytes`` are
queued, then drops; it drops at once while ``refusing()`` (circuit open) or
after ``close``. Batches of at most BATCH_ITEMS / BATCH_BYTES go to ``send``
(which must not raise). ``drain`` waits only for writes ticketed before its
call. Every method may be called from any thread. Design:
docs/architecture.md#write-behind-queues.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ecstore.format import PendingPut, PutQueue

log = logging.getLogger("ecstore")

#: A write batch (one pipeline) holds at most this many entries / bytes.
BATCH_ITEMS = 64
BATCH_BYTES = 64 << 20


#: Puts taken together, oldest first (each a :class:`~ecstore.format.put.PendingPut`:
#: the tensor, contiguous CPU, and its blob, None: encode it; ``ticket``: the
#: order it was queued in).
Batch = list[PendingPut]


class WriteQueue:
    """Args:
        send: writes one batch (writer thread).
        refusing: True while writes should be dropped without queueing.
        on_dropped: called with the number of writes dropped here.
        max_bytes: tensor bytes queued before ``submit`` waits.
        wait_s: the longest ``submit`` waits for room (seconds).
    """

    def __init__(self, send: Callable[[Batch], None], *, refusing: Callable[[], bool],
                 on_dropped: Callable[[int], None], max_bytes: int, wait_s: float) -> None:
        self._send = send
        self._refusing = refusing
        self._on_dropped = on_dropped
        self.max_bytes = max(1, max_bytes)
        self.wait_s = wait_s
        self._cv = threading.Condition()
        # writes queued and being sent (the batch), their bytes, the tickets
        self._puts = PutQueue()
        self.drainers = 0  # threads waiting in drain()
        self._stopping = False
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name="ecstore-remote-writer", daemon=True)
        self._thread.start()

    def submit(self, item: PendingPut) -> bool:
        """Queue ``item`` (under ``item.key``); False if it was dropped."""
        key = item.key
        deadline = time.monotonic() + self.wait_s
        with self._cv:
            # The bytes pending count the batch being sent too (until it is sent):
            # an empty queue with a batch in flight has no more room than that.
            while not self._puts.room_for(item.nbytes, self.max_bytes):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stopping or self._refusing():
                    self._on_dropped(1)
                    return False
                self._cv.wait(remaining)
            if self._refusing() or self._stopping:
                self._on_dropped(1)
                return False
            if key not in self._puts.queued:  # else the queued one (older ticket) stands for it
                self._puts.add(item)
                self._cv.notify_all()
        return True

    def cancel(self, key: str) -> None:
        """Forget a queued (not yet taken) write of ``key``."""
        with self._cv:
            if self._puts.remove(key) is not None:
                self._cv.notify_all()

    def drain(self) -> None:
        """Wait until every write queued before the call was sent or dropped.
        Writes queued after the call do not hold it up (see the module doc):
        batches are taken oldest first, so the last earlier write is sent
        after a bounded number of batches.

        While no batch is being sent and one of those writes is still queued,
        the calling thread sends that batch itself (one batch in flight at a
        time, as from the writer thread, bounded the same way): on a busy
        machine waking the writer thread, then this one, cost more than a
        small write (ms each)."""
        with self._cv:
            target = self._puts.ticket
            self.drainers += 1
            try:
                while True:
                    oldest = self._puts.oldest()
                    if oldest is None or oldest > target:
                        return
                    if not self._puts.taken:  # oldest is a queued write of before the call
                        batch = self._puts.take(BATCH_BYTES, BATCH_ITEMS)
                        self._cv.release()
                        try:
                            self._send_batch(batch)
                        finally:
                            del batch
                            self._cv.acquire()
                        continue
                    self._cv.wait()
            finally:
                self.drainers -= 1

    def drop_queued(self) -> int:
        """Drop every write still queued (not the batch being sent), counted
        by ``on_dropped``; how many. The tier calls it when a batch failed
        because the remote is unreachable or too slow, so that ``drain`` and
        ``close`` wait for one timed-out batch, not for one per queued batch."""
        with self._cv:
            n = self._puts.drop_queued()
            self._cv.notify_all()
        if n:
            self._on_dropped(n)
        return n

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._puts.queued)

    def close(self) -> None:
        """Send what is queued, then stop the thread. Idempotent."""
        if self._thread is not None:
            with self._cv:
                self._stopping = True
                self._cv.notify_all()
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._cv:
                # A batch in flight may be a drain()er's: one at a time.
                while (not self._puts.queued or self._puts.taken) and not self._stopping:
                    self._cv.wait()
                while self._puts.taken:
                    self._cv.wait()
                if not self._puts.queued:
                    if self._stopping:
                        return
                    continue
                batch = self._puts.take(BATCH_BYTES, BATCH_ITEMS)
            self._send_batch(batch)

    def _send_batch(self, batch: Batch) -> None:
        """Send ``batch`` (taken from the queue; ``_cv`` not held), then mark
        it done. Never raises an Exception."""
        try:
            self._send(batch)
        except Exception as e:  # noqa: BLE001  (never let the writer die, nor fail a drain()er)
            log.error("ecstore: remote write failed: %s", e)
            self._on_dropped(len(batch))
        finally:
            with self._cv:
                self._puts.done(batch)
                self._cv.notify_all()
