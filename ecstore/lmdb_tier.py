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
from typing import Any, Iterator

import lmdb
import torch

from . import codec, schema
from .codec import CorruptBlobError, Record
from .errors import SchemaError, StoreFullError, StoreOpenError, check_same_process

log = logging.getLogger("ecstore")

MiB = 1 << 20
_U64 = struct.Struct("<Q")
_SEQ = struct.Struct(">Q")  # big-endian so LMDB's byte order is numeric order
_LEASE = struct.Struct("<IQ")  # pid, expiry (ns since epoch)
#: Lease-file keys under this prefix are eviction tombstones (see _evict_in).
_TOMB = b"\x00evicting\x00"
TOMBSTONE_MAX_AGE_NS = 60 * 10**9

MAP_HEADROOM_FACTOR = 1.25
MAP_HEADROOM_BYTES = 1 * MiB  # floor for small caps (B-tree and meta pages)
MAX_MAPFULL_RETRIES = 8


def map_size_for(capacity_bytes: int) -> int:
    """LMDB map size (bytes) for a disk cap: bounds the data file size."""
    size = max(int(capacity_bytes * MAP_HEADROOM_FACTOR), capacity_bytes + MAP_HEADROOM_BYTES)
    page = 4096
    return (size + page - 1) // page * page


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


class _SharedEnv:
    """One lmdb.Environment per directory per process, reference counted."""

    _lock = threading.Lock()
    _open: dict[str, "_SharedEnv"] = {}
    #: Directories whose environment this process inherited across fork()
    #: (path -> pid of the process that opened it).
    _inherited: dict[str, int] = {}

    def __init__(self, path: str, env: lmdb.Environment, leases: lmdb.Environment | None, readonly: bool):
        self.path = path
        self.env = env
        self.leases = leases
        self.readonly = readonly
        self.refs = 0
        self.pid = os.getpid()
        self.write_lock = threading.Lock()  # LMDB allows one write txn per env

    @classmethod
    def acquire(cls, path: str, map_size: int, readonly: bool, create: bool) -> "_SharedEnv":
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
                opened = _open_env(real, map_size, readonly, create)
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
            shared = cls(real, *opened, readonly=readonly)
            shared.refs = 1
            cls._open[real] = shared
            return shared

    def open_leases(self) -> None:
        """Open leases.mdb (read-write environments only), once."""
        with self._lock:
            if self.leases is None and not self.readonly:
                self.leases = _open_leases(self.path)

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


def _open_env(path: str, map_size: int, readonly: bool, create: bool) -> tuple[lmdb.Environment, lmdb.Environment | None]:
    data = os.path.join(path, "data.mdb")
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
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise StoreOpenError(f"cannot create store directory {path}: {e.strerror}") from None
    elif os.path.isdir(data):
        raise StoreOpenError(f"{path} is not an ecstore store ({data} is a directory)")
    elif os.path.getsize(data) > 0:
        _check_data_file(data)
        map_size = max(map_size, os.path.getsize(data))
    try:
        env = lmdb.open(
            path, map_size=map_size, subdir=True, max_dbs=8, readonly=readonly, lock=True,
            sync=True, metasync=False, max_readers=256, meminit=False, create=create and not readonly,
        )
    except lmdb.Error as e:
        raise StoreOpenError(f"cannot open ecstore store at {path}: {e}") from None
    # leases.mdb is opened by LMDBTier once the file proved to be an ecstore
    # store (_SharedEnv.open_leases): a foreign LMDB directory gets no new files.
    return env, None


def _open_leases(path: str) -> lmdb.Environment:
    lpath = os.path.join(path, "leases.mdb")
    for attempt in (1, 2):
        try:
            return lmdb.open(lpath, subdir=False, map_size=64 * MiB, max_dbs=0, sync=False,
                             metasync=False, lock=True, max_readers=256)
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
                 map_size_bytes: int | None = None) -> None:
        """``map_size_bytes`` overrides the LMDB map size (default
        :func:`map_size_for` the cap); LMDB still uses at least the data
        file's size, and only the first open of a directory in a process sets
        it. A map smaller than the cap is legal: a full map makes puts evict
        (see the design notes), it never fails them while anything is
        evictable. Tests use it to reach a full map without filling a disk."""
        self.path = path
        self.capacity_bytes = int(capacity_bytes)
        self.readonly = readonly
        map_size = map_size_for(self.capacity_bytes) if map_size_bytes is None else int(map_size_bytes)
        self._shared = _SharedEnv.acquire(path, map_size, readonly, create)
        self.env = self._shared.env
        self._pid = os.getpid()
        self._closed = False
        try:
            if not readonly:
                self.env.reader_check()
            self.schema_version = schema.ensure_schema(self.env, readonly=readonly, path=path,
                                                       target=schema_target)
            # On a writable environment, open_db() without a transaction
            # takes LMDB's write lock while holding the GIL: if a writer
            # thread of another handle in this process holds that lock and
            # waits for the GIL, both hang, and so does every other process
            # waiting for the lock. begin() releases the GIL while it waits.
            # (Handles opened in a read transaction die with it: read-only
            # environments keep the plain call, which takes no write lock.)
            txn = None if self._shared.readonly else self._begin(write=True)
            try:
                self._blobs = self.env.open_db(b"blobs", txn=txn, create=False)
                self._entries = self.env.open_db(b"entries", txn=txn, create=False)
                self._meta = self.env.open_db(b"meta", txn=txn, create=False)
                self._lru = (self.env.open_db(b"lru", txn=txn, create=False)
                             if self.schema_version >= 2 else None)
                self._namespaces = (self.env.open_db(b"namespaces", txn=txn, create=False)
                                    if self.schema_version >= 3 else None)
                # Records this handle writes and serves: from schema 3 on, v2
                # records holding stored names (ecstore.identity); a handle
                # held at an older schema (tests) writes and serves v1.
                self.record_version = (codec.RECORD_VERSION if self.schema_version >= 3
                                       else codec.LEGACY_RECORD_VERSION)
            finally:
                if txn is not None:
                    txn.commit()  # nothing written: makes the handles permanent
            self._shared.open_leases()
        except lmdb.Error as e:
            self._shared.release()
            raise StoreOpenError(f"cannot open ecstore store at {path}: {e}") from None
        except (SchemaError, StoreOpenError):
            self._shared.release()
            raise
        self.evictions = 0
        self.corrupt_dropped = 0
        self._tombstones: list[bytes] = []
        if not readonly and self.total_bytes() > self.capacity_bytes:
            self._evict_to(self.capacity_bytes)  # reopened with a smaller cap

    # ------------------------------------------------------------------ utils
    def _check(self) -> None:
        check_same_process(self._pid, f"the ecstore handle of {self.path}")
        if self._closed:
            raise StoreOpenError(f"store at {self.path} is closed")

    def _begin(self, write: bool = False, buffers: bool = False) -> lmdb.Transaction:
        try:
            return self.env.begin(write=write, buffers=buffers)
        except lmdb.MapResizedError:
            self.env.set_mapsize(0)  # another process grew the map: adopt its size
            return self.env.begin(write=write, buffers=buffers)

    @contextlib.contextmanager
    def _write_txn(self) -> Iterator[lmdb.Transaction]:
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
        return key.encode("utf-8")

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
    def get(self, key: str, identifier: str) -> torch.Tensor | None:
        """The stored tensor (a fresh CPU copy), or None on a miss.

        A blob failing its checksum/header check is logged, removed (unless
        read-only) and reported as a miss: garbage is never returned.
        """
        self._check()
        k = self._k(key)
        with self._begin(buffers=True) as txn:
            raw = txn.get(k, db=self._entries)
            if raw is None:
                return None
            try:
                rec = codec.unpack_record(raw)
            except CorruptBlobError as e:
                rec, err = None, e
            else:
                if rec.identifier != identifier or rec.version != self.record_version:  # another identity, or legacy
                    return None
                blob = txn.get(k, db=self._blobs)
                try:
                    if blob is None:
                        raise CorruptBlobError("record without blob")
                    t = codec.decode(blob, expected_checksum=rec.checksum, identifier=identifier)
                    if str(t.dtype).removeprefix("torch.") != rec.dtype or tuple(t.shape) != rec.shape:
                        raise CorruptBlobError("blob header does not match its record")
                    return t
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
        expiry = time.time_ns() + int(ttl_s * 1e9)
        with self._shared.leases.begin(write=True) as txn:
            for key in keys:
                k = self._k(key)
                cur = txn.get(k) or b""
                txn.put(k, bytes(cur) + _LEASE.pack(pid, expiry))

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
        """Delete an entry inside ``txn``; returns the bytes freed."""
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
        if rec is not None and self._lru is not None:
            txn.delete(_SEQ.pack(rec.lru_seq), db=self._lru)
        total = _U64.unpack(txn.get(b"total_bytes", db=self._meta))[0]
        txn.put(b"total_bytes", _U64.pack(max(0, total - size)), db=self._meta)
        return size

    def _evict_in(self, txn: lmdb.Transaction, need: int, protect: set[bytes]) -> int:
        """Evict LRU entries inside ``txn`` until ``need`` bytes are freed.

        Skips leased entries and ``protect``. Returns bytes freed (may be
        less than ``need`` when everything left is pinned).
        """
        freed = 0
        pinned = self.leased_keys() | protect
        victims: list[bytes] = []
        if self._lru is not None:
            with txn.cursor(db=self._lru) as cur:
                for _, k in cur:
                    if freed >= need:
                        break
                    k = bytes(k)
                    if k in pinned:
                        continue
                    rec = codec.unpack_record(txn.get(k, db=self._entries))
                    victims.append(k)
                    freed += rec.blob_size
        else:
            recs = sorted((codec.unpack_record(v).lru_seq, bytes(k), codec.unpack_record(v).blob_size)
                          for k, v in txn.cursor(db=self._entries))
            for _, k, size in recs:
                if freed >= need:
                    break
                if k not in pinned:
                    victims.append(k)
                    freed += size
        if victims and self._shared.leases is not None:
            # Tombstone protocol, steps (2) and (3): see pin_if_present.
            stamp = _LEASE.pack(os.getpid(), time.time_ns())
            with self._shared.leases.begin(write=True) as ltxn:
                for k in victims:
                    ltxn.put(_TOMB + k, stamp)
            self._tombstones.extend(victims)
            pinned_now = self.leased_keys()
            kept = [k for k in victims if k in pinned_now]
            if kept:
                victims = [k for k in victims if k not in pinned_now]
                freed = 0
                for k in victims:
                    rec = codec.unpack_record(txn.get(k, db=self._entries))
                    freed += rec.blob_size
        for k in victims:
            self._remove(txn, k, None)
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
            total = _U64.unpack(txn.get(b"total_bytes", db=self._meta))[0]
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
        nothing_left = False
        for attempt in range(MAX_MAPFULL_RETRIES + 1):
            try:
                self._write_once(todo, touches)
                return
            except SchemaError as e:
                for p in todo:
                    p.result, p.error = "failed", e
                raise
            except lmdb.MapFullError:
                if attempt == MAX_MAPFULL_RETRIES:
                    break
                if self.env.reader_check() > 0:
                    continue  # a dead process's reader pinned old pages: free now, retry first
                # Fragmentation: free more pages in a committed transaction, retry.
                extra = max(extra * 2, sum(len(p.blob) for p in todo) + 4 * MiB)
                freed = self._evict_to(self.capacity_bytes, extra)
                # LMDB keeps the previous snapshot intact (recovery may fall
                # back to it), so pages freed by a commit are reused only
                # after one more commit: make one, or the retry cannot use
                # what was just evicted.
                self._commit_nothing()
                if freed == 0 and self.entry_count() == 0:
                    if nothing_left:
                        break
                    nothing_left = True  # one retry with the last pages freed
            except lmdb.Error as e:
                # LMDB reports a short write (ENOSPC, EFBIG) as EIO: say why.
                hint = self._space_hint(sum(len(p.blob) for p in todo))
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

    def _commit_nothing(self) -> None:
        """Commit a transaction that changes no value (rewrites ``next_seq``):
        advances LMDB's transaction id so pages freed by the previous commit
        become reusable."""
        try:
            with self._write_txn() as txn:
                txn.put(b"next_seq", txn.get(b"next_seq", db=self._meta), db=self._meta)
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
        ops: list[tuple[int, tuple]] = [(p.order, ("put", i)) for i, p in enumerate(todo)]
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
            total = _U64.unpack(txn.get(b"total_bytes", db=self._meta))[0]
            seq = _U64.unpack(txn.get(b"next_seq", db=self._meta))[0]
            results: list[str] = ["pending"] * len(todo)
            for op in self._in_call_order(todo, touches):
                if op[0] == "touch":
                    _, key, identifier, hits, last_ns = op
                    k = self._k(key)
                    raw = txn.get(k, db=self._entries)
                    if raw is None or codec.record_identifier(raw, self.record_version) != identifier:
                        continue
                    rec = codec.unpack_record(raw)
                    if self._lru is not None:
                        txn.delete(_SEQ.pack(rec.lru_seq), db=self._lru)
                        txn.put(_SEQ.pack(seq), k, db=self._lru, append=True)
                    txn.put(k, codec.pack_record(rec.touched(last_ns, seq, hits)), db=self._entries)
                    seq += 1
                    continue
                i = op[1]
                p = todo[i]
                k = self._k(p.key)
                raw = txn.get(k, db=self._entries)
                if raw is not None:
                    same = codec.record_identifier(raw, self.record_version) == p.identifier
                    results[i] = "present" if same else "collision"
                    continue
                size = len(p.blob)
                if total + size > self.capacity_bytes:
                    # _remove updates total_bytes in meta: bring it up to date
                    # with the entries written so far in this transaction.
                    txn.put(b"total_bytes", _U64.pack(total), db=self._meta)
                    # Entries written earlier in this batch are evictable like
                    # any other: the batch behaves as the same puts committed
                    # one by one.
                    self._evict_in(txn, total + size - self.capacity_bytes, set())
                    total = _U64.unpack(txn.get(b"total_bytes", db=self._meta))[0]
                    if total + size > self.capacity_bytes:
                        results[i] = "full"
                        continue
                rec = Record(p.identifier, str(p.tensor.dtype).removeprefix("torch."), tuple(p.tensor.shape),
                             codec.tensor_nbytes(p.tensor), size, codec.checksum(p.blob), now, now, 0, seq,
                             self.record_version)
                txn.put(k, p.blob, db=self._blobs)
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
                    f"no room for {len(p.blob)} bytes: the rest of the store is pinned by leases")
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
        self._check()
        k = self._k(key)
        with self._write_txn() as txn:
            if txn.get(k, db=self._entries) is None:
                return False
            self._remove(txn, k, None)
            return True

    @_lmdb_errors_as_store_errors
    def sync(self) -> None:
        """Force committed transactions to stable storage."""
        self._check()
        if not self.readonly:
            self.env.sync(True)
