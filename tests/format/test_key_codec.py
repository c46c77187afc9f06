"""EC keys (ecstore.key) and the blob/record codec (ecstore.format.codec)."""

from __future__ import annotations

import json
import re
import struct

import pytest
import safetensors
import safetensors.torch
import torch
import xxhash
from helpers.tensors import assert_same, make_tensor
from hypothesis import given, settings
from hypothesis import strategies as st

import ecstore
from ecstore import InvalidEntryError, key
from ecstore.errors import CorruptEntryError
from ecstore.format import Record, blob_check, blob_read, codec
from ecstore.pool import BufferPool

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"

# ----------------------------------------------------------------------------
# keys
# ----------------------------------------------------------------------------


def test_chunk_hash_is_xxh64_of_utf8_as_16_hex():
    for ident in ["a", "image-0001", "é@/\x00", "x" * 4096]:
        h = ecstore.chunk_hash(ident)
        assert re.fullmatch(r"[0-9a-f]{16}", h)
        assert h == format(xxhash.xxh64_intdigest(ident.encode("utf-8"), seed=0), "016x")
    # leading zeros are kept: find an identifier whose hash starts with 0
    ident = next(f"z{i}" for i in range(10_000) if xxhash.xxh64_intdigest(f"z{i}".encode()) < 1 << 60)
    assert ecstore.chunk_hash(ident).startswith("0") and len(ecstore.chunk_hash(ident)) == 16


@pytest.mark.parametrize("model", [MODEL, "org/model@rev@2", "@lead", "a/b/c", "m" * 400, "ünï/cødé"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_key_format_and_parse_round_trip(model, dtype):
    chunk = ecstore.chunk_hash("image-1")
    k = ecstore.make_key(model, chunk, dtype)
    assert k == f"{model}@1@0@{chunk}@{dtype}"
    parsed = ecstore.parse_key(k)
    assert parsed == ecstore.ECKey(model, 1, 0, chunk, dtype)
    assert str(parsed) == k
    assert key.looks_like_key(k)


@pytest.mark.parametrize("bad", ["", "a@b", "@1@0@abc@bf16", "m@x@0@abc@bf16", "m@1@y@abc@bf16", "m@1@0@abc"])
def test_parse_key_rejects_non_keys(bad):
    with pytest.raises(InvalidEntryError):
        ecstore.parse_key(bad)
    assert not key.looks_like_key(bad)


def _no_surrogates(s: str) -> bool:
    return not any(0xD800 <= ord(c) < 0xE000 for c in s)


@given(model=st.text(min_size=1, max_size=40).filter(lambda s: "\x00" not in s and _no_surrogates(s)),
       ident=st.text(min_size=1, max_size=60).filter(_no_surrogates))
@settings(max_examples=200, deadline=None, derandomize=True, database=None)
def test_parse_key_round_trips_any_model(model, ident):
    k = ecstore.make_key(key.check_model(model), ecstore.chunk_hash(key.check_identifier(ident)), "bfloat16")
    p = ecstore.parse_key(k)
    want = (model, 1, 0, ecstore.chunk_hash(ident), "bfloat16")
    assert (p.model, p.world_size, p.worker_id, p.chunk_hash, p.dtype) == want


@pytest.mark.parametrize("ident", ["a@b@c", "img/1/2", "nul\x00inside", "\x00", "é" * 2048, "x" * 4096,
                                   "🙂" * 1024, " ", "line\nbreak"])
def test_identifiers_accepted(ident):
    assert key.check_identifier(ident) == ident
    h = ecstore.chunk_hash(ident)
    assert ecstore.parse_key(ecstore.make_key(MODEL, h, "bfloat16")).chunk_hash == h


@pytest.mark.parametrize("ident", ["", "x" * 4097, "é" * 2049, "y" * 10 * 1024, "🙂" * 1025, "\ud800", "a\udfffb",
                                   None, 12, b"bytes", ["a"]])
def test_identifiers_refused(ident):
    assert key.MAX_IDENTIFIER_BYTES == 4096
    with pytest.raises(InvalidEntryError) as ei:
        key.check_identifier(ident)
    assert isinstance(ei.value, ecstore.ECStoreError)


@pytest.mark.parametrize("model", ["", "x" * 401, "nul\x00", "\ud800", None, 3])
def test_models_refused(model):
    with pytest.raises(InvalidEntryError):
        key.check_model(model)


def test_store_refuses_bad_model(tmp_path):
    with pytest.raises(InvalidEntryError):
        ecstore.ECStore(ecstore.ECStoreConfig(), model="", dtype=torch.bfloat16)


def test_dtype_names():
    assert key.dtype_name(torch.bfloat16) == "bfloat16"
    assert key.dtype_name(torch.float8_e8m0fnu) == "float8_e8m0fnu"
    assert key.dtype_from_name("float8_e4m3fnuz") is torch.float8_e4m3fnuz
    for bad in ["nope", "Tensor", "manual_seed"]:
        with pytest.raises(InvalidEntryError):
            key.dtype_from_name(bad)
    with pytest.raises(InvalidEntryError):
        key.dtype_name("bfloat16")


# ----------------------------------------------------------------------------
# blobs
# ----------------------------------------------------------------------------

_NOT_STORABLE = re.compile(r"^(q|bits|u?int[1-7]$)")  # quantized, bit-packed and sub-byte placeholders
ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)
                     and v.itemsize >= 1 and not _NOT_STORABLE.match(str(v)[6:])}, key=str)
MUST_HAVE = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
             torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32,
             torch.uint64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
             torch.float8_e5m2fnuz, torch.float8_e8m0fnu]


def test_dtype_list_is_complete():
    assert set(MUST_HAVE) <= set(ALL_DTYPES)


def _tensor(dtype: torch.dtype, rows: int = 3, cols: int = 8) -> torch.Tensor:
    return make_tensor(xxhash.xxh32_intdigest(str(dtype).encode()) & 0xFFFF, rows, cols, dtype)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d)[6:])
def test_codec_round_trip_every_dtype(dtype, tmp_path):
    t = _tensor(dtype)
    ident = "img@1/\x00é"
    blob = codec.encode(t, identifier=ident, model=MODEL)
    assert len(blob) == codec.blob_size(t, identifier=ident, model=MODEL)
    got = blob_read.decode(blob, expected_checksum=codec.checksum(blob), identifier=ident)
    assert_same(got, t)
    got2 = blob_read.decode(memoryview(bytes(blob)), expected_checksum=None)
    assert_same(got2, t)
    hdr = blob_check.parse_header(blob)
    assert (hdr.identifier, hdr.model, hdr.dtype, hdr.shape) == (ident, MODEL, str(dtype)[6:], tuple(t.shape))
    assert hdr.data_nbytes == t.numel() * t.element_size()
    assert hdr.data_offset % 8 == 0
    # any safetensors reader opens it
    path = tmp_path / "b.safetensors"
    path.write_bytes(bytes(blob))
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        raw = f.get_tensor("ec")
    assert meta["format"] == "ecstore/1" and meta["identifier"] == ident and meta["model"] == MODEL
    assert meta["dtype"] == str(dtype)[6:] and json.loads(meta["shape"]) == list(t.shape)
    if raw.dtype == dtype:
        assert_same(raw, t)
    else:  # no safetensors code for this dtype: stored as its raw bytes
        assert raw.dtype == torch.uint8 and raw.shape == (t.numel() * t.element_size(),)
        assert_same(raw.view(dtype).reshape(t.shape), t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.int64, torch.bool])
def test_blob_is_what_safetensors_loads(dtype):
    t = _tensor(dtype, 5, 16)
    blob = codec.encode(t, identifier="i", model=MODEL)
    loaded = safetensors.torch.load(bytes(blob))
    assert list(loaded) == ["ec"]
    assert_same(loaded["ec"], t)


def test_decode_does_not_alias_the_blob():
    t = make_tensor(1)
    blob = codec.encode(t, identifier="i", model=MODEL)
    got = blob_read.decode(blob, expected_checksum=None)
    blob[-1] ^= 0xFF
    assert_same(got, t)


def test_encode_of_a_non_contiguous_view_equals_its_contiguous_copy():
    base = make_tensor(2, 8, 4)
    assert bytes(codec.encode(base.t(), identifier="i", model=MODEL)) == bytes(
        codec.encode(base.t().contiguous(), identifier="i", model=MODEL))


class _Marked(torch.Tensor):
    """A tensor subclass (as wrappers such as vLLM's parameters are)."""


@pytest.mark.parametrize("view", ["neg bit", "conj bit", "row slice", "subclass", "requires grad"])
@pytest.mark.parametrize("rows", [3, codec.MEMMOVE_MAX_BYTES // 16 + 1])  # below and above the memmove cap
def test_encode_copies_what_the_tensor_reads_as_whichever_copy_it_takes(view, rows):
    """A contiguous CPU save below ``MEMMOVE_MAX_BYTES`` is copied by a raw
    ``memmove``: views whose bytes are not their values (negative or
    conjugate view bits) and subclasses must still encode as their values."""
    base = torch.randn(rows + 1, 4, dtype=torch.complex64 if view == "conj bit" else torch.float32)
    t = {"neg bit": lambda: torch._neg_view(base), "conj bit": lambda: base.conj(),
         "row slice": lambda: base[1:], "subclass": lambda: base.as_subclass(_Marked),
         "requires grad": lambda: base.clone().requires_grad_()}[view]()
    assert t.is_contiguous() and t.is_neg() == (view == "neg bit") and t.is_conj() == (view == "conj bit")
    want = t.resolve_neg().resolve_conj().detach().as_subclass(torch.Tensor).clone()
    for pool in (None, BufferPool(min_bytes=0)):
        blob, got = codec.encode_view(t, identifier="i", model=MODEL, pool=pool)
        assert torch.equal(got.as_subclass(torch.Tensor), want)
        assert bytes(blob) == bytes(codec.encode(want, identifier="i", model=MODEL))


def _corruptions(blob: bytearray):
    hlen = struct.unpack_from("<Q", blob, 0)[0]
    yield "flip last data byte", blob[:-1] + bytes([blob[-1] ^ 1]), True
    yield "flip header byte", blob[:20] + bytes([blob[20] ^ 0x20]) + blob[21:], True
    yield "truncated", blob[:-3], False
    yield "extra byte", blob + b"\x00", False
    yield "empty", bytearray(), False
    yield "short prefix", blob[:5], False
    yield "huge header length", struct.pack("<Q", 1 << 40) + blob[8:], False
    yield "header not json", blob[:8] + b"{" * hlen + blob[8 + hlen:], False
    hdr = json.loads(bytes(blob[8:8 + hlen]))
    for name, change in [
        ("other format", lambda h: h["__metadata__"].update(format="ecstore/99")),
        ("unknown dtype", lambda h: h["__metadata__"].update(dtype="float99")),
        ("shape mismatch", lambda h: h["__metadata__"].update(shape="[3, 3]")),
        ("no metadata", lambda h: h.pop("__metadata__")),
        ("no tensor", lambda h: h.pop("ec")),
    ]:
        h = json.loads(json.dumps(hdr))
        change(h)
        hb = json.dumps(h, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        yield name, bytearray(struct.pack("<Q", len(hb)) + hb + blob[8 + hlen:]), False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e8m0fnu])
def test_corrupted_blob_raises_corrupt_blob_error(dtype):
    t = make_tensor(3, 4, 8, dtype)
    blob = codec.encode(t, identifier="img", model=MODEL)
    good = codec.checksum(blob)
    seen = 0
    for _name, bad, header_ok in _corruptions(bytearray(blob)):
        with pytest.raises(CorruptEntryError):
            blob_read.decode(bad, expected_checksum=good)
        if not header_ok:  # caught by the header checks alone
            with pytest.raises(CorruptEntryError):
                blob_read.decode(bad, expected_checksum=None)
        seen += 1
    assert seen == 13
    with pytest.raises(CorruptEntryError):  # identifier mismatch
        blob_read.decode(blob, expected_checksum=good, identifier="other")
    assert_same(blob_read.decode(blob, expected_checksum=good, identifier="img"), t)
    assert issubclass(CorruptEntryError, ecstore.ECStoreError)  # every error ecstore raises is one


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_check_storable():
    codec.check_storable(make_tensor(1))
    codec.check_storable(torch.zeros(1, 1, dtype=torch.float8_e8m0fnu))
    codec.check_storable(torch.nn.Parameter(torch.zeros(2, 3)))  # a subclass: the fast path too
    for bad in [torch.zeros(3), torch.zeros(1, 1, 1), torch.zeros(0, 4), torch.zeros(4, 0),
                torch.zeros(2, 2).to_sparse(), torch.zeros(2, 2).to_sparse_csr(),
                torch.nested.nested_tensor([torch.zeros(2, 2), torch.zeros(3, 2)]),
                torch.empty(2, 2, device="meta"), torch.zeros(2, 2, dtype=torch.complex128), [[1.0]],
                torch.quantize_per_tensor(torch.zeros(2, 2), 0.1, 0, torch.quint8)]:
        with pytest.raises(InvalidEntryError) as fast:
            codec.check_storable(bad)
        with pytest.raises(InvalidEntryError) as slow:  # the fast path refuses what the full checks refuse
            codec._check_storable_slow(bad)
        assert str(fast.value) == str(slow.value)


# ----------------------------------------------------------------------------
# records
# ----------------------------------------------------------------------------

records = st.builds(
    Record,
    identifier=st.text(min_size=1, max_size=50).filter(lambda s: not any(0xD800 <= ord(c) < 0xE000 for c in s)),
    dtype=st.sampled_from([str(d)[6:] for d in ALL_DTYPES]),
    shape=st.lists(st.integers(0, 2**40), min_size=0, max_size=4).map(tuple),
    nbytes=st.integers(0, 2**64 - 1),
    blob_size=st.integers(0, 2**64 - 1),
    checksum=st.integers(0, 2**64 - 1),
    created_ns=st.integers(0, 2**64 - 1),
    last_access_ns=st.integers(0, 2**64 - 1),
    hits=st.integers(0, 2**64 - 1),
    lru_seq=st.integers(0, 2**64 - 1),
)


@given(records)
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
def test_record_pack_unpack_round_trip(rec):
    raw = codec.pack_record(rec)
    assert codec.unpack_record(raw) == rec
    assert codec.unpack_record(memoryview(raw)) == rec
    assert codec.record_identifier(raw) == rec.identifier


def test_record_examples_and_corruption():
    rec = Record("img@/\x00é", "bfloat16", (577, 3584), 577 * 3584 * 2, 577 * 3584 * 2 + 320, 2**64 - 1,
                 1, 2, 3, 4)
    raw = codec.pack_record(rec)
    assert codec.unpack_record(raw) == rec
    t = rec.touched(10, 99)
    assert (t.last_access_ns, t.hits, t.lru_seq) == (10, 4, 99)
    assert rec.touched(0, 5, hits=0).last_access_ns == 2  # never goes back in time
    for bad in [raw[:-1], raw + b"x", raw[:10], b"", bytes([3]) + raw[1:]]:
        with pytest.raises(CorruptEntryError):
            codec.unpack_record(bad)
    assert codec.record_identifier(b"") is None


def test_checksum_is_xxh3_64():
    assert codec.checksum(b"abc") == xxhash.xxh3_64_intdigest(b"abc")
    assert codec.checksum(bytearray(b"abc")) == codec.checksum(memoryview(b"abc"))
