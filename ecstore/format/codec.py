"""Bytes <-> tensors: the blob format, and how ecstore writes it.

Each blob is a valid safetensors file of one tensor ``"ec"`` with
``__metadata__`` ``{"format": "ecstore/1", "identifier", "model", "dtype",
"shape"}`` (dtypes safetensors lacks are stored as ``U8`` bytes), framed here
so the tensor bytes are copied once. Re-exports the record
(:mod:`ecstore.format.record`); checks are :mod:`ecstore.format.blob_check`,
checked copies out :mod:`ecstore.format.blob_read`. Format: docs/format.md.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import struct
from typing import Any

import numpy as np
import torch
import xxhash

from ecstore.errors import InvalidEntryError
from ecstore.format.record import LEGACY_RECORD_VERSION as LEGACY_RECORD_VERSION
from ecstore.format.record import RECORD_VERSION as RECORD_VERSION
from ecstore.format.record import Record as Record
from ecstore.format.record import pack_record as pack_record
from ecstore.format.record import record_identifier as record_identifier
from ecstore.format.record import record_readable as record_readable
from ecstore.format.record import unpack_record as unpack_record
from ecstore.pool import BufferPool

FORMAT = "ecstore/1"
TENSOR_NAME = "ec"

#: torch dtype -> safetensors dtype code (those safetensors defines).
ST_CODE: dict[torch.dtype, str] = {
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


def checksummer() -> xxhash.xxh3_64:
    """A streaming :func:`checksum`: ``update`` with the bytes in order, then ``intdigest``."""
    return xxhash.xxh3_64()


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def raw_bytes_view(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor's bytes (no copy)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy() if t.dtype != torch.uint8 else flat.numpy()


#: The tensor data of a blob written by :func:`encode` starts at a multiple
#: of this many bytes (safetensors asks for 8; 64 is a cache line: a copy
#: into or out of the blob runs at memcpy speed, faster than at an offset of
#: 8: docs/benchmarks.md). Readers accept any multiple of 8
#: (entries written before, and other writers). The header's JSON is padded
#: with spaces, which the safetensors format allows.
DATA_ALIGN = 64

_json_str = json.encoder.encode_basestring_ascii


@functools.cache
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
    see docs/benchmarks.md, "Figures behind constants")."""
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
    code = ST_CODE.get(dtype)
    st_shape = shape if code else (nbytes,)
    before = (f'{{"{TENSOR_NAME}":{{"dtype":"{code or "U8"}","shape":[{",".join(map(str, st_shape))}],'
              f'"data_offsets":[0,{nbytes}]}},"__metadata__":{{"format":"{FORMAT}","identifier":')
    after = ',"model":{},"dtype":"{}","shape":"[{}]"}}}}'.format(
        _json_str(model), _dtype_name(dtype), ", ".join(map(str, shape)))
    return before, after


def blob_size(tensor: torch.Tensor, *, identifier: str, model: str) -> int:
    """``len(encode(tensor, ...))`` without building the blob (header only)."""
    return 8 + len(header_bytes(tensor, identifier, model)) + tensor_nbytes(tensor)


#: A save of a CPU tensor up to this many bytes is copied into its blob by one
#: ``memmove`` on the calling thread instead of ``Tensor.copy_``, which splits
#: a copy this large between torch's threads: waking the other one after a
#: pause costs more than the copy (docs/benchmarks.md, "Figures behind constants").
MEMMOVE_MAX_BYTES = 4 << 20


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
    elif 0 < nbytes <= MEMMOVE_MAX_BYTES and type(src) is torch.Tensor and src.is_cpu and not src.is_neg() \
            and not dtype.is_complex and src.is_contiguous():
        # The same bytes as copy_ (a plain dense CPU tensor: no conjugate or
        # negative view bit, no subclass), on this thread; releases the GIL.
        ctypes.memmove(view.data_ptr(), src.data_ptr(), nbytes)
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


#: Dtypes :func:`check_storable` admits on its fast path (none is quantized or
#: an unsupported complex type); other dtypes take the full checks.
_FAST_DTYPES = frozenset(ST_CODE)

#: Sub-byte integer dtypes (``uint1``-``uint7``, ``int1``-``int7``): torch
#: makes such tensors but cannot copy them (``copy_kernel`` is not implemented).
SUB_BYTE_DTYPES = frozenset(getattr(torch, f"{sign}int{bits}") for sign in ("u", "") for bits in range(1, 8)
                            if hasattr(torch, f"{sign}int{bits}"))


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
    if tensor.dtype in SUB_BYTE_DTYPES:
        raise InvalidEntryError(f"dtype {tensor.dtype} is a sub-byte integer: it cannot be stored")
    if tensor.dtype.is_complex and tensor.dtype not in ST_CODE:
        raise InvalidEntryError(f"dtype {tensor.dtype} is not supported")
