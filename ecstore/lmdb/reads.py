"""The read side of the LMDB tier: lookups, the checked ``get``, listings,
counters and snapshots for tooling.

Every read opens one short read transaction and closes it before
returning, so no reader pins old pages across calls (a full map waits for
readers; see :mod:`ecstore.lmdb.full`). Thread-safe; any number of
processes read while others write. ``get`` removes an entry that fails its
checks (through a :class:`~ecstore.lmdb.txn.WriteTxn`) unless the handle is
read-only.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import lmdb
import torch

from ecstore.errors import CorruptEntryError, StoreFullError
from ecstore.format import Record, blob_check, blob_read, codec
from ecstore.lmdb.blobfiles import POINTER_MAGIC, BlobFileUnavailable, FileRef, unpack_ref
from ecstore.lmdb.handle import StoreHandle, _lmdb_errors_as_store_errors
from ecstore.lmdb.txn import _U64, Dbs, file_ref
from ecstore.lmdb.txngate import begin_read, end_read

log = logging.getLogger("ecstore")

_T = TypeVar("_T")

#: Blob file pointers lately decoded (pointer bytes -> FileRef): the decode
#: is a pure function of the bytes, and a hit costs a copy and a dict lookup
#: instead of a regex match and a record. Bounded; malformed pointers are
#: never kept (they raise). Thread-safe (single dict operations under the GIL).
_POINTERS: dict[bytes, FileRef] = {}
_POINTERS_MAX = 4096


def _pointer(value: memoryview) -> FileRef | None:
    """:func:`~ecstore.lmdb.blobfiles.unpack_ref` of a ``blobs`` value, cached
    (an inline blob is never copied: it does not start with the pointer magic)."""
    if value[:len(POINTER_MAGIC)] != POINTER_MAGIC:
        return None
    raw = bytes(value)
    ref = _POINTERS.get(raw)
    if ref is None:
        ref = unpack_ref(raw)
        if ref is not None:
            if len(_POINTERS) >= _POINTERS_MAX:
                _POINTERS.clear()
            _POINTERS[raw] = ref
    return ref


def _check_inline(rec: Record, blob: memoryview, **expect: Any) -> bool:
    """:meth:`TierReads.verify` of an inline blob: checked (checksum included)
    in place, nothing copied; True, or CorruptEntryError."""
    blob_check.check_entry(rec, blob, **expect)
    return True


def _check_file(rec: Record, fd: int, **expect: Any) -> bool:
    """:meth:`TierReads.verify` of a blob file: hashed a chunk at a time,
    nothing kept; True, or CorruptEntryError."""
    blob_read.check_file_entry(rec, fd, **expect)
    return True


class TierReads(StoreHandle):
    """Reads of one store handle (see the module docstring)."""

    @_lmdb_errors_as_store_errors
    def contains(self, key: str, identifier: str) -> bool:
        """Whether ``key`` holds an entry of ``identifier`` (one read)."""
        return self._identifier_at(key) == identifier

    @_lmdb_errors_as_store_errors
    def identifier_at(self, key: str) -> str | None:
        """The full identifier stored under ``key``, or None if absent."""
        return self._identifier_at(key)

    def _identifier_at(self, key: str) -> str | None:
        self._check()
        shared = self._shared
        txn = begin_read(shared)
        try:
            raw = txn.get(self._k(key), db=self._dbs.entries)
        finally:
            end_read(shared, txn)
        return None if raw is None else codec.record_identifier(raw, self.record_version)

    @_lmdb_errors_as_store_errors
    def record(self, key: str) -> Record | None:
        """``key``'s record; None if absent; CorruptEntryError if unreadable."""
        self._check()
        with self._begin(buffers=True) as txn:
            raw = txn.get(self._k(key), db=self._dbs.entries)
            return None if raw is None else codec.unpack_record(raw)

    @_lmdb_errors_as_store_errors
    def get(self, key: str, identifier: str, *, model: str | None = None,
            dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The stored tensor (a fresh CPU copy), or None on a miss.

        The entry passes :func:`blob_check.check_entry` (record, blob, checksum,
        header; the ``key``, and the ``model`` / ``dtype`` of the asking
        handle if given) before a byte of it is copied. An entry failing it
        is logged, removed (unless read-only) and reported as a miss: garbage
        or a tensor of another model, dtype or shape is never returned, and
        no hostile header makes this raise anything but an ECStoreError.
        """
        return self._checked(key, identifier, model, dtype, blob_read.read_entry, self._read_from_file)

    @_lmdb_errors_as_store_errors
    def verify(self, key: str, identifier: str, *, model: str | None = None,
               dtype: torch.dtype | None = None) -> bool:
        """Whether :meth:`get` would return the entry: the same checks (a
        failing entry is dropped the same way), the whole blob read and
        hashed, but nothing copied out: a blob file is hashed a chunk at a
        time (:func:`~ecstore.format.blob_read.check_file_entry`), an inline
        blob in place, inside the read transaction."""
        return self._checked(key, identifier, model, dtype, _check_inline, _check_file) is not None

    def _read_from_file(self, rec: Record, fd: int, **expect: Any) -> torch.Tensor:
        return blob_read.read_file_entry(rec, fd, split_from=self.split_reads_from, **expect)

    def _checked(self, key: str, identifier: str, model: str | None, dtype: torch.dtype | None,
                 inline: Callable[..., _T], from_file: Callable[..., _T]) -> _T | None:
        """``inline(rec, blob, **expect)`` or ``from_file(rec, fd, **expect)``
        (each checks the entry against ``expect``, CorruptEntryError if it
        fails) of ``key``'s entry if it is ``identifier``'s; None on a miss
        (a failing entry dropped: :meth:`get`)."""
        self._check()
        k = self._k(key)
        rec: Record | None = None
        ref: FileRef | None = None
        shared = self._shared
        txn = begin_read(shared, buffers=True)
        try:
            raw = txn.get(k, db=self._dbs.entries)
            if raw is None:
                return None
            try:
                rec = codec.unpack_record(raw)
                if rec.identifier != identifier or rec.version != self.record_version:
                    return None  # another identity or identifier (hash collision), or legacy: a plain miss
                blob = txn.get(k, db=self._dbs.blobs)
                if blob is None:
                    raise CorruptEntryError("record without blob")
                ref = _pointer(blob)
                if ref is None:
                    return inline(rec, blob, identifier=identifier, model=model, dtype=dtype, key=key)
            except CorruptEntryError as e:
                err = e
        finally:
            end_read(shared, txn)
        if ref is not None and rec is not None:  # read after the transaction: no snapshot held
            try:
                out = self._read_file(k, ref, rec, from_file, identifier=identifier, model=model, dtype=dtype,
                                      key=key)
            except CorruptEntryError as e:
                err = e
            else:
                if out is not None:
                    return out
                return None  # the entry was removed meanwhile: a plain miss
        self.drop_corrupt(key, err, None if rec is None else rec.checksum)
        return None

    def _read_file(self, k: bytes, ref: FileRef, rec: Record, read: Callable[..., _T],
                   **expect: Any) -> _T | None:
        """``read(rec, fd, **expect)`` of an entry whose blob is the file
        ``ref`` (checked like an inline blob, e.g.
        :func:`~ecstore.format.blob_read.read_file_entry`); None if
        the file is gone because the entry was removed after our read
        transaction (eviction by another process: a plain miss);
        CorruptEntryError if it is gone while the entry still points to it
        (damage) or fails a check. A file that cannot be opened for want of
        descriptors or memory is a miss too, the entry kept."""
        try:
            fd = self.files.open(ref)
        except BlobFileUnavailable:  # logged by open(); the entry is not damaged
            return None
        if fd is None:
            if not self.points_to(k, ref):
                return None
            raise CorruptEntryError(f"blob file {ref.name} is missing")
        try:
            return read(rec, fd, **expect)
        finally:
            os.close(fd)

    @_lmdb_errors_as_store_errors
    def drop_corrupt(self, key: str, why: object, checksum: int | None = None) -> None:
        """``key``'s entry failed a check (``why``): log it as a miss and
        remove it (unless the handle is read-only, or the entry was replaced
        meanwhile: see :meth:`_drop_corrupt`). ``checksum``: the record's, if
        the record itself was readable. A full map leaves it for the next
        get or eviction (logged)."""
        log.warning("ecstore: corrupt entry %s (%s) at %s: treated as a miss%s", key, why, self.path,
                    "" if self.readonly else ", removed")
        if not self.readonly:
            try:
                self._write_retrying(lambda: self._drop_corrupt(self._k(key), checksum),
                                     f"drop the corrupt entry {key}")
            except StoreFullError as e:  # still a miss; the next get or eviction drops it
                log.warning("ecstore: %s", e)

    def _drop_corrupt(self, k: bytes, raw_expected: int | None) -> None:
        """Remove the damaged entry under ``k`` unless it was replaced
        meanwhile: its record now reads with another checksum than
        ``raw_expected``, or reads at all where it did not (``raw_expected``
        None: the record was the damage)."""
        with self._writing() as w:
            raw = w.txn.get(k, db=self._dbs.entries)
            if raw is None:
                return
            try:
                rec = codec.unpack_record(raw)
            except CorruptEntryError:
                rec = None
            if rec is not None and (raw_expected is None or rec.checksum != raw_expected):
                return  # replaced by a fresh entry meanwhile
            w.remove(k, rec)
            self.counters.corrupt_dropped += 1

    def iter_records(self, *, reverse: bool = False) -> Iterator[tuple[str, Record | None]]:
        """(key, record) for every entry, in key order; None for an unreadable record.

        Holds one read transaction while iterating: use for tooling, not on
        the serving path.
        """
        self._check()
        with self._begin() as txn, txn.cursor(db=self._dbs.entries) as cur:
            for k, raw in (cur.iterprev() if reverse else cur):
                try:
                    yield k.decode("utf-8"), codec.unpack_record(raw)
                except CorruptEntryError:
                    yield k.decode("utf-8", "replace"), None

    @_lmdb_errors_as_store_errors
    def blob_bytes(self, key: str) -> bytes | None:
        """A copy of an entry's raw blob (for export/verify tooling): the
        file's contents for a blob kept in a file (b"" if it is missing)."""
        self._check()
        with self._begin() as txn:
            value = txn.get(self._k(key), db=self._dbs.blobs)
        return None if value is None else bytes(self.resolve_blob(value))

    def points_to(self, k: bytes, ref: FileRef) -> bool:
        """Whether ``k``'s entry points to the blob file ``ref`` now (a fresh
        read transaction): a file found missing or short after an older one
        is damage only if so; else its entry was removed meanwhile."""
        with self._begin(buffers=True) as txn:
            now = txn.get(k, db=self._dbs.blobs)
            return now is not None and file_ref(now) == ref

    def resolve_blob(self, value: bytes | memoryview) -> bytes | memoryview:
        """A ``blobs`` value as the blob it stands for (tooling): an inline
        blob as it is, a pointer as its file's contents (b"" if the file is
        missing or unreadable: the entry checks then report it as damaged;
        BlobFileUnavailable, an ECStoreError, when out of descriptors).
        Reads the whole file: not for the serving path."""
        ref = file_ref(value)
        if ref is None:
            return value
        fd = self.files.open(ref)
        if fd is None:
            return b""
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read(ref.size + 1)
        except OSError:
            return b""
        finally:
            os.close(fd)

    @_lmdb_errors_as_store_errors
    def referenced_files(self) -> set[str]:
        """Names of the blob files committed entries point to, from the
        ``files`` index (one read transaction; it never reads a blob: the
        sweep at open costs O(blob files), not a read of every entry)."""
        self._check()
        if self._dbs.files is None:
            return set()
        with self._begin() as txn, txn.cursor(db=self._dbs.files) as cur:
            return {bytes(name).decode("ascii", "replace") for name in cur.iternext(keys=True, values=False)}

    @_lmdb_errors_as_store_errors
    def lru_keys(self) -> list[str]:
        """Keys from least to most recently used."""
        self._check()
        with self._begin() as txn:
            if self._dbs.lru is not None:
                return [bytes(v).decode() for _, v in txn.cursor(db=self._dbs.lru)]
            recs = [(codec.unpack_record(v).lru_seq, bytes(k).decode()) for k, v in txn.cursor(db=self._dbs.entries)]
        return [k for _, k in sorted(recs)]

    @_lmdb_errors_as_store_errors
    def total_bytes(self) -> int:
        """Sum of stored blob sizes (bytes), as committed."""
        with self._begin() as txn:
            raw = txn.get(b"total_bytes", db=self._dbs.meta)
            return _U64.unpack(raw)[0] if raw else 0

    @_lmdb_errors_as_store_errors
    def entry_count(self) -> int:
        """Number of entries, as committed."""
        with self._begin() as txn:
            return txn.stat(self._dbs.entries)["entries"]

    def env_info(self) -> dict[str, Any]:
        """LMDB's ``Environment.info()`` plus ``psize`` (page size) and
        ``file_size`` (data.mdb, bytes; 0 if unreadable)."""
        info = dict(self.env.info())
        info["psize"] = self.env.stat()["psize"]
        try:
            info["file_size"] = os.path.getsize(os.path.join(self.path, "data.mdb"))
        except OSError:
            info["file_size"] = 0
        return info

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[tuple[lmdb.Transaction, Dbs]]:
        """One read transaction (``buffers=True``) and the sub-database handles
        (:class:`~ecstore.lmdb.txn.Dbs`: ``lru`` None in schema 1, ``namespaces``
        before schema 3, ``files`` before schema 4), for tooling
        (``ecstore-dump``) that needs a consistent view. Read-only; buffers are
        valid only inside the ``with`` block; keep it short."""
        self._check()
        with self._begin(buffers=True) as txn:
            yield txn, self._dbs

    @_lmdb_errors_as_store_errors
    def namespace_descriptions(self) -> dict[str, bytes]:
        """namespace -> identity description (JSON bytes) of every registered one."""
        self._check()
        if self._dbs.namespaces is None:
            return {}
        with self._begin() as txn, txn.cursor(db=self._dbs.namespaces) as cur:
            return {bytes(k).decode("ascii", "replace"): bytes(v) for k, v in cur}
