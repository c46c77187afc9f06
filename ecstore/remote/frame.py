"""The remote value of one entry: the LMDB record and the safetensors blob.

``b"ECRV" | u8 version | u32 record length | record | zero padding | blob``,
the blob aligned to ALIGN bytes so a read can hand out a view. :func:`unpack`
checks the framing and record, :func:`check_value` a value on its own,
:func:`decode_entry` both plus the reader's identity; a failure is a miss
(:class:`ecstore.errors.CorruptEntryError`: delete it; :class:`ForeignValue`:
a valid value of another entry, keep it). Layout: docs/format.md#remote-values.
"""

from __future__ import annotations

import contextlib
import struct
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ecstore.errors import CorruptEntryError
from ecstore.format import Record, blob_check, blob_read, codec

MAGIC = b"ECRV"
VERSION = 1
ALIGN = 64
_HEAD = struct.Struct("<4sBI")


class ForeignValue(Exception):
    """A valid value that belongs to another identifier, model or dtype."""


@dataclass(frozen=True)
class RemoteEntry:
    """A verified remote value: the tensor (fresh CPU memory) and its blob."""

    tensor: torch.Tensor
    blob: memoryview  # the safetensors blob, for promotion to LMDB as is
    record: Record


def pack(identifier: str, blob: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> list[Any]:
    """The remote value of a blob, as buffers to send in order (no copy of the blob)."""
    n = len(memoryview(blob).cast("B"))
    now = time.time_ns()
    rec = Record(identifier, str(dtype).removeprefix("torch."), tuple(shape),
                 codec.tensor_nbytes_of(dtype, tuple(shape)), n, codec.checksum(blob), now, now, 0, 0)
    packed = codec.pack_record(rec)
    head = _HEAD.pack(MAGIC, VERSION, len(packed)) + packed
    return [head + bytes(-len(head) % ALIGN), blob]


def record_end(head: Any) -> int:
    """Bytes of a value up to the end of its record (from its first 9+ bytes)."""
    mv = memoryview(head).cast("B")
    if len(mv) < _HEAD.size:
        return _HEAD.size
    return int(_HEAD.size + _HEAD.unpack_from(mv, 0)[2])


def blob_start(head: Any) -> int:
    """Offset of the blob in a value (the record's end, rounded up to ALIGN)."""
    end = record_end(head)
    return end + (-end % ALIGN)


def unpack_record(head: Any) -> Record:
    """The record of a value from its first :func:`record_end` bytes (or more)."""
    mv = memoryview(head).cast("B")
    if len(mv) < _HEAD.size:
        raise CorruptEntryError("remote value shorter than its header")
    magic, version, rlen = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC or version != VERSION:
        raise CorruptEntryError(f"not an ecstore remote value (magic {bytes(magic)!r}, version {version})")
    if _HEAD.size + rlen > len(mv):
        raise CorruptEntryError("record length out of range")
    return codec.unpack_record(mv[_HEAD.size:_HEAD.size + rlen])


def unpack(value: Any) -> tuple[Record, memoryview]:
    """(record, blob view) of a remote value; CorruptEntryError if malformed."""
    mv = memoryview(value).cast("B")
    rec = unpack_record(mv)
    blob = mv[blob_start(mv):]
    if len(blob) != rec.blob_size:
        raise CorruptEntryError("blob size does not match its record")
    return rec, blob


@contextlib.contextmanager
def _as_corrupt(what: str) -> Iterator[None]:
    """Whatever a library raises on hostile bytes inside the block is a bad
    value: CorruptEntryError ("<what> remote value: ..."); CorruptEntryError
    and MemoryError pass as they are."""
    try:
        yield
    except (CorruptEntryError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001  (hostile bytes: whatever a library raises is a bad value)
        raise CorruptEntryError(f"{what} remote value: {type(e).__name__}: {e}") from None


def check_value(value: Any, *, key: str | None = None) -> tuple[Record, memoryview, blob_check.BlobHeader]:
    """(record, blob view, parsed header) of a remote value that checks out on
    its own: framing, record, the blob's size and checksum, its strict
    header, the record against the header (:func:`blob_check.check_entry`,
    the one entry check LMDB reads use too; with ``key``, the key's model
    and dtype against the header), and a tensor shape ``put`` stores
    (:func:`blob_check.check_put_shape`). Raises CorruptEntryError naming
    the first failure, never another exception but MemoryError."""
    with _as_corrupt("unreadable"):
        rec, blob = unpack(value)
        hdr = blob_check.check_entry(rec, blob, key=key)
        return rec, blob, blob_check.check_put_shape(hdr)


def decode_entry(value: Any, *, identifier: str, model: str, dtype_name: str) -> RemoteEntry:
    """Verify a remote value for (identifier, model, dtype) and decode it.

    Integrity comes first (:func:`check_value`): a value that fails it
    raises CorruptEntryError, whatever identity its record claims (one
    flipped bit in the record's identifier is damage, not another entry).
    Only a value that passes it and belongs to another identifier, model,
    dtype or record version raises ForeignValue. Raises nothing else but
    MemoryError: whatever torch or numpy raise on a value is CorruptEntryError.
    """
    rec, blob, hdr = check_value(value)
    if rec.version != codec.RECORD_VERSION:
        raise ForeignValue(f"holds a record of version {rec.version} (no encoder identity)")
    if hdr.identifier != identifier or hdr.dtype != dtype_name:
        raise ForeignValue(f"holds identifier {hdr.identifier!r} dtype {hdr.dtype}")
    if hdr.model != model:
        raise ForeignValue(f"holds an entry of model {hdr.model!r}")
    with _as_corrupt("undecodable"):  # torch/numpy on a value that passed the checks
        return RemoteEntry(_view(blob, hdr), blob, rec)


def _view(blob: memoryview, hdr: blob_check.BlobHeader) -> torch.Tensor:
    """The verified tensor as a view of the reply's bytes (no copy) when its
    data is aligned for its dtype, else a copy. The reply buffer is owned by
    the view alone: nothing else sees a write to it (treat it as read-only,
    like a memory-tier hit)."""
    dtype = getattr(torch, hdr.dtype)
    addr = np.frombuffer(blob, dtype=np.uint8, count=0, offset=hdr.data_offset).__array_interface__["data"][0]
    if addr % dtype.itemsize:
        return blob_read.decode(blob, expected_checksum=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given buffer is not writable"
        raw = torch.frombuffer(blob, dtype=torch.uint8, count=hdr.data_nbytes, offset=hdr.data_offset)
    return raw.view(dtype).view(hdr.shape) if dtype != torch.uint8 else raw.view(hdr.shape)
