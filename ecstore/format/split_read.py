"""Reading a large blob file on two cores: the caller and one helper thread.

A large entry's hit is bound by copying its bytes out of the page cache
(``preadv``) and hashing them (xxh3), more than a memcpy on one core. Here the
caller and a helper thread claim 1 MiB chunks in file order from one counter
and read each straight into the destination (``preadv`` releases the GIL);
the caller hashes the chunks in order as they land. Work-sharing, not
splitting: when the helper is busy elsewhere (another thread's read) the
caller simply reads every chunk itself. It helps where a second core is
free and costs about as much where none is (a helper preempted holding a chunk makes the caller wait for it):
the ``split_reads`` setting turns it off.

Safety: :func:`read_hashed` returns or raises only after the helper has
stopped writing into the destination (a destination handed back to the pool
must never be written again). Thread-safe; the helper thread is per process
(re-created in a forked child).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

#: Entries with at least this many data bytes are read on two cores.
SPLIT_READ_BYTES = 8 << 20

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _helper_pool() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ecstore-read")
        return _executor


def _forget_pool_in_child() -> None:
    global _executor, _executor_lock
    _executor = None  # the parent's thread does not exist in the child
    _executor_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)


def read_exactly(fd: int, dst: memoryview, offset: int) -> None:
    """Fill ``dst`` from ``fd`` at ``offset`` (short reads retried);
    EOFError if the file ends first."""
    done = 0
    while done < len(dst):
        got = os.preadv(fd, [dst[done:]], offset + done)
        if got == 0:
            raise EOFError("blob file shorter than its record")
        done += got


class _Chunks:
    """The chunks of one read and who has claimed, read or failed them."""

    def __init__(self, fd: int, dst: memoryview, offset: int, chunk: int) -> None:
        self.fd, self.dst, self.offset, self.chunk = fd, dst, offset, chunk
        self.count = -(-len(dst) // chunk)
        self.cv = threading.Condition()
        self.next = 0  # the next chunk nobody has claimed
        self.done = [False] * self.count
        self.error: BaseException | None = None
        self.closed = False  # the caller is leaving: claim nothing more

    def claim(self) -> int | None:
        with self.cv:
            if self.closed or self.error is not None or self.next >= self.count:
                return None
            i, self.next = self.next, self.next + 1
            return i

    def read(self, i: int) -> None:
        """Read chunk ``i`` into the destination (:func:`read_exactly`)."""
        lo = i * self.chunk
        read_exactly(self.fd, self.dst[lo:lo + self.chunk], self.offset + lo)
        with self.cv:
            self.done[i] = True
            self.cv.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cv:
            if self.error is None:
                self.error = error
            self.cv.notify_all()

    def help(self) -> None:
        """The helper thread's part: claim and read until nothing is left."""
        try:
            while (i := self.claim()) is not None:
                self.read(i)
        except BaseException as e:  # handed to the caller, which raises it  # noqa: BLE001
            # Without its traceback: its frames hold views of the destination,
            # and the stored error a reference to this object (a cycle that
            # kept a pool slab alive until the cyclic collector ran).
            self.fail(e.with_traceback(None))


def read_hashed(fd: int, dst: memoryview, offset: int, update: Any, chunk: int) -> None:
    """Fill ``dst`` from ``fd`` at ``offset`` and feed the bytes, in order,
    to ``update`` (a hash's ``update``), ``chunk`` bytes at a time, with a
    helper thread reading chunks ahead. Raises ``OSError`` (a failed read) or
    ``EOFError`` (the file is shorter), only after the helper has stopped
    writing into ``dst``."""
    work = _Chunks(fd, dst, offset, chunk)
    helper: Future[None] | None = None
    if work.count > 1:
        try:
            helper = _helper_pool().submit(work.help)
        except RuntimeError:  # the interpreter is shutting down: the caller reads every chunk
            helper = None
    try:
        for i in range(work.count):
            while not work.done[i]:
                j = work.claim()
                if j is not None:
                    work.read(j)  # the caller's own share (this one or ahead)
                    continue
                with work.cv:
                    while not work.done[i] and work.error is None:
                        work.cv.wait()
                    if work.error is not None:
                        raise work.error  # stored without its traceback (see help)
            lo = i * chunk
            update(dst[lo:lo + chunk])
    finally:
        with work.cv:
            work.closed = True
        if helper is not None and not helper.cancel():
            helper.result()  # wait for the chunk it may be reading (help never raises)
        # Nothing of this read keeps the destination alive: an error raised
        # from work.error carries a traceback through this frame (a cycle).
        work.dst, work.error = memoryview(b""), None
