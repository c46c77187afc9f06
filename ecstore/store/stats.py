"""The counters of one :class:`~ecstore.store.ECStore` handle, and the log
lines that go with its refusals.

:class:`Counters` counts what this handle did (hits per tier, misses, puts,
refusals); :meth:`Counters.snapshot` adds what the tiers hold at that moment
(:class:`StoreStats`). Counters are per handle and per process: another
process sharing the LMDB directory has its own.
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ecstore.store.tiers import Tiers

log = logging.getLogger("ecstore")


class HitTier(enum.Enum):
    """Where a hit was served from (the pending-write map counts as memory)."""

    MEMORY = "memory"
    DISK = "disk"
    REMOTE = "remote"


@dataclass
class StoreStats:
    """Counters of one handle (this process only) plus tier occupancy.

    Counts are events since the handle was opened; ``*_bytes`` are bytes
    (``memory_bytes``: tensor data bytes; ``disk_bytes``: whole blobs, what
    the disk cap counts); ``*_entries`` are entries held at snapshot time.
    """

    hits: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    puts: int = 0
    puts_skipped: int = 0
    puts_refused: int = 0
    puts_found_stored: int = 0  # puts made with known_absent that the writer found stored: nothing written
    write_errors: int = 0
    sync_errors: int = 0  # committed blob files whose fdatasync after the commit failed (flush raises)
    memory_evictions: int = 0
    disk_evictions: int = 0
    corrupt_dropped: int = 0
    memory_entries: int = 0
    memory_bytes: int = 0
    memory_capacity_bytes: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_capacity_bytes: int = 0
    pending_writes: int = 0
    pending_bytes: int = 0
    # Remote tier (zero without remote_url): see ecstore.remote.tier.RemoteStats.
    remote_hits: int = 0
    remote_misses: int = 0
    remote_errors: int = 0
    remote_puts: int = 0
    remote_puts_dropped: int = 0
    remote_corrupt_dropped: int = 0
    remote_bytes_read: int = 0
    remote_bytes_written: int = 0
    remote_pending_writes: int = 0
    remote_promotions_skipped: int = 0  # remote hits not written to LMDB: its write queue was full

    @property
    def evictions(self) -> int:
        return self.memory_evictions + self.disk_evictions

    def as_dict(self) -> dict[str, int]:
        d = dict(self.__dict__)
        d["evictions"] = self.evictions
        return d


class Counters:
    """The event counters of one handle. Every method is thread-safe (one
    lock held for a few attribute updates); nothing here blocks on I/O."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._s = StoreStats()

    def hit(self, tier: HitTier) -> None:
        with self._lock:
            self._s.hits += 1
            if tier is HitTier.MEMORY:
                self._s.memory_hits += 1
            elif tier is HitTier.DISK:
                self._s.disk_hits += 1

    def miss(self) -> None:
        with self._lock:
            self._s.misses += 1

    def put(self) -> None:
        with self._lock:
            self._s.puts += 1

    def put_skipped(self) -> None:
        """A put of an identifier the store already holds."""
        with self._lock:
            self._s.puts_skipped += 1

    def refused_too_large(self, mm_hash: str, nbytes: int, memory_capacity: int, disk_capacity: int) -> None:
        """A put larger than every tier's capacity (bytes): logged, counted."""
        log.warning("ecstore: refused mm_hash=%s: %d bytes exceed every tier's capacity "
                    "(memory %d, disk %d bytes)", mm_hash, nbytes, memory_capacity, disk_capacity)
        with self._lock:
            self._s.puts_refused += 1

    def refused_collision(self, mm_hash: str, key: str, held: str) -> None:
        """A put whose key holds another identifier: logged, counted."""
        log.warning("ecstore: refused mm_hash=%s: its key %s already holds identifier %r "
                    "(64-bit hash collision); the existing entry is kept", mm_hash, key, held)
        with self._lock:
            self._s.puts_refused += 1

    def snapshot(self, tiers: Tiers) -> StoreStats:
        """The counters plus what each of ``tiers`` holds now (one short LMDB
        read transaction for the disk tier's totals)."""
        memory, disk, writer, remote = tiers.memory, tiers.disk, tiers.writer, tiers.remote
        with self._lock:
            s = StoreStats(**{f.name: getattr(self._s, f.name) for f in fields(StoreStats)})
        if memory is not None:
            s.memory_entries = len(memory)
            s.memory_bytes = memory.used_bytes
            s.memory_capacity_bytes = memory.capacity_bytes
            s.memory_evictions = memory.evictions
        if disk is not None:
            s.disk_entries = disk.entry_count()
            s.disk_bytes = disk.total_bytes()
            s.disk_capacity_bytes = disk.capacity_bytes
            s.disk_evictions = disk.evictions
            s.corrupt_dropped = disk.corrupt_dropped
        if writer is not None:
            with writer.cv:
                s.write_errors = writer.write_errors
                s.puts_found_stored = writer.found_stored
                s.sync_errors = writer.sync_errors
                s.pending_writes = len(writer.puts.queued) + len(writer.puts.taken)
                s.pending_bytes = writer.puts.bytes
                s.remote_promotions_skipped = writer.offers_refused
        if remote is not None:
            r = remote.stats()
            s.remote_hits, s.remote_misses, s.remote_errors = r.hits, r.misses, r.errors
            s.remote_puts, s.remote_puts_dropped, s.remote_corrupt_dropped = r.puts, r.puts_dropped, r.corrupt_dropped
            s.remote_bytes_read, s.remote_bytes_written = r.bytes_read, r.bytes_written
            s.remote_pending_writes = remote.pending
        return s
