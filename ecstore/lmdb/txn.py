"""The write transaction: the one place entries are added, removed, touched
and evicted, and the one place the store's byte accounting is kept.

:class:`WriteTxn` owns one LMDB write transaction and the sub-database
handles (:class:`Dbs`). It reads the ``meta`` counters ``total_bytes``
(sum of stored blob sizes, bytes) and ``next_seq`` (the next LRU sequence
number) once, on first use; :meth:`~WriteTxn.insert`,
:meth:`~WriteTxn.remove`, :meth:`~WriteTxn.touch` and the evictions keep
them up to date in memory, and they are written back once, just before the
transaction commits. A blob, its record, its LRU row and the counters
therefore always change in the same transaction: the accounting cannot
drift from the entries, and nothing outside this module writes them.

Threads and processes: a WriteTxn lives inside one write transaction, so
it is used by one thread at a time (the tier holds its process's write
lock, LMDB's lock serialises processes).
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, replace
from typing import Any

import lmdb

from ecstore.errors import CorruptEntryError, StoreOpenError
from ecstore.format import Record, codec
from ecstore.lmdb.blobfiles import BlobFiles, FileRef, pack_ref, unpack_ref
from ecstore.lmdb.leases import LeaseTable

log = logging.getLogger("ecstore")

_U64 = struct.Struct("<Q")
_SEQ = struct.Struct(">Q")  # big-endian so LMDB's byte order is numeric order


def file_ref(value: bytes | memoryview) -> FileRef | None:
    """The blob file a ``blobs`` value points to; None for an inline blob
    and for a malformed pointer (damage: it is dropped like an inline blob)."""
    try:
        return unpack_ref(value)
    except CorruptEntryError:
        return None


def stored_size(value: bytes | memoryview | None) -> int:
    """The blob bytes a ``blobs`` value stands for (what ``total_bytes``
    counted): a pointer's file size, else the inline blob's length; 0 for
    no value."""
    if value is None:
        return 0
    ref = file_ref(value)
    return len(value) if ref is None else ref.size


def _meta_value(txn: lmdb.Transaction, name: bytes, db: Any, path: str) -> bytes | memoryview:
    """The ``meta`` record ``name`` (in sub-database ``db``) read in ``txn``;
    StoreOpenError if it is missing (a damaged store: :func:`schema.check_meta`
    verified it at open, so only a store damaged since then gets here)."""
    raw = txn.get(name, db=db)
    if raw is None:
        raise StoreOpenError(f"store at {path} is damaged: its meta record {name.decode()} is missing; "
                             f"move the store away or restore a copy")
    return raw


def _u64(txn: lmdb.Transaction, name: bytes, db: Any, path: str) -> int:
    """The u64 counter ``name`` (``total_bytes``, ``next_seq``) of the ``meta``
    sub-database ``db``, read in ``txn``; StoreOpenError if it is missing."""
    value: int = _U64.unpack(_meta_value(txn, name, db, path))[0]
    return value


@dataclass(frozen=True)
class Dbs:
    """The sub-database handles of one environment (see :mod:`ecstore.lmdb.migrations`):
    ``blobs`` (key -> safetensors blob), ``entries`` (key -> packed Record),
    ``meta`` (schema version and counters), ``lru`` (u64 BE seq -> key; None
    in schema 1), ``namespaces`` (namespace -> identity; None before schema 3),
    ``files`` (blob file name -> key; None before schema 4)."""

    blobs: Any
    entries: Any
    meta: Any
    lru: Any | None
    namespaces: Any | None
    files: Any | None = None

    @classmethod
    def open(cls, env: lmdb.Environment, txn: lmdb.Transaction | None, schema_version: int) -> Dbs:
        """The existing sub-databases of ``env``, a store at ``schema_version``
        (those a later schema adds are None), opened in ``txn`` (None: without
        a transaction; see ``StoreHandle``'s note on the write lock)."""
        def db(name: bytes, since: int = 1) -> Any:
            return env.open_db(name, txn=txn, create=False) if schema_version >= since else None
        return cls(blobs=db(b"blobs"), entries=db(b"entries"), meta=db(b"meta"), lru=db(b"lru", 2),
                   namespaces=db(b"namespaces", 3), files=db(b"files", 4))

    def present(self, *names: str) -> dict[str, Any]:
        """name -> handle of those of ``names`` (sub-database names, in that
        order) this schema has."""
        return {n: db for n in names if (db := getattr(self, n)) is not None}


@dataclass
class TierCounters:
    """Per-handle event counts (not persisted): entries evicted, damaged
    entries dropped. Updated by write transactions as they happen."""

    evictions: int = 0
    corrupt_dropped: int = 0


class WriteTxn:
    """One write transaction over a store's sub-databases (see the module
    docstring). Begin it with :meth:`open`; values read through it are
    ``bytes``."""

    def __init__(self, txn: lmdb.Transaction, dbs: Dbs, *, path: str, leases: LeaseTable | None,
                 pinned: Callable[[], set[bytes]], record_version: int, counters: TierCounters,
                 files: BlobFiles | None = None) -> None:
        """``leases``: the lease table evictions mark their victims in (None:
        read-only handle); ``pinned()``: the keys eviction must spare now;
        ``files``: the store's blob files (sizes of a damaged entry's file).
        ``unreferenced``: names of blob files whose entries this transaction
        removed; they are deleted once it commits (:meth:`open`)."""
        self.txn = txn
        self.dbs = dbs
        self.path = path
        self.leases = leases
        self.pinned = pinned
        self.record_version = record_version
        self.counters = counters
        self.files = files
        self._total: int | None = None  # read on first use
        self._seq: int | None = None
        self._dirty = False
        self.unreferenced: list[str] = []

    @classmethod
    @contextlib.contextmanager
    def open(cls, begin: contextlib.AbstractContextManager[lmdb.Transaction], dbs: Dbs, *, path: str,
             leases: LeaseTable | None, pinned: Callable[[], set[bytes]], record_version: int,
             counters: TierCounters, files: BlobFiles | None = None,
             durable: Callable[[], None] | None = None) -> Iterator[WriteTxn]:
        """``with WriteTxn.open(tier._write_txn(), ...) as w``: enters the
        write transaction ``begin``; when the block ends normally writes the
        counters back (if anything changed) and commits, then deletes the
        blob files of the entries it removed (``files``); on an exception
        aborts, counters included, and deletes nothing. (A crash between the
        commit and the deletes leaves files no entry references: swept at the
        next open, see :mod:`ecstore.lmdb.blobfiles`.)

        ``durable()`` (``env.sync(True)``) runs between the commit and the
        deletes: with ``metasync=False`` the commit's meta page reaches the
        disk only with the next fsync, and a power cut before it would bring
        back the commit before, whose entries still point to the deleted
        files. If it fails, the files are left for the sweep (logged)."""
        with begin as txn:
            w = cls(txn, dbs, path=path, leases=leases, pinned=pinned, record_version=record_version,
                    counters=counters, files=files)
            yield w
            w._write_back()
        if w.unreferenced and files is not None:
            if durable is not None:
                try:
                    durable()
                except lmdb.Error as e:  # never raise after the commit: the caller would take it for undone
                    log.warning("ecstore: cannot sync %s before deleting %d evicted blob files (left for the "
                                "sweep at the next open): %s", path, len(w.unreferenced), e)
                    return
            files.discard(w.unreferenced)

    # --------------------------------------------------------------- counters
    @property
    def total(self) -> int:
        """``total_bytes`` as of this transaction's changes so far (bytes)."""
        if self._total is None:
            self._total = _u64(self.txn, b"total_bytes", self.dbs.meta, self.path)
        return self._total

    def _next_seq(self) -> int:
        if self._seq is None:
            self._seq = _u64(self.txn, b"next_seq", self.dbs.meta, self.path)
        seq = self._seq
        self._seq += 1
        self._dirty = True
        return seq

    def force_commit(self) -> None:
        """Make the commit write (the counters, unchanged): LMDB skips a
        commit that wrote nothing, and callers need the transaction id to
        advance (pages freed by the previous commit become reusable)."""
        self.total  # noqa: B018 -- loads it, so it is written back
        if self._seq is None:
            self._seq = _u64(self.txn, b"next_seq", self.dbs.meta, self.path)
        self._dirty = True

    def _write_back(self) -> None:
        if not self._dirty:
            return
        if self._total is not None:
            self.txn.put(b"total_bytes", _U64.pack(self._total), db=self.dbs.meta)
        if self._seq is not None:
            self.txn.put(b"next_seq", _U64.pack(self._seq), db=self.dbs.meta)

    # ---------------------------------------------------------------- entries
    def identifier_of(self, k: bytes) -> str | None:
        """The identifier stored under ``k``; None if there is no entry. A
        damaged entry (unreadable record) is removed and counts as none."""
        raw = self.txn.get(k, db=self.dbs.entries)
        if raw is not None and not codec.record_readable(raw):
            self.remove(k)
            self.counters.corrupt_dropped += 1
            return None
        return None if raw is None else codec.record_identifier(raw, self.record_version)

    def file_of(self, k: bytes) -> str | None:
        """The name of the blob file ``k``'s entry points to; None for an
        inline blob or no entry."""
        value = self.txn.get(k, db=self.dbs.blobs)
        ref = None if value is None else file_ref(value)
        return None if ref is None else ref.name

    def insert(self, k: bytes, blob: codec.Blob, record: Record, ref: FileRef | None = None) -> None:
        """Store a new entry (no entry may exist under ``k``): blob (or, with
        ``ref``, a pointer to the file already holding it), record (its
        ``lru_seq`` is set here: most recently used) and LRU row;
        ``total_bytes`` grows by ``record.blob_size``."""
        rec = replace(record, lru_seq=self._next_seq())
        # numpy's stubs give ndarray __buffer__ only for Python >= 3.12; it has
        # the buffer protocol on 3.11 too (py-lmdb stores it without a copy).
        value = blob if ref is None else pack_ref(ref)
        self.txn.put(k, value, db=self.dbs.blobs)  # type: ignore[arg-type]
        if ref is not None:
            assert self.dbs.files is not None, "blob files need schema 4"
            self.txn.put(ref.name.encode("ascii"), k, db=self.dbs.files)
        self.txn.put(k, codec.pack_record(rec), db=self.dbs.entries)
        if self.dbs.lru is not None:
            self.txn.put(_SEQ.pack(rec.lru_seq), k, db=self.dbs.lru, append=True)
        self._total = self.total + rec.blob_size

    def touch(self, k: bytes, identifier: str, hits: int, last_ns: int) -> bool:
        """Make ``k``'s entry the most recently used, add ``hits`` and raise
        its last access to ``last_ns`` (ns since the epoch), if it still holds
        ``identifier``; False if not (or damaged: the next read drops it)."""
        raw = self.txn.get(k, db=self.dbs.entries)
        if raw is None or codec.record_identifier(raw, self.record_version) != identifier:
            return False
        try:
            rec = codec.unpack_record(raw)
        except CorruptEntryError:
            return False
        seq = self._next_seq()
        if self.dbs.lru is not None:
            self.txn.delete(_SEQ.pack(rec.lru_seq), db=self.dbs.lru)
            self.txn.put(_SEQ.pack(seq), k, db=self.dbs.lru, append=True)
        self.txn.put(k, codec.pack_record(rec.touched(last_ns, seq, hits)), db=self.dbs.entries)
        return True

    def remove(self, k: bytes, rec: Record | None = None) -> int:
        """Delete the entry under ``k`` (blob, record, every LRU row naming
        it) and take its bytes off ``total_bytes``; returns the bytes freed.

        Works on damaged entries too: with an unreadable record the blob's
        length (a pointer's file size) is what ``total_bytes`` counted for it,
        and its LRU row is found by scanning the LRU index (rare: damaged
        entries only). A blob file it pointed to is deleted after the commit."""
        txn, dbs = self.txn, self.dbs
        if rec is None:
            raw = txn.get(k, db=dbs.entries)
            if raw is not None:
                try:
                    rec = codec.unpack_record(raw)
                except CorruptEntryError:
                    rec = None
        blob = txn.get(k, db=dbs.blobs)
        size = rec.blob_size if rec is not None else stored_size(blob)
        ref = None if blob is None else file_ref(blob)
        if ref is not None:
            names = [ref.name]
            if dbs.files is not None:
                txn.delete(ref.name.encode("ascii"), db=dbs.files)
        elif dbs.files is not None and (blob is None or rec is None or rec.blob_size != len(blob)):
            # Damaged (no valid pointer, yet not a consistent inline blob): a
            # file it pointed to is found through the files index.
            index_rows = self._indexed_files_of(k)
            for row in index_rows:
                txn.delete(row, db=dbs.files)
            names = [n.decode("ascii") for n in index_rows if n.isascii()]  # discard() checks the pattern
            if names and rec is None and self.files is not None:  # what total_bytes counted
                size = sum(self.files.size(n) or 0 for n in names)
        else:
            names = []
        self.unreferenced.extend(names)
        txn.delete(k, db=dbs.blobs)
        txn.delete(k, db=dbs.entries)
        if dbs.lru is not None:
            if rec is not None and txn.get(_SEQ.pack(rec.lru_seq), db=dbs.lru) == k:
                txn.delete(_SEQ.pack(rec.lru_seq), db=dbs.lru)
            else:
                with txn.cursor(db=dbs.lru) as cur:
                    rows = [bytes(seq) for seq, v in cur if v == k]
                for seq in rows:
                    txn.delete(seq, db=dbs.lru)
        if size:
            self._total = max(0, self.total - size)
            self._dirty = True
        return size

    def _indexed_files_of(self, k: bytes) -> list[bytes]:
        """The files index's rows (file names, as stored) for entry ``k`` (a
        scan of the index: only for damaged entries, whose pointer cannot
        name the file)."""
        assert self.dbs.files is not None
        with self.txn.cursor(db=self.dbs.files) as cur:
            return [bytes(name) for name, key in cur if bytes(key) == k]

    # --------------------------------------------------------------- eviction
    def make_room(self, size: int, cap: int) -> bool:
        """Evict least recently used entries until ``size`` more bytes fit
        under ``cap`` (bytes); False if they cannot (the rest is pinned).
        Entries inserted earlier in this transaction are evictable like any
        other: a batch behaves as the same puts committed one by one."""
        if self.total + size > cap:
            self.evict(self.total + size - cap)
        return self.total + size <= cap

    def evict_to(self, target: int, extra: int = 0) -> int:
        """Evict until ``total_bytes`` <= ``target`` and at least ``extra``
        bytes are freed (bytes); returns the bytes freed."""
        need = max(extra, self.total - target)
        return self.evict(need) if need > 0 else 0

    def evict(self, need: int, protect: frozenset[bytes] = frozenset()) -> int:
        """Evict LRU entries until ``need`` bytes are freed.

        Skips leased entries and ``protect``; damaged entries (unreadable
        records) met on the way are removed too. Victims that get leased
        between their choice and their marking (the tombstone protocol, see
        :mod:`ecstore.lmdb.leases`) are spared and replaced by the next least
        recently used entries. Returns bytes freed (less than ``need`` only
        when everything left is pinned). Never raises for a damaged entry.
        """
        freed = 0
        skip = self.pinned() | protect
        while freed < need:
            victims: list[tuple[bytes, int]] = []
            damaged: list[bytes] = []
            chosen = 0
            candidates = self._lru_candidates(skip)
            try:
                for k, size, bad in candidates:
                    if bad:
                        damaged.append(k)
                    else:
                        victims.append((k, size))
                    chosen += size
                    if freed + chosen >= need:
                        break
            finally:
                candidates.close()  # its cursor, before the deletions below
            if not victims and not damaged:
                break  # nothing left that may be evicted
            for k in damaged:
                freed += self.remove(k)
                self.counters.corrupt_dropped += 1
            if victims and self.leases is not None:
                # Tombstone protocol, steps (2) and (3): see ecstore.lmdb.leases.
                self.leases.mark_evicting([k for k, _ in victims])
                pinned_now = self.pinned()
                skip |= pinned_now
                victims = [(k, size) for k, size in victims if k not in pinned_now]
            for k, _ in victims:
                freed += self.remove(k)
            self.counters.evictions += len(victims)
        return freed

    def _lru_candidates(self, skip: set[bytes]) -> Generator[tuple[bytes, int, bool], None, None]:
        """``(key, blob bytes, damaged)`` of evictable entries, least recently
        used first, skipping ``skip``. Cleans the LRU index on the way: a row
        whose entry is gone, or whose record names another position, is
        deleted (neither is an entry). A damaged entry (unreadable record) is
        yielded with ``damaged=True`` whatever ``skip`` says: it can only
        ever be a miss, so it is always removed."""
        txn, dbs = self.txn, self.dbs
        if dbs.lru is None:  # schema 1 (tooling only): order by the records
            order: list[tuple[int, bytes, int, bool]] = []
            with txn.cursor(db=dbs.entries) as cur:
                for k, packed in cur:
                    try:
                        rec = codec.unpack_record(packed)
                        order.append((rec.lru_seq, bytes(k), rec.blob_size, False))
                    except CorruptEntryError:
                        blob = txn.get(k, db=dbs.blobs)
                        order.append((-1, bytes(k), stored_size(blob), True))
            for _, k, size, damaged in sorted(order):
                if damaged or k not in skip:
                    yield k, size, damaged
            return
        stale: list[bytes] = []
        try:
            with txn.cursor(db=dbs.lru) as cur:
                for seq, kv in cur:
                    k = bytes(kv)
                    raw = txn.get(k, db=dbs.entries)
                    if raw is None:
                        stale.append(bytes(seq))
                        continue
                    try:
                        rec = codec.unpack_record(raw)
                    except CorruptEntryError:
                        blob = txn.get(k, db=dbs.blobs)
                        yield k, stored_size(blob), True
                        continue
                    if _SEQ.pack(rec.lru_seq) != bytes(seq):
                        stale.append(bytes(seq))
                        continue
                    if k not in skip:
                        yield k, rec.blob_size, False
        finally:
            for seq in stale:
                txn.delete(seq, db=dbs.lru)
