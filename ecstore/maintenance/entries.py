"""Opening a store for tooling, reading its entries, and checking one entry.

Read-only: nothing here takes the write lock or changes LRU order or hit
counts, so all of it is safe while vLLM writes to the same store. Records are
read in batches of short read transactions (:data:`SCAN_BATCH`); each blob is
read in its own transaction. Not thread-safe per tier handle beyond what
:class:`~ecstore.lmdb.tier.LMDBTier` guarantees.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ecstore.errors import CorruptEntryError, ECStoreError, StoreOpenError
from ecstore.format import Record, codec
from ecstore.key import parse_key
from ecstore.lmdb import LMDBTier
from ecstore.lmdb.check import entry_problem as entry_problem
from ecstore.lmdb.txn import file_ref
from ecstore.maintenance.progress import Ticker

#: Records read per read transaction while scanning (short transactions).
SCAN_BATCH = 2048
#: LMDB's data-file magic (MDB_meta.mm_magic, after the 16-byte page header).
LMDB_MAGIC = 0xBEEFC0DE


def key_bytes(key: str) -> bytes:
    """A key as stored: UTF-8, with bytes that were not UTF-8 (read from the
    store or from argv as surrogate escapes) restored exactly."""
    return key.encode("utf-8", "surrogateescape")


def key_text(raw: bytes) -> str:
    """A stored key as text; bytes that are not UTF-8 become surrogate
    escapes, so :func:`key_bytes` gives the very same key back."""
    return bytes(raw).decode("utf-8", "surrogateescape")


@dataclass
class Row:
    """One entry: its key and record (None if the record is unreadable)."""

    key: str
    rec: Record | None
    error: str | None = None

    @property
    def model(self) -> str:
        """The model part of the key, ``"?"`` if the key is not an EC key."""
        try:
            return parse_key(self.key).model
        except ECStoreError:
            return "?"


def precheck_store(path: str) -> None:
    """Refuse, without touching anything, what is clearly not a store
    (:class:`StoreOpenError`).

    Opening LMDB creates ``lock.mdb``; checking the data file's magic first
    means a random directory or file is left exactly as it was.
    """
    if not os.path.exists(path):
        raise StoreOpenError(f"{path}: no such directory")
    if not os.path.isdir(path):
        raise StoreOpenError(f"{path} is not a directory (expected an ecstore local_disk directory)")
    data = os.path.join(path, "data.mdb")
    if not os.path.isfile(data):
        raise StoreOpenError(f"{path} is not an ecstore store (no data.mdb)")
    try:
        with open(data, "rb") as fh:
            head = fh.read(24)
    except OSError as e:
        raise StoreOpenError(f"cannot read {data}: {e.strerror or e}") from None
    if len(head) < 24 or struct.unpack_from("=I", head, 16)[0] != LMDB_MAGIC:
        raise StoreOpenError(f"{path} is not an ecstore store (data.mdb is not an LMDB file)")


@contextlib.contextmanager
def open_readonly(path: str, cap_bytes: int | None = None, file_mode: int | None = None) -> Iterator[LMDBTier]:
    """The store at ``path`` opened read-only (no write lock, no migration,
    no LRU change), after :func:`precheck_store`.

    ``schema_target=1`` lets tooling read a store of any supported schema
    without upgrading it; a newer schema raises SchemaError.
    """
    precheck_store(path)
    tier = LMDBTier(path, cap_bytes or 0, readonly=True, create=False, schema_target=1, file_mode=file_mode)
    try:
        yield tier
    finally:
        tier.close()


def _row(k: bytes, raw: Any) -> Row:
    key = key_text(k)
    try:
        return Row(key, codec.unpack_record(raw))
    except CorruptEntryError as e:
        return Row(key, None, f"unreadable record: {e}")


def scan(tier: LMDBTier, progress: Ticker | None = None) -> Iterator[Row]:
    """Every entry in key order, read :data:`SCAN_BATCH` records per read
    transaction; ``progress.advance()`` once per entry.

    Short transactions never pin old pages for long while vLLM writes; the
    price is that a scan of a busy store is not one atomic snapshot.
    """
    last: bytes | None = None
    while True:
        chunk: list[tuple[bytes, bytes]] = []
        with tier.snapshot() as (txn, dbs), txn.cursor(db=dbs.entries) as cur:
            ok = cur.set_range(last) if last is not None else cur.first()
            while ok and len(chunk) < SCAN_BATCH:
                k = bytes(cur.key())
                if k != last:
                    chunk.append((k, bytes(cur.value())))
                ok = cur.next()
        if not chunk:
            return
        last = chunk[-1][0]
        for k, raw in chunk:
            if progress is not None:
                progress.advance()
            yield _row(k, raw)


def read_entry(tier: LMDBTier, key: str, with_blob: bool = True) -> tuple[Record | None, bytes | None, bool]:
    """(record, blob copy, present) of ``key`` from one read transaction;
    the record is None if unreadable. A blob file found missing or short
    because the entry was removed after that transaction (evicted by
    another process) counts as not present, not as damage."""
    k = key_bytes(key)
    with tier.snapshot() as (txn, dbs):
        raw = txn.get(k, db=dbs.entries)
        if raw is None:
            return None, None, False
        value = txn.get(k, db=dbs.blobs) if with_blob else None
        ref = None if value is None else file_ref(value)
        blob = None if value is None else bytes(tier.resolve_blob(value))  # a blob file's contents
        try:
            rec: Record | None = codec.unpack_record(raw)
        except CorruptEntryError:
            rec = None
    if ref is not None and blob is not None and len(blob) != ref.size and not tier.points_to(k, ref):
        return None, None, False
    return rec, blob, True


def find_entries(tier: LMDBTier, text: str, model: str | None = None) -> tuple[list[Row], str]:
    """Entries named by a full key, else by mm identifier; (rows, how) with
    ``how`` ``"key"`` or ``"identifier"``.

    A string that is an existing key selects that entry. Otherwise every
    entry whose stored identifier equals ``text`` matches (records are
    scanned: no assumption about which hash made the key). ``model``
    narrows either way.
    """
    rec, _, present = read_entry(tier, text, with_blob=False)
    if present:
        row = Row(text, rec, None if rec is not None else "unreadable record")
        if model is None or row.model == model:
            return [row], "key"
        return [], "key"
    rows = [r for r in scan(tier)
            if r.rec is not None and text in (r.rec.identifier, r.rec.mm_identifier)
            and (model is None or r.model == model)]
    return rows, "identifier"
