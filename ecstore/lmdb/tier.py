"""The LMDB tier: :class:`LMDBTier`, the persistent, size-bounded,
multi-process LRU tier over one store directory.

It adds to the reads (:mod:`ecstore.lmdb.reads`) and the open handle
(:mod:`ecstore.lmdb.handle`): write batches and their retry policy when the
map is full (:mod:`ecstore.lmdb.full`), deletes, leases (pins against
eviction, :mod:`ecstore.lmdb.leases`), namespace registration and the
eviction down to the cap at open. Every change to entries and byte
accounting goes through one :class:`~ecstore.lmdb.txn.WriteTxn`. See the
design notes in docs/architecture.md ("The LMDB tier").
"""

from __future__ import annotations

import errno
import logging
import math
import time

import lmdb
import numpy as np

from ecstore.errors import (
    THIS_PROCESS,
    CorruptEntryError,
    ECStoreError,
    InvalidEntryError,
    SchemaError,
    StoreFullError,
    StoreOpenError,
)
from ecstore.format import PutOutcome, Record, codec
from ecstore.lmdb.batch import BatchPut, PutOp, Touch, in_call_order
from ecstore.lmdb.blobfiles import DIRECT_FROM, SPARE_FROM
from ecstore.lmdb.env import MiB
from ecstore.lmdb.full import MapFullRetry, space_hint
from ecstore.lmdb.handle import _lmdb_errors_as_store_errors, lmdb_store_error
from ecstore.lmdb.leases import PIN_ABSENT, Pin, PinAnswer
from ecstore.lmdb.reads import TierReads
from ecstore.lmdb.txn import file_ref
from ecstore.lmdb.txngate import begin_read, end_read
from ecstore.pool import POOL

log = logging.getLogger("ecstore")
_NO_BLOB: codec.Blob = np.empty(0, dtype=np.uint8)  # what WriteTxn.insert is given for an entry in a file

#: Longest lease, in seconds (one day): a lease pins an entry against
#: eviction until released; one that outlived its loader must expire. The
#: bound of the ``lease_seconds`` setting (:mod:`ecstore.config.limits`).
MAX_LEASE_SECONDS = 86400.0


def _check_ttl(ttl_s: object) -> float:
    """``ttl_s`` (seconds) as a float if a lease can last that long: a finite
    number in [0, MAX_LEASE_SECONDS] (the bound of ``lease_seconds``); else
    InvalidEntryError (the lease file holds expiries as u64 nanoseconds)."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not (
            math.isfinite(ttl_s) and 0 <= ttl_s <= MAX_LEASE_SECONDS):
        raise InvalidEntryError(f"lease ttl_s must be a number of seconds in [0, {MAX_LEASE_SECONDS:g}], "
                                f"got {ttl_s!r:.40}")
    return float(ttl_s)


class LMDBTier(TierReads):
    """Persistent, size-bounded, multi-process LRU tier.

    ``capacity_bytes`` bounds the sum of stored blob sizes (tensor bytes plus
    a few hundred bytes of safetensors header each). ``readonly`` handles
    never write (no eviction, no LRU updates, corrupt entries are reported
    but not removed). Thread-safe; any number of processes may open the
    same directory (see :mod:`ecstore.lmdb`).
    """

    def __init__(self, path: str, capacity_bytes: int, *, readonly: bool = False,
                 create: bool = True, schema_target: int | None = None,
                 map_size_bytes: int | None = None, file_mode: int | None = None,
                 file_blobs_from: int | None = None, split_reads_from: int | None = None,
                 direct_writes_from: int | None = DIRECT_FROM,
                 spare_writes_from: int | None = SPARE_FROM) -> None:
        """``map_size_bytes`` overrides the LMDB map size (default
        :func:`~ecstore.lmdb.env.map_size_for` the cap); LMDB still uses at
        least the data file's size, and only the first open of a directory in
        a process sets it. A map smaller than the cap is legal: a full map
        makes puts evict (docs/architecture.md), it never fails them while
        anything is evictable. Tests use it to reach a full map without
        filling a disk.

        ``file_mode``: mode of the files a read-write open creates (default
        0600, directory 0700) and the mode an existing store is checked
        against (see :mod:`ecstore.lmdb.store_files`); None also means the caller
        does not know the configured mode: looser modes are then not warned
        about, only refused where unsafe.

        ``file_blobs_from``: blobs of at least this many bytes are kept in
        files of their own (default
        :data:`~ecstore.lmdb.handle.FILE_BLOBS_FROM`; 0: every blob); a
        read-write open also removes the blob files dead processes left
        behind (:meth:`~ecstore.lmdb.blobfiles.BlobFiles.sweep`).

        ``split_reads_from``: blob files with at least this many bytes of
        data are read on two cores (:mod:`ecstore.format.split_read`); None (the
        default): one core.

        ``direct_writes_from``: blob files of at least this many bytes are
        written with ``O_DIRECT`` where the file system takes it (default
        :data:`~ecstore.lmdb.blobfiles.DIRECT_FROM`; None: through the page
        cache; see :meth:`~ecstore.lmdb.blobfiles.BlobFiles.write`).

        ``spare_writes_from``: blob files of at least this many bytes are
        copied into a spare file made ahead in the page cache (default
        :data:`~ecstore.lmdb.blobfiles.SPARE_FROM`; None: never)."""
        super().__init__(path, capacity_bytes, readonly=readonly, create=create, schema_target=schema_target,
                         map_size_bytes=map_size_bytes, file_mode=file_mode, file_blobs_from=file_blobs_from,
                         split_reads_from=split_reads_from, direct_writes_from=direct_writes_from,
                         spare_writes_from=spare_writes_from)
        if not readonly:
            self._initial_eviction()
            try:  # best effort, like the eviction: leftovers wait for the next open
                self.sweep_files()
            except ECStoreError as e:
                log.warning("ecstore: could not remove the blob files dead processes left in %s: %s", path, e)

    def _initial_eviction(self) -> None:
        """Evict down to the cap at open (reopened with a smaller cap).

        Best effort: a store error here (the map full -- even for the
        eviction's own transaction while readers pin the pages other writers
        freed --, entries pinned) leaves the store open and usable (the next
        put evicts again) and is logged; anything else releases the shared
        environment before it propagates, so a failing open never leaks a
        reference to it."""
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

    # ----------------------------------------------------------------- leases
    @_lmdb_errors_as_store_errors
    def lease(self, keys: list[str], ttl_s: float, pid: int | None = None) -> None:
        """Pin ``keys`` against eviction for ``ttl_s`` seconds (or until
        released, or until process ``pid`` dies); InvalidEntryError for a
        ``ttl_s`` outside [0, 86400] s."""
        ttl_s = _check_ttl(ttl_s)
        leases = self._leases
        if leases is None or not keys:
            return
        self._check()
        leases.lease([self._k(key) for key in keys], ttl_s, THIS_PROCESS.pid if pid is None else pid)

    @_lmdb_errors_as_store_errors
    def release(self, keys: list[str], pid: int | None = None, *, wait: bool = True) -> bool:
        """Drop one lease of ``pid`` on each of ``keys``. ``wait=False``:
        False (nothing released) instead of waiting for another process's
        lease write (see :meth:`LeaseTable.release`)."""
        leases = self._leases
        if leases is None or not keys:
            return True
        self._check()
        return leases.release([self._k(key) for key in keys], THIS_PROCESS.pid if pid is None else pid, wait=wait)

    def pin_if_present(self, key: str, identifier: str, ttl_s: float) -> bool:
        """Whether :meth:`pin` holds ``key`` (``Pin.HELD``): a True answer
        guarantees no process evicts the entry before the lease ends; False
        also while the lease write lock is busy (see :meth:`pin`)."""
        return self.pin(key, identifier, ttl_s) is Pin.HELD

    def pin(self, key: str, identifier: str, ttl_s: float) -> Pin:
        """:meth:`pin_entry`'s answer alone."""
        return self.pin_entry(key, identifier, ttl_s).pin

    @_lmdb_errors_as_store_errors
    def pin_entry(self, key: str, identifier: str, ttl_s: float) -> PinAnswer:
        """Lease ``key`` if it holds ``identifier``, such that ``Pin.HELD``
        guarantees no process evicts the entry before the lease ends: steps
        (a) lease, (b) tombstone check, (c) entry check of the
        eviction-marker protocol (docs/architecture.md#leases-and-eviction-markers).
        ``Pin.ABSENT``: not stored (or being evicted, or its record is
        unreadable: logged and dropped, as by :meth:`get`); nothing leased.
        ``Pin.BUSY``: stored, but another process (or thread) held the lease
        write lock (a process stopped inside its transaction, say) for more
        than :data:`~ecstore.lmdb.leases.LEASE_LOCK_WAIT_S`, or did so just
        before (:data:`~ecstore.lmdb.leases.LEASE_BUSY_HOLD_S`); nothing
        leased. Never waits longer than that for another process's lease
        write; the cleanup of a lease taken for an entry found gone does not
        wait either (a release the busy lock refuses is left to the lease's
        expiry). The answer carries the entry's record (read in step (c) for
        ``HELD``): its shape needs no second read. One lease-file commit
        (steps (a) and (b) together, :meth:`LeaseTable.try_pin`) and one short
        read of the data file (two if a write committed meanwhile); InvalidEntryError for a ``ttl_s`` outside
        [0, 86400] s.
        """
        ttl_s = _check_ttl(ttl_s)
        self._check()
        k = self._k(key)
        # A miss needs no pin: answering "no" is always safe, and the
        # scheduler asks about every uncached item at every step, so the
        # common miss costs one read instead of two lease-file commits.
        seen = self._seen_record(k, identifier)
        if seen is None:
            return PIN_ABSENT
        leases = self._leases
        if leases is None:
            rec = self._decoded(key, seen[0])
            return PIN_ABSENT if rec is None else PinAnswer(Pin.HELD, rec)
        leased = leases.try_pin(k, ttl_s, THIS_PROCESS.pid)  # steps (a) and (b)
        if leased is None:
            return PinAnswer(Pin.BUSY)
        if not leased:
            return PIN_ABSENT  # being evicted
        rec = None
        try:
            # Step (c). No write transaction committed since the first read
            # (the environment's last one is still that read's snapshot): the
            # entry is still there as read, no second read needed.
            rec = (self._decoded(key, seen[0]) if self._last_txnid() == seen[1]
                   else self._record_of(key, k, identifier))
        finally:
            if rec is None:
                self.release([key], wait=False)  # refused while busy: the lease expires
        return PIN_ABSENT if rec is None else PinAnswer(Pin.HELD, rec)

    @_lmdb_errors_as_store_errors
    def pin_entries(self, pins: list[tuple[str, str]], ttl_s: float,
                    release: list[str] | None = None) -> list[Pin]:
        """:meth:`pin_entry` for each (key, identifier) of ``pins`` (one lease
        each, a pair given twice is leased twice), after dropping one lease of
        this process on each key of ``release``: one lease-file commit
        (steps (a) and (b) for all) and a read of the data file (step (c)
        for all); the leases of entries found gone are dropped again (one
        more commit, not waited for). Per pair, ``Pin.HELD`` or ``Pin.ABSENT``;
        all ``Pin.BUSY`` (nothing leased, nothing released) while the lease
        write lock is busy, as for :meth:`pin_entry`. Misses (one first read
        for all) are not leased; the second read is skipped when no write
        committed since the first."""
        ttl_s = _check_ttl(ttl_s)
        self._check()
        ks = [self._k(key) for key, _ in pins]
        there, snapshot = self._present(ks, pins)  # misses are not leased
        leases = self._leases
        if leases is None:
            return [Pin.HELD if t else Pin.ABSENT for t in there]
        leased = leases.try_pin_many([k for k, ok in zip(ks, there) if ok], ttl_s, THIS_PROCESS.pid,
                                     [self._k(key) for key in release or ()])
        if leased is None:
            return [Pin.BUSY] * len(pins)
        it = iter(leased)
        held = [ok and next(it) for ok in there]  # steps (a) and (b)
        if self._last_txnid() != snapshot:  # step (c), unless nothing committed since the first read
            there, _ = self._present(ks, pins)
        out = [Pin.HELD if h and t else Pin.ABSENT for h, t in zip(held, there)]
        gone = [key for (key, _), h, t in zip(pins, held, there) if h and not t]
        if gone:
            self.release(gone, wait=False)  # refused while busy: the leases expire
        return out

    def _present(self, ks: list[bytes], pins: list[tuple[str, str]]) -> tuple[list[bool], int]:
        """Whether each of ``ks`` holds the entry of its pair's identifier, and
        the id of the snapshot that was read in (one read for all)."""
        shared = self._shared
        txn = begin_read(shared)
        try:
            raws = [txn.get(k, db=self._dbs.entries) for k in ks]
            snapshot = txn.id()
        finally:
            end_read(shared, txn)
        return [raw is not None and codec.record_identifier(raw, self.record_version) == ident
                for raw, (_, ident) in zip(raws, pins)], snapshot

    def _seen_record(self, k: bytes, identifier: str) -> tuple[bytes, int] | None:
        """``k``'s packed record and the id of the snapshot it was read in
        (one read; only the record's identifier is decoded), if it is
        ``identifier``'s entry of this handle's record version; else None."""
        shared = self._shared
        txn = begin_read(shared)
        try:
            raw = txn.get(k, db=self._dbs.entries)
            snapshot = txn.id()
        finally:
            end_read(shared, txn)
        if raw is None or codec.record_identifier(raw, self.record_version) != identifier:
            return None
        return raw, snapshot

    def _decoded(self, key: str, raw: bytes) -> Record | None:
        """The record packed in ``raw`` (``key``'s); None for an unreadable
        one (logged and dropped, as by :meth:`get`)."""
        try:
            return codec.unpack_record(raw)
        except CorruptEntryError as e:
            self.drop_corrupt(key, e)
            return None

    def _record_of(self, key: str, k: bytes, identifier: str) -> Record | None:
        """``k``'s record if it is ``identifier``'s entry of this handle's
        record version (one read); None otherwise, and for an unreadable
        record (logged and dropped, as by :meth:`get`)."""
        shared = self._shared
        txn = begin_read(shared)
        try:
            raw = txn.get(k, db=self._dbs.entries)
        finally:
            end_read(shared, txn)
        if raw is None or codec.record_identifier(raw, self.record_version) != identifier:
            return None
        return self._decoded(key, raw)

    # ----------------------------------------------------------------- writes
    def _evict_to(self, target_bytes: int, extra: int = 0) -> int:
        """Evict in a transaction of its own until ``total_bytes`` <=
        ``target_bytes`` and at least ``extra`` bytes are freed; returns the
        bytes freed."""
        with self._writing() as w:
            return w.evict_to(target_bytes, extra)

    @_lmdb_errors_as_store_errors
    def write_batch(self, puts: list[BatchPut], touches: dict[str, Touch] | None = None, *,
                    sync_files: bool = True) -> None:
        """Store ``puts`` and apply ``touches`` (key -> :class:`~ecstore.lmdb.batch.Touch`)
        in one transaction, evicting LRU entries to
        stay within the cap. Sets each request's ``result``; never raises for a
        single bad entry. Raises StoreFullError only if the whole batch could
        not be committed (disk full, or the map full with nothing more to
        evict: see :class:`~ecstore.lmdb.full.MapFullRetry`), with nothing
        written; SchemaError if another process migrated the store;
        StoreOpenError (every pending put failed with it) for any other LMDB
        error, e.g. a damaged page met by the eviction a full map makes.

        Order: puts and touches are applied in the order of each put's
        ticket and each touch's ``orders`` (the positions at which the key
        was read), so an entry read before a put is already most recently
        used when that put evicts (:func:`~ecstore.lmdb.batch.in_call_order`).

        ``sync_files=False``: blob files are written completely (into the
        page cache: a killed process loses nothing of them) but not
        ``fdatasync``ed before the commit, so the entries are visible sooner;
        the caller then makes them durable with :meth:`sync_files` (the names
        of the stored puts' ``ref``, and the ``present_file`` of the puts
        found present: another handle may have committed that entry the
        same way and not synced its file yet). Until then a power loss may leave such a
        committed entry's file torn or missing: a checked miss at its read
        (size, header and checksum), never garbage.
        """
        self._check()
        touches = touches or {}
        for p in puts:
            if p.put.blob is None:
                t = p.put.tensor
                p.head = codec.blob_head(tuple(t.shape), t.dtype, p.put.identifier, p.model)
                # Left unencoded where a spare may take it from the tensor's bytes
                # (_write_file): only where those are its values (a negative or
                # conjugate view's sign is applied by a copy).
                if not (self._in_file(p) and self.files.spares_from(p.size) and not (t.is_neg() or t.is_conj())):
                    self._encode(p)
            if p.size > self.capacity_bytes:
                p.outcome, p.error = PutOutcome.FAILED, StoreFullError(
                    f"entry of {p.size} bytes exceeds the disk cap of {self.capacity_bytes} bytes")
            elif not self._in_file(p) and p.size > self._map_room():  # would evict everything, then fail
                p.outcome, p.error = PutOutcome.FAILED, StoreFullError(
                    f"entry of {p.size} bytes can never fit in the LMDB map of {self.path} "
                    f"(about {self._map_room()} bytes usable)")
        todo = [p for p in puts if p.outcome is PutOutcome.PENDING]
        try:
            self._mark_stored(todo)
            self._write_files(todo, sync=sync_files)
            self._write_batch(todo, touches, sync_files)
        finally:  # files of puts that were not stored (present, full, failed) are nobody's
            self.files.discard([p.ref.name for p in todo if p.ref is not None and p.outcome is not PutOutcome.STORED])

    def _mark_stored(self, todo: list[BatchPut]) -> None:
        """Mark the puts whose entry is already stored (one read for all), so
        that no blob file is written for them before the transaction (a put
        that did not ask the store first: ``ECStore.put(known_absent=True)``).
        The transaction still decides each at its turn: PRESENT if the entry
        is there then, else (evicted in between, or its record unreadable)
        stored, its file written inside the transaction."""
        filed = [p for p in todo if self._in_file(p)]
        if not filed:
            return
        pairs = [(p.put.key, p.put.identifier) for p in filed]
        present, _ = self._present([self._k(key) for key, _ in pairs], pairs)
        for p, held in zip(filed, present):
            p.seen_stored = held

    def _in_file(self, p: BatchPut) -> bool:
        """Whether ``p``'s blob goes to a file of its own (see ``file_blobs_from``)."""
        return self.file_blobs_from is not None and p.size >= self.file_blobs_from

    def _write_files(self, todo: list[BatchPut], sync: bool = True) -> None:
        """Write the blobs that go to files, then (``sync``) make them durable
        together (``fdatasync`` each, then the directory: :meth:`BlobFiles.sync`),
        before the transaction that references them: a committed entry's
        file is always complete (in the page cache at least), and durable unless ``sync`` is False (then
        only the store directory's entry for ``blobs/`` is made durable first,
        and :meth:`sync_files` the files after the commit). Outside LMDB's write lock, so
        other processes keep committing meanwhile. StoreFullError (every put
        failed with it) if a file cannot be written; files already written
        are discarded by the caller."""
        try:
            for p in todo:
                if self._in_file(p) and not p.seen_stored:
                    self._write_file(p, sync)
            written = [p.ref.name for p in todo if p.ref is not None]
            if written and sync:
                self.files.sync(written)
            elif written:
                self.files.sync_store_dir()
        except ECStoreError as e:
            for p in todo:
                p.outcome, p.error = PutOutcome.FAILED, e
            raise

    def _write_file(self, p: BatchPut, sync: bool) -> None:
        """Write ``p``'s blob file (``p.ref``), hashed as it goes
        (``p.checksum``). A put not encoded yet (``p.head``) goes into a ready
        spare file from its head and its tensor's own bytes (no copy of the
        blob made); with no spare ready it is encoded here first. ``sync``:
        early writeback (a file synced after the commit gets none, see
        :meth:`BlobFiles.write`)."""
        hasher = codec.checksummer()
        if p.put.blob is None:
            assert p.head is not None
            data = codec.raw_bytes_view(p.put.tensor)
            p.ref = self.files.write_parts([p.head, data], writeback=sync, hasher=hasher)  # type: ignore[list-item]  # ndarray: a buffer
            if p.ref is None:  # no spare ready: encoded, then written as any blob
                self._encode(p)
        if p.ref is None:
            p.ref = self.files.write(p.encoded, writeback=sync, hasher=hasher)  # type: ignore[arg-type]  # ndarray: a buffer
        p.checksum = hasher.intdigest()

    @staticmethod
    def _encode(p: BatchPut) -> None:
        """Encode ``p``'s tensor behind its ``head`` into a blob of the pool (``p.put.blob``)."""
        p.put.blob = codec.encode_view(p.put.tensor, identifier=p.put.identifier, model=p.model, pool=POOL,
                                       head=p.head)[0]

    def _write_batch(self, todo: list[BatchPut], touches: dict[str, Touch], sync_files: bool = True) -> None:
        """:meth:`write_batch` once the blob files are written: the
        transaction, retried while the map is full."""
        extra = 0
        retry = MapFullRetry(self)

        def evict() -> int:  # fragmentation: free more pages in a committed transaction
            nonlocal extra
            in_map = sum(p.size if p.ref is None else 4096 for p in todo)
            extra = max(extra * 2, in_map + 4 * MiB)
            return self._evict_to(self.capacity_bytes, extra)

        while True:
            try:
                self._write_once(todo, touches, sync_files)
                return
            except SchemaError as e:
                for p in todo:
                    p.outcome, p.error = PutOutcome.FAILED, e
                raise
            except lmdb.MapFullError:
                try:
                    if not retry.again(evict):
                        break
                except lmdb.Error as e:  # the eviction or empty commit: a damaged page, EIO...
                    err_open = lmdb_store_error(self.path, e)
                    for p in todo:
                        p.outcome, p.error = PutOutcome.FAILED, err_open
                    raise err_open from e
            except lmdb.Error as e:
                # LMDB reports a short write (ENOSPC, EFBIG) as EIO: say why.
                hint = space_hint(self.path, sum(p.size for p in todo))
                err = StoreFullError(f"write to {self.path} failed: {e}{hint}")
                if isinstance(e, (lmdb.DiskError,)) or getattr(e, "errno", None) in (errno.ENOSPC, errno.EFBIG):
                    err = StoreFullError(f"disk full while writing to {self.path}: {e}{hint}")
                for p in todo:
                    p.outcome, p.error = PutOutcome.FAILED, err
                raise err from None
        err = StoreFullError(f"LMDB map of {self.path} is full and nothing more can be evicted")
        for p in todo:
            p.outcome, p.error = PutOutcome.FAILED, err
        raise err

    def _map_room(self) -> int:
        """Bytes of blob the LMDB map could hold at best (map minus the meta
        pages and some B-tree pages)."""
        return self.env.info()["map_size"] - 64 * self.env.stat()["psize"]

    def _write_once(self, todo: list[BatchPut], touches: dict[str, Touch], sync_files: bool = True) -> None:
        """One attempt at a batch: one :class:`~ecstore.lmdb.txn.WriteTxn`;
        sets the results only once it committed."""
        now = time.time_ns()
        results: list[PutOutcome] = [PutOutcome.PENDING] * len(todo)
        present_files: list[str | None] = [None] * len(todo)
        no_room: set[int] = set()  # puts with no room left: every other entry is pinned
        with self._writing() as w:
            for op in in_call_order(todo, touches):
                if not isinstance(op, PutOp):
                    w.touch(self._k(op.key), op.identifier, op.hits, op.last_ns)
                    continue
                p = todo[op.index]
                k = self._k(p.put.key)
                held = w.identifier_of(k)  # a damaged entry under this key is dropped: replaced
                if held is not None:
                    results[op.index] = PutOutcome.PRESENT if held == p.put.identifier else PutOutcome.COLLISION
                    if held == p.put.identifier:
                        present_files[op.index] = w.file_of(k)
                    continue
                if not w.make_room(p.size, self.capacity_bytes):
                    results[op.index] = PutOutcome.FAILED
                    no_room.add(op.index)
                    continue
                if p.ref is None and p.seen_stored and self._in_file(p):
                    # Stored when the batch began (no file written for it), gone
                    # now: its file, here (rare: inside the write lock).
                    p.seen_stored = False
                    self._write_files([p], sync=sync_files)
                blob = p.encoded if p.ref is None else _NO_BLOB  # a file's entry: its record and a pointer
                w.insert(k, blob, Record(p.put.identifier, str(p.put.tensor.dtype).removeprefix("torch."),
                                         tuple(p.put.tensor.shape), p.put.nbytes, p.size,
                                         codec.checksum(blob) if p.checksum is None else p.checksum,
                                         now, now, 0, 0, self.record_version), p.ref)
                results[op.index] = PutOutcome.STORED
        for i, (p, r, present) in enumerate(zip(todo, results, present_files)):
            p.present_file = present
            p.outcome = r
            if i in no_room:
                p.error = StoreFullError(
                    f"no room for {p.size} bytes: the rest of the store is pinned by leases")

    @_lmdb_errors_as_store_errors
    def register_namespace(self, namespace: str, description: bytes) -> None:
        """Record what ``namespace`` stands for (JSON ``description``), once."""
        self._check()
        if self.readonly or self._dbs.namespaces is None:
            return
        k = namespace.encode("ascii")
        with self._begin() as txn:
            if txn.get(k, db=self._dbs.namespaces) == description:
                return

        def put_once() -> None:
            with self._write_txn() as txn:
                txn.put(k, description, db=self._dbs.namespaces)
        # A few hundred bytes, but fresh pages all the same: wait like a delete.
        self._write_retrying(put_once, f"record namespace {namespace}")

    @_lmdb_errors_as_store_errors
    def delete(self, key: str) -> bool:
        """Remove ``key``'s entry; False if there was none."""
        return self.remove(key) is not None

    @_lmdb_errors_as_store_errors
    def remove(self, key: str) -> int | None:
        """Remove ``key``'s entry (damaged ones too: record, blob and LRU row)
        and return the bytes it took off ``total_bytes``; None if absent.
        Waits while the map is full (a delete needs pages too); StoreFullError
        if it stays full."""
        self._check()
        k = self._k(key)

        def remove_once() -> int | None:
            with self._writing() as w:
                if w.txn.get(k, db=self._dbs.entries) is None:
                    return None
                return w.remove(k)
        return self._write_retrying(remove_once, f"remove {key}")

    @_lmdb_errors_as_store_errors
    def sweep_files(self) -> int:
        """Remove blob files that dead processes left behind and no entry
        references (a crash between writing a file and committing its entry,
        or between an eviction's commit and its delete); returns how many.
        Live processes' files are never touched. Runs at every read-write
        open (every ECStore with a disk tier, ``ecstore-dump purge``)."""
        self._check()
        if self.readonly:
            return 0

        def referenced() -> set[str]:
            names = self.referenced_files()
            # The commit these names come from (metasync=False) must be on
            # disk before a file it no longer references is deleted: else a
            # power cut brings back an older commit pointing to it.
            self._sync_for_deletes()
            return names
        return self.files.sweep(referenced)

    @_lmdb_errors_as_store_errors
    def file_of(self, key: str, identifier: str) -> str | None:
        """The name of the blob file ``key``'s entry of ``identifier`` points
        to (one read transaction); None for an inline blob, another
        identifier or no entry."""
        self._check()
        k = self._k(key)
        with self._begin(buffers=True) as txn:
            raw = txn.get(k, db=self._dbs.entries)
            if raw is None or codec.record_identifier(raw, self.record_version) != identifier:
                return None
            value = txn.get(k, db=self._dbs.blobs)
            ref = None if value is None else file_ref(value)
        return None if ref is None else ref.name

    def sync_files(self, names: list[str]) -> None:
        """Make the blob files of entries committed by
        ``write_batch(sync_files=False)`` durable (``fdatasync`` each, then
        ``blobs/``); a file gone meanwhile (its entry evicted or removed) is
        skipped. StoreFullError on an OS error: the entries stay committed,
        their durability is not known."""
        self._check()
        if names:
            self.files.sync(names, missing_ok=True)

    def prepare_spare(self) -> None:
        """Have a spare blob file made for the next large put, in the
        background (:meth:`~ecstore.lmdb.blobfiles.BlobFiles.prepare_spare`);
        nothing on a closed or read-only tier."""
        if not (self._closed or self.readonly):
            self.files.prepare_spare()

    @_lmdb_errors_as_store_errors
    def sync(self) -> None:
        """Force committed transactions to stable storage. An LMDB error
        (EIO from the fsync, a closed environment) is an ECStoreError."""
        self._check()
        if not self.readonly:
            self.env.sync(True)
