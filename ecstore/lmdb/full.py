"""What a write does when the LMDB map (or the disk) is full.

* :class:`MapFullRetry`: the retry policy of a write transaction that LMDB
  refused with ``MDB_MAP_FULL`` (write batches, deletes, dropping damaged
  entries): evict, let old snapshots go, retry; give up only when nobody
  makes progress.
* :func:`wait_for_older_readers`: the wait for read transactions (of any
  process) that pin the pages a commit freed.
* :func:`space_hint`: why a write failed with EIO (disk full, file size
  limit), in words.

Background: LMDB files never grow past the map size, and pages a commit
frees are reused only after one more commit and once no reader holds an
older snapshot (design notes: docs/architecture.md, "The LMDB tier").
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Protocol

import lmdb

from ecstore.lmdb.env import MiB, _reader_txnids

#: How long a write whose map is full waits, at most, for read transactions
#: of other processes to release old snapshots (seconds).
MAPFULL_PATIENCE_S = 60.0
#: Retries of a write whose map stays full with nothing left to evict, no
#: reader of an older snapshot to wait for and no other writer committing in
#: between (rounds in which others committed do not count; see MapFullRetry).
MAPFULL_STUCK_RETRIES = 3


class _Committer(Protocol):
    """What :class:`MapFullRetry` needs of a tier (its handle)."""

    env: lmdb.Environment

    def _commit_nothing(self) -> None: ...

    def _last_txnid(self) -> int: ...


class MapFullRetry:
    """What a write transaction does after LMDB refused it with MDB_MAP_FULL,
    round after round, until it gives up (one instance per write call).

    Pages a commit frees are reusable only after one more commit and once no
    reader (of any process) holds an older snapshot. So each round: clear
    dead processes' readers; optionally evict (the caller's ``evict``); make
    one commit; if that freed nothing, wait for older readers to end; make
    one more commit. A round in which nothing was freed, no older reader was
    seen and no *other* writer committed since the previous round counts as
    stuck; :data:`MAPFULL_STUCK_RETRIES` stuck rounds, or
    :data:`MAPFULL_PATIENCE_S` seconds, and the write gives up. Rounds in which
    other writers committed do not count: their evictions may have taken what
    this one would evict and their puts the pages that freed, so the map is
    in use, not full of live data. Used by one thread at a time; the caller
    holds no transaction of the environment.
    """

    def __init__(self, tier: _Committer) -> None:
        self.tier = tier
        self.deadline = time.monotonic() + MAPFULL_PATIENCE_S  # time.monotonic() seconds
        self.stuck = 0
        #: last_txnid after this write's own latest commit (None: none yet).
        self.own_txnid: int | None = None

    def _committed(self) -> None:
        self.tier._commit_nothing()
        self.own_txnid = self.tier._last_txnid()

    def again(self, evict: Callable[[], int] | None = None) -> bool:
        """One round after a MapFullError: True to retry the write, False to
        give up. ``evict`` frees pages in a committed transaction of its own
        and returns the blob bytes it removed."""
        tier = self.tier
        if time.monotonic() > self.deadline:
            return False
        if self.own_txnid is not None and tier._last_txnid() != self.own_txnid:
            self.stuck = 0  # other writers committed since the last round
        if tier.env.reader_check() > 0:
            return True  # a dead process's reader pinned old pages: free now, retry first
        freed = 0
        if evict is not None:
            try:
                freed = evict()
            except lmdb.MapFullError:
                # Not one free page for the eviction's own copy-on-write: the
                # pages others freed are still pinned by older readers.
                freed = 0
        # LMDB keeps the previous snapshot intact (recovery may fall back to
        # it), so pages freed by a commit are reused only after one more
        # commit: make one, or the retry cannot use what was just freed.
        self._committed()
        if freed > 0:
            self.stuck = 0
            return True
        # Nothing (more) freed, yet the map was full: the free pages are
        # still part of snapshots that read transactions of other processes
        # hold (each is short: one call). Wait for those to end, then retry.
        # With no such reader, either other writers are using the map (the
        # next round sees their commits) or it is full of live, pinned data.
        if not wait_for_older_readers(tier.env, self.deadline):
            self.stuck += 1
            if self.stuck > MAPFULL_STUCK_RETRIES:
                return False
        self._committed()
        return True


def wait_for_older_readers(env: lmdb.Environment, deadline: float) -> bool:
    """Wait until no read transaction (of any process) holds a snapshot
    older than the last commit, so the pages that commit freed can be
    reused. True if there was one and it ended; False if there was none
    (nothing to wait for) or ``deadline`` (time.monotonic()) passed. Polls
    LMDB's reader table, backing off from 1 ms to 50 ms."""
    last = env.info()["last_txnid"]
    pause = 0.001
    waited = False
    while True:
        older = [t for t in _reader_txnids(env.readers()) if t < last]
        if not older:
            return waited
        if time.monotonic() > deadline:
            return False
        waited = True
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def space_hint(path: str, need: int, files: tuple[str, ...] = ("data.mdb",)) -> str:
    """`` (disk full: ...)`` when the file system of store ``path`` or
    RLIMIT_FSIZE (for any of the store's ``files``) leaves no room for
    ``need`` more bytes, else ``""``."""
    hints = []
    try:
        free = shutil.disk_usage(path).free
        if free < need + 4 * MiB:
            hints.append(f"disk full: {free} bytes free")
    except OSError:
        pass
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        size = max(os.path.getsize(p) for p in (os.path.join(path, f) for f in files) if os.path.exists(p))
        if soft != resource.RLIM_INFINITY and size + need > soft:
            hints.append(f"file size limit (RLIMIT_FSIZE) of {soft} bytes reached")
    except (OSError, ImportError, ValueError):
        pass
    return f" ({'; '.join(hints)})" if hints else ""
