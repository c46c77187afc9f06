"""Read-only inspection of a store: verify, page statistics, reader slots,
totals per model / dtype and per namespace.

All functions take a tier opened read-only (:func:`.entries.open_readonly`)
and use short read transactions only: safe while vLLM writes the store.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import lmdb

from ecstore.format import Record
from ecstore.lmdb import LMDBTier
from ecstore.lmdb.check import BadEntry as BadEntry
from ecstore.lmdb.check import StoreCheck, check_store
from ecstore.maintenance import namespaces
from ecstore.maintenance.entries import Row, scan
from ecstore.maintenance.progress import NO_PROGRESS, ProgressFactory

#: What :func:`verify` found (:class:`ecstore.lmdb.check.StoreCheck`): ``checked``
#: entries read (``vanished`` ones were evicted or deleted between listing and
#: reading them), ``bad`` ones, store-level ``problems`` (database row counts).
VerifyResult = StoreCheck


def verify(tier: LMDBTier, progress: ProgressFactory = NO_PROGRESS) -> VerifyResult:
    """Check every entry (:func:`.entries.entry_problem`: the ``get`` entry
    check) in its own short read transaction, and the row counts of the
    sub-databases against each other: :func:`ecstore.lmdb.check.check_store`,
    the check the test audit runs too. Reads every blob once; changes nothing."""
    keys = [r.key for r in scan(tier)]
    with progress("verifying", len(keys)) as prog:
        return check_store(tier, keys=keys, on_entry=prog.advance)


@dataclass
class PageStats:
    """Page accounting of the LMDB file, from what LMDB exposes.

    * ``tree_pages``: branch + leaf + overflow pages of the main tree and
      every sub-database, plus the 2 meta pages (env.stat / txn.stat);
    * ``free_pages`` = (last_pgno + 1) - tree pages: pages below the
      high-water mark that hold no live data: LMDB's free list (reused by
      later writes) and the free list's own pages, which LMDB does not
      report separately;
    * ``tail_pages`` = file pages - (last_pgno + 1): file beyond the high-water mark;
    * ``reclaimable_bytes`` ~ (file pages - tree pages) * page size: what compact frees;
    * ``blob_files`` / ``blob_file_bytes``: the blob files in ``blobs/``
      (entries of at least ``min_file_blob_size``, plus any a crash left
      before the next read-write open swept them).

    Sizes in bytes. ``accounted_bytes`` is the store's own ``total_bytes``
    counter (None if missing); it is not part of :meth:`as_json`.
    """

    page_size: int
    map_size: int
    file_size: int
    file_pages: int
    last_pgno: int
    last_txnid: int
    tree_pages: int
    free_pages: int
    free_bytes: int
    tail_pages: int
    reclaimable_bytes: int
    trees: dict[str, dict[str, Any]]
    max_readers: int
    reader_slots_high_water: int
    blob_files: int = 0
    blob_file_bytes: int = 0
    accounted_bytes: int | None = None

    def as_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["trees"] = {k: dict(v) for k, v in self.trees.items()}
        d.pop("accounted_bytes")
        return d


def page_stats(tier: LMDBTier) -> PageStats:
    """:class:`PageStats` of the store, from one read transaction."""
    main_db = tier.env.open_db(None)
    with tier.snapshot() as (txn, dbs):
        stats = {"main": txn.stat(main_db)}
        for name, db in dbs.present("blobs", "entries", "meta", "lru", "files").items():
            stats[name] = txn.stat(db)
        raw_total = txn.get(b"total_bytes", db=dbs.meta)
        accounted = struct.unpack("<Q", raw_total)[0] if raw_total is not None else None
    info = tier.env_info()
    files = tier.files.sizes()
    psize = info["psize"]
    used_pages = info["last_pgno"] + 1
    file_pages = info["file_size"] // psize
    tree_pages = 2 + sum(t["branch_pages"] + t["leaf_pages"] + t["overflow_pages"] for t in stats.values())
    free_pages = max(0, used_pages - tree_pages)
    return PageStats(
        page_size=psize, map_size=info["map_size"], file_size=info["file_size"], file_pages=file_pages,
        last_pgno=info["last_pgno"], last_txnid=info["last_txnid"], tree_pages=tree_pages,
        free_pages=free_pages, free_bytes=free_pages * psize, tail_pages=max(0, file_pages - used_pages),
        reclaimable_bytes=max(0, file_pages - tree_pages) * psize,
        trees={name: dict(t) for name, t in stats.items()},
        max_readers=info["max_readers"], reader_slots_high_water=info["num_readers"],
        blob_files=len(files), blob_file_bytes=sum(files.values()), accounted_bytes=accounted,
    )


@dataclass
class ReaderSlot:
    """One active slot of LMDB's reader table."""

    pid: int
    thread: str
    txnid: int | None
    alive: bool
    this_process: bool


def reader_slots(env: lmdb.Environment) -> list[ReaderSlot]:
    """Active reader slots from LMDB's reader table (pid, thread, txnid);
    ``alive`` from ``kill(pid, 0)`` (a process of another user counts as alive)."""
    out = []
    me = os.getpid()
    for line in env.readers().splitlines()[1:]:
        parts = line.split()
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        pid = int(parts[0])
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        out.append(ReaderSlot(pid, parts[1], None if parts[2] == "-" else int(parts[2]), alive, pid == me))
    return out


@dataclass
class ModelTotals:
    """Entries of one (model, dtype): counts, blob bytes, tensor bytes, hits."""

    model: str
    dtype: str
    entries: int = 0
    bytes: int = 0
    tensor_bytes: int = 0
    hits: int = 0


@dataclass
class StoreReport:
    """Everything ``ecstore-dump stats`` reports about a store's files (entries,
    totals, pages, reader slots): a read of the store at rest, not the live
    per-handle counters of :class:`ecstore.StoreStats`."""

    schema_version: int
    rows: list[Row]
    by_model: list[ModelTotals]
    by_namespace: list[namespaces.NamespaceSummary]
    pages: PageStats
    readers: list[ReaderSlot]

    @property
    def unreadable(self) -> int:
        return sum(1 for r in self.rows if r.rec is None)

    @property
    def records(self) -> list[Record]:
        return [r.rec for r in self.rows if r.rec is not None]

    @property
    def bytes(self) -> int:
        return sum(g.bytes for g in self.by_model)


def store_report(tier: LMDBTier, progress: ProgressFactory = NO_PROGRESS) -> StoreReport:
    """Scan every record once and gather :class:`StoreReport`."""
    with progress("reading entries", tier.entry_count()) as prog:
        rows = list(scan(tier, prog))
    pages = page_stats(tier)
    readers = reader_slots(tier.env)
    by_namespace = namespaces.summarize((r.rec for r in rows), tier.namespace_descriptions())
    groups: dict[tuple[str, str], ModelTotals] = {}
    for r in rows:
        if r.rec is None:
            continue
        g = groups.setdefault((r.model, r.rec.dtype), ModelTotals(r.model, r.rec.dtype))
        g.entries += 1
        g.bytes += r.rec.blob_size
        g.tensor_bytes += r.rec.nbytes
        g.hits += r.rec.hits
    by = sorted(groups.values(), key=lambda g: (g.model, g.dtype))
    return StoreReport(tier.schema_version, rows, by, by_namespace, pages, readers)
