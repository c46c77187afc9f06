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
waits behind a writer committing a 100 MB blob.

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
import threading
import time
from dataclasses import dataclass
from typing import Any, Generator, Iterator, Literal, overload

import lmdb
import torch

from . import codec, schema
from .codec import CorruptBlobError, Record
from .errors import ECStoreError, SchemaError, StoreFullError, StoreOpenError, check_same_process
from .store_files import (FilePolicy, check_file_types, check_writable_location, create_store_dir,
                          fix_created_modes, missing_files, readonly_needs_nolock)

log = logging.getLogger("ecstore")

MiB = 1 << 20
_U64 = struct.Struct("<Q")
_SEQ = struct.Struct(">Q")  # big-endian so LMDB's byte order is numeric order
_LEASE = struct.Struct("<IQ")  # pid, expiry (ns since epoch)
#: Lease-file keys under this prefix are eviction tombstones (see _evict_in).
_TOMB = b"\x00evicting\x00"
TOMBSTONE_MAX_AGE_NS = 60 * 10**9
#: lease() prunes dead and expired leases once the lease table holds more
#: keys than this (and then at twice the live count): leases that are never
#: released cannot grow the file or the cost of a pin without bound.
LEASE_PRUNE_MIN = 1024

MAP_HEADROOM_FACTOR = 1.25
MAP_HEADROOM_BYTES = 1 * MiB  # floor for small caps (B-tree and meta pages)
#: How long a write whose map is full waits, at most, for read transactions
#: of other processes to release old snapshots (seconds; see write_batch).
MAPFULL_PATIENCE_S = 60.0
#: Retries of a write whose map stays full with nothing left to evict and no
#: reader of an older snapshot to wait for.
MAPFULL_STUCK_RETRIES = 3


def map_size_for(capacity_bytes: int) -> int:
    """LMDB map size (bytes) for a disk cap: bounds the data file size."""
    size = max(int(capacity_bytes * MAP_HEADROOM_FACTOR), capacity_bytes + MAP_HEADROOM_BYTES)
    page = 4096
    return (size + page - 1) // page * page


def _reader_txnids(table: str) -> list[int]:
    """Snapshot (transaction id) of each active read transaction in LMDB's
    reader table (``Environment.readers()``: ``pid thread txnid`` rows; idle
    slots are not listed, or show ``-``)."""
    ids = []
    for line in table.splitlines()[1:]:
        parts = line.split()
        if len(parts) == 3 and parts[2].isdigit():
            ids.append(int(parts[2]))
    return ids


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
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


#: How often a transaction is retried after adopting a map another process
#: grew (each retry needs that process to grow the map again meanwhile).
MAX_MAP_RESIZED_RETRIES = 16


class _TxnGate:
    """Transactions of one environment in this process versus a map resize.

    Another process may grow the LMDB map past this process's: beginning a
    transaction then fails with ``MDB_MAP_RESIZED``, and LMDB's remedy,
    ``mdb_env_set_mapsize(0)``, remaps the file, which is only safe while no
    transaction of this process is open (their pages would be unmapped under
    them). Every transaction enters the gate (shared); a resize waits until
    none is open and holds new ones back meanwhile (exclusive). A thread
    that itself holds a transaction of the environment cannot wait for that:
    it gets StoreOpenError (an ECStoreError) instead and may retry once its
    transaction ended. Thread-safe; costs one uncontended lock per begin and
    end.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._active = 0
        self._resizing = False
        self._mine = threading.local()

    def enter(self) -> None:
        with self._cv:
            while self._resizing:
                self._cv.wait()
            self._active += 1
        self._mine.depth = getattr(self._mine, "depth", 0) + 1

    def leave(self) -> None:
        # max(): a transaction of an abandoned generator may be finalized by
        # the garbage collector in another thread.
        self._mine.depth = max(0, getattr(self._mine, "depth", 0) - 1)
        with self._cv:
            self._active -= 1
            if self._active == 0:
                self._cv.notify_all()

    def adopt_new_size(self, env: lmdb.Environment, path: str) -> None:
        """``env.set_mapsize(0)`` (adopt the size another process set) once no
        transaction of this process is open."""
        if getattr(self._mine, "depth", 0) > 0:
            raise StoreOpenError(
                f"the LMDB map of {path} was grown by another process while this thread holds a "
                f"transaction of it; retry the call")
        with self._cv:
            if self._resizing:  # another thread is adopting it: wait for that, then retry
                while self._resizing:
                    self._cv.wait()
                return
            self._resizing = True
            try:
                while self._active:
                    self._cv.wait()
                env.set_mapsize(0)
            finally:
                self._resizing = False
                self._cv.notify_all()


class _SharedEnv:
    """One lmdb.Environment per directory per process, reference counted."""

    _lock = threading.Lock()
    _open: dict[str, "_SharedEnv"] = {}
    #: Directories whose environment this process inherited across fork()
    #: (path -> pid of the process that opened it).
    _inherited: dict[str, int] = {}

    def __init__(self, path: str, env: lmdb.Environment, leases: lmdb.Environment | None, readonly: bool,
                 policy: FilePolicy | None = None):
        self.path = path
        self.policy = policy or FilePolicy()
        self.env = env
        self.leases = leases
        self.readonly = readonly
        self.refs = 0
        self.pid = os.getpid()
        self.write_lock = threading.Lock()  # LMDB allows one write txn per env
        self.gate = _TxnGate()
        #: Lease-table size above which lease() prunes dead and expired leases.
        self.lease_prune_at = LEASE_PRUNE_MIN

    @contextlib.contextmanager
    def txn(self, write: bool = False, buffers: bool = False) -> Iterator[lmdb.Transaction]:
        """A transaction of the data environment: committed when the block
        ends normally, aborted on an exception. The one way ecstore begins
        one: when another process grew the map (``MDB_MAP_RESIZED``), adopts
        the new size (see :class:`_TxnGate`) and retries. Write transactions
        must be begun under ``write_lock``."""
        for _ in range(MAX_MAP_RESIZED_RETRIES):
            self.gate.enter()
            try:
                txn: lmdb.Transaction = (self.env.begin(write=write, buffers=True) if buffers
                                         else self.env.begin(write=write))
            except lmdb.MapResizedError:
                self.gate.leave()
                self.gate.adopt_new_size(self.env, self.path)
                continue
            except BaseException:
                self.gate.leave()
                raise
            break
        else:
            raise StoreOpenError(f"the LMDB map of {self.path} keeps growing under this process; retry")
        try:
            with txn:
                yield txn
        finally:
            self.gate.leave()

    @classmethod
    def acquire(cls, path: str, map_size: int, readonly: bool, create: bool,
                policy: FilePolicy | None = None, explicit_mode: bool = True) -> "_SharedEnv":
        real = os.path.realpath(path)
        with cls._lock:
            shared = cls._open.get(real)
            if shared is not None and shared.pid != os.getpid():
                cls._open.pop(real)  # inherited across fork: never touch it here
                cls._inherited[real] = shared.pid
                shared = None
            if shared is not None:
                if shared.readonly and not readonly:
                    raise StoreOpenError(
                        f"{path} is already open read-only in this process; close that handle first"
                    )
                shared.refs += 1
                return shared
            try:
                opened = _open_env(real, map_size, readonly, create, policy or FilePolicy(), explicit_mode)
            except StoreOpenError as e:
                parent = cls._inherited.get(real)
                if parent is None:
                    raise
                # py-lmdb refuses a second environment on the same files in one
                # process, and closing the inherited one could hang (a write
                # transaction of a parent thread that does not exist here).
                raise StoreOpenError(
                    f"{path} was open in process {parent} when it forked this process ({os.getpid()}); "
                    f"it cannot be opened again in the forked child ({e}). Open the store in a process "
                    f"started with 'spawn' or 'forkserver', or open it in the parent only after forking"
                ) from None
            shared = cls(real, *opened, readonly=readonly, policy=policy)
            shared.refs = 1
            cls._open[real] = shared
            return shared

    def open_leases(self) -> None:
        """Open leases.mdb (read-write environments only), once."""
        with self._lock:
            if self.leases is None and not self.readonly:
                self.leases = _open_leases(self.path, self.policy)

    def release(self) -> None:
        with self._lock:
            self.refs -= 1
            if self.refs > 0:
                return
            if self._open.get(self.path) is self:
                del self._open[self.path]
        if self.pid == os.getpid():
            self.env.close()
            if self.leases is not None:
                self.leases.close()


#: Names a directory may hold besides a store's files and still get a new
#: store created in it (dot-files such as ``.nfs*`` are ignored too).
_FOREIGN_OK = {"lock.mdb", "leases.mdb", "leases.mdb-lock", "lost+found"}
_META = struct.Struct("<II")  # mm_magic, mm_version at offset 16 of a meta page
_LMDB_MAGIC = 0xBEEFC0DE


def _check_data_file(data: str) -> None:
    """Refuse a data.mdb shorter than its own meta pages say it is.

    LMDB trusts the last-page number in the meta page and maps the file: a
    truncated file (copy interrupted, disk trouble) would kill the process
    with SIGBUS on the first read past the end. Reads both meta pages
    (64-bit layout: page header 16 bytes, then magic, version, address,
    map size, two 48-byte DB records -- the first's ``md_pad`` is the page
    size -- then ``mm_last_pg``); anything not an LMDB file is left to LMDB.
    """
    try:
        with open(data, "rb") as fh:
            head = fh.read(256)
            size = os.fstat(fh.fileno()).st_size
            if len(head) < 152:
                return
            magic, _ = _META.unpack_from(head, 16)
            if magic != _LMDB_MAGIC:
                return  # LMDB reports MDB_INVALID
            psize = struct.unpack_from("<I", head, 40)[0]
            if not 512 <= psize <= 1 << 16:
                return
            fh.seek(psize)
            second = fh.read(152)
    except OSError:
        return  # let LMDB report it
    pages = [struct.unpack_from("<Q", head, 136)[0]]
    if len(second) == 152 and _META.unpack_from(second, 16)[0] == _LMDB_MAGIC:
        pages.append(struct.unpack_from("<Q", second, 136)[0])
    need = (max(pages) + 1) * psize
    if need > size:
        raise StoreOpenError(
            f"{data} is truncated: its LMDB meta page needs {need} bytes, the file has {size}; "
            f"the store is damaged (move it away, or restore a copy)")


def _open_env(path: str, map_size: int, readonly: bool, create: bool, policy: FilePolicy,
              explicit_mode: bool = True) -> tuple[lmdb.Environment, lmdb.Environment | None]:
    data = os.path.join(path, "data.mdb")
    # Before LMDB touches anything: no symlinked or odd store files (LMDB
    # follows links and blocks on FIFOs); read-write: ssh-StrictModes-like
    # owner/mode checks (see store_files and docs/security.md).
    if readonly:
        check_file_types(path)
    else:
        check_writable_location(path, policy, explicit_mode=explicit_mode)  # types too
    if not os.path.exists(data):
        if not create or readonly:
            if not os.path.exists(path):
                raise StoreOpenError(f"{path}: no such directory")
            raise StoreOpenError(f"{path} is not an ecstore store (no data.mdb)")
        if os.path.isdir(path):
            try:
                others = sorted(n for n in os.listdir(path) if n not in _FOREIGN_OK and not n.startswith("."))
            except OSError as e:
                raise StoreOpenError(f"cannot read store directory {path}: {e.strerror}") from None
            if others:
                shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
                raise StoreOpenError(
                    f"{path} is not an ecstore store (no data.mdb) and is not empty ({shown}); "
                    f"point local_disk at a new or empty directory")
        try:
            create_store_dir(path, policy)
        except OSError as e:
            raise StoreOpenError(f"cannot create store directory {path}: {e.strerror}") from None
    elif os.path.isdir(data):
        raise StoreOpenError(f"{path} is not an ecstore store ({data} is a directory)")
    elif os.path.getsize(data) > 0:
        _check_data_file(data)
        # A map no larger than the file leaves no page for a write: not even
        # the eviction that brings a store reopened with a smaller cap under it.
        map_size = max(map_size, os.path.getsize(data) + MAP_HEADROOM_BYTES)
    # A reader without write access to lock.mdb (another user) reads without
    # LMDB's reader table: it cannot register there; see docs/security.md.
    lock = not (readonly and readonly_needs_nolock(path))
    created = [] if readonly else missing_files(path, ("data.mdb", "lock.mdb"))
    try:
        env = lmdb.open(
            path, map_size=map_size, subdir=True, max_dbs=8, readonly=readonly, lock=lock,
            sync=True, metasync=False, max_readers=256, meminit=False, create=create and not readonly,
            mode=policy.file_mode,
        )
    except lmdb.Error as e:
        raise StoreOpenError(f"cannot open ecstore store at {path}: {e}") from None
    fix_created_modes(path, created, policy)
    # leases.mdb is opened by LMDBTier once the file proved to be an ecstore
    # store (_SharedEnv.open_leases): a foreign LMDB directory gets no new files.
    return env, None


def _open_leases(path: str, policy: FilePolicy) -> lmdb.Environment:
    lpath = os.path.join(path, "leases.mdb")
    for attempt in (1, 2):
        created = missing_files(path, ("leases.mdb", "leases.mdb-lock"))
        try:
            env = lmdb.open(lpath, subdir=False, map_size=64 * MiB, max_dbs=0, sync=False,
                            metasync=False, lock=True, max_readers=256, mode=policy.file_mode)
            fix_created_modes(path, created, policy)
            return env
        except lmdb.Error:
            if attempt == 2:
                raise
            # Leases are ephemeral: a damaged lease file is simply recreated.
            log.warning("ecstore: lease file %s unreadable; recreating it", lpath)
            for p in (lpath, lpath + "-lock"):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
    raise AssertionError("unreachable")


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
        self._tombstones: list[bytes] = []
        if not readonly:
            self._initial_eviction()

    def _initial_eviction(self) -> None:
        """Evict down to the cap at open (reopened with a smaller cap).

        Best effort: a store error here (the map full, entries pinned) leaves
        the store open and usable (the next put evicts again) and is logged;
        anything else releases the shared environment before it propagates,
        so a failing open never leaks a reference to it."""
        try:
            if self.total_bytes() > self.capacity_bytes:
                self._evict_to(self.capacity_bytes)
        except ECStoreError as e:
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
            self._drop_corrupt(k, raw_expected=None if rec is None else rec.checksum)
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
    @_lmdb_errors_as_store_errors
    def lease(self, keys: list[str], ttl_s: float, pid: int | None = None) -> None:
        """Pin ``keys`` against eviction for ``ttl_s`` seconds (or until
        released, or until process ``pid`` dies)."""
        if self._shared.leases is None or not keys:
            return
        self._check()
        pid = os.getpid() if pid is None else pid
        now = time.time_ns()
        expiry = now + int(ttl_s * 1e9)
        with self._shared.leases.begin(write=True) as txn:
            for key in keys:
                k = self._k(key)
                cur = txn.get(k)
                # Expired leases of this key go (a pin costs what is live).
                kept = b"" if cur is None else b"".join(
                    bytes(cur[i:i + _LEASE.size]) for i in range(0, len(cur) - _LEASE.size + 1, _LEASE.size)
                    if _LEASE.unpack_from(cur, i)[1] > now)
                txn.put(k, kept + _LEASE.pack(pid, expiry))
            if txn.stat()["entries"] > self._shared.lease_prune_at:
                live = self._prune_leases(txn, now)
                self._shared.lease_prune_at = max(LEASE_PRUNE_MIN, 2 * live)

    def _prune_leases(self, txn: lmdb.Transaction, now: int) -> int:
        """Drop expired leases and leases of dead processes inside the lease
        write transaction ``txn``; returns the keys left (tombstones too)."""
        alive: dict[int, bool] = {}
        dead: list[bytes] = []
        rewrite: list[tuple[bytes, bytes]] = []
        left = 0
        for k, v in txn.cursor():
            if bytes(k).startswith(_TOMB):
                left += 1
                continue
            items = [_LEASE.unpack_from(v, i) for i in range(0, len(v) - _LEASE.size + 1, _LEASE.size)]
            for p, _ in items:
                if p not in alive:
                    alive[p] = _pid_alive(p)
            keep = [(p, e) for p, e in items if e > now and alive[p]]
            if not keep:
                dead.append(bytes(k))
            else:
                left += 1
                if len(keep) != len(items):
                    rewrite.append((bytes(k), b"".join(_LEASE.pack(p, e) for p, e in keep)))
        for k in dead:
            txn.delete(k)
        for k, v in rewrite:
            txn.put(k, v)
        return left

    @_lmdb_errors_as_store_errors
    def release(self, keys: list[str], pid: int | None = None) -> None:
        """Drop one lease of ``pid`` on each of ``keys``."""
        if self._shared.leases is None or not keys:
            return
        self._check()
        pid = os.getpid() if pid is None else pid
        with self._shared.leases.begin(write=True) as txn:
            for key in keys:
                k = self._k(key)
                cur = txn.get(k)
                if cur is None:
                    continue
                items = [_LEASE.unpack_from(cur, i) for i in range(0, len(cur), _LEASE.size)]
                for i, (p, _) in enumerate(items):
                    if p == pid:
                        del items[i]
                        break
                if items:
                    txn.put(k, b"".join(_LEASE.pack(*it) for it in items))
                else:
                    txn.delete(k)

    @_lmdb_errors_as_store_errors
    def pin_if_present(self, key: str, identifier: str, ttl_s: float) -> bool:
        """Lease ``key`` and report whether it holds ``identifier``, such that
        a True answer guarantees no process evicts the entry before the lease
        ends.

        Leases and entries live in two LMDB files, so this needs a protocol
        with the evictor (``_evict_in``): the evictor (1) picks victims that
        are not leased, (2) writes tombstones for them to the lease file,
        (3) drops any victim that got leased meanwhile, (4) commits the
        deletion, (5) clears the tombstones. Here we (a) lease, (b) check for
        a tombstone, (c) check the entry. If (a) precedes (3) the evictor sees
        the lease and spares the entry; otherwise (2) precedes (b) and we see
        the tombstone, unless it was already cleared, in which case (4)
        precedes (c) and the entry is visibly gone.
        """
        if not self.contains(key, identifier):
            # A miss needs no pin: answering "no" is always safe, and the
            # scheduler asks about every uncached item at every step, so the
            # common miss costs one read instead of two lease-file commits.
            return False
        if self._shared.leases is None:
            return True
        self.lease([key], ttl_s)
        k = self._k(key)
        with self._shared.leases.begin() as txn:
            tomb = txn.get(_TOMB + k)
        if (tomb is not None and self._tombstone_live(tomb)) or not self.contains(key, identifier):
            self.release([key])
            return False
        return True

    @staticmethod
    def _tombstone_live(raw: bytes) -> bool:
        pid, t_ns = _LEASE.unpack(raw)
        return time.time_ns() - t_ns < TOMBSTONE_MAX_AGE_NS and _pid_alive(pid)

    @_lmdb_errors_as_store_errors
    def leased_keys(self) -> set[bytes]:
        """Keys with at least one live lease (unexpired, owner alive)."""
        if self._shared.leases is None:
            return set()
        now = time.time_ns()
        live: set[bytes] = set()
        dead: list[bytes] = []
        alive_cache: dict[int, bool] = {}
        with self._shared.leases.begin() as txn:
            for k, v in txn.cursor():
                if k.startswith(_TOMB):
                    continue
                ok = False
                for i in range(0, len(v), _LEASE.size):
                    pid, exp = _LEASE.unpack_from(v, i)
                    if exp > now:
                        if pid not in alive_cache:
                            alive_cache[pid] = _pid_alive(pid)
                        ok = ok or alive_cache[pid]
                (live.add if ok else dead.append)(bytes(k))
        if dead:
            with self._shared.leases.begin(write=True) as txn:
                for k in dead:
                    txn.delete(k)
        return live

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
        :meth:`pin_if_present`) are spared and replaced by the next least
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
            if victims and self._shared.leases is not None:
                # Tombstone protocol, steps (2) and (3): see pin_if_present.
                stamp = _LEASE.pack(os.getpid(), time.time_ns())
                with self._shared.leases.begin(write=True) as ltxn:
                    for k, _ in victims:
                        ltxn.put(_TOMB + k, stamp)
                self._tombstones.extend(k for k, _ in victims)
                pinned_now = self.leased_keys()
                skip |= pinned_now
                victims = [(k, size) for k, size in victims if k not in pinned_now]
            for k, _ in victims:
                freed += self._remove(txn, k, None)
            self.evictions += len(victims)
        return freed

    def _clear_tombstones(self) -> None:
        """Step (5) of the tombstone protocol: after the eviction committed."""
        if not self._tombstones or self._shared.leases is None:
            return
        with self._shared.leases.begin(write=True) as ltxn:
            for k in self._tombstones:
                ltxn.delete(_TOMB + k)
        self._tombstones = []

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
        deadline = time.monotonic() + MAPFULL_PATIENCE_S
        stuck = 0
        while True:
            try:
                self._write_once(todo, touches)
                return
            except SchemaError as e:
                for p in todo:
                    p.result, p.error = "failed", e
                raise
            except lmdb.MapFullError:
                if time.monotonic() > deadline:
                    break
                if self.env.reader_check() > 0:
                    continue  # a dead process's reader pinned old pages: free now, retry first
                # Fragmentation: free more pages in a committed transaction, retry.
                extra = max(extra * 2, sum(len(p.encoded) for p in todo) + 4 * MiB)
                freed = self._evict_to(self.capacity_bytes, extra)
                # LMDB keeps the previous snapshot intact (recovery may fall
                # back to it), so pages freed by a commit are reused only
                # after one more commit: make one, or the retry cannot use
                # what was just evicted.
                self._commit_nothing()
                if freed > 0:
                    stuck = 0
                    continue
                # Nothing (more) to evict, yet the map was full: the free
                # pages are still part of snapshots that read transactions
                # of other processes hold (each is short: one call). Wait
                # for those to end, then retry. With no such reader, other
                # writers emptied the map meanwhile or it is full of live
                # data: retry, a few times.
                if not self._wait_for_older_readers(deadline):
                    stuck += 1
                    if stuck > MAPFULL_STUCK_RETRIES:
                        break
                self._commit_nothing()
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
        with self._write_txn() as txn:
            if txn.get(k, db=self._entries) is None:
                return None
            return self._remove(txn, k, None)

    @_lmdb_errors_as_store_errors
    def sync(self) -> None:
        """Force committed transactions to stable storage."""
        self._check()
        if not self.readonly:
            self.env.sync(True)
