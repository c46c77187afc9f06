"""Bytes <-> tensors: the one place ecstore interprets stored bytes.

Blob format
-----------
Each entry's blob is a valid safetensors file holding one tensor named
``"ec"``, with ``__metadata__``::

    {"format": "ecstore/1", "identifier": <full mm identifier>,
     "model": <model>, "dtype": <torch dtype name>, "shape": "[n, h]"}

Tensors whose dtype safetensors has no code for (e.g. ``float8_e8m0fnu``) are
stored as ``U8`` bytes with shape ``[nbytes]``; ``__metadata__`` then carries
the real dtype and shape, and readers reinterpret the bytes. Any
safetensors reader can open every blob.

We write the safetensors framing ourselves rather than calling
``safetensors.torch.save``: that way the tensor bytes are copied exactly once
(into the blob) instead of two or three times; tests check that the library
reads our output back bit-exact.

Record format
-------------
The eviction/metadata record stored beside each blob lives in
:mod:`ecstore.record` (re-exported here: ``codec.Record``, ``pack_record``...).
Copying a checked tensor out of a blob (``read_entry``, ``decode``) lives in
:mod:`ecstore.blob_read`.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from .errors import CorruptEntryError, ECStoreError, InvalidEntryError
from .key import parse_key
from .pool import BufferPool
from .record import LEGACY_RECORD_VERSION as LEGACY_RECORD_VERSION
from .record import RECORD_VERSION as RECORD_VERSION
from .record import Record as Record
from .record import pack_record as pack_record
from .record import record_identifier as record_identifier
from .record import record_readable as record_readable
from .record import unpack_record as unpack_record

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


#: The tensor data of a blob written by :func:`encode` starts at a multiple
#: of this many bytes (safetensors asks for 8; 64 is a cache line: a copy
#: into or out of the blob runs at memcpy speed, ~2x faster at 1 MB than at
#: an offset of 8 on the benchmark VM). Readers accept any multiple of 8
#: (entries written before, and other writers). The header's JSON is padded
#: with spaces, which the safetensors format allows.
DATA_ALIGN = 64

_json_str = json.encoder.encode_basestring_ascii


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def header_bytes(tensor: torch.Tensor, identifier: str, model: str) -> bytes:
    """The safetensors header of ``tensor``'s blob, padded with spaces so the
    data starts at a multiple of :data:`DATA_ALIGN`. The blob is
    ``8 + len(header) + tensor bytes`` long; its data starts at
    ``8 + len(header)``.

    The JSON is that of ``json.dumps(header, separators=(",", ":"),
    ensure_ascii=True)`` (keys in the order below), formatted directly
    (tests compare the two)."""
    return blob_head(tensor.shape, tensor.dtype, identifier, model)[8:]


def blob_head(shape: tuple[int, ...], dtype: torch.dtype, identifier: str, model: str) -> bytes:
    """The first ``8 + len(header)`` bytes of the blob of a tensor of
    ``shape`` and ``dtype``: the header's length (little-endian u64), then
    :func:`header_bytes`. Everything but the identifier comes from a
    template cached per (shape, dtype, model) (:func:`_header_template`;
    ~1 µs instead of ~8 µs with the caches cold after a model step)."""
    before, after = _header_template(shape, dtype, model)
    text = before + _json_str(identifier) + after
    pad = -(8 + len(text)) % DATA_ALIGN
    return struct.pack("<Q", len(text) + pad) + text.encode("ascii") + b" " * pad


@functools.lru_cache(maxsize=1024)
def _header_template(shape: tuple[int, ...], dtype: torch.dtype, model: str) -> tuple[str, str]:
    """The header's JSON before and after the identifier's JSON string, for a
    blob of ``shape``, ``dtype`` and ``model`` (no tensor contents, no
    identifier: what every entry of that shape shares). Thread-safe (an
    ``lru_cache``, bounded)."""
    nbytes = tensor_nbytes_of(dtype, shape)
    code = _ST_CODE.get(dtype)
    st_shape = shape if code else (nbytes,)
    before = ('{"%s":{"dtype":"%s","shape":[%s],"data_offsets":[0,%d]},"__metadata__":{"format":"%s",'
              '"identifier":') % (TENSOR_NAME, code or "U8", ",".join(map(str, st_shape)), nbytes, FORMAT)
    after = ',"model":%s,"dtype":"%s","shape":"[%s]"}}' % (
        _json_str(model), _dtype_name(dtype), ", ".join(map(str, shape)))
    return before, after


def blob_size(tensor: torch.Tensor, *, identifier: str, model: str) -> int:
    """``len(encode(tensor, ...))`` without building the blob (header only)."""
    return 8 + len(header_bytes(tensor, identifier, model)) + tensor_nbytes(tensor)


#: A blob under construction: a writable, C-contiguous uint8 numpy array (any
#: bytes-like object is accepted where blobs are read).
Blob = np.ndarray


def encode(tensor: torch.Tensor, *, identifier: str, model: str, header: bytes | None = None,
           pool: BufferPool | None = None) -> Blob:
    """Serialize a tensor into a safetensors blob with exactly one copy of its
    data: from any device and any strides straight into the blob. ``header``
    is ``header_bytes(tensor, identifier, model)`` if the caller has it.
    See :func:`encode_view` for ``pool``."""
    return encode_view(tensor, identifier=identifier, model=model, header=header, pool=pool)[0]


def encode_view(tensor: torch.Tensor, *, identifier: str, model: str, header: bytes | None = None,
                pool: BufferPool | None = None, head: bytes | None = None) -> tuple[Blob, torch.Tensor]:
    """:func:`encode`, plus a CPU tensor viewing the blob's data (the copy of
    ``tensor``; it keeps the blob's memory alive).

    The blob's memory comes from torch's allocator, not ``bytearray(n)``:
    that would zero-fill every page before the copy writes it again (a
    second pass over 100+ MB), and numpy's allocator asks for huge pages,
    which costs compaction stalls on machines with THP in ``madvise`` mode.
    With ``pool`` it comes from that :class:`~ecstore.pool.BufferPool`:
    memory already faulted in, which nothing else references (a slab returns
    to the pool only when the blob, the view and every view of them are gone).
    ``head``: :func:`blob_head` of the tensor if the caller has it (else
    ``header``, else both are built here).
    """
    shape, dtype = tensor.shape, tensor.dtype
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if head is None:
        hbytes = header_bytes(tensor, identifier, model) if header is None else header
        head = struct.pack("<Q", len(hbytes)) + hbytes
    off = len(head)
    on_gpu = tensor.is_cuda
    # Few torch calls on this path: on a save each costs µs (more with the
    # caches cold after the model step), at 1 MB as much as the copy itself.
    if pool is not None and nbytes and shape:
        # A GPU tensor is copied into page-locked memory: D2H at full bandwidth.
        blob, view = pool.typed_buffer(off + nbytes, off, dtype, shape, pinned=on_gpu)
    else:
        blob = (torch.empty(off + nbytes, dtype=torch.uint8).numpy() if pool is None
                else pool.buffer(off + nbytes, pinned=on_gpu))
        view = (torch.frombuffer(blob, dtype=dtype, count=numel, offset=off).view(shape) if nbytes
                else torch.empty(shape, dtype=dtype))
    memoryview(blob)[:off] = head  # type: ignore[arg-type]
    src = tensor.detach() if tensor.requires_grad else tensor
    if nbytes and on_gpu and view.is_pinned():
        # An asynchronous D2H copy into the pinned blob, waited for on an event
        # recorded after it on the tensor's stream (nothing else is waited
        # for): the blob is complete before anyone else can see it.
        view.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(tensor.device))
        done.synchronize()
    elif nbytes:
        # torch's copy releases the GIL (numpy's does not): the background
        # writer encoding a 100 MB blob must not stall the model-runner thread.
        view.copy_(src)
    return blob, view


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


#: The former name of :class:`~ecstore.errors.CorruptEntryError` (kept for callers).
CorruptBlobError = CorruptEntryError


#: Largest accepted header (bytes) and dimension count / size of a tensor in
#: a blob: a header claiming more is damaged or hostile.
MAX_HEADER_BYTES = 1 << 20
MAX_NDIM = 8
MAX_DIM = 1 << 48


@functools.lru_cache(maxsize=None)
def storable_dtype(name: str) -> torch.dtype | None:
    """The torch dtype a blob may claim by ``name``, or None: only canonical
    names (``"float32"``, not the alias ``"float"``) of dtypes whose tensors
    are ``numel * itemsize`` plain bytes (no quantized dtypes)."""
    dt = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dt, torch.dtype) or str(dt) != f"torch.{name}":
        return None
    try:
        probe = torch.empty(1, dtype=dt)
    except Exception:
        return None
    if probe.is_quantized or probe.element_size() != dt.itemsize or dt.itemsize < 1:
        return None
    return dt


def _is_int(x: Any) -> bool:
    return type(x) is int  # not bool, not float


def _shape_of(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise CorruptBlobError(f"{what} is not a list of at most {MAX_NDIM} dimensions")
    return check_shape(tuple(value), what)


def check_shape(shape: tuple[Any, ...], what: str) -> tuple[int, ...]:
    """``shape`` if torch can make a tensor of it: at most MAX_NDIM integer
    dimensions in [0, MAX_DIM) whose product, zeros counted as ones, stays
    below 2**62 (torch's strides would overflow: ``(0, 2**47, 2**47)`` has
    no element yet cannot be allocated); CorruptBlobError otherwise."""
    if len(shape) > MAX_NDIM:
        raise CorruptBlobError(f"{what} is not a list of at most {MAX_NDIM} dimensions")
    if not all(_is_int(d) and 0 <= d < MAX_DIM for d in shape):
        raise CorruptBlobError(f"{what} {list(shape)!r} has a dimension that is not an integer in [0, 2**48)")
    span = 1
    for d in shape:
        span *= max(d, 1)
    if span >= 1 << 62:
        raise CorruptBlobError(f"{what} {list(shape)!r} spans more elements than a tensor can address")
    return shape


def parse_header(blob: Any, size: int | None = None) -> BlobHeader:
    """Parse and strictly check a blob's safetensors header (no data read).

    ``size``: the whole blob's length (bytes) when ``blob`` holds only its
    beginning (at least the length prefix and the header: a blob kept in a
    file, whose data is read later); default ``len(blob)``.

    Accepts exactly what :func:`encode` writes: one tensor ``"ec"`` plus
    ``__metadata__`` whose values are strings; a canonical, storable dtype
    name; a shape of non-negative integers whose byte count (numel x
    itemsize) is the data length; ``data_offsets == [0, data length]`` with
    the data right after the header up to the end of the blob; a safetensors
    dtype code and shape that agree with the real dtype and shape. Anything
    else raises :class:`CorruptBlobError` (never another exception).
    """
    try:
        mv = memoryview(blob).cast("B")
    except (TypeError, ValueError) as e:
        raise CorruptBlobError(f"not a bytes-like blob: {e}") from None
    total = len(mv) if size is None else size
    if len(mv) < 8 or total < 8:
        raise CorruptBlobError("blob shorter than its length prefix")
    (hlen,) = struct.unpack_from("<Q", mv, 0)
    if hlen > len(mv) - 8 or hlen > total - 8 or hlen > MAX_HEADER_BYTES:
        raise CorruptBlobError(f"header length {hlen} out of range")
    raw = bytes(mv[8 : 8 + hlen])
    if hlen > _PARSED_MAX_HEADER:
        return _parse_header(raw, hlen, total)
    hdr = _PARSED.get((raw, total))
    if hdr is None:
        hdr = _parse_header(raw, hlen, total)
        if set(hdr.raw["__metadata__"]) == _META_KEYS:  # what encode writes: a bounded dict
            if len(_PARSED) >= _PARSED_MAX:
                _PARSED.clear()
            _PARSED[(raw, total)] = hdr
    return hdr


#: Headers :func:`parse_header` accepted, by (header bytes, blob size): the
#: parse is a pure function of both, and a hit costs one dict lookup instead
#: of two JSON decodes and the checks (~8 µs a read). Bounded; thread-safe
#: (single dict operations under the GIL; a race only parses twice).
_PARSED: dict[tuple[bytes, int], BlobHeader] = {}
_PARSED_MAX = 1024
#: Only headers up to this many bytes, whose ``__metadata__`` holds just the
#: keys :func:`encode` writes, are kept (ecstore writes a few hundred bytes;
#: up to MAX_HEADER_BYTES and any extra string keys parse): the cache holds
#: at most ~10 MiB.
_PARSED_MAX_HEADER = 4096
_META_KEYS = frozenset({"format", "identifier", "model", "dtype", "shape"})


def _parse_header(raw: bytes, hlen: int, total: int) -> BlobHeader:
    """:func:`parse_header` once the header's bytes ``raw`` (``hlen`` of
    them) are cut out of a blob of ``total`` bytes."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptBlobError(f"malformed header: {e}") from None
    if not isinstance(header, dict) or set(header) != {TENSOR_NAME, "__metadata__"}:
        raise CorruptBlobError("header must hold exactly the tensor 'ec' and '__metadata__'")
    meta, info = header["__metadata__"], header[TENSOR_NAME]
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptBlobError("__metadata__ must map names to strings")
    if meta.get("format") != FORMAT:
        raise CorruptBlobError(f"unknown blob format {meta.get('format')!r}")
    for name in ("identifier", "model", "dtype", "shape"):
        if name not in meta:
            raise CorruptBlobError(f"__metadata__ has no {name!r}")
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise CorruptBlobError("tensor 'ec' must have exactly dtype, shape and data_offsets")
    dt = storable_dtype(meta["dtype"])
    if dt is None:
        raise CorruptBlobError(f"dtype {meta['dtype']!r} is not a storable torch dtype")
    try:
        shape = _shape_of(json.loads(meta["shape"]), "__metadata__ shape")
    except (ValueError, RecursionError) as e:
        raise CorruptBlobError(f"malformed __metadata__ shape: {e}") from None
    offsets = info["data_offsets"]
    data_offset = 8 + hlen
    nbytes = total - data_offset
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(x) for x in offsets)):
        raise CorruptBlobError("data_offsets must be two integers")
    if offsets != [0, nbytes]:
        raise CorruptBlobError(f"data_offsets {offsets} do not span the {nbytes} data bytes after the header")
    if tensor_nbytes_of(dt, shape) != nbytes:
        raise CorruptBlobError("shape and dtype do not match the data length")
    code = _ST_CODE.get(dt)
    st_shape = _shape_of(info["shape"], "tensor shape")
    if info["dtype"] != (code or "U8") or st_shape != (shape if code else (nbytes,)):
        raise CorruptBlobError("safetensors dtype/shape do not match the real dtype/shape")
    return BlobHeader(meta["identifier"], meta["model"], meta["dtype"], shape, data_offset, nbytes, header)


def check_entry(rec: Record, blob: Any, *, identifier: str | None = None, model: str | None = None,
                dtype: torch.dtype | str | None = None, key: str | None = None,
                checksum_by_caller: bool = False, size: int | None = None) -> BlobHeader:
    """Check one stored entry (its record and blob) before any byte of it is
    used; returns the blob's parsed header. The one entry check: ``get()``
    and ``ecstore-dump verify/show/export`` all use it.

    Checks, in order: the blob's length and checksum against the record;
    the header (:func:`parse_header`, strict); the record against the header
    (identifier, dtype, shape, tensor bytes); then what the caller expects,
    each only if given: the ``identifier``, the ``model``, the ``dtype``
    (exactly, by name), and the EC ``key`` the entry is stored under (its
    model and dtype parts must be the header's). Raises
    :class:`CorruptBlobError` naming the first mismatch, never another
    exception. ``checksum_by_caller``: skip the checksum (the header is
    parsed unverified, which :func:`parse_header` allows): the caller
    verifies it before using any byte (:func:`ecstore.blob_read.read_entry`).
    ``size``: the blob's length (bytes) when ``blob`` is only its beginning
    (a blob kept in a file: see :func:`parse_header`); needs
    ``checksum_by_caller``. Pure function; thread-safe.
    """
    assert size is None or checksum_by_caller, "a blob's beginning has no checksum of its own"
    try:
        held = len(memoryview(blob).cast("B"))
    except (TypeError, ValueError) as e:
        raise CorruptBlobError(f"not a bytes-like blob: {e}") from None
    size = held if size is None else size
    if size != rec.blob_size:
        raise CorruptBlobError(f"blob is {size} bytes, its record says {rec.blob_size}")
    if not checksum_by_caller and checksum(blob) != rec.checksum:
        raise CorruptBlobError("checksum mismatch")
    hdr = parse_header(blob, size)
    if hdr.identifier != rec.identifier:
        raise CorruptBlobError("identifier in blob does not match the record")
    if (hdr.dtype, hdr.shape, hdr.data_nbytes) != (rec.dtype, rec.shape, rec.nbytes):
        raise CorruptBlobError(f"blob header ({hdr.dtype} {list(hdr.shape)}, {hdr.data_nbytes} bytes) does not "
                               f"match its record ({rec.dtype} {list(rec.shape)}, {rec.nbytes} bytes)")
    if identifier is not None and hdr.identifier != identifier:
        raise CorruptBlobError("identifier in blob does not match the requested one")
    if model is not None and hdr.model != model:
        raise CorruptBlobError(f"entry of model {hdr.model!r}, expected {model!r}")
    if dtype is not None:
        want = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        if hdr.dtype != want:
            raise CorruptBlobError(f"entry of dtype {hdr.dtype}, expected {want}")
    if key is not None:
        try:
            k = parse_key(key)
        except ECStoreError as e:
            raise CorruptBlobError(f"stored under a malformed key: {e}") from None
        if (k.model, k.dtype) != (hdr.model, hdr.dtype):
            raise CorruptBlobError(f"entry of model {hdr.model!r} dtype {hdr.dtype} stored under key {key!r}")
    return hdr


#: Dtypes :func:`check_storable` admits on its fast path (none is quantized or
#: an unsupported complex type); other dtypes take the full checks.
_FAST_DTYPES = frozenset(_ST_CODE)


def check_storable(tensor: object) -> None:
    """Raise InvalidEntryError unless ``tensor`` is a dense 2-D non-empty tensor
    whose bytes can be stored (any plain dtype; quantized, sparse, meta,
    nested tensors refused).

    A tensor that passes takes six attribute reads (no method calls: each
    costs µs with the caches cold after a model step); anything else goes
    through the full checks below, which raise the specific error."""
    if (isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided and not tensor.is_nested
            and not tensor.is_meta and tensor.dtype in _FAST_DTYPES):
        shape = tensor.shape
        if len(shape) == 2 and shape[0] and shape[1]:
            return
    _check_storable_slow(tensor)


def _check_storable_slow(tensor: object) -> None:
    """:func:`check_storable`'s checks one by one, in the order of their errors."""
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
