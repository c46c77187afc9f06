"""The persistent tier: one LMDB environment in the ``local_disk`` directory.

This module is ecstore's only I/O seam: every byte that reaches or leaves
the disk goes through :class:`LMDBTier`.

Layout (see ``migrations/``): sub-databases ``blobs`` (key -> safetensors
blob), ``entries`` (key -> packed Record), ``lru`` (u64 BE seq -> key) and
``meta`` (schema version, total bytes, next LRU sequence number). A blob, its
record and its LRU position are always written and removed in the same write
transaction, and ``total_bytes`` is updated in that transaction too, so the
accounting can never drift from the entries.

Leases (pins against eviction while a loader is about to read an entry) live
in a second, tiny LMDB file, ``leases.mdb``, opened without fsync: they are
ephemeral, and keeping them apart means a scheduler taking a lease never
waits behind a writer committing a 100 MB blob. The lease table and its
eviction-marker protocol are :mod:`ecstore.leases`; the per-process
environment registry, map sizing and the data-file checks are
:mod:`ecstore.lmdb_env`. This module keeps :class:`LMDBTier` (reads, writes,
eviction) and re-exports the names other modules import from it.

Design notes
------------
* Map size. LMDB files never shrink and can only grow up to the map size, so
  the map size is what actually bounds the file. We use
  ``max(1.25 * cap, cap + 1 MiB)``. When fragmentation makes a commit hit the map
  limit (``MapFullError``), we evict extra least-recently-used entries in a
  separate transaction (pages freed by a committed transaction become
  reusable) and retry: a full map costs hit ratio, never a crash.
* Readers. Read transactions are opened per call and closed before
  returning, so no reader pins old pages across calls; ``reader_check()``
  clears slots of dead processes at open and whenever the map fills.
* Durability. The environment is opened with ``metasync=False``: one fsync
  per commit; the newest commit can be lost on power failure (not on a
  process crash), integrity is preserved. ``sync()`` forces it to disk.
* Processes and threads. Any number of processes may open the same directory
  (LMDB serialises writers with a lock in ``lock.mdb``). Within a process
  one environment per directory is shared by all handles (LMDB forbids
  opening the same file twice in a process); every method is thread-safe.
  An environment must never be used across ``fork()``: the child gets
  ForkedStoreError. A forked child cannot open the same directory either
  while the parent had it open (py-lmdb refuses a second environment on the
  same files, and closing the inherited one may hang): StoreOpenError says
  so; use processes started with ``spawn``/``forkserver`` for that.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import shutil
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, Literal, TypeVar, overload

import lmdb
import torch

from . import codec, schema
from .codec import CorruptBlobError, Record
from .errors import ECStoreError, SchemaError, StoreFullError, StoreOpenError, check_same_process
from .leases import LeaseTable
from .store_files import FilePolicy

# Moved to lmdb_env / leases; re-exported here for the modules and tests that
# import them from this one (``import X as X`` marks an explicit re-export).
from .leases import _LEASE as _LEASE
from .leases import _TOMB as _TOMB
from .leases import LEASE_PRUNE_MIN as LEASE_PRUNE_MIN
from .leases import TOMBSTONE_MAX_AGE_NS as TOMBSTONE_MAX_AGE_NS
from .leases import _pid_alive as _pid_alive
from .lmdb_env import _FOREIGN_OK as _FOREIGN_OK
from .lmdb_env import MAP_HEADROOM_BYTES as MAP_HEADROOM_BYTES
from .lmdb_env import MAP_HEADROOM_FACTOR as MAP_HEADROOM_FACTOR
from .lmdb_env import MAX_MAP_RESIZED_RETRIES as MAX_MAP_RESIZED_RETRIES
from .lmdb_env import MiB as MiB
from .lmdb_env import _check_data_file as _check_data_file
from .lmdb_env import _open_env as _open_env
from .lmdb_env import _open_leases as _open_leases
from .lmdb_env import _reader_txnids as _reader_txnids
from .lmdb_env import _SharedEnv as _SharedEnv
from .lmdb_env import _TxnGate as _TxnGate
from .lmdb_env import map_size_for as map_size_for

log = logging.getLogger("ecstore")

_T = TypeVar("_T")
_U64 = struct.Struct("<Q")
_SEQ = struct.Struct(">Q")  # big-endian so LMDB's byte order is numeric order

#: How long a write whose map is full waits, at most, for read transactions
#: of other processes to release old snapshots (seconds; see write_batch).
MAPFULL_PATIENCE_S = 60.0
#: Retries of a write whose map stays full with nothing left to evict, no
#: reader of an older snapshot to wait for and no other writer committing in
#: between (rounds in which others committed do not count; see write_batch).
MAPFULL_STUCK_RETRIES = 3


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


class _MapFullRetry:
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
    in use, not full of live data. Used by one thread at a time.
    """

    def __init__(self, tier: "LMDBTier") -> None:
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
        if not tier._wait_for_older_readers(self.deadline):
            self.stuck += 1
            if self.stuck > MAPFULL_STUCK_RETRIES:
                return False
        self._committed()
        return True


@dataclass
class PutRequest:
    """One entry for :meth:`LMDBTier.write_batch`."""

    key: str
    identifier: str
    model: str
    tensor: torch.Tensor  # contiguous, CPU
    blob: codec.Blob | None = None
    result: str = "pending"  # "stored" | "present" | "collision" | "failed"
    error: BaseException | None = None
    #: Position of this put among the puts and touches of a batch (see
    #: :meth:`LMDBTier.write_batch`); None: in list order, before all touches.
    order: int | None = None

    @property
    def encoded(self) -> codec.Blob:
        """``blob``, once :meth:`LMDBTier.write_batch` has set it (it encodes
        every request without one before anything else)."""
        assert self.blob is not None, "PutRequest.blob is set by write_batch before it is used"
        return self.blob



def _lmdb_errors_as_store_errors(method: Any) -> Any:
    """An LMDB error escaping a public LMDBTier method (a damaged B-tree page,
    an I/O error) becomes StoreOpenError, an ECStoreError: callers (the vLLM
    connector) catch that family and treat it as a miss instead of meeting a
    foreign exception type."""
    @functools.wraps(method)
    def wrapper(self: "LMDBTier", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except lmdb.Error as e:
            raise StoreOpenError(f"LMDB error on store {self.path} ({type(e).__name__}: {e}); "
                                 f"the store may be damaged: check it with ecstore-dump verify") from e
    return wrapper


class LMDBTier:
    """Persistent, size-bounded, multi-process LRU tier.

    ``capacity_bytes`` bounds the sum of stored blob sizes (tensor bytes plus
    a few hundred bytes of safetensors header each). ``readonly`` handles
    never write (no eviction, no LRU updates, corrupt entries are reported
    but not removed).
    """

    def __init__(self, path: str, capacity_bytes: int, *, readonly: bool = False,
                 create: bool = True, schema_target: int | None = None,
                 map_size_bytes: int | None = None, file_mode: int | None = None) -> None:
        """``map_size_bytes`` overrides the LMDB map size (default
        :func:`map_size_for` the cap); LMDB still uses at least the data
        file's size, and only the first open of a directory in a process sets
        it. A map smaller than the cap is legal: a full map makes puts evict
        (see the design notes), it never fails them while anything is
        evictable. Tests use it to reach a full map without filling a disk.

        ``file_mode``: mode of the files a read-write open creates (default
        0600, directory 0700) and the mode an existing store is checked
        against (see :mod:`ecstore.store_files`); None also means the caller
        does not know the configured mode: looser modes are then not warned
        about, only refused where unsafe."""
        self.path = path
        self.capacity_bytes = int(capacity_bytes)
        self.readonly = readonly
        map_size = map_size_for(self.capacity_bytes) if map_size_bytes is None else int(map_size_bytes)
        policy = FilePolicy() if file_mode is None else FilePolicy(file_mode)
        self._shared = _SharedEnv.acquire(path, map_size, readonly, create, policy,
                                          explicit_mode=file_mode is not None)
        self.env = self._shared.env
        self._pid = os.getpid()
        self._closed = False
        try:
            if not readonly:
                self.env.reader_check()
            self.schema_version = schema.ensure_schema(self.env, readonly=readonly, path=path,
                                                       target=schema_target, begin=self._schema_begin)
            # On a writable environment, open_db() without a transaction
            # takes LMDB's write lock while holding the GIL: if a writer
            # thread of another handle in this process holds that lock and
            # waits for the GIL, both hang, and so does every other process
            # waiting for the lock. begin() releases the GIL while it waits.
            # (Handles opened in a read transaction die with it: read-only
            # environments keep the plain call, which takes no write lock.)
            if self._shared.readonly:
                self._open_dbs(None)
            else:
                with self._shared.write_lock, self._shared.txn(write=True) as txn:
                    self._open_dbs(txn)  # nothing written: the commit makes the handles permanent
            self._shared.open_leases()
        except lmdb.Error as e:
            self._shared.release()
            raise StoreOpenError(f"cannot open ecstore store at {path}: {e}") from None
        except BaseException:  # SchemaError, StoreOpenError, or anything unforeseen: never leak the env
            self._shared.release()
            raise
        self.evictions = 0
        self.corrupt_dropped = 0
        if not readonly:
            self._initial_eviction()

    def _initial_eviction(self) -> None:
        """Evict down to the cap at open (reopened with a smaller cap).

        Best effort: a store error here (the map full -- even for the
        eviction's own transaction while readers pin the pages other writers
        freed --, entries pinned) leaves
        the store open and usable (the next put evicts again) and is logged;
        anything else releases the shared environment before it propagates,
        so a failing open never leaks a reference to it."""
        try:
            if self.total_bytes() > self.capacity_bytes:
                self._evict_to(self.capacity_bytes)
        except (ECStoreError, lmdb.MapFullError) as e:
            log.warning("ecstore: could not evict %s down to its cap of %d bytes at open: %s",
                        self.path, self.capacity_bytes, e)
        except lmdb.Error as e:
            self._closed = True
            self._shared.release()
            raise StoreOpenError(f"cannot open ecstore store at {self.path}: {e}") from None
        except BaseException:
            self._closed = True
            self._shared.release()
            raise

    @contextlib.contextmanager
    def _schema_begin(self, write: bool = False) -> Iterator[lmdb.Transaction]:
        """Transactions for :func:`schema.ensure_schema` (writes under the write lock)."""
        with contextlib.ExitStack() as stack:
            if write:
                stack.enter_context(self._shared.write_lock)
            yield stack.enter_context(self._shared.txn(write=write))

    def _open_dbs(self, txn: lmdb.Transaction | None) -> None:
        self._blobs = self.env.open_db(b"blobs", txn=txn, create=False)
        self._entries = self.env.open_db(b"entries", txn=txn, create=False)
        self._meta = self.env.open_db(b"meta", txn=txn, create=False)
        self._lru = self.env.open_db(b"lru", txn=txn, create=False) if self.schema_version >= 2 else None
        self._namespaces = (self.env.open_db(b"namespaces", txn=txn, create=False)
                            if self.schema_version >= 3 else None)
        # Records this handle writes and serves: from schema 3 on, v2 records
        # holding stored names (ecstore.identity); a handle held at an older
        # schema (tests) writes and serves v1.
        self.record_version = (codec.RECORD_VERSION if self.schema_version >= 3
                               else codec.LEGACY_RECORD_VERSION)

    # ------------------------------------------------------------------ utils
    def _check(self) -> None:
        check_same_process(self._pid, f"the ecstore handle of {self.path}")
        if self._closed:
            raise StoreOpenError(f"store at {self.path} is closed")

    @overload
    def _begin(self, write: bool = False,
               buffers: Literal[False] = False) -> contextlib.AbstractContextManager[lmdb.Transaction[bytes]]: ...

    @overload
    def _begin(self, write: bool = False, *,
               buffers: Literal[True]) -> contextlib.AbstractContextManager[lmdb.Transaction[memoryview]]: ...

    def _begin(self, write: bool = False, buffers: bool = False) -> contextlib.AbstractContextManager[lmdb.Transaction]:
        """``with self._begin() as txn``: see :meth:`_SharedEnv.txn`. Values
        read in the transaction are ``bytes``, or ``memoryview`` with
        ``buffers=True`` (valid only inside the ``with`` block)."""
        return self._shared.txn(write=write, buffers=buffers)

    @contextlib.contextmanager
    def _write_txn(self) -> Iterator[lmdb.Transaction[bytes]]:
        """A write transaction under this process's write lock; eviction
        tombstones it left are cleared once it has committed or aborted."""
        with self._shared.write_lock:
            try:
                with self._begin(write=True) as txn:
                    raw = txn.get(b"schema_version", db=self._meta)
                    if raw is not None and int(raw) != self.schema_version:
                        # Another process migrated the file after we opened it:
                        # our view of the layout is stale, so write nothing.
                        raise SchemaError(
                            f"store at {self.path} was migrated to schema {int(raw)} by another "
                            f"process while this handle (schema {self.schema_version}) was open; "
                            f"reopen the store")
                    yield txn
            finally:
                self._clear_tombstones()

    @staticmethod
    def _k(key: str) -> bytes:
        # surrogateescape: a key read back from the file with bytes that are
        # not UTF-8 (tooling decodes them so) maps to the very same bytes.
        return key.encode("utf-8", "surrogateescape")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if os.getpid() == self._pid:
                self._shared.release()

    # ------------------------------------------------------------------ reads
    @_lmdb_errors_as_store_errors
    def contains(self, key: str, identifier: str) -> bool:
        return self.identifier_at(key) == identifier

    @_lmdb_errors_as_store_errors
    def identifier_at(self, key: str) -> str | None:
        """The full identifier stored under ``key``, or None if absent."""
        self._check()
        with self._begin(buffers=True) as txn:
            raw = txn.get(self._k(key), db=self._entries)
            return None if raw is None else codec.record_identifier(raw, self.record_version)

    @_lmdb_errors_as_store_errors
    def record(self, key: str) -> Record | None:
        self._check()
        with self._begin(buffers=True) as txn:
            raw = txn.get(self._k(key), db=self._entries)
            return None if raw is None else codec.unpack_record(raw)

    @_lmdb_errors_as_store_errors
    def get(self, key: str, identifier: str, *, model: str | None = None,
            dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The stored tensor (a fresh CPU copy), or None on a miss.

        The entry passes :func:`codec.check_entry` (record, blob, checksum,
        header; the ``key``, and the ``model`` / ``dtype`` of the asking
        handle if given) before a byte of it is copied. An entry failing it
        is logged, removed (unless read-only) and reported as a miss: garbage
        or a tensor of another model, dtype or shape is never returned, and
        no hostile header makes this raise anything but an ECStoreError.
        """
        self._check()
        k = self._k(key)
        rec: Record | None = None
        with self._begin(buffers=True) as txn:
            raw = txn.get(k, db=self._entries)
            if raw is None:
                return None
            try:
                rec = codec.unpack_record(raw)
                if rec.identifier != identifier or rec.version != self.record_version:
                    return None  # another identity or identifier (hash collision), or legacy: a plain miss
                blob = txn.get(k, db=self._blobs)
                if blob is None:
                    raise CorruptBlobError("record without blob")
                return codec.read_entry(rec, blob, identifier=identifier, model=model, dtype=dtype, key=key)
            except CorruptBlobError as e:
                err = e
        log.warning("ecstore: corrupt entry %s (%s) at %s: treated as a miss%s", key, err, self.path,
                    "" if self.readonly else ", removed")
        if not self.readonly:
            try:
                self._write_retrying(lambda: self._drop_corrupt(k, None if rec is None else rec.checksum),
                                     f"drop the corrupt entry {key}")
            except StoreFullError as e:  # still a miss; the next get or eviction drops it
                log.warning("ecstore: %s", e)
        return None

    def _drop_corrupt(self, k: bytes, raw_expected: int | None) -> None:
        with self._write_txn() as txn:
            raw = txn.get(k, db=self._entries)
            if raw is None:
                return
            try:
                rec = codec.unpack_record(raw)
            except CorruptBlobError:
                rec = None
            if rec is not None and raw_expected is not None and rec.checksum != raw_expected:
                return  # replaced by a fresh entry meanwhile
            self._remove(txn, k, rec)
            self.corrupt_dropped += 1

    def iter_records(self, *, reverse: bool = False) -> Iterator[tuple[str, Record | None]]:
        """(key, record) for every entry, in key order; None for an unreadable record.

        Holds one read transaction while iterating: use for tooling, not on
        the serving path.
        """
        self._check()
        with self._begin() as txn, txn.cursor(db=self._entries) as cur:
            for k, raw in (cur.iterprev() if reverse else cur):
                try:
                    yield k.decode("utf-8"), codec.unpack_record(raw)
                except CorruptBlobError:
                    yield k.decode("utf-8", "replace"), None

    @_lmdb_errors_as_store_errors
    def blob_bytes(self, key: str) -> bytes | None:
        """A copy of an entry's raw blob (for export/verify tooling)."""
        self._check()
        with self._begin() as txn:
            return txn.get(self._k(key), db=self._blobs)

    @_lmdb_errors_as_store_errors
    def lru_keys(self) -> list[str]:
        """Keys from least to most recently used."""
        self._check()
        with self._begin() as txn:
            if self._lru is not None:
                return [bytes(v).decode() for _, v in txn.cursor(db=self._lru)]
            recs = [(codec.unpack_record(v).lru_seq, bytes(k).decode()) for k, v in txn.cursor(db=self._entries)]
        return [k for _, k in sorted(recs)]

    @_lmdb_errors_as_store_errors
    def total_bytes(self) -> int:
        with self._begin() as txn:
            raw = txn.get(b"total_bytes", db=self._meta)
            return _U64.unpack(raw)[0] if raw else 0

    @_lmdb_errors_as_store_errors
    def entry_count(self) -> int:
        with self._begin() as txn:
            return txn.stat(self._entries)["entries"]

    def env_info(self) -> dict[str, Any]:
        info = dict(self.env.info())
        info["psize"] = self.env.stat()["psize"]
        try:
            info["file_size"] = os.path.getsize(os.path.join(self.path, "data.mdb"))
        except OSError:
            info["file_size"] = 0
        return info

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[tuple[lmdb.Transaction, dict[str, Any]]]:
        """One read transaction (``buffers=True``) and the sub-database handles
        ``{"blobs", "entries", "meta", "lru"}`` (``lru`` None in schema 1), for
        tooling (``ecstore-dump``) that needs a consistent view. Read-only;
        buffers are valid only inside the ``with`` block; keep it short."""
        self._check()
        with self._begin(buffers=True) as txn:
            yield txn, {"blobs": self._blobs, "entries": self._entries, "meta": self._meta, "lru": self._lru}

    # ----------------------------------------------------------------- leases
    @property
    def _leases(self) -> LeaseTable | None:
        """The lease table (:mod:`ecstore.leases`); None on read-only handles."""
        return self._shared.lease_table

    @_lmdb_errors_as_store_errors
    def lease(self, keys: list[str], ttl_s: float, pid: int | None = None) -> None:
        """Pin ``keys`` against eviction for ``ttl_s`` seconds (or until
        released, or until process ``pid`` dies)."""
        leases = self._leases
        if leases is None or not keys:
            return
        self._check()
        leases.lease([self._k(key) for key in keys], ttl_s, os.getpid() if pid is None else pid)

    @_lmdb_errors_as_store_errors
    def release(self, keys: list[str], pid: int | None = None) -> None:
        """Drop one lease of ``pid`` on each of ``keys``."""
        leases = self._leases
        if leases is None or not keys:
            return
        self._check()
        leases.release([self._k(key) for key in keys], os.getpid() if pid is None else pid)

    @_lmdb_errors_as_store_errors
    def pin_if_present(self, key: str, identifier: str, ttl_s: float) -> bool:
        """Lease ``key`` and report whether it holds ``identifier``, such that
        a True answer guarantees no process evicts the entry before the lease
        ends: steps (a) lease, (b) tombstone check, (c) entry check of the
        eviction-marker protocol written down in :mod:`ecstore.leases`.
        """
        if not self.contains(key, identifier):
            # A miss needs no pin: answering "no" is always safe, and the
            # scheduler asks about every uncached item at every step, so the
            # common miss costs one read instead of two lease-file commits.
            return False
        leases = self._leases
        if leases is None:
            return True
        self.lease([key], ttl_s)
        if leases.evicting(self._k(key)) or not self.contains(key, identifier):
            self.release([key])
            return False
        return True

    @_lmdb_errors_as_store_errors
    def leased_keys(self) -> set[bytes]:
        """Keys with at least one live lease (unexpired, owner alive)."""
        leases = self._leases
        if leases is None:
            return set()
        return leases.leased_keys()

    # ----------------------------------------------------------------- writes
    def _remove(self, txn: lmdb.Transaction, k: bytes, rec: Record | None) -> int:
        """Delete an entry inside ``txn`` (blob, record, every LRU row naming
        it) and take its bytes off ``total_bytes``; returns the bytes freed.

        Works on damaged entries too: with an unreadable record the blob's
        length is what ``total_bytes`` counted for it, and its LRU row is
        found by scanning the LRU index (rare: damaged entries only)."""
        if rec is None:
            raw = txn.get(k, db=self._entries)
            if raw is not None:
                try:
                    rec = codec.unpack_record(raw)
                except CorruptBlobError:
                    rec = None
        blob = txn.get(k, db=self._blobs)
        size = rec.blob_size if rec is not None else (len(blob) if blob is not None else 0)
        txn.delete(k, db=self._blobs)
        txn.delete(k, db=self._entries)
        if self._lru is not None:
            if rec is not None and txn.get(_SEQ.pack(rec.lru_seq), db=self._lru) == k:
                txn.delete(_SEQ.pack(rec.lru_seq), db=self._lru)
            else:
                self._delete_lru_rows_of(txn, k)
        if size:
            total = _u64(txn, b"total_bytes", self._meta, self.path)
            txn.put(b"total_bytes", _U64.pack(max(0, total - size)), db=self._meta)
        return size

    def _delete_lru_rows_of(self, txn: lmdb.Transaction, k: bytes) -> None:
        """Delete every LRU row pointing at ``k`` (a full scan of the index)."""
        with txn.cursor(db=self._lru) as cur:
            rows = [bytes(seq) for seq, v in cur if v == k]
        for seq in rows:
            txn.delete(seq, db=self._lru)

    def _lru_candidates(self, txn: lmdb.Transaction,
                        skip: set[bytes]) -> Generator[tuple[bytes, int, bool], None, None]:
        """``(key, blob bytes, damaged)`` of evictable entries, least recently
        used first, skipping ``skip``. Cleans the LRU index on the way: a row
        whose entry is gone, or whose record names another position, is
        deleted (neither is an entry). A damaged entry (unreadable record) is
        yielded with ``damaged=True`` whatever ``skip`` says: it can only
        ever be a miss, so it is always removed."""
        if self._lru is None:  # schema 1 (tooling only): order by the records
            order: list[tuple[int, bytes, int, bool]] = []
            with txn.cursor(db=self._entries) as cur:
                for k, packed in cur:
                    try:
                        rec = codec.unpack_record(packed)
                        order.append((rec.lru_seq, bytes(k), rec.blob_size, False))
                    except CorruptBlobError:
                        blob = txn.get(k, db=self._blobs)
                        order.append((-1, bytes(k), len(blob) if blob is not None else 0, True))
            for _, k, size, damaged in sorted(order):
                if damaged or k not in skip:
                    yield k, size, damaged
            return
        stale: list[bytes] = []
        try:
            with txn.cursor(db=self._lru) as cur:
                for seq, kv in cur:
                    k = bytes(kv)
                    raw = txn.get(k, db=self._entries)
                    if raw is None:
                        stale.append(bytes(seq))
                        continue
                    try:
                        rec = codec.unpack_record(raw)
                    except CorruptBlobError:
                        blob = txn.get(k, db=self._blobs)
                        yield k, len(blob) if blob is not None else 0, True
                        continue
                    if _SEQ.pack(rec.lru_seq) != bytes(seq):
                        stale.append(bytes(seq))
                        continue
                    if k not in skip:
                        yield k, rec.blob_size, False
        finally:
            for seq in stale:
                txn.delete(seq, db=self._lru)

    def _evict_in(self, txn: lmdb.Transaction, need: int, protect: set[bytes]) -> int:
        """Evict LRU entries inside ``txn`` until ``need`` bytes are freed.

        Skips leased entries and ``protect``; damaged entries (unreadable
        records) met on the way are removed too. Victims that get leased
        between their choice and their marking (the tombstone protocol, see
        :mod:`ecstore.leases`) are spared and replaced by the next least
        recently used entries. Returns bytes freed (less than ``need`` only
        when everything left is pinned). Never raises for a damaged entry.
        """
        freed = 0
        skip = self.leased_keys() | protect
        while freed < need:
            victims: list[tuple[bytes, int]] = []
            damaged: list[bytes] = []
            chosen = 0
            candidates = self._lru_candidates(txn, skip)
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
                freed += self._remove(txn, k, None)
                self.corrupt_dropped += 1
            leases = self._leases
            if victims and leases is not None:
                # Tombstone protocol, steps (2) and (3): see ecstore.leases.
                leases.mark_evicting([k for k, _ in victims])
                pinned_now = self.leased_keys()
                skip |= pinned_now
                victims = [(k, size) for k, size in victims if k not in pinned_now]
            for k, _ in victims:
                freed += self._remove(txn, k, None)
            self.evictions += len(victims)
        return freed

    def _clear_tombstones(self) -> None:
        """Step (5) of the tombstone protocol: after the eviction committed."""
        leases = self._leases
        if leases is not None:
            leases.clear_tombstones()

    def _evict_to(self, target_bytes: int, extra: int = 0) -> int:
        with self._write_txn() as txn:
            total = _u64(txn, b"total_bytes", self._meta, self.path)
            need = max(extra, total - target_bytes)
            return self._evict_in(txn, need, set()) if need > 0 else 0

    def write_batch(self, puts: list[PutRequest], touches: dict[str, tuple] | None = None) -> None:
        """Store ``puts`` and apply ``touches`` (key -> (identifier, hits,
        last_access_ns[, orders])) in one transaction, evicting LRU entries to
        stay within the cap. Sets each request's ``result``; never raises for a
        single bad entry. Raises StoreFullError only if the whole batch could
        not be committed (disk full...), with nothing written.

        Order: when every put has an ``order`` and every touch a tuple of
        ``orders`` (the positions at which the key was read), puts and touches
        are applied in that order, so an entry read before a put is already
        most recently used when that put evicts. Otherwise puts are applied
        in list order, then touches.
        """
        self._check()
        touches = touches or {}
        for p in puts:
            if p.blob is None:
                p.blob = codec.encode(p.tensor, identifier=p.identifier, model=p.model)
            if len(p.blob) > self.capacity_bytes:
                p.result, p.error = "failed", StoreFullError(
                    f"entry of {len(p.blob)} bytes exceeds the disk cap of {self.capacity_bytes} bytes")
            elif len(p.blob) > self._map_room():  # would evict everything, then fail anyway
                p.result, p.error = "failed", StoreFullError(
                    f"entry of {len(p.blob)} bytes can never fit in the LMDB map of {self.path} "
                    f"(about {self._map_room()} bytes usable)")
        todo = [p for p in puts if p.result == "pending"]
        extra = 0
        retry = _MapFullRetry(self)

        def evict() -> int:  # fragmentation: free more pages in a committed transaction
            nonlocal extra
            extra = max(extra * 2, sum(len(p.encoded) for p in todo) + 4 * MiB)
            return self._evict_to(self.capacity_bytes, extra)

        while True:
            try:
                self._write_once(todo, touches)
                return
            except SchemaError as e:
                for p in todo:
                    p.result, p.error = "failed", e
                raise
            except lmdb.MapFullError:
                if not retry.again(evict):
                    break
            except lmdb.Error as e:
                # LMDB reports a short write (ENOSPC, EFBIG) as EIO: say why.
                hint = self._space_hint(sum(len(p.encoded) for p in todo))
                err = StoreFullError(f"write to {self.path} failed: {e}{hint}")
                if isinstance(e, (lmdb.DiskError,)) or getattr(e, "errno", None) in (errno.ENOSPC, errno.EFBIG):
                    err = StoreFullError(f"disk full while writing to {self.path}: {e}{hint}")
                for p in todo:
                    p.result, p.error = "failed", err
                raise err from None
        err = StoreFullError(f"LMDB map of {self.path} is full and nothing more can be evicted")
        for p in todo:
            p.result, p.error = "failed", err
        raise err

    def _write_retrying(self, write: Callable[[], _T], what: str) -> _T:
        """``write()`` (one write transaction that frees rather than adds),
        retried while the map is full (see :class:`_MapFullRetry`, without
        eviction); StoreFullError ("cannot <what>") when that gives up."""
        retry = _MapFullRetry(self)
        while True:
            try:
                return write()
            except lmdb.MapFullError:
                if not retry.again():
                    raise StoreFullError(f"LMDB map of {self.path} is full: cannot {what}") from None

    def _wait_for_older_readers(self, deadline: float) -> bool:
        """Wait until no read transaction (of any process) holds a snapshot
        older than the last commit, so the pages that commit freed can be
        reused. True if there was one and it ended; False if there was none
        (nothing to wait for) or ``deadline`` (time.monotonic()) passed. Polls LMDB's reader
        table, backing off from 1 ms to 50 ms."""
        last = self.env.info()["last_txnid"]
        pause = 0.001
        waited = False
        while True:
            older = [t for t in _reader_txnids(self.env.readers()) if t < last]
            if not older:
                return waited
            if time.monotonic() > deadline:
                return False
            waited = True
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _last_txnid(self) -> int:
        """The id of the newest committed write transaction of the environment
        (any process's): it grows by one with every commit that wrote."""
        txnid: int = self.env.info()["last_txnid"]
        return txnid

    def _commit_nothing(self) -> None:
        """Commit a transaction that changes no value (rewrites ``next_seq``):
        advances LMDB's transaction id so pages freed by the previous commit
        become reusable."""
        try:
            with self._write_txn() as txn:
                txn.put(b"next_seq", _meta_value(txn, b"next_seq", self._meta, self.path), db=self._meta)
        except lmdb.MapFullError:
            pass

    def _map_room(self) -> int:
        """Bytes of blob the LMDB map could hold at best (map minus the meta
        pages and some B-tree pages)."""
        return self.env.info()["map_size"] - 64 * self.env.stat()["psize"]

    def _space_hint(self, need: int) -> str:
        """`` (disk full: ...)`` when the file system or RLIMIT_FSIZE leaves no
        room for ``need`` more bytes, else ``""``."""
        hints = []
        try:
            free = shutil.disk_usage(self.path).free
            if free < need + 4 * MiB:
                hints.append(f"disk full: {free} bytes free")
        except OSError:
            pass
        try:
            import resource

            soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            size = os.path.getsize(os.path.join(self.path, "data.mdb"))
            if soft != resource.RLIM_INFINITY and size + need > soft:
                hints.append(f"file size limit (RLIMIT_FSIZE) of {soft} bytes reached")
        except (OSError, ImportError, ValueError):
            pass
        return f" ({'; '.join(hints)})" if hints else ""

    @staticmethod
    def _in_call_order(todo: list[PutRequest], touches: dict[str, tuple]) -> list[tuple]:
        """``("put", index)`` and ``("touch", key, identifier, hits, last_ns)``
        operations in the order they were made (see :meth:`write_batch`). A
        key read at several positions gets one touch per position; its hits
        are counted on the last one."""
        ordered = (all(p.order is not None for p in todo)
                   and all(len(t) > 3 and t[3] for t in touches.values()))
        if not ordered:
            return ([("put", i) for i in range(len(todo))]
                    + [("touch", key, t[0], t[1], t[2]) for key, t in touches.items()])
        ops: list[tuple[int, tuple]] = []
        for i, p in enumerate(todo):
            assert p.order is not None  # every put has one: `ordered`
            ops.append((p.order, ("put", i)))
        for key, (identifier, hits, last_ns, orders, *_) in touches.items():
            orders = sorted(orders)
            for o in orders[:-1]:
                ops.append((o, ("touch", key, identifier, 0, 0)))
            ops.append((orders[-1], ("touch", key, identifier, hits, last_ns)))
        ops.sort(key=lambda op: op[0])
        return [op for _, op in ops]

    def _write_once(self, todo: list[PutRequest], touches: dict[str, tuple]) -> None:
        now = time.time_ns()
        with self._write_txn() as txn:
            total = _u64(txn, b"total_bytes", self._meta, self.path)
            seq = _u64(txn, b"next_seq", self._meta, self.path)
            results: list[str] = ["pending"] * len(todo)
            for op in self._in_call_order(todo, touches):
                if op[0] == "touch":
                    _, key, identifier, hits, last_ns = op
                    k = self._k(key)
                    raw = txn.get(k, db=self._entries)
                    if raw is None or codec.record_identifier(raw, self.record_version) != identifier:
                        continue
                    try:
                        rec = codec.unpack_record(raw)
                    except CorruptBlobError:
                        continue  # damaged: the next get() or eviction drops it
                    if self._lru is not None:
                        txn.delete(_SEQ.pack(rec.lru_seq), db=self._lru)
                        txn.put(_SEQ.pack(seq), k, db=self._lru, append=True)
                    txn.put(k, codec.pack_record(rec.touched(last_ns, seq, hits)), db=self._entries)
                    seq += 1
                    continue
                i: int = op[1]
                p = todo[i]
                k = self._k(p.key)
                raw = txn.get(k, db=self._entries)
                if raw is not None and not codec.record_readable(raw):
                    # A damaged entry under this key: replace it.
                    txn.put(b"total_bytes", _U64.pack(total), db=self._meta)
                    self._remove(txn, k, None)
                    self.corrupt_dropped += 1
                    total = _u64(txn, b"total_bytes", self._meta, self.path)
                    raw = None
                if raw is not None:
                    same = codec.record_identifier(raw, self.record_version) == p.identifier
                    results[i] = "present" if same else "collision"
                    continue
                blob = p.encoded
                size = len(blob)
                if total + size > self.capacity_bytes:
                    # _remove updates total_bytes in meta: bring it up to date
                    # with the entries written so far in this transaction.
                    txn.put(b"total_bytes", _U64.pack(total), db=self._meta)
                    # Entries written earlier in this batch are evictable like
                    # any other: the batch behaves as the same puts committed
                    # one by one.
                    self._evict_in(txn, total + size - self.capacity_bytes, set())
                    total = _u64(txn, b"total_bytes", self._meta, self.path)
                    if total + size > self.capacity_bytes:
                        results[i] = "full"
                        continue
                rec = Record(p.identifier, str(p.tensor.dtype).removeprefix("torch."), tuple(p.tensor.shape),
                             codec.tensor_nbytes(p.tensor), size, codec.checksum(blob), now, now, 0, seq,
                             self.record_version)
                # numpy's stubs give ndarray __buffer__ only for Python >= 3.12; it has
                # the buffer protocol on 3.11 too (py-lmdb stores it without a copy).
                txn.put(k, blob, db=self._blobs)  # type: ignore[arg-type]
                txn.put(k, codec.pack_record(rec), db=self._entries)
                if self._lru is not None:
                    txn.put(_SEQ.pack(seq), k, db=self._lru, append=True)
                seq += 1
                total += size
                results[i] = "stored"
            txn.put(b"total_bytes", _U64.pack(total), db=self._meta)
            txn.put(b"next_seq", _U64.pack(seq), db=self._meta)
        for p, r in zip(todo, results):
            if r == "full":
                p.result, p.error = "failed", StoreFullError(
                    f"no room for {len(p.encoded)} bytes: the rest of the store is pinned by leases")
            else:
                p.result = r

    # ------------------------------------------------------------- namespaces
    @_lmdb_errors_as_store_errors
    def register_namespace(self, namespace: str, description: bytes) -> None:
        """Record what ``namespace`` stands for (JSON ``description``), once."""
        self._check()
        if self.readonly or self._namespaces is None:
            return
        k = namespace.encode("ascii")
        with self._begin() as txn:
            if txn.get(k, db=self._namespaces) == description:
                return
        with self._write_txn() as txn:
            txn.put(k, description, db=self._namespaces)

    @_lmdb_errors_as_store_errors
    def namespace_descriptions(self) -> dict[str, bytes]:
        """namespace -> identity description (JSON bytes) of every registered one."""
        self._check()
        if self._namespaces is None:
            return {}
        with self._begin() as txn, txn.cursor(db=self._namespaces) as cur:
            return {bytes(k).decode("ascii", "replace"): bytes(v) for k, v in cur}

    @_lmdb_errors_as_store_errors
    def delete(self, key: str) -> bool:
        """Remove ``key``'s entry; False if there was none."""
        return self.remove(key) is not None

    @_lmdb_errors_as_store_errors
    def remove(self, key: str) -> int | None:
        """Remove ``key``'s entry (damaged ones too: record, blob and LRU row)
        and return the bytes it took off ``total_bytes``; None if absent."""
        self._check()
        k = self._k(key)

        def remove_once() -> int | None:
            with self._write_txn() as txn:
                if txn.get(k, db=self._entries) is None:
                    return None
                return self._remove(txn, k, None)
        return self._write_retrying(remove_once, f"remove {key}")

    @_lmdb_errors_as_store_errors
    def sync(self) -> None:
        """Force committed transactions to stable storage."""
        self._check()
        if not self.readonly:
            self.env.sync(True)
