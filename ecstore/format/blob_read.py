"""Copying a stored tensor out of its blob, checked: the read side of
:mod:`ecstore.format.codec` (which checks headers and entries and builds blobs).

Every function returns a tensor in CPU memory nothing else references (never
aliasing ``blob``, which may be a view of the LMDB map valid only inside its
read transaction), or raises :class:`~ecstore.errors.CorruptEntryError`:
no byte of a blob that failed a check reaches the caller
(:func:`check_file_entry` makes the same checks and returns nothing). Pure
functions; thread-safe.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import stat
import struct
import threading
from typing import Any

import numpy as np
import torch
import xxhash

from ecstore.errors import CorruptEntryError
from ecstore.format import split_read
from ecstore.format.blob_check import (
    MAX_HEADER_BYTES,
    BlobHeader,
    check_entry,
    check_shape,
    parse_header,
    storable_dtype,
)
from ecstore.format.codec import checksum, raw_bytes_view, tensor_nbytes, tensor_nbytes_of
from ecstore.format.record import Record
from ecstore.pool import POOL


def _destination(blob: Any, hdr: BlobHeader, size: int | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """The tensor ``hdr``'s data is copied into (pool memory nothing else
    references) and a uint8 numpy view of its bytes, once the header's
    dtype and sizes are checked against ``blob`` (of ``size`` bytes if
    given: ``blob`` is then only its beginning)."""
    dt = storable_dtype(hdr.dtype)
    if dt is None:
        raise CorruptEntryError(f"dtype {hdr.dtype!r} is not a storable torch dtype")
    if hdr.data_offset + hdr.data_nbytes != (len(memoryview(blob).cast("B")) if size is None else size):
        raise CorruptEntryError("header sizes do not match the blob")  # parse_header prevents this
    out = POOL.empty(hdr.shape, dt)
    if tensor_nbytes(out) != hdr.data_nbytes:
        raise CorruptEntryError("header sizes do not match the blob")
    return out, raw_bytes_view(out)


def copy_out(blob: Any, hdr: BlobHeader) -> torch.Tensor:
    """The tensor of a blob whose header ``hdr`` passed :func:`parse_header`,
    copied (one copy) into CPU memory nothing else references (never aliases
    ``blob``): reused, already-faulted memory from :data:`ecstore.pool.POOL`
    when a slab is free, which saves the page faults of fresh memory."""
    out, dst = _destination(blob, hdr)
    if hdr.data_nbytes:
        dst[:] = np.frombuffer(blob, dtype=np.uint8, count=hdr.data_nbytes, offset=hdr.data_offset)
    return out


#: Entries whose data is larger than two of these are copied out and
#: checksummed in chunks of this many bytes (bytes): each chunk is hashed
#: right after it was copied, while it is still in the CPU cache, instead of
#: hashing the whole blob from memory first and then copying it; smaller
#: chunks did worse (docs/benchmarks.md, "Figures behind constants").
FUSED_CHUNK = 1 << 20


def read_entry(rec: Record, blob: Any, *, identifier: str | None = None, model: str | None = None,
               dtype: torch.dtype | str | None = None, key: str | None = None) -> torch.Tensor:
    """:func:`check_entry`, then the tensor copied out of ``blob`` (fresh CPU
    memory). Raises only :class:`CorruptEntryError`; never returns a tensor
    whose blob failed a check.

    An entry larger than ``2 * FUSED_CHUNK`` is checked without its checksum
    first, then copied out chunk by chunk, each chunk fed to the checksum
    after the copy (``ctypes.memmove``, which releases the GIL); a mismatch
    at the end raises (the copy is dropped)."""
    if rec.nbytes <= 2 * FUSED_CHUNK:
        return copy_out(blob, check_entry(rec, blob, identifier=identifier, model=model, dtype=dtype, key=key))
    hdr = check_entry(rec, blob, identifier=identifier, model=model, dtype=dtype, key=key,
                      checksum_by_caller=True)
    out = _copy_out_hashed(blob, hdr, rec.checksum)
    if out is None:
        raise CorruptEntryError("checksum mismatch")
    return out


def _copy_out_hashed(blob: Any, hdr: BlobHeader, expected: int) -> torch.Tensor | None:
    """:func:`copy_out` fused with the blob's checksum: the header bytes and
    then each copied chunk feed one xxh3-64; None (the copy dropped) unless
    it equals ``expected``. ``ctypes.memmove`` releases the GIL and, unlike a
    torch tensor over ``blob`` (a read-only view of the LMDB map), needs no
    writable buffer."""
    out, dst = _destination(blob, hdr)
    mv = memoryview(blob).cast("B")
    h = xxhash.xxh3_64(mv[:hdr.data_offset])
    src_addr = np.frombuffer(mv, dtype=np.uint8).ctypes.data + hdr.data_offset
    dst_addr = dst.ctypes.data
    n = hdr.data_nbytes
    memmove, update = ctypes.memmove, h.update
    for i in range(0, n, FUSED_CHUNK):
        c = min(FUSED_CHUNK, n - i)
        memmove(dst_addr + i, src_addr + i, c)
        update(dst[i:i + c])  # type: ignore[arg-type]  # ndarray has the buffer protocol
    return out if h.intdigest() == expected else None


def read_file_entry(rec: Record, fd: int, *, identifier: str | None = None, model: str | None = None,
                    dtype: torch.dtype | str | None = None, key: str | None = None,
                    split_from: int | None = None) -> torch.Tensor:
    """:func:`read_entry` for a blob kept in a file (``fd``, open for
    reading; the caller closes it). The file must be exactly the record's
    ``blob_size``; its beginning (length prefix and header) is read and
    checked like an LMDB blob's, then the data is read straight into the
    destination (``os.preadv``, which releases the GIL) in
    :data:`FUSED_CHUNK` pieces, each fed to the checksum right after it was
    read (with ``split_from`` bytes of data or more, by the caller and a
    helper thread: :mod:`ecstore.format.split_read`). Raises only :class:`CorruptEntryError` (a short file, an I/O
    error, a checksum or header mismatch); never returns a tensor whose
    blob failed a check."""
    with _file_errors:
        size = _file_size(rec, fd)
        head_len = size - rec.nbytes  # where the record says the data starts
        if rec.nbytes <= 2 * FUSED_CHUNK and 8 <= head_len <= 8 + MAX_HEADER_BYTES:
            return _read_whole_file(rec, fd, size, head_len, identifier=identifier, model=model,
                                    dtype=dtype, key=key)
        head, hdr = _file_header(rec, fd, size, identifier=identifier, model=model, dtype=dtype, key=key)
        out, dst = _destination(head, hdr, size)
        h = xxhash.xxh3_64(head)
        n, preadv, update = hdr.data_nbytes, os.preadv, h.update
        mv = memoryview(dst)  # type: ignore[arg-type]  # ndarray has the buffer protocol on 3.11 too
        if split_from is not None and n >= split_from:
            split_read.read_hashed(fd, mv[:n], hdr.data_offset, update, FUSED_CHUNK)
        else:
            for i in range(0, n, FUSED_CHUNK):
                c = min(FUSED_CHUNK, n - i)
                if preadv(fd, [mv[i:i + c]], hdr.data_offset + i) != c:  # short: the file shrank under us
                    split_read.read_exactly(fd, mv[i:i + c], hdr.data_offset + i)
                update(mv[i:i + c])
    if h.intdigest() != rec.checksum:
        raise CorruptEntryError("checksum mismatch")
    return out


def check_file_entry(rec: Record, fd: int, *, identifier: str | None = None, model: str | None = None,
                     dtype: torch.dtype | str | None = None, key: str | None = None) -> None:
    """Every check :func:`read_file_entry` makes, without the copy: the
    file's beginning is read and checked the same way, then its data is fed
    to the checksum :data:`FUSED_CHUNK` bytes at a time through one buffer
    per thread (no memory of the entry's size is taken, and the CPU caches
    hold one chunk, not the entry). For a verification that keeps nothing
    (the scheduler's, before it promises an entry). Returns if the entry
    passes; raises only :class:`CorruptEntryError`. Thread-safe."""
    with _file_errors:
        size = _file_size(rec, fd)
        head, hdr = _file_header(rec, fd, size, identifier=identifier, model=model, dtype=dtype, key=key)
        h = xxhash.xxh3_64(head)
        buf = _scratch()
        offset, preadv, update = hdr.data_offset, os.preadv, h.update
        while offset < size:
            got = preadv(fd, [buf[:min(FUSED_CHUNK, size - offset)]], offset)
            if got == 0:
                raise EOFError("blob file shorter than its record")
            update(buf[:got])
            offset += got
    if h.intdigest() != rec.checksum:
        raise CorruptEntryError("checksum mismatch")


class _FileErrors:
    """A blob file read's EOFError (shorter than its record) or OSError
    re-raised as :class:`CorruptEntryError`: to the caller the entry is
    unusable. A class, not a generator: it is on every file hit's path."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: object) -> None:
        if isinstance(e, EOFError):
            raise CorruptEntryError(str(e)) from None
        if isinstance(e, OSError):
            raise CorruptEntryError(f"blob file unreadable: {os.strerror(e.errno or errno.EIO)}") from None


_file_errors = _FileErrors()


_scratch_of_thread = threading.local()


def _scratch() -> memoryview:
    """This thread's :data:`FUSED_CHUNK`-byte buffer for :func:`check_file_entry`."""
    buf = getattr(_scratch_of_thread, "buf", None)
    if buf is None:
        buf = _scratch_of_thread.buf = memoryview(bytearray(FUSED_CHUNK))
    return buf


def _file_size(rec: Record, fd: int) -> int:
    """The size of the blob file ``fd`` if it is a regular file of the
    record's ``blob_size``; else CorruptEntryError (OSError from ``fstat``)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise CorruptEntryError("blob file is not a regular file")
    size = st.st_size
    if size != rec.blob_size:
        raise CorruptEntryError(f"blob file is {size} bytes, its record says {rec.blob_size}")
    if size < 8:
        raise CorruptEntryError("blob file shorter than its length prefix")
    return size


def _file_header(rec: Record, fd: int, size: int, **expect: Any) -> tuple[bytearray, BlobHeader]:
    """The beginning of a blob file of ``size`` bytes (length prefix and
    header) and its header, checked against ``rec`` and ``expect`` as
    :func:`check_entry` does (the checksum left to the caller); else
    CorruptEntryError (EOFError for a file shorter than its prefix says)."""
    (hlen,) = struct.unpack("<Q", _pread_exact(fd, 8))
    if hlen > min(size - 8, MAX_HEADER_BYTES):
        raise CorruptEntryError(f"header length {hlen} out of range")
    head = _pread_exact(fd, 8 + hlen)
    return head, check_entry(rec, head, checksum_by_caller=True, size=size, **expect)


def _read_whole_file(rec: Record, fd: int, size: int, head_len: int, *, identifier: str | None,
                     model: str | None, dtype: torch.dtype | str | None, key: str | None) -> torch.Tensor:
    """:func:`read_file_entry` of a small entry: one ``preadv`` of the whole
    file, its first ``head_len`` bytes (where the record says the data
    starts) into a header buffer and the rest straight into the destination
    (shaped after the record), then the header checked against the record
    and the checksum over both. A record that lies about the layout fails
    the header check; the destination is dropped with any failure."""
    dt, numel = _record_layout(rec.dtype, rec.shape, rec.nbytes)
    head = bytearray(head_len)
    if numel == 0:
        out = POOL.empty(rec.shape, dt)
        mv = memoryview(raw_bytes_view(out))  # type: ignore[arg-type]  # ndarray has the buffer protocol
    else:  # the destination's bytes straight from the pool; the tensor over them made after the read
        buf = POOL.buffer(rec.nbytes)
        mv = memoryview(buf)  # type: ignore[arg-type]  # ndarray has the buffer protocol
    if os.preadv(fd, [head, mv], 0) != size:  # short (the file shrank under us): again, or CorruptEntryError
        split_read.read_exactly(fd, memoryview(head), 0)
        split_read.read_exactly(fd, mv, head_len)
    hdr = check_entry(rec, head, identifier=identifier, model=model, dtype=dtype, key=key,
                      checksum_by_caller=True, size=size)
    if hdr.data_offset != head_len:  # implied by the checks above; kept explicit
        raise CorruptEntryError("header sizes do not match the record")
    h = xxhash.xxh3_64(head)
    h.update(mv)
    if h.intdigest() != rec.checksum:
        raise CorruptEntryError("checksum mismatch")
    if numel == 0:
        return out
    # One torch call, as POOL.empty makes it: the tensor holds the pool's array.
    t = torch.frombuffer(buf, dtype=dt, count=numel)
    return t.view(rec.shape) if len(rec.shape) != 1 else t


@functools.lru_cache(maxsize=1024)
def _record_layout(dtype: str, shape: tuple[int, ...], nbytes: int) -> tuple[torch.dtype, int]:
    """The torch dtype and element count of a record's tensor, if its dtype,
    shape and data bytes agree (else CorruptEntryError, never cached). A
    pure function of a few shapes: cached."""
    dt = storable_dtype(dtype)
    if dt is None or tensor_nbytes_of(dt, check_shape(shape, "record shape")) != nbytes:
        raise CorruptEntryError("record's dtype and shape do not match its data bytes")
    return dt, nbytes // dt.itemsize


def _pread_exact(fd: int, n: int) -> bytearray:
    """The first ``n`` bytes of ``fd``; EOFError if the file is shorter
    (read_file_entry reports it as CorruptEntryError)."""
    data = bytearray(n)
    split_read.read_exactly(fd, memoryview(data), 0)
    return data


def decode(blob: Any, *, expected_checksum: int | None, identifier: str | None = None) -> torch.Tensor:
    """Verify and copy a blob's tensor out into fresh CPU memory.

    ``blob`` may be a memoryview into the LMDB map (only valid inside its read
    transaction): the returned tensor never aliases it. Raises
    :class:`CorruptEntryError` on a checksum, header or identifier mismatch.
    Stored entries are read with :func:`read_entry`, which also checks the
    record and what the caller expects.
    """
    if expected_checksum is not None and checksum(blob) != expected_checksum:
        raise CorruptEntryError("checksum mismatch")
    hdr = parse_header(blob)
    if identifier is not None and hdr.identifier != identifier:
        raise CorruptEntryError("identifier in blob does not match the record")
    return copy_out(blob, hdr)
