"""Schema versions and migrations of the LMDB file (ecstore.lmdb.schema, ecstore.lmdb.migrations)."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import lmdb
import pytest
import torch
from conftest import gib
from helpers.tensors import assert_same, make_tensor

import ecstore
from ecstore import ECStore, ECStoreConfig, SchemaError, StoreOpenError
from ecstore.format import codec
from ecstore.lmdb import schema
from ecstore.testing.stores import open_store_at_schema

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
IDS = [f"mig-{i:03d}" for i in range(6)]


def blob_cost(ident: str, t: torch.Tensor) -> int:
    return len(codec.encode(t, identifier=ident, model=MODEL))


def open_store(path: Path, cap: int = 64 << 20, schema_target: int | None = None, **kw) -> ECStore:
    cfg = ECStoreConfig(local_cpu=False, local_disk=str(path), max_local_disk_size=gib(cap))
    return open_store_at_schema(cfg, schema_target, model=MODEL, dtype=torch.bfloat16, **kw)


def db_names(path: Path) -> set[bytes]:
    env = lmdb.open(str(path), max_dbs=8, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return {bytes(k) for k, _ in txn.cursor()}
    finally:
        env.close()


def set_meta(path: Path, key: bytes, value: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=8)
    try:
        meta = env.open_db(b"meta", create=False)
        with env.begin(write=True) as txn:
            txn.put(key, value, db=meta)
    finally:
        env.close()


def file_state(path: Path) -> tuple[str, int, int]:
    data = path / "data.mdb"
    st = data.stat()
    return hashlib.sha256(data.read_bytes()).hexdigest(), st.st_mtime_ns, st.st_size


def test_migrations_are_numbered_without_gaps():
    migs = schema.migrations()
    assert [m.VERSION for m in migs] == list(range(1, len(migs) + 1))
    assert schema.current_version() == len(migs) >= 2
    assert all(callable(m.upgrade) for m in migs)


def test_new_store_is_at_the_current_version(tmp_store_dir):
    with open_store(tmp_store_dir) as store:
        assert store.disk.schema_version == schema.current_version()
        assert schema.read_version(store.disk.env) == schema.current_version()
    assert {b"blobs", b"entries", b"meta", b"lru", b"namespaces", b"files"} <= db_names(tmp_store_dir)


def _fill_v1(path: Path, cap: int) -> dict[str, torch.Tensor]:
    """A schema-1 store holding IDS[:4], with IDS[0] and IDS[2] read last."""
    ts = {h: make_tensor(i) for i, h in enumerate(IDS)}
    with open_store(path, cap, schema_target=1) as store:
        assert store.disk.schema_version == 1
        for h in IDS[:4]:
            assert store.put(h, ts[h])
        store.flush()
        assert_same(store.get(IDS[0]), ts[IDS[0]])
        assert_same(store.get(IDS[2]), ts[IDS[2]])
        store.flush()
        assert store.disk.lru_keys() == [store.key(h) for h in (IDS[1], IDS[3], IDS[0], IDS[2])]
    return ts


def test_schema_target_1_creates_and_keeps_a_v1_store(tmp_store_dir):
    ts = _fill_v1(tmp_store_dir, 64 << 20)
    assert b"lru" not in db_names(tmp_store_dir)
    with open_store(tmp_store_dir, schema_target=1) as store:  # reopen: stays at 1
        assert store.disk.schema_version == 1
        assert store.disk._dbs.lru is None
        for h in IDS[:4]:
            assert_same(store.get(h), ts[h])
    assert b"lru" not in db_names(tmp_store_dir)


def test_v1_store_evicts_in_lru_order(tmp_store_dir):
    t = make_tensor(0)
    c = blob_cost(IDS[0], t)
    cap = 4 * c + c // 2
    ts = _fill_v1(tmp_store_dir, cap)
    with open_store(tmp_store_dir, cap, schema_target=1) as store:
        assert store.put(IDS[4], ts[IDS[4]])
        store.flush()
        assert [h for h in IDS if store.contains(h)] == [IDS[0], IDS[2], IDS[3], IDS[4]]
        assert store.stats().disk_bytes == 4 * c


def test_upgrade_to_2_keeps_entries_and_eviction_order(tmp_store_dir, caplog):
    """Migration 2 (LRU index) on a schema-1 store; schema 3 is covered by
    test_upgrade_to_3_keeps_legacy_entries_but_never_serves_them."""
    t = make_tensor(0)
    c = blob_cost(IDS[0], t)
    cap = 4 * c + c // 2
    ts = _fill_v1(tmp_store_dir, cap)
    with open_store(tmp_store_dir, cap, schema_target=1) as store:
        order_v1 = store.disk.lru_keys()
        records_v1 = {k: store.disk.record(k) for k in order_v1}
        bytes_v1 = store.stats().disk_bytes
    with open_store(tmp_store_dir, cap, schema_target=2) as store:  # migrate to 2
        assert store.disk.schema_version == 2
        assert schema.read_version(store.disk.env) == 2
        assert store.disk.lru_keys() == order_v1
        assert {k: store.disk.record(k) for k in order_v1} == records_v1
        assert store.stats().disk_bytes == bytes_v1 == 4 * c
        for h in IDS[:4]:
            assert store.contains(h)
            assert_same(store.disk.get(store.key(h), store.stored_name(h)), ts[h])
        # eviction follows the order carried over: IDS[1] then IDS[3]
        assert store.put(IDS[4], ts[IDS[4]])
        store.flush()
        assert [h for h in IDS if store.contains(h)] == [IDS[0], IDS[2], IDS[3], IDS[4]]
        assert_same(store.get(IDS[3]), ts[IDS[3]])
        store.flush()
        assert store.put(IDS[5], ts[IDS[5]])
        store.flush()
        assert [h for h in IDS if store.contains(h)] == [IDS[2], IDS[3], IDS[4], IDS[5]]
        assert store.disk.lru_keys() == [store.key(h) for h in (IDS[2], IDS[4], IDS[3], IDS[5])]
        assert store.stats().disk_bytes == 4 * c <= cap
    assert b"lru" in db_names(tmp_store_dir)
    # the lru index matches the records exactly
    with open_store(tmp_store_dir, cap, schema_target=2) as store:
        by_seq = sorted((r.lru_seq, k) for k, r in store.disk.iter_records())
        assert [k for _, k in by_seq] == store.disk.lru_keys()
        assert store.disk.schema_version == 2


def test_reopening_a_current_store_with_schema_target_1_keeps_it_current(tmp_store_dir):
    with open_store(tmp_store_dir) as store:
        store.put("x", make_tensor(1))
    with open_store(tmp_store_dir, schema_target=1) as store:
        assert store.disk.schema_version == schema.current_version()
        assert_same(store.get("x"), make_tensor(1))


def test_readonly_open_of_an_old_store_refuses_and_does_not_migrate(tmp_store_dir):
    _fill_v1(tmp_store_dir, 64 << 20)
    before = file_state(tmp_store_dir)
    with pytest.raises(SchemaError, match="older"):
        open_store(tmp_store_dir, readonly=True)
    assert file_state(tmp_store_dir) == before
    with open_store(tmp_store_dir, schema_target=1) as store:
        assert store.disk.schema_version == 1


def test_readonly_open_of_a_store_being_created_says_so(tmp_store_dir):
    """A read-only open (ecstore-dump) of a store another process is creating
    at that moment, LMDB's file made and the schema not yet written, said the
    store had schema version 0 and must be upgraded."""
    lmdb.open(str(tmp_store_dir), max_dbs=8).close()  # what the creator has made so far
    before = file_state(tmp_store_dir)
    with pytest.raises(SchemaError, match="is empty: no ecstore schema yet .*creating it at this moment"):
        open_store(tmp_store_dir, readonly=True)
    assert file_state(tmp_store_dir) == before
    with open_store(tmp_store_dir) as store:  # the creator goes on
        assert store.disk.schema_version == schema.current_version()


@pytest.mark.parametrize("readonly", [False, True])
def test_newer_schema_is_refused_and_the_file_is_untouched(tmp_store_dir, readonly):
    with open_store(tmp_store_dir) as store:
        store.put("x", make_tensor(1))
    cur = schema.current_version()
    newer = cur + 1
    set_meta(tmp_store_dir, b"schema_version", str(newer).encode())
    before = file_state(tmp_store_dir)
    for kw in ({}, {"schema_target": 1}):
        with pytest.raises(SchemaError) as ei:
            open_store(tmp_store_dir, readonly=readonly, **kw)
        msg = str(ei.value)
        assert str(newer) in msg and str(cur) in msg
        assert isinstance(ei.value, ecstore.ECStoreError)
        assert file_state(tmp_store_dir) == before
    # the failed opens released the environment: once the version is back, it opens
    set_meta(tmp_store_dir, b"schema_version", str(cur).encode())
    with open_store(tmp_store_dir) as store:
        assert_same(store.get("x"), make_tensor(1))


def test_lmdb_file_that_is_not_an_ecstore_store(tmp_store_dir):
    env = lmdb.open(str(tmp_store_dir), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"hello", b"world")
    env.close()
    before = file_state(tmp_store_dir)
    with pytest.raises(StoreOpenError):
        open_store(tmp_store_dir)
    assert file_state(tmp_store_dir) == before


@pytest.mark.parametrize("raw", [None, b"two"])
def test_meta_without_a_valid_schema_version(tmp_store_dir, raw):
    with open_store(tmp_store_dir):
        pass
    env = lmdb.open(str(tmp_store_dir), max_dbs=8)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        if raw is None:
            txn.delete(b"schema_version", db=meta)
        else:
            txn.put(b"schema_version", raw, db=meta)
    env.close()
    with pytest.raises(StoreOpenError):
        open_store(tmp_store_dir)


def test_migration_2_builds_the_index_from_records(tmp_store_dir):
    """Unit test of 0002: the index is exactly the records' lru_seq."""
    _fill_v1(tmp_store_dir, 64 << 20)
    env = lmdb.open(str(tmp_store_dir), max_dbs=8)
    try:
        mig2 = schema.migrations()[1]
        with env.begin(write=True) as txn:
            mig2.upgrade(env, txn)
            lru = env.open_db(b"lru", txn=txn)
            entries = env.open_db(b"entries", txn=txn)
            index = [(struct.unpack(">Q", bytes(k))[0], bytes(v)) for k, v in txn.cursor(db=lru)]
            recs = sorted((codec.unpack_record(v).lru_seq, bytes(k)) for k, v in txn.cursor(db=entries))
            assert index == recs and len(index) == 4
            txn.abort()
    finally:
        env.close()


def test_handle_opened_before_a_migration_refuses_to_write(tmp_path):
    """A handle still at schema 1 (an older ecstore in another process) must not
    write once another handle migrated the file: its layout view is stale."""
    import torch

    import ecstore

    cfg = ecstore.ECStoreConfig(local_cpu=False, local_disk=str(tmp_path), max_local_disk_size=0.001)
    old = open_store_at_schema(cfg, 1, model="m", dtype=torch.float32)
    old.put("a", torch.ones(2, 2))
    old.flush()
    new = open_store_at_schema(cfg, 2, model="m", dtype=torch.float32)
    assert new.disk.schema_version == 2
    old.put("b", torch.ones(2, 2))
    with pytest.raises(ecstore.StoreFullError, match="migrated to schema 2"):
        old.flush()
    assert not new.contains("b")
    assert new.get("a") is not None
    new.put("c", torch.ones(2, 2))
    new.flush()
    assert new.contains("c")
    old.close()
    new.close()


def test_upgrade_to_4_keeps_large_inline_entries_and_puts_new_ones_in_files(tmp_store_dir):
    """Schema 4 (blob files): an entry of 1 MiB stored inside LMDB by
    schema 3 keeps being served from there; a new one of that size goes to a
    file, listed in the ``files`` index; deleting each cleans up its own."""
    big_old, big_new = make_tensor(1, rows=1024, cols=512), make_tensor(2, rows=1024, cols=512)
    with open_store(tmp_store_dir, schema_target=3) as store:
        assert store.disk.schema_version == 3 and store.disk.file_blobs_from is None
        store.put("old", big_old)
        store.flush()
    assert not (tmp_store_dir / "blobs").exists()  # schema 3 writes no blob files
    with open_store(tmp_store_dir) as store:  # migrates
        assert store.disk.schema_version == 4
        assert_same(store.get("old"), big_old)
        assert store.disk.referenced_files() == set()
        store.put("new", big_new)
        store.flush()
        (name,) = store.disk.referenced_files()
        assert sorted(p.name for p in (tmp_store_dir / "blobs").glob("*.ecb")) == [name]
        assert_same(store.get("new"), big_new)
        assert store.delete("new") and store.delete("old")
        assert store.disk.referenced_files() == set() and not list((tmp_store_dir / "blobs").glob("*.ecb"))
    assert b"files" in db_names(tmp_store_dir)
