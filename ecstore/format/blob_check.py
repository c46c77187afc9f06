"""Checking a stored blob before any byte of it is used: the read side of
:mod:`ecstore.format.codec` (which builds blobs; the format is described there).

:func:`parse_header` parses and strictly checks a blob's safetensors header
(no data read; accepted headers are kept in a small cache), and
:func:`check_entry` checks one stored entry -- record, blob, and what the
caller expects -- the one entry check ``get()``, the remote tier and
``ecstore-dump verify/show/export`` all use. Everything raises
:class:`~ecstore.errors.CorruptEntryError` and
nothing else. Pure functions; thread-safe.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from ecstore.errors import CorruptEntryError, ECStoreError
from ecstore.format.codec import FORMAT, ST_CODE, TENSOR_NAME, checksum, tensor_nbytes_of
from ecstore.format.record import Record
from ecstore.key import parse_key


@dataclass(frozen=True)
class BlobHeader:
    identifier: str
    model: str
    dtype: str
    shape: tuple[int, ...]
    data_offset: int
    data_nbytes: int
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)


#: Largest accepted header (bytes) and dimension count / size of a tensor in
#: a blob: a header claiming more is damaged or hostile.
MAX_HEADER_BYTES = 1 << 20
MAX_NDIM = 8
MAX_DIM = 1 << 48


@functools.cache
def storable_dtype(name: str) -> torch.dtype | None:
    """The torch dtype a blob may claim by ``name``, or None: only canonical
    names (``"float32"``, not the alias ``"float"``) of dtypes whose tensors
    are ``numel * itemsize`` plain bytes (no quantized dtypes)."""
    dt = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dt, torch.dtype) or str(dt) != f"torch.{name}":
        return None
    try:
        probe = torch.empty(1, dtype=dt)
    except Exception:  # noqa: BLE001
        return None
    if probe.is_quantized or probe.element_size() != dt.itemsize or dt.itemsize < 1:
        return None
    return dt


def _is_int(x: Any) -> bool:
    return type(x) is int  # not bool, not float


def _shape_of(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise CorruptEntryError(f"{what} is not a list of at most {MAX_NDIM} dimensions")
    return check_shape(tuple(value), what)


def check_shape(shape: tuple[Any, ...], what: str) -> tuple[int, ...]:
    """``shape`` if torch can make a tensor of it: at most MAX_NDIM integer
    dimensions in [0, MAX_DIM) whose product, zeros counted as ones, stays
    below 2**62 (torch's strides would overflow: ``(0, 2**47, 2**47)`` has
    no element yet cannot be allocated); CorruptEntryError otherwise."""
    if len(shape) > MAX_NDIM:
        raise CorruptEntryError(f"{what} is not a list of at most {MAX_NDIM} dimensions")
    if not all(_is_int(d) and 0 <= d < MAX_DIM for d in shape):
        raise CorruptEntryError(f"{what} {list(shape)!r} has a dimension that is not an integer in [0, 2**48)")
    span = 1
    for d in shape:
        span *= max(d, 1)
    if span >= 1 << 62:
        raise CorruptEntryError(f"{what} {list(shape)!r} spans more elements than a tensor can address")
    return shape


def check_put_shape(hdr: BlobHeader) -> BlobHeader:
    """``hdr`` if its tensor has a shape ``ECStore.put`` stores (2-D with no
    empty dimension, as :func:`ecstore.format.codec.check_storable` demands); else
    CorruptEntryError. An entry of any other shape (a well-formed blob ecstore
    never writes) is unusable: a 1-D or empty "encoder output" must never
    reach the model. Used where entries come from outside this process's
    writes (the remote tier)."""
    if len(hdr.shape) != 2 or 0 in hdr.shape:
        raise CorruptEntryError(f"tensor of shape {list(hdr.shape)}: ecstore stores only 2-D tensors "
                               f"with no empty dimension")
    return hdr


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
    else raises :class:`CorruptEntryError` (never another exception).
    """
    try:
        mv = memoryview(blob).cast("B")
    except (TypeError, ValueError) as e:
        raise CorruptEntryError(f"not a bytes-like blob: {e}") from None
    total = len(mv) if size is None else size
    if len(mv) < 8 or total < 8:
        raise CorruptEntryError("blob shorter than its length prefix")
    (hlen,) = struct.unpack_from("<Q", mv, 0)
    if hlen > len(mv) - 8 or hlen > total - 8 or hlen > MAX_HEADER_BYTES:
        raise CorruptEntryError(f"header length {hlen} out of range")
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
#: of two JSON decodes and the checks. Bounded; thread-safe
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
        raise CorruptEntryError(f"malformed header: {e}") from None
    if not isinstance(header, dict) or set(header) != {TENSOR_NAME, "__metadata__"}:
        raise CorruptEntryError("header must hold exactly the tensor 'ec' and '__metadata__'")
    meta, info = header["__metadata__"], header[TENSOR_NAME]
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptEntryError("__metadata__ must map names to strings")
    if meta.get("format") != FORMAT:
        raise CorruptEntryError(f"unknown blob format {meta.get('format')!r}")
    for name in ("identifier", "model", "dtype", "shape"):
        if name not in meta:
            raise CorruptEntryError(f"__metadata__ has no {name!r}")
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise CorruptEntryError("tensor 'ec' must have exactly dtype, shape and data_offsets")
    dt = storable_dtype(meta["dtype"])
    if dt is None:
        raise CorruptEntryError(f"dtype {meta['dtype']!r} is not a storable torch dtype")
    try:
        shape = _shape_of(json.loads(meta["shape"]), "__metadata__ shape")
    except (ValueError, RecursionError) as e:
        raise CorruptEntryError(f"malformed __metadata__ shape: {e}") from None
    offsets = info["data_offsets"]
    data_offset = 8 + hlen
    nbytes = total - data_offset
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(x) for x in offsets)):
        raise CorruptEntryError("data_offsets must be two integers")
    if offsets != [0, nbytes]:
        raise CorruptEntryError(f"data_offsets {offsets} do not span the {nbytes} data bytes after the header")
    if tensor_nbytes_of(dt, shape) != nbytes:
        raise CorruptEntryError("shape and dtype do not match the data length")
    code = ST_CODE.get(dt)
    st_shape = _shape_of(info["shape"], "tensor shape")
    if info["dtype"] != (code or "U8") or st_shape != (shape if code else (nbytes,)):
        raise CorruptEntryError("safetensors dtype/shape do not match the real dtype/shape")
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
    :class:`CorruptEntryError` naming the first mismatch, never another
    exception. ``checksum_by_caller``: skip the checksum (the header is
    parsed unverified, which :func:`parse_header` allows): the caller
    verifies it before using any byte (:func:`ecstore.format.blob_read.read_entry`).
    ``size``: the blob's length (bytes) when ``blob`` is only its beginning
    (a blob kept in a file: see :func:`parse_header`); needs
    ``checksum_by_caller``. Pure function; thread-safe.
    """
    assert size is None or checksum_by_caller, "a blob's beginning has no checksum of its own"
    try:
        held = len(memoryview(blob).cast("B"))
    except (TypeError, ValueError) as e:
        raise CorruptEntryError(f"not a bytes-like blob: {e}") from None
    size = held if size is None else size
    if size != rec.blob_size:
        raise CorruptEntryError(f"blob is {size} bytes, its record says {rec.blob_size}")
    if not checksum_by_caller and checksum(blob) != rec.checksum:
        raise CorruptEntryError("checksum mismatch")
    hdr = parse_header(blob, size)
    if hdr.identifier != rec.identifier:
        raise CorruptEntryError("identifier in blob does not match the record")
    if (hdr.dtype, hdr.shape, hdr.data_nbytes) != (rec.dtype, rec.shape, rec.nbytes):
        raise CorruptEntryError(f"blob header ({hdr.dtype} {list(hdr.shape)}, {hdr.data_nbytes} bytes) does not "
                               f"match its record ({rec.dtype} {list(rec.shape)}, {rec.nbytes} bytes)")
    if identifier is not None and hdr.identifier != identifier:
        raise CorruptEntryError("identifier in blob does not match the requested one")
    if model is not None and hdr.model != model:
        raise CorruptEntryError(f"entry of model {hdr.model!r}, expected {model!r}")
    if dtype is not None:
        want = dtype if isinstance(dtype, str) else _dtype_name(dtype)
        if hdr.dtype != want:
            raise CorruptEntryError(f"entry of dtype {hdr.dtype}, expected {want}")
    if key is not None:
        try:
            k = _parsed_key(key)
        except ECStoreError as e:
            raise CorruptEntryError(f"stored under a malformed key: {e}") from None
        if (k.model, k.dtype) != (hdr.model, hdr.dtype):
            raise CorruptEntryError(f"entry of model {hdr.model!r} dtype {hdr.dtype} stored under key {key!r}")
    return hdr


#: :func:`~ecstore.key.parse_key` of the keys entries were lately checked
#: under (a pure function; bounded; a malformed key is never kept: it raises).
_parsed_key = functools.lru_cache(maxsize=4096)(parse_key)


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (a handful of dtypes: unbounded is fine)."""
    return str(dtype).removeprefix("torch.")
