"""The store's integrity check: the one place that knows what a sound store
is. ``ecstore-dump verify`` (:func:`ecstore.maintenance.verify`) and the
test audit (:func:`ecstore.testing.faults.audit`) both run it.

Invariants (each reported, none raised):

* every entry: a readable record, a blob (inline, or a file whose length
  is its pointer's), and the entry check of ``get``
  (:func:`entry_problem`: length, checksum, strict header, record matching
  the header; with ``ec_keys``, the EC key's model and dtype too);
* the sub-databases agree: as many blobs and LRU rows as records; the
  ``files`` index (schema 4) names exactly the blob files the pointers name;
* with ``one_snapshot`` (everything from one read transaction, so exact):
  each entry's LRU row points to it; ``meta total_bytes`` == sum of record
  blob sizes == sum of blob lengths; total <= ``cap``; ``data.mdb`` no
  larger than the LMDB map. Blob files nobody points to are listed (a
  crash leaves them until a read-write open sweeps them; not a problem).

Without ``one_snapshot`` each entry is read in its own short read
transaction, safe while vLLM writes (an entry removed meanwhile counts as
``vanished``, not damaged). Read-only: changes nothing; reads every blob once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ecstore.errors import CorruptEntryError
from ecstore.format import Record, blob_check, checksum, parse_header, unpack_record
from ecstore.lmdb.reads import TierReads
from ecstore.lmdb.txn import _SEQ, _U64, file_ref


@dataclass
class BadEntry:
    """An entry that failed the entry check."""

    key: str
    #: The entry's mm identifier, None when its record is unreadable.
    identifier: str | None
    #: One-line reason (:func:`entry_problem`).
    error: str


@dataclass
class StoreCheck:
    """What :func:`check_store` found. ``checked`` counts entries read
    (``vanished`` ones were evicted or deleted between listing and reading
    them); ``problems`` are store-level inconsistencies. ``entries`` (key ->
    (mm identifier, blob size) of every readable record), ``total_bytes``
    (the meta counter, -1 if missing), ``unreferenced_files``, ``file_size``
    and ``map_size`` (bytes) are filled by a ``one_snapshot`` check only."""

    checked: int = 0
    vanished: int = 0
    bad: list[BadEntry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    entries: dict[str, tuple[str, int]] = field(default_factory=dict)
    total_bytes: int = 0
    #: Blob files in ``blobs/`` no entry references (left by a crash until a
    #: read-write open sweeps them; not a problem by themselves).
    unreferenced_files: list[str] = field(default_factory=list)
    file_size: int = 0
    map_size: int = 0

    @property
    def ok(self) -> int:
        return self.checked - len(self.bad)

    @property
    def clean(self) -> bool:
        return not self.bad and not self.problems

    @property
    def identifiers(self) -> dict[str, int]:
        """identifier -> blob size."""
        return {ident: size for ident, size in self.entries.values()}


def entry_problem(key: str, rec: Record | None, blob: Any, *, ec_key: bool = True) -> str | None:
    """None if the entry is sound, else a one-line reason.

    A thin wrapper over :func:`ecstore.format.blob_check.check_entry` (the entry check
    every ``get`` runs) with the entry's ``key`` (if ``ec_key``: the key's
    model and dtype must be the entry's), adding what only tooling
    sees: an unreadable record, a record without blob, the two checksums of
    a mismatch, and ``bad safetensors header:`` before a header problem.
    Never raises.
    """
    if rec is None:
        return "unreadable entry record"
    if blob is None:
        return "record without blob"
    try:
        blob_check.check_entry(rec, blob, key=key if ec_key else None)
        return None
    except CorruptEntryError as e:
        reason = str(e)
    if len(blob) == rec.blob_size:
        actual = checksum(blob)
        if actual != rec.checksum:
            return f"checksum mismatch (record {rec.checksum:016x}, blob {actual:016x})"
        try:
            parse_header(blob)
        except CorruptEntryError as e:
            return f"bad safetensors header: {e}"
    return reason


def _key_text(raw: bytes | memoryview) -> str:
    return bytes(raw).decode("utf-8", "surrogateescape")


def _unpack(raw: Any) -> Record | None:
    try:
        return unpack_record(raw)
    except CorruptEntryError:
        return None


def check_store(tier: TierReads, *, one_snapshot: bool = False, ec_keys: bool = True, cap: int | None = None,
                keys: Sequence[str] | None = None, on_entry: Callable[[], None] | None = None) -> StoreCheck:
    """Check the store's invariants (see the module docstring); ``keys``:
    the entries to read one by one (default: all, listed first; ignored
    with ``one_snapshot``); ``on_entry()`` after each entry."""
    if one_snapshot:
        return _check_one_snapshot(tier, ec_keys, cap, on_entry)
    result = StoreCheck()
    with tier.snapshot() as (txn, dbs):
        counts = {name: txn.stat(db)["entries"] for name, db in dbs.present("blobs", "entries", "lru", "files").items()}
        if dbs.files is not None:  # schema 4: the index of blob files matches the pointers
            with txn.cursor(db=dbs.blobs) as cur:
                pointers = {ref.name for v in cur.iternext(keys=False) if (ref := file_ref(v)) is not None}
            with txn.cursor(db=dbs.files) as cur:  # the same snapshot: other writers may commit meanwhile
                indexed = {bytes(n).decode("ascii", "replace") for n in cur.iternext(keys=True, values=False)}
            if pointers != indexed:
                result.problems.append(f"the files index ({counts['files']} rows) does not match the "
                                       f"{len(pointers)} blob-file pointers")
        if keys is None:
            with txn.cursor(db=dbs.entries) as cur:
                keys = [_key_text(k) for k in cur.iternext(keys=True, values=False)]
    _check_counts(counts, result.problems)
    for key in keys:
        k = key.encode("utf-8", "surrogateescape")
        with tier.snapshot() as (txn, dbs):  # one short transaction per entry
            raw = txn.get(k, db=dbs.entries)
            if raw is None:
                result.vanished += 1  # evicted or deleted since the key list was read
                if on_entry is not None:
                    on_entry()
                continue
            rec = _unpack(raw)
            value = txn.get(k, db=dbs.blobs)
            ref = None if value is None else file_ref(value)
            problem = entry_problem(key, rec, None if value is None else tier.resolve_blob(value), ec_key=ec_keys)
        if problem and ref is not None and not tier.points_to(k, ref):
            result.vanished += 1  # removed after our snapshot, its file deleted: no damage
        else:
            result.checked += 1
            if problem:
                result.bad.append(BadEntry(key, rec.mm_identifier if rec else None, problem))
        if on_entry is not None:
            on_entry()
    return result


def _check_counts(counts: dict[str, int], problems: list[str]) -> None:
    """Row counts of the sub-databases against the records'."""
    if counts["blobs"] != counts["entries"]:
        problems.append(f"{counts['blobs']} blobs but {counts['entries']} entry records")
    if "lru" in counts and counts["lru"] != counts["entries"]:
        problems.append(f"{counts['lru']} LRU index rows but {counts['entries']} entry records")


def _check_one_snapshot(tier: TierReads, ec_keys: bool, cap: int | None,
                        on_entry: Callable[[], None] | None) -> StoreCheck:
    a = StoreCheck()
    with tier.snapshot() as (txn, dbs):
        raw_total = txn.get(b"total_bytes", db=dbs.meta)
        a.total_bytes = _U64.unpack(raw_total)[0] if raw_total is not None else -1
        counts = {name: txn.stat(db)["entries"] for name, db in dbs.present("blobs", "entries", "lru", "files").items()}
        sum_rec = sum_blob = 0
        referenced: set[str] = set()
        with txn.cursor(db=dbs.entries) as cur:
            for k, raw in cur:
                key = _key_text(k)
                a.checked += 1
                if on_entry is not None:
                    on_entry()
                rec = _unpack(raw)
                blob = txn.get(k, db=dbs.blobs)
                if rec is not None:
                    sum_rec += rec.blob_size
                    a.entries[key] = (rec.mm_identifier, rec.blob_size)
                    if dbs.lru is not None and txn.get(_SEQ.pack(rec.lru_seq), db=dbs.lru) != bytes(k):
                        a.problems.append(f"{key}: LRU row {rec.lru_seq} missing or pointing elsewhere")
                if blob is not None:
                    ref = file_ref(blob)
                    if ref is not None:
                        referenced.add(ref.name)
                        blob = tier.resolve_blob(blob)
                        if len(blob) != ref.size:
                            a.problems.append(f"{key}: blob file {ref.name} is {len(blob)} bytes, "
                                              f"its pointer says {ref.size}")
                    sum_blob += len(blob)
                problem = entry_problem(key, rec, blob, ec_key=ec_keys)
                if problem:
                    a.bad.append(BadEntry(key, rec.mm_identifier if rec else None, problem))
        _check_counts(counts, a.problems)
        if not (a.total_bytes == sum_rec == sum_blob):
            a.problems.append(f"meta total_bytes {a.total_bytes} != sum of record sizes {sum_rec} "
                              f"or of blob lengths {sum_blob}")
        if dbs.files is not None:
            with txn.cursor(db=dbs.files) as cur:
                index = {bytes(n).decode("ascii", "replace") for n in cur.iternext(keys=True, values=False)}
            if index != referenced:
                a.problems.append(f"files index {sorted(index ^ referenced)[:5]} differs from the pointers")
        if os.path.isdir(tier.files.dir):
            a.unreferenced_files = sorted(n for n in os.listdir(tier.files.dir)
                                          if n.endswith(".ecb") and n not in referenced)
    info = tier.env_info()
    a.file_size, a.map_size = info["file_size"], info["map_size"]
    if cap is not None and a.total_bytes > cap:
        a.problems.append(f"total_bytes {a.total_bytes} exceeds the cap {cap}")
    if a.file_size > a.map_size:
        a.problems.append(f"data.mdb is {a.file_size} bytes, larger than the map ({a.map_size})")
    return a
