"""One open handle on a store directory: the shared environment, the schema
check, the sub-database handles and the ways a transaction is begun.

:class:`StoreHandle` is the base of :class:`~ecstore.lmdb.tier.LMDBTier`
(through :class:`~ecstore.lmdb.reads.TierReads`): it opens and closes, and
it is the only place read transactions (:meth:`StoreHandle._begin`), raw
write transactions (:meth:`StoreHandle._write_txn`, under the process's write
lock) and :class:`~ecstore.lmdb.txn.WriteTxn` objects
(:meth:`StoreHandle._writing`) are made.

Processes and threads: any number of processes may open the same
directory; within a process all handles of a directory share one
environment (:class:`~ecstore.lmdb.env._SharedEnv`) and every method is
thread-safe. A handle must not be used across ``fork()`` (ForkedStoreError).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar, overload

import lmdb

from ecstore.errors import THIS_PROCESS, SchemaError, StoreFullError, StoreOpenError, check_same_process
from ecstore.format import codec
from ecstore.lmdb import schema
from ecstore.lmdb.blobfiles import DIRECT_FROM, SPARE_FROM, BlobFiles
from ecstore.lmdb.env import MiB, _SharedEnv, map_size_for
from ecstore.lmdb.full import MapFullRetry, space_hint
from ecstore.lmdb.leases import LeaseTable
from ecstore.lmdb.store_files import FilePolicy
from ecstore.lmdb.txn import Dbs, TierCounters, WriteTxn

log = logging.getLogger("ecstore")

_T = TypeVar("_T")

#: Blobs of at least this many bytes are written to files of their own in the
#: store's ``blobs/`` directory instead of LMDB's B-tree (bytes): one copy into
#: the page cache and an ``fdatasync`` instead of LMDB's copy into freshly
#: faulted memory plus ``pwrite`` (docs/benchmarks.md, durable writes).
FILE_BLOBS_FROM = MiB // 2


#: What LMDB's message says when a commit could not write its pages for want
#: of room (py-lmdb raises DiskError or Error with the C library's strerror;
#: a short write, as at a file size limit, is reported as EIO).
_NO_ROOM = tuple(os.strerror(n) for n in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT))
_SHORT_WRITE = os.strerror(errno.EIO)


def lmdb_store_error(path: str, e: lmdb.Error) -> StoreOpenError | StoreFullError:
    """The ECStoreError an LMDB error ``e`` on the store at ``path`` is
    reported as (see :func:`_lmdb_errors_as_store_errors`): StoreFullError
    when a write found no room (disk full, a file size limit or quota: the
    commit was not made, LMDB keeps the last committed state, nothing is
    damaged), else StoreOpenError (the store may be damaged)."""
    msg = str(e)
    no_room = any(t in msg for t in _NO_ROOM)
    hint = space_hint(path, MiB, ("data.mdb", "leases.mdb")) \
        if no_room or isinstance(e, lmdb.DiskError) or _SHORT_WRITE in msg else ""
    if hint or no_room:
        return StoreFullError(f"disk full while writing to store {path} ({type(e).__name__}: {e}){hint}: "
                              f"that write was not made and the store is intact; free space on its file system")
    return StoreOpenError(f"LMDB error on store {path} ({type(e).__name__}: {e}); "
                          f"the store may be damaged: check it with ecstore-dump verify")


def _lmdb_errors_as_store_errors(method: Any) -> Any:
    """An LMDB error escaping a public tier method (a damaged B-tree page,
    an I/O error) becomes StoreOpenError, an ECStoreError: callers (the vLLM
    connector) catch that family and treat it as a miss instead of meeting a
    foreign exception type."""
    @functools.wraps(method)
    def wrapper(self: StoreHandle, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except lmdb.Error as e:
            raise lmdb_store_error(self.path, e) from e
    return wrapper


class StoreHandle:
    """An open store directory (see the module docstring and
    :class:`~ecstore.lmdb.tier.LMDBTier` for the arguments)."""

    def __init__(self, path: str, capacity_bytes: int, *, readonly: bool = False,
                 create: bool = True, schema_target: int | None = None,
                 map_size_bytes: int | None = None, file_mode: int | None = None,
                 file_blobs_from: int | None = None, split_reads_from: int | None = None,
                 direct_writes_from: int | None = DIRECT_FROM,
                 spare_writes_from: int | None = SPARE_FROM) -> None:
        self.path = path
        self.split_reads_from = split_reads_from  # blob files this large are read on two cores
        self.capacity_bytes = int(capacity_bytes)
        self.readonly = readonly
        self.counters = TierCounters()
        self._close_lock = threading.Lock()  # close(): one caller releases the environment
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
            # Blobs of at least file_blobs_from bytes are kept in files
            # (schema 4 on; see ecstore.lmdb.blobfiles); None: all inline.
            self.files = BlobFiles(path, readonly=readonly or self.schema_version < 4, file_mode=file_mode,
                                   direct_from=direct_writes_from, spare_from=spare_writes_from)
            self.file_blobs_from: int | None = (
                (FILE_BLOBS_FROM if file_blobs_from is None else int(file_blobs_from))
                if self.schema_version >= 4 else None)
        except lmdb.Error as e:
            self._shared.release()
            raise StoreOpenError(f"cannot open ecstore store at {path}: {e}") from None
        except BaseException:  # SchemaError, StoreOpenError, or anything unforeseen: never leak the env
            self._shared.release()
            raise

    @property
    def evictions(self) -> int:
        """Entries this handle evicted since it opened."""
        return self.counters.evictions

    @property
    def corrupt_dropped(self) -> int:
        """Damaged entries this handle removed since it opened."""
        return self.counters.corrupt_dropped

    @contextlib.contextmanager
    def _schema_begin(self, write: bool = False) -> Iterator[lmdb.Transaction]:
        """Transactions for :func:`schema.ensure_schema` (writes under the write lock)."""
        with contextlib.ExitStack() as stack:
            if write:
                stack.enter_context(self._shared.write_lock)
            yield stack.enter_context(self._shared.txn(write=write))

    def _open_dbs(self, txn: lmdb.Transaction | None) -> None:
        #: The sub-database handles (the one form: :class:`Dbs`; tooling gets
        #: them with a read transaction from ``snapshot()``).
        self._dbs = Dbs.open(self.env, txn, self.schema_version)
        # Records this handle writes and serves: from schema 3 on, v2 records
        # holding stored names (ecstore.identity); a handle held at an older
        # schema (tests) writes and serves v1.
        self.record_version = (codec.RECORD_VERSION if self.schema_version >= 3
                               else codec.LEGACY_RECORD_VERSION)

    def _check(self) -> None:
        if THIS_PROCESS.pid != self._pid:  # the message only then: every read checks
            check_same_process(self._pid, f"the ecstore handle of {self.path}")
        if self._closed:
            raise StoreOpenError(f"store at {self.path} is closed")

    def close(self) -> None:
        """Release this handle (the environment closes with its last one).
        Idempotent and thread-safe: of concurrent calls exactly one releases
        the shared environment (a second release would close it under
        another open handle of the directory in this process); the others
        return at once."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if os.getpid() == self._pid:
            self.files.close()
            self._shared.release()

    @staticmethod
    def _k(key: str) -> bytes:
        # surrogateescape: a key read back from the file with bytes that are
        # not UTF-8 (tooling decodes them so) maps to the very same bytes.
        return key.encode("utf-8", "surrogateescape")

    @property
    def _leases(self) -> LeaseTable | None:
        """The lease table (:mod:`ecstore.lmdb.leases`); None on read-only handles."""
        return self._shared.lease_table

    @_lmdb_errors_as_store_errors
    def leased_keys(self) -> set[bytes]:
        """Keys with at least one live lease (unexpired, owner alive)."""
        leases = self._leases
        if leases is None:
            return set()
        return leases.leased_keys()

    # ----------------------------------------------------------- transactions
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
        """A raw write transaction under this process's write lock; eviction
        tombstones it left are cleared once it has committed or aborted.
        Entries and counters change only through :meth:`_writing`."""
        with self._shared.write_lock:
            try:
                with self._begin(write=True) as txn:
                    raw = txn.get(b"schema_version", db=self._dbs.meta)
                    if raw is not None and not (raw.isdigit() and raw.isascii()):
                        raise StoreOpenError(
                            f"store at {self.path} is damaged: its meta record schema_version is "
                            f"{bytes(raw)[:40]!r}; move the store away or restore a copy")
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

    def _clear_tombstones(self) -> None:
        """Step (5) of the tombstone protocol (docs/architecture.md#leases-and-eviction-markers),
        after a data write transaction committed or aborted. Never raises: an
        error of the lease file (its map or disk full) must not undo, in the
        caller's eyes, a commit that stands (the batch would be reported
        failed and its blob files deleted under committed entries), nor hide
        the error an aborted transaction raised. The tombstones stay listed
        and the next write transaction clears them; until then they only make
        pins of those keys answer False (a miss), for at most
        ``TOMBSTONE_MAX_AGE_NS``."""
        leases = self._leases
        if leases is None:
            return
        try:
            leases.clear_tombstones()
        except lmdb.Error as e:
            log.warning("ecstore: cannot clear eviction markers in the lease file of %s (retried at the next "
                        "write; they expire on their own): %s", self.path, e)

    def _writing(self) -> contextlib.AbstractContextManager[WriteTxn]:
        """``with self._writing() as w``: a :class:`WriteTxn` over
        :meth:`_write_txn` (counters written back at commit)."""
        return WriteTxn.open(self._write_txn(), self._dbs, path=self.path, leases=self._leases,
                             pinned=self.leased_keys, record_version=self.record_version,
                             counters=self.counters, files=self.files, durable=self._sync_for_deletes)

    def _sync_for_deletes(self) -> None:
        """Make every commit so far durable (``env.sync(True)``): before blob
        files an uncommitted-to-disk commit no longer references are deleted."""
        self.env.sync(True)

    def _last_txnid(self) -> int:
        """The id of the newest committed write transaction of the environment
        (any process's): it grows by one with every commit that wrote."""
        txnid: int = self.env.info()["last_txnid"]
        return txnid

    def _commit_nothing(self) -> None:
        """Commit a transaction that changes no value (rewrites the
        counters): advances LMDB's transaction id so pages freed by the
        previous commit become reusable. A full map is ignored."""
        try:
            with self._writing() as w:
                w.force_commit()
        except lmdb.MapFullError:
            pass

    def _write_retrying(self, write: Callable[[], _T], what: str) -> _T:
        """``write()`` (one write transaction that frees rather than adds),
        retried while the map is full (:class:`~ecstore.lmdb.full.MapFullRetry`,
        without eviction); StoreFullError ("cannot <what>") when that gives up."""
        retry = MapFullRetry(self)
        while True:
            try:
                return write()
            except lmdb.MapFullError:
                if not retry.again():
                    raise StoreFullError(f"LMDB map of {self.path} is full: cannot {what}") from None
