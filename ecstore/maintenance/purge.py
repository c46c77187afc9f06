"""Removing entries: select what matches, then remove it through a writable
:class:`~ecstore.lmdb.tier.LMDBTier`, one short write transaction per entry.

Accounting stays exact (the tier's own ``remove``), a running vLLM is never
blocked for long, and entries under a live lease are skipped, not removed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ecstore.lmdb import LMDBTier
from ecstore.maintenance import namespaces
from ecstore.maintenance.entries import Row, key_bytes, scan
from ecstore.maintenance.progress import NO_PROGRESS, ProgressFactory


@dataclass(frozen=True)
class PurgeCriteria:
    """What to purge; every given criterion must hold (``all_entries`` alone
    selects everything).

    ``keys``: exact stored keys (resolve identifiers first with
    :func:`.entries.find_entries`); ``model``: the key's model;
    ``cutoff_ns``: last access strictly before this instant (ns since the
    epoch; entries with an unreadable record never match); ``namespace``:
    a spec checked by :func:`ecstore.maintenance.namespaces.check_spec`.
    """

    all_entries: bool = False
    keys: frozenset[str] | None = None
    model: str | None = None
    cutoff_ns: int | None = None
    namespace: str | None = None

    def matches(self, r: Row) -> bool:
        if self.all_entries:
            return True
        if self.keys is not None and r.key not in self.keys:
            return False
        if self.model is not None and r.model != self.model:
            return False
        if self.cutoff_ns is not None and (r.rec is None or r.rec.last_access_ns >= self.cutoff_ns):
            return False
        if self.namespace and not namespaces.matches(r.rec, self.namespace):
            return False
        return True


def select_victims(tier: LMDBTier, criteria: PurgeCriteria, progress: ProgressFactory = NO_PROGRESS) -> list[Row]:
    """The entries ``criteria`` selects, in key order (read-only scan).
    With a namespace prefix, raises ECStoreError unless it names exactly one
    namespace among them (:func:`ecstore.maintenance.namespaces.resolve`)."""
    with progress("selecting", tier.entry_count()) as prog:
        victims = [r for r in scan(tier, prog) if criteria.matches(r)]
    if criteria.namespace:
        namespaces.resolve(criteria.namespace, (r.rec.namespace for r in victims if r.rec))
    return victims


def purge_capacity(path: str, cap_bytes: int | None, tier_total: int) -> int:
    """A cap for the writable handle that can never trigger eviction on open.

    LMDBTier evicts at open when the store holds more than the cap; a purge
    must remove exactly what was asked. The total is bounded by the data file
    (which a concurrent writer may still grow a little), so use twice the file
    plus 1 GiB, or the configured cap if larger. Only the virtual map size
    depends on it.
    """
    try:
        fsize = os.path.getsize(os.path.join(path, "data.mdb"))
    except OSError:
        fsize = 0
    return max(cap_bytes or 0, 2 * max(fsize, tier_total) + (1 << 30))


@dataclass
class PurgeResult:
    """What :func:`purge` did: entries removed, bytes taken off the store's
    total, entries skipped because a loader leases them, and the size of
    data.mdb afterwards (LMDB reuses freed pages; it does not shrink)."""

    removed: int = 0
    freed: int = 0
    skipped: int = 0
    file_size: int = 0


def purge(path: str, victims: list[Row], *, schema_version: int, capacity: int, cutoff_ns: int | None = None,
          file_mode: int | None = None, on_removed: Callable[[str], None] | None = None,
          progress: ProgressFactory = NO_PROGRESS) -> PurgeResult:
    """Remove ``victims`` (from :func:`select_victims`) from the store at
    ``path``, each in its own write transaction, then sync.

    Leased entries are skipped; with ``cutoff_ns`` an entry read since it was
    selected is kept; an entry already gone is not counted. ``capacity``:
    see :func:`purge_capacity`. ``on_removed(key)`` is called after each
    removal. Takes LMDB's write lock briefly per entry.
    """
    result = PurgeResult()
    tier = LMDBTier(path, capacity, readonly=False, create=False, schema_target=schema_version,
                    file_mode=file_mode)
    try:
        leased = tier.leased_keys()
        with progress("purging", len(victims)) as prog:
            for r in victims:
                prog.advance()
                if key_bytes(r.key) in leased:
                    result.skipped += 1
                    continue
                if cutoff_ns is not None:  # re-check: it may have been read since selection
                    cur = tier.record(r.key)
                    if cur is not None and cur.last_access_ns >= cutoff_ns:
                        continue
                gone = tier.remove(r.key)
                if gone is not None:
                    result.removed += 1
                    result.freed += gone
                    if on_removed is not None:
                        on_removed(r.key)
        tier.sync()
        result.file_size = tier.env_info()["file_size"]
    finally:
        tier.close()
    return result
