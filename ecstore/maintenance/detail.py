"""One entry in detail (``ecstore-dump show``): record, blob check, safetensors header.

Read-only: one short read transaction per entry (:func:`.entries.read_entry`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ecstore.errors import CorruptEntryError
from ecstore.format import blob_check
from ecstore.lmdb import LMDBTier
from ecstore.maintenance.entries import Row, entry_problem, read_entry


@dataclass(frozen=True)
class EntryDetail:
    """An entry as read for ``show``.

    ``row`` holds the record as re-read (None when unreadable). When the entry
    vanished between finding and reading it, ``present`` is False and nothing
    else is set. Sizes are in bytes.
    """

    row: Row
    present: bool
    #: Why the entry fails the check every read runs (None: ok).
    problem: str | None = None
    #: Size of the stored blob (None: no blob stored).
    blob_bytes: int | None = None
    #: The parsed safetensors header (JSON object), when readable.
    header: dict[str, Any] | None = None
    #: Length of the header's JSON text.
    header_bytes: int | None = None
    #: Offset of the tensor data in the blob.
    data_offset: int | None = None
    #: Why the header could not be parsed (None: parsed, or no blob).
    header_error: str | None = None


def entry_detail(tier: LMDBTier, row: Row) -> EntryDetail:
    """Re-read ``row``'s entry (record and blob) and check it."""
    rec, blob, present = read_entry(tier, row.key)
    fresh = Row(row.key, rec, row.error)
    if not present:
        return EntryDetail(fresh, False)
    problem = entry_problem(row.key, rec, blob)
    if blob is None:
        return EntryDetail(fresh, True, problem)
    try:
        hdr = blob_check.parse_header(blob)
    except CorruptEntryError as e:
        return EntryDetail(fresh, True, problem, len(blob), header_error=str(e))
    except Exception as e:  # noqa: BLE001 - a hostile header (wrong JSON types...)
        text = " ".join(str(e).split("\n")).replace("\r", " ")
        return EntryDetail(fresh, True, problem, len(blob), header_error=f"{type(e).__name__}: {text[:200]}")
    return EntryDetail(fresh, True, problem, len(blob), dict(hdr.raw), hdr.data_offset - 8, hdr.data_offset)
