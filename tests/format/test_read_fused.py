"""Entries larger than ``2 * blob_read.FUSED_CHUNK`` are copied out of the LMDB
map, or read from their blob file, and checksummed chunk by chunk
(``blob_read.read_entry``, ``read_file_entry``): the same
guarantee as the one-pass check must hold, a damaged byte anywhere is a miss
and the entry is dropped, never a tensor handed out. ``ECStore.verify`` (the
scheduler's check before it promises an entry) makes the same checks without
copying the entry out (``blob_read.check_file_entry``): it must refuse and
drop exactly what ``get`` does."""

from __future__ import annotations

import os

import pytest
import torch

from ecstore import ECStore, ECStoreConfig
from ecstore.errors import CorruptEntryError
from ecstore.format import Record, blob_read, codec
from ecstore.lmdb.txn import file_ref

ROWS = 3 * blob_read.FUSED_CHUNK // (512 * 2) + 7  # > 3 chunks of data, not a multiple of one
COLS = 512


@pytest.fixture(params=["in LMDB", "in a file"])
def store_at(request):
    """``store_at(path, readonly=False)``: a store whose large blobs live
    inside LMDB's map (read with ``read_entry``) or in files of their own
    (``min_file_blob_size`` 0: ``read_file_entry``); each test runs with both."""
    files = request.param == "in a file"

    def make(path, *, readonly: bool = False) -> ECStore:
        cfg = ECStoreConfig(local_disk=str(path), max_local_disk_size=0.25, local_cpu=False,
                            min_file_blob_size=0.0 if files else 64.0)
        return ECStore(cfg, model="m/fused", dtype=torch.bfloat16, readonly=readonly)
    return make


@pytest.fixture(params=["get", "verify"])
def misses(request):
    """``misses(store, mm_hash)``: whether the reader under test refuses the
    entry: ``get`` returns None, or ``verify`` returns False."""
    if request.param == "get":
        return lambda st, h: st.get(h) is None
    return lambda st, h: not st.verify(h)


def _tensor(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, COLS, generator=g).to(torch.bfloat16)


def _flip(st: ECStore, mm_hash: str, pos: int) -> None:
    """Flip the byte at ``pos`` of the stored blob (negative: from its end)."""
    tier = st.disk
    k = tier._k(st.key(mm_hash))
    with tier._write_txn() as txn:
        value = txn.get(k, db=tier._dbs.blobs)
        ref = file_ref(value)
        if ref is not None:  # the blob file, in place
            with open(os.path.join(tier.files.dir, ref.name), "r+b") as f:
                f.seek(pos, os.SEEK_SET if pos >= 0 else os.SEEK_END)
                b = f.read(1)[0]
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([b ^ 0x01]))
            return
        data = bytearray(value)
        data[pos] ^= 0x01
        txn.put(k, bytes(data), db=tier._dbs.blobs)


def test_large_entry_round_trips(tmp_path, store_at):
    t = _tensor()
    assert t.numel() * 2 > 2 * blob_read.FUSED_CHUNK and (t.numel() * 2) % blob_read.FUSED_CHUNK
    with store_at(tmp_path) as st:
        st.put("big", t)
        st.flush()
    with store_at(tmp_path) as st:
        got = st.get("big")
        assert got is not None and torch.equal(got, t)
        assert got.data_ptr() != t.data_ptr()


@pytest.mark.parametrize("where", ["first data byte", "chunk boundary", "last chunk", "last byte", "header"])
def test_a_flipped_byte_in_a_large_entry_is_a_miss_and_dropped(tmp_path, where, store_at, misses):
    t = _tensor(1)
    with store_at(tmp_path) as st:
        st.put("big", t)
        st.put("other", _tensor(2))
        st.flush()
        off = 8 + len(codec.header_bytes(t, st.stored_name("big"), st.model))
        pos = {"first data byte": off, "chunk boundary": off + blob_read.FUSED_CHUNK,
               "last chunk": off + 3 * blob_read.FUSED_CHUNK + 5, "last byte": -1,
               "header": off - 3}[where]  # the header's padding: the JSON still parses
        _flip(st, "big", pos)
    with store_at(tmp_path) as st:
        assert st.verify("other")
        assert misses(st, "big")
        assert not st.contains("big")  # dropped, not served again
        assert st.stats().corrupt_dropped == 1
        other = st.get("other")
        assert other is not None and torch.equal(other, _tensor(2))


def test_read_only_handle_misses_without_dropping(tmp_path, store_at, misses):
    t = _tensor(3)
    with store_at(tmp_path) as st:
        st.put("big", t)
        st.flush()
        _flip(st, "big", -2)
    with store_at(tmp_path, readonly=True) as ro:
        assert misses(ro, "big")
    with store_at(tmp_path) as st:
        assert st.contains("big")  # the read-only handle left it for a writer to drop


def test_read_entry_raises_on_a_checksum_mismatch():
    t = _tensor(4)
    blob = bytes(codec.encode(t, identifier="x", model="m"))
    rec = Record(identifier="x", dtype="bfloat16", shape=tuple(t.shape), nbytes=t.numel() * 2,
                 blob_size=len(blob), checksum=codec.checksum(blob), created_ns=0, last_access_ns=0,
                 hits=0, lru_seq=0)
    assert torch.equal(blob_read.read_entry(rec, blob), t)
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0x80
    with pytest.raises(CorruptEntryError, match="checksum mismatch"):
        blob_read.read_entry(rec, bytes(bad))


@pytest.mark.parametrize("where", ["chunk boundary", "last byte"])
def test_an_entry_read_on_two_cores_round_trips_and_a_flipped_byte_is_a_miss(tmp_path, where, store_at):
    """Entries of ``split_read.SPLIT_READ_BYTES`` and more kept in files are
    read by the caller and a helper thread: the same guarantee holds."""
    from ecstore.format import split_read
    g = torch.Generator().manual_seed(5)
    t = torch.randn(split_read.SPLIT_READ_BYTES // (COLS * 2) + 3, COLS, generator=g).to(torch.bfloat16)
    with store_at(tmp_path) as st:
        st.put("big", t)
        st.put("twin", t.clone())
        st.flush()
        off = 8 + len(codec.header_bytes(t, st.stored_name("big"), st.model))
        _flip(st, "big", {"chunk boundary": off + 5 * blob_read.FUSED_CHUNK, "last byte": -1}[where])
    with store_at(tmp_path) as st:
        assert st.get("big") is None and not st.contains("big")
        twin = st.get("twin")
        assert twin is not None and torch.equal(twin, t)


def test_verify_passes_a_good_entry_without_taking_memory_of_its_size(tmp_path, store_at):
    """The scheduler verifies entries it will not read itself: a good entry
    passes, and no pool slab (memory of the entry's size) is taken for it;
    ``get`` of the same entry takes one. Before, ``verify`` was a ``get``
    whose copy was thrown away: up to an entry's size of memory per
    verification, kept idle in the scheduler process's pool afterwards."""
    from ecstore.pool import POOL

    t = _tensor(6)
    with store_at(tmp_path) as st:
        st.put("big", t)
        st.flush()
    with store_at(tmp_path) as st:
        before = (POOL.fresh, POOL.reused)
        assert st.verify("big") and st.verify("big")
        assert (POOL.fresh, POOL.reused) == before
        assert st.stats().hits == 0  # a verification is not a hit
        got = st.get("big")
        assert got is not None and torch.equal(got, t)
        assert POOL.fresh + POOL.reused == sum(before) + 1


def test_verify_of_a_blob_file_cut_short_or_grown_is_a_miss_and_dropped(tmp_path):
    """A blob file whose size is not its record's fails the check before any
    hashing, as for ``get``."""
    cfg = ECStoreConfig(local_disk=str(tmp_path), max_local_disk_size=0.25, local_cpu=False,
                        min_file_blob_size=0.0)
    with ECStore(cfg, model="m/fused", dtype=torch.bfloat16) as st:
        for h, seed in (("short", 7), ("long", 8), ("other", 9)):
            st.put(h, _tensor(seed))
        st.flush()
        for h, change in (("short", -1), ("long", 1)):
            tier = st.disk
            with tier.snapshot() as (txn, dbs):
                ref = file_ref(txn.get(tier._k(st.key(h)), db=dbs.blobs))
            assert ref is not None
            path = os.path.join(tier.files.dir, ref.name)
            os.truncate(path, os.path.getsize(path) + change)
            assert not st.verify(h)
            assert not st.contains(h)
        assert st.verify("other")
        assert st.stats().corrupt_dropped == 2
