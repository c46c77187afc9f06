"""``O_DIRECT`` writes through two reused staging buffers on transparent huge
pages: the calling thread copies the next chunk while a lane thread writes
the previous one.

Why: an ``O_DIRECT`` write pins the pages it reads; from base-page memory
(torch's allocations, where THP is "madvise") the device gets many small
segments, from 2 MiB pages few large ones, and the write is faster
(docs/benchmarks.md, "O_DIRECT through huge-page buffers"). The copy costs
one pass over the blob, overlapped with the device's work.

Threads and processes: one :class:`DirectWriter` per process
(:data:`DIRECT`, used by every :class:`~ecstore.lmdb.blobfiles.BlobFiles`),
one write at a time (a concurrent caller gets None and writes straight from
its own memory); its buffers (16 MiB) and lane (a daemon thread) are made on
first use and kept; a forked child starts without them.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from ecstore.lmdb.spare import Hasher

#: Bytes copied and written per step.
CHUNK = 8 << 20
_HUGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KiB pages)


class Written(NamedTuple):
    """What :meth:`DirectWriter.write` wrote: ``done`` bytes from the start
    (contiguous), the OSError that stopped it, if one did, and ``hashed``:
    the bytes from the start fed to its hasher (at least ``done``; 0
    without one)."""

    done: int
    error: OSError | None
    hashed: int = 0


class _Run:
    """One write's shared state (the lane sets it, the caller reads it)."""

    def __init__(self) -> None:
        self.done = 0
        self.stopped = False  # an error or a short write: queued chunks are skipped
        self.error: OSError | None = None
        self.fatal: BaseException | None = None  # not an OSError: re-raised on the caller's thread


class DirectWriter:
    """Two huge-page staging buffers and the lane thread that writes them."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self._jobs: queue.SimpleQueue[tuple[int, np.ndarray, int, _Run] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.writes = 0  # writes made through the buffers

    def write(self, fd: int, data: memoryview, end: int, hasher: Hasher | None = None) -> Written | None:
        """Write ``data[:end]`` to ``fd`` (opened with ``O_DIRECT``, at its
        current offset; ``end`` a multiple of the file system's block size),
        chunk by chunk through the staging buffers; ``hasher`` is fed each
        chunk once it is staged (in the caches, while the lane writes the
        one before). Returns once no chunk is in flight; None (nothing
        written or hashed) when another thread is writing through them. A
        short write stops it (the rest is the caller's); so does an OSError,
        returned, not raised."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            self._start()
            src = np.frombuffer(data, dtype=np.uint8)
            run = _Run()
            off = 0
            while off < end and not run.stopped:
                buf = self._free.get()
                n = min(CHUNK, end - off)
                np.copyto(buf[:n], src[off:off + n])  # numpy releases the GIL for the copy
                self._jobs.put((fd, buf, n, run))
                if hasher is not None:
                    hasher.update(buf[:n])  # type: ignore[arg-type]  # ndarray: a buffer
                off += n
            bufs = [self._free.get(), self._free.get()]  # both back: nothing in flight
            for b in bufs:
                self._free.put(b)
            if run.fatal is not None:
                raise run.fatal
            self.writes += 1
            return Written(run.done, run.error, off if hasher is not None else 0)
        finally:
            self._lock.release()

    def _start(self) -> None:
        """Holds ``_lock``: the buffers (faulted here, once) and the lane."""
        if self._thread is not None:
            return
        for _ in range(2):
            raw = np.empty(CHUNK + _HUGE, dtype=np.uint8)  # numpy asks for huge pages (madvise) at this size
            pad = -raw.ctypes.data % _HUGE
            buf = raw[pad:pad + CHUNK]
            buf.fill(0)
            self._free.put(buf)
        self._thread = threading.Thread(target=self._lane, name="ecstore-direct", daemon=True)
        self._thread.start()

    def _lane(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fd, buf, n, run = job
            try:
                if not run.stopped:
                    w = os.write(fd, memoryview(buf)[:n])  # type: ignore[arg-type]  # ndarray: a buffer
                    run.done += w
                    if w != n:
                        run.stopped = True
            except OSError as e:
                run.error, run.stopped = e, True
            except BaseException as e:  # noqa: BLE001  # a defect: raised by write() on its thread
                run.fatal, run.stopped = e, True
            finally:
                self._free.put(buf)


#: The process's direct writer.
DIRECT = DirectWriter()
os.register_at_fork(after_in_child=DIRECT._reset)
