"""Bytes <-> tensors: the one place ecstore interprets stored bytes.

Blob format
-----------
Each entry's blob is a valid safetensors file holding one tensor named
``"ec"``, with ``__metadata__``::

    {"format": "ecstore/1", "identifier": <full mm identifier>,
     "model": <model>, "dtype": <torch dtype name>, "shape": "[n, h]"}

Tensors whose dtype safetensors has no code for (e.g. ``float8_e8m0fnu``) are
stored as ``U8`` bytes with shape ``[nbytes]``; ``__metadata__`` then carries
the real dtype and shape, and ``decode`` reinterprets the bytes. Any
safetensors reader can open every blob.

We write the safetensors framing ourselves rather than calling
``safetensors.torch.save``: that way the tensor bytes are copied exactly once
(into the blob) instead of two or three times; tests check that the library
reads our output back bit-exact.

Record format
-------------
The eviction/metadata record stored beside each blob is a little-endian
struct (fixed part + shape + dtype + identifier) so reads on the hot path
(``contains``) cost well under a microsecond to parse.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import xxhash

from .errors import InvalidEntryError
from .identity import split_stored

FORMAT = "ecstore/1"
TENSOR_NAME = "ec"

# torch dtype -> safetensors dtype code (those safetensors defines).
_ST_CODE: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.complex64: "C64",
}


def checksum(data: Any) -> int:
    """xxh3-64 of a bytes-like object (the blob checksum)."""
    return xxhash.xxh3_64_intdigest(data)


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _raw_bytes_view(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor's bytes (no copy)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy() if t.dtype != torch.uint8 else flat.numpy()


def header_bytes(tensor: torch.Tensor, identifier: str, model: str) -> bytes:
    """The safetensors header of ``tensor``'s blob, padded to 8 bytes. The
    blob is ``8 + len(header) + tensor bytes`` long; its data starts at
    ``8 + len(header)``."""
    dtype_name = str(tensor.dtype).removeprefix("torch.")
    nbytes = tensor_nbytes(tensor)
    code = _ST_CODE.get(tensor.dtype)
    st_shape = list(tensor.shape) if code else [nbytes]
    header = {
        TENSOR_NAME: {"dtype": code or "U8", "shape": st_shape, "data_offsets": [0, nbytes]},
        "__metadata__": {
            "format": FORMAT,
            "identifier": identifier,
            "model": model,
            "dtype": dtype_name,
            "shape": json.dumps(list(tensor.shape)),
        },
    }
    hbytes = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return hbytes + b" " * (-len(hbytes) % 8)  # safetensors aligns the data to 8 bytes


def blob_size(tensor: torch.Tensor, *, identifier: str, model: str) -> int:
    """``len(encode(tensor, ...))`` without building the blob (header only)."""
    return 8 + len(header_bytes(tensor, identifier, model)) + tensor_nbytes(tensor)


#: A blob under construction: a writable, C-contiguous uint8 numpy array (any
#: bytes-like object is accepted where blobs are read).
Blob = np.ndarray


def encode(tensor: torch.Tensor, *, identifier: str, model: str, header: bytes | None = None) -> Blob:
    """Serialize a tensor into a safetensors blob with exactly one copy of its
    data: from any device and any strides straight into the blob. ``header``
    is ``header_bytes(tensor, identifier, model)`` if the caller has it.

    The blob's memory comes from torch's allocator, not ``bytearray(n)``:
    that would zero-fill every page before the copy writes it again (a
    second pass over 100+ MB), and numpy's allocator asks for huge pages,
    which costs compaction stalls on machines with THP in ``madvise`` mode.
    """
    nbytes = tensor_nbytes(tensor)
    hbytes = header_bytes(tensor, identifier, model) if header is None else header
    off = 8 + len(hbytes)
    blob = torch.empty(off + nbytes, dtype=torch.uint8).numpy()
    struct.pack_into("<Q", blob, 0, len(hbytes))
    blob[8:off] = np.frombuffer(hbytes, dtype=np.uint8)
    if nbytes:
        # torch's copy releases the GIL (numpy's does not): the background
        # writer encoding a 100 MB blob must not stall the model-runner thread.
        blob_tensor(blob, off, tensor.dtype, tuple(tensor.shape)).copy_(tensor.detach())
    return blob


def blob_tensor(blob: Any, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor viewing the data of a writable blob (no copy; keeps it alive)."""
    count = tensor_nbytes_of(dtype, shape)
    raw = torch.frombuffer(blob, dtype=torch.uint8, count=count, offset=offset)
    return raw.view(dtype).view(shape) if dtype != torch.uint8 else raw.view(shape)


def tensor_nbytes_of(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of data of a tensor of ``dtype`` and ``shape``."""
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


@dataclass(frozen=True)
class BlobHeader:
    identifier: str
    model: str
    dtype: str
    shape: tuple[int, ...]
    data_offset: int
    data_nbytes: int
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)


class CorruptBlobError(Exception):
    """A blob failed its checksum or header check (internal; becomes a miss)."""


def parse_header(blob: Any) -> BlobHeader:
    """Parse and sanity-check a blob's safetensors header (no data read)."""
    mv = memoryview(blob)
    if len(mv) < 8:
        raise CorruptBlobError("blob shorter than its length prefix")
    (hlen,) = struct.unpack_from("<Q", mv, 0)
    if hlen > len(mv) - 8 or hlen > 1 << 20:
        raise CorruptBlobError(f"header length {hlen} out of range")
    try:
        header = json.loads(bytes(mv[8 : 8 + hlen]))
        meta = header["__metadata__"]
        info = header[TENSOR_NAME]
        if meta.get("format") != FORMAT:
            raise CorruptBlobError(f"unknown blob format {meta.get('format')!r}")
        start, end = (int(x) for x in info["data_offsets"])
        shape = tuple(int(x) for x in json.loads(meta["shape"]))
        hdr = BlobHeader(meta["identifier"], meta["model"], meta["dtype"], shape,
                         8 + hlen + start, end - start, header)
    except CorruptBlobError:
        raise
    except Exception as e:  # malformed JSON / missing fields / wrong types
        raise CorruptBlobError(f"malformed header: {e}") from None
    if hdr.data_offset + hdr.data_nbytes != len(mv):
        raise CorruptBlobError("data length does not match the blob size")
    dt = getattr(torch, hdr.dtype, None)
    if not isinstance(dt, torch.dtype):
        raise CorruptBlobError(f"unknown dtype {hdr.dtype!r}")
    if tensor_nbytes_of(dt, shape) != hdr.data_nbytes:
        raise CorruptBlobError("shape and dtype do not match the data length")
    return hdr


def decode(blob: Any, *, expected_checksum: int | None, identifier: str | None = None) -> torch.Tensor:
    """Verify and copy a blob's tensor out into fresh CPU memory.

    ``blob`` may be a memoryview into the LMDB map (only valid inside its read
    transaction): the returned tensor never aliases it. Raises
    :class:`CorruptBlobError` on a checksum, header or identifier mismatch.
    """
    if expected_checksum is not None and checksum(blob) != expected_checksum:
        raise CorruptBlobError("checksum mismatch")
    hdr = parse_header(blob)
    if identifier is not None and hdr.identifier != identifier:
        raise CorruptBlobError("identifier in blob does not match the record")
    dt = getattr(torch, hdr.dtype)
    out = torch.empty(hdr.shape, dtype=dt)
    if hdr.data_nbytes:
        _raw_bytes_view(out)[:] = np.frombuffer(blob, dtype=np.uint8, count=hdr.data_nbytes,
                                                offset=hdr.data_offset)
    return out


def check_storable(tensor: object) -> None:
    """Raise InvalidEntryError unless ``tensor`` is a dense 2-D non-empty tensor
    whose bytes can be stored (any plain dtype; quantized, sparse, meta,
    nested tensors refused)."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidEntryError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_quantized:
        raise InvalidEntryError("quantized tensors cannot be stored; dequantize first")
    if tensor.layout != torch.strided:
        raise InvalidEntryError(f"only dense (strided) tensors can be stored, got layout {tensor.layout}")
    if tensor.is_meta or tensor.device.type == "meta":
        raise InvalidEntryError("meta tensors have no data to store")
    if getattr(tensor, "is_nested", False):
        raise InvalidEntryError("nested tensors cannot be stored")
    if tensor.dim() != 2:
        raise InvalidEntryError(
            f"encoder outputs are 2-D [num_tokens, hidden]; got shape {tuple(tensor.shape)}"
        )
    if tensor.numel() == 0:
        raise InvalidEntryError(f"empty tensor (shape {tuple(tensor.shape)}) cannot be stored")
    if tensor.dtype.is_complex and tensor.dtype not in _ST_CODE:
        raise InvalidEntryError(f"dtype {tensor.dtype} is not supported")


# --------------------------------------------------------------------------
# Entry records
# --------------------------------------------------------------------------

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

    def touched(self, now_ns: int, seq: int, hits: int = 1) -> "Record":
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
        if ver not in (RECORD_VERSION, LEGACY_RECORD_VERSION):
            raise CorruptBlobError(f"unknown record version {ver}")
        off = _REC.size
        shape = struct.unpack_from(f"<{ndim}Q", mv, off)
        off += 8 * ndim
        dtype = bytes(mv[off : off + dlen]).decode("ascii")
        off += dlen
        ident = bytes(mv[off : off + ilen]).decode("utf-8")
        if off + ilen != len(mv):
            raise CorruptBlobError("record length mismatch")
    except CorruptBlobError:
        raise
    except Exception as e:
        raise CorruptBlobError(f"malformed record: {e}") from None
    return Record(ident, dtype, tuple(shape), nbytes, bsize, csum, created, last, hits, seq, ver)


def record_identifier(data: Any, version: int = RECORD_VERSION) -> str | None:
    """Only the identifier of a packed record (fast path for ``contains``);
    None for a record of another ``version`` (a legacy entry is never served)."""
    mv = memoryview(data)
    if len(mv) < _REC.size:
        return None
    ver, *_rest, ndim, dlen, ilen = _REC.unpack_from(mv, 0)
    if ver != version:
        return None
    off = _REC.size + 8 * ndim + dlen
    try:
        return bytes(mv[off : off + ilen]).decode("utf-8")
    except UnicodeDecodeError:
        return None
