"""The blob layout written by codec.encode: the header's JSON, the data
offset's alignment, and blobs written before (8-byte alignment) still read."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ecstore.errors import CorruptEntryError
from ecstore.format import blob_check, blob_read, codec
from ecstore.pool import BufferPool

MODEL = 'org/m "x" é'


def json_header(tensor: torch.Tensor, identifier: str, model: str) -> bytes:
    """The header as json.dumps writes it (what codec wrote before it formatted
    the JSON itself), unpadded."""
    nbytes = tensor.numel() * tensor.element_size()
    code = codec.ST_CODE.get(tensor.dtype)
    header = {
        "ec": {"dtype": code or "U8", "shape": list(tensor.shape) if code else [nbytes],
               "data_offsets": [0, nbytes]},
        "__metadata__": {"format": codec.FORMAT, "identifier": identifier, "model": model,
                         "dtype": str(tensor.dtype).removeprefix("torch."),
                         "shape": json.dumps(list(tensor.shape))},
    }
    return json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")


DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.uint8, torch.bool, torch.float8_e8m0fnu]


@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(0, 40), cols=st.integers(0, 9),
       identifier=st.text(max_size=40), model=st.text(max_size=20))
def test_header_is_the_json_dumps_header_padded_to_a_64_byte_data_offset(
        dtype: torch.dtype, rows: int, cols: int, identifier: str, model: str) -> None:
    t = torch.zeros(rows, cols, dtype=dtype)
    h = codec.header_bytes(t, identifier, model)
    assert h.rstrip(b" ") == json_header(t, identifier, model)
    assert (8 + len(h)) % codec.DATA_ALIGN == 0 and codec.DATA_ALIGN == 64
    assert len(h) - len(h.rstrip(b" ")) < 64


def test_encoded_blob_data_is_64_byte_aligned_and_safetensors_reads_it(tmp_path: Path) -> None:
    t = torch.randn(7, 33).to(torch.bfloat16)
    for pool in (None, BufferPool(min_bytes=0)):
        blob, view = codec.encode_view(t, identifier="ns/img", model=MODEL, pool=pool)
        hdr = blob_check.parse_header(blob)
        assert hdr.data_offset % 64 == 0
        assert view.data_ptr() % 64 == 0 if pool is not None else True
        assert torch.equal(view, t) and view.data_ptr() == blob.ctypes.data + hdr.data_offset
        path = tmp_path / "b.safetensors"
        path.write_bytes(bytes(blob))
        assert torch.equal(safetensors.torch.load_file(str(path))["ec"], t)


def test_blob_with_the_former_8_byte_alignment_still_reads() -> None:
    """Entries written before the 64-byte alignment (header padded to 8) are
    served: readers accept any data offset the header says."""
    t = torch.randn(5, 12).to(torch.bfloat16)
    hb = json_header(t, "ns/old", MODEL)
    hb += b" " * (-len(hb) % 8)
    old = struct.pack("<Q", len(hb)) + hb + t.view(torch.uint8).numpy().tobytes()
    assert (8 + len(hb)) % 64 != 0  # really the old layout
    got = blob_read.decode(old, expected_checksum=codec.checksum(old), identifier="ns/old")
    assert torch.equal(got, t)
    rec = codec.Record("ns/old", "bfloat16", (5, 12), t.numel() * 2, len(old), codec.checksum(old), 0, 0, 0, 0)
    assert torch.equal(blob_read.read_entry(rec, old, identifier="ns/old", model=MODEL, dtype=torch.bfloat16), t)


def test_parsed_header_cache_answers_as_a_fresh_parse() -> None:
    """parse_header keeps the headers it accepted, by (header bytes, blob
    size): the same header in a blob of another size is parsed (and refused)
    anew, a refused header is refused every time, and headers longer than
    the cache's bound are never kept (a store of forged 1 MiB headers cannot
    make it hold gigabytes)."""
    t = torch.randn(6, 16).to(torch.bfloat16)
    blob = bytes(codec.encode_view(t, identifier="ns/cache", model=MODEL)[0])
    blob_check._PARSED.clear()
    first = blob_check.parse_header(blob)
    assert len(blob_check._PARSED) == 1
    assert blob_check.parse_header(blob) == first
    for bad in (blob + b"\x00", blob[:-1]):  # the same header, another blob size
        for _ in range(2):
            try:
                blob_check.parse_header(bad)
            except CorruptEntryError:
                pass
            else:
                raise AssertionError("a header whose sizes do not match the blob was accepted")
    assert len(blob_check._PARSED) == 1
    hb = json_header(t, "ns/" + "x" * 5000, MODEL)
    hb += b" " * (-(8 + len(hb)) % 64)
    big = struct.pack("<Q", len(hb)) + hb + t.view(torch.uint8).numpy().tobytes()
    assert blob_check.parse_header(big).identifier == "ns/" + "x" * 5000
    assert len(blob_check._PARSED) == 1


def test_a_header_with_no_element_but_huge_dimensions_is_refused() -> None:
    """``[0, 2**47, 2**47]`` holds no element and every dimension is below
    MAX_DIM, but torch cannot allocate it (its strides overflow): accepted,
    copy_out then raised RuntimeError instead of CorruptEntryError."""
    shape = [0, 1 << 47, 1 << 47]
    h = {"ec": {"dtype": "U8", "shape": shape, "data_offsets": [0, 0]},
         "__metadata__": {"format": codec.FORMAT, "identifier": "i", "model": "m", "dtype": "uint8",
                          "shape": json.dumps(shape)}}
    raw = json.dumps(h, separators=(",", ":")).encode()
    with pytest.raises(CorruptEntryError, match="spans more elements"):
        blob_check.parse_header(struct.pack("<Q", len(raw)) + raw)


def test_headers_with_extra_metadata_are_never_cached() -> None:
    """Any extra ``__metadata__`` string keys parse; such headers (never
    written by ecstore) are not kept, so a store of forged 4 KiB headers
    with hundreds of keys each cannot grow the cache past its bound."""
    t = torch.randn(2, 4).to(torch.bfloat16)
    hb = json.loads(json_header(t, "ns/extra", MODEL))
    hb["__metadata__"].update({f"k{i}": "v" for i in range(300)})
    raw = json.dumps(hb).encode()
    raw += b" " * (-(8 + len(raw)) % 64)
    blob = struct.pack("<Q", len(raw)) + raw + t.view(torch.uint8).numpy().tobytes()
    blob_check._PARSED.clear()
    assert blob_check.parse_header(blob).identifier == "ns/extra"
    assert blob_check._PARSED == {}
