"""Entry records: the metadata stored beside each blob (same transaction).

A record is a little-endian struct (fixed part + shape + dtype +
identifier) so reads on the hot path (``contains``) cost well under a
microsecond to parse. Pure functions and frozen records: thread-safe.
:mod:`ecstore.format.codec` re-exports every name here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import Any

from ecstore.errors import CorruptEntryError
from ecstore.identity import split_stored

#: Version 2 records hold a stored name ``"<namespace>/<mm identifier>"``
#: (see ecstore.identity); version 1 records (schema <= 2) hold a bare mm
#: identifier, have no identity and are never served. Same layout.
RECORD_VERSION = 2
LEGACY_RECORD_VERSION = 1
_REC = struct.Struct("<BQQQQQQQBHI")  # version, created_ns, last_access_ns, hits, lru_seq,
#                                       nbytes, blob_size, checksum, ndim, dtype_len, ident_len


@dataclass(frozen=True)
class Record:
    """Metadata kept beside each blob (same transaction).

    Times are nanoseconds since the epoch; ``nbytes`` is the tensor's data
    size, ``blob_size`` the stored safetensors size (what the disk cap
    counts); ``lru_seq`` orders eviction (smallest = least recently used).
    """

    identifier: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    blob_size: int
    checksum: int
    created_ns: int
    last_access_ns: int
    hits: int
    lru_seq: int
    version: int = RECORD_VERSION

    @property
    def namespace(self) -> str | None:
        """The entry's encoder identity (namespace); None: written without one."""
        if self.version == LEGACY_RECORD_VERSION:
            return None
        return split_stored(self.identifier).namespace

    @property
    def mm_identifier(self) -> str:
        """vLLM's item identifier, without the namespace."""
        if self.version == LEGACY_RECORD_VERSION:
            return self.identifier
        return split_stored(self.identifier).identifier

    def touched(self, now_ns: int, seq: int, hits: int = 1) -> Record:
        return replace(self, last_access_ns=max(self.last_access_ns, now_ns), hits=self.hits + hits, lru_seq=seq)


def pack_record(r: Record) -> bytes:
    dt = r.dtype.encode("ascii")
    ident = r.identifier.encode("utf-8")
    return b"".join(
        (
            _REC.pack(r.version, r.created_ns, r.last_access_ns, r.hits, r.lru_seq, r.nbytes,
                      r.blob_size, r.checksum, len(r.shape), len(dt), len(ident)),
            struct.pack(f"<{len(r.shape)}Q", *r.shape),
            dt,
            ident,
        )
    )


def unpack_record(data: Any) -> Record:
    mv = memoryview(data)
    try:
        (ver, created, last, hits, seq, nbytes, bsize, csum, ndim, dlen, ilen) = _REC.unpack_from(mv, 0)
        if ver != RECORD_VERSION and ver != LEGACY_RECORD_VERSION:
            raise CorruptEntryError(f"unknown record version {ver}")
        shape_fmt = _SHAPE.get(ndim)
        shape = (struct.unpack_from(f"<{ndim}Q", mv, _REC.size) if shape_fmt is None
                 else shape_fmt.unpack_from(mv, _REC.size))
        off = _REC.size + 8 * ndim
        end = off + dlen
        dtype = str(mv[off:end], "ascii")
        ident = str(mv[end:end + ilen], "utf-8")
        if end + ilen != len(mv):
            raise CorruptEntryError("record length mismatch")
    except CorruptEntryError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CorruptEntryError(f"malformed record: {e}") from None
    # The fields set at once, as Record's own __init__ would (it is a frozen
    # dataclass: eleven object.__setattr__ calls, the larger part of a decode).
    rec = _new_record(Record)
    _set_fields(rec, "__dict__", {"identifier": ident, "dtype": dtype, "shape": shape, "nbytes": nbytes,
                                  "blob_size": bsize, "checksum": csum, "created_ns": created,
                                  "last_access_ns": last, "hits": hits, "lru_seq": seq, "version": ver})
    return rec


_SHAPE = {n: struct.Struct(f"<{n}Q") for n in range(1, 5)}  # the shape formats of common ranks
_new_record = object.__new__
_set_fields = object.__setattr__


def record_readable(data: Any) -> bool:
    """True if ``data`` unpacks as a record (see :func:`unpack_record`)."""
    try:
        unpack_record(data)
    except CorruptEntryError:
        return False
    return True


def record_identifier(data: Any, version: int = RECORD_VERSION) -> str | None:
    """Only the identifier of a packed record (fast path for ``contains``);
    None for a record of another ``version`` (a legacy entry is never served)."""
    mv = memoryview(data)
    if len(mv) < _REC.size:
        return None
    fields = _REC.unpack_from(mv, 0)
    if fields[0] != version:
        return None
    off = _REC.size + 8 * fields[8] + fields[9]
    try:
        return str(mv[off : off + fields[10]], "utf-8")
    except UnicodeDecodeError:
        return None
