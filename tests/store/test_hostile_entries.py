"""Hostile entries (record and blob agree, checksum recomputed, header
planted) are misses and dropped; the one entry check
(``blob_check.check_entry``) names each mismatch; any header value is refused
or read exactly. Readers that might crash on a hostile entry run in worker
processes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import hostile
from helpers.tensors import assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ecstore.errors import CorruptEntryError
from ecstore.format import blob_check, blob_read, codec
from ecstore.testing import faults as fc


@pytest.mark.parametrize("case", sorted(hostile.CASES))
def test_hostile_entry_is_a_miss_and_dropped(tmp_path, case):
    """Each hostile header (table in tests/helpers/hostile.py) planted over a
    float32 [4, 16] entry: ``get`` returns a miss (no exception, no crash,
    never another model's, dtype's or shape's tensor, never header bytes as
    data), the entry is dropped, the other entry is intact. Runs in a worker
    process: before the fix, quantized dtypes corrupted the heap (SIGABRT)."""
    r = fc.run_forked(hostile.get_hostile, str(tmp_path / "s"), case, timeout=180).ok()
    assert r == {"get": "miss", "still_stored": False, "corrupt_dropped": 1, "bystander_ok": True}, r


def test_entry_check_is_public_and_names_the_mismatch():
    """``blob_check.check_entry`` is the one entry check (get() and ecstore-dump
    use it): a good entry passes and returns its header; each expectation
    that differs is named."""
    t = hostile.good_tensor()
    blob = bytes(codec.encode(t, identifier="img", model="m/x"))
    rec = hostile.consistent_record(
        codec.Record("img", "float32", (4, 16), 256, 0, 0, 1, 1, 0, 0), blob)
    key = "m/x@1@0@0123456789abcdef@float32"
    hdr = blob_check.check_entry(rec, blob, identifier="img", model="m/x", dtype=torch.float32, key=key)
    assert (hdr.dtype, hdr.shape, hdr.data_nbytes) == ("float32", (4, 16), 256)
    assert_same(blob_read.read_entry(rec, blob, dtype="float32"), t)
    for kw, msg in [({"identifier": "other"}, "identifier"), ({"model": "m/y"}, "model"),
                    ({"dtype": torch.bfloat16}, "dtype"), ({"key": key.replace("float32", "float16")}, "key"),
                    ({"key": "not a key"}, "key")]:
        with pytest.raises(CorruptEntryError, match=msg):
            blob_check.check_entry(rec, blob, **kw)
    with pytest.raises(CorruptEntryError, match="record says"):
        blob_check.check_entry(replace(rec, blob_size=rec.blob_size + 1), blob)
    with pytest.raises(CorruptEntryError, match="does not match its record"):
        blob_check.check_entry(replace(rec, shape=(16, 4)), blob)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False) | st.text(max_size=12)
    | st.sampled_from(["float32", "quint4x2", "quint2x4", "qint32", "int32", "float", "U8", "F32",
                       "[4, 16]", "[-4, -16]", "[16, 16]", "[0, 99999999999999999999]", "ecstore/1"]),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3),
    max_leaves=6)
_FIELDS = [("__metadata__", f) for f in ("format", "identifier", "model", "dtype", "shape")] + [
    ("ec", f) for f in ("dtype", "shape", "data_offsets")] + [("ec", None), ("__metadata__", None)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.sampled_from(_FIELDS), _JSON), min_size=1, max_size=3),
       data_len=st.one_of(st.none(), st.integers(min_value=0, max_value=300)))
def test_any_hostile_header_is_refused_or_read_exactly(edits, data_len):
    """Random values in any header field (the record made consistent with the
    hostile header, checksum recomputed): reading the entry for a float32
    handle either refuses it with CorruptEntryError or returns exactly the
    stored float32 [4, 16] tensor; nothing else is raised."""
    def edit(h: dict) -> None:
        for (top, name), value in edits:
            if name is None:
                h[top] = value
            elif isinstance(h.get(top), dict):
                h[top][name] = value

    blob = hostile.hostile_blob(edit, data_len)
    rec = hostile.consistent_record(codec.Record(hostile.IDENT, "float32", (4, 16), 256, 0, 0, 1, 1, 0, 0), blob)
    try:
        got = blob_read.read_entry(rec, blob, identifier=hostile.IDENT, model=hostile.MODEL, dtype=torch.float32)
    except CorruptEntryError:
        return
    assert_same(got, hostile.good_tensor())
