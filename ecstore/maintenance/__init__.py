"""Store maintenance as a library: the work behind ``ecstore-dump``.

Everything here works on a real store directory through
:class:`~ecstore.lmdb.tier.LMDBTier`'s own methods and returns typed records
(dataclasses); the CLI (:mod:`ecstore.cli`) only parses arguments, formats
these records as tables or JSON and picks exit codes.

* :mod:`.entries`  opening a store read-only, scanning and finding entries,
  and the per-entry check (a thin wrapper over :func:`ecstore.format.blob_check.check_entry`,
  the one entry check shared with ``get``);
* :mod:`.detail`   one entry in detail (record, blob check, safetensors header);
* :mod:`.inspect`  verify, page statistics, reader slots, per-model totals;
* :mod:`.purge`    selecting and removing entries (by key, model, namespace,
  last-access cutoff, or all);
* :mod:`.compact`  rewriting ``data.mdb`` compactly under LMDB's lock protocol.

Errors are :class:`~ecstore.errors.ECStoreError` subclasses.
"""

from __future__ import annotations

from ecstore.maintenance.compact import COMPACT_PREFIX, CompactResult, StoreBusyError, compact, try_exclusive
from ecstore.maintenance.detail import EntryDetail, entry_detail
from ecstore.maintenance.entries import (
    LMDB_MAGIC,
    SCAN_BATCH,
    Row,
    entry_problem,
    find_entries,
    key_bytes,
    key_text,
    open_readonly,
    precheck_store,
    read_entry,
    scan,
)
from ecstore.maintenance.inspect import (
    BadEntry,
    ModelTotals,
    PageStats,
    ReaderSlot,
    StoreReport,
    VerifyResult,
    page_stats,
    reader_slots,
    store_report,
    verify,
)
from ecstore.maintenance.progress import NO_PROGRESS, ProgressFactory, Ticker
from ecstore.maintenance.purge import PurgeCriteria, PurgeResult, purge, purge_capacity, select_victims

__all__ = [
    "COMPACT_PREFIX", "CompactResult", "StoreBusyError", "compact", "try_exclusive",
    "EntryDetail", "entry_detail",
    "LMDB_MAGIC", "SCAN_BATCH", "Row", "entry_problem", "find_entries", "key_bytes", "key_text",
    "open_readonly", "precheck_store", "read_entry", "scan",
    "BadEntry", "ModelTotals", "PageStats", "ReaderSlot", "StoreReport", "VerifyResult", "page_stats",
    "reader_slots", "store_report", "verify",
    "NO_PROGRESS", "ProgressFactory", "Ticker",
    "PurgeCriteria", "PurgeResult", "purge", "purge_capacity", "select_victims",
]
