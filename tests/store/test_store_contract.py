"""The store contract (:mod:`ecstore.testing.store_contract`) for each tier layout, plus
checks specific to one layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb
import pytest
import safetensors
import safetensors.torch
import torch
from conftest import gib
from helpers.tensors import assert_same, make_tensor

from ecstore import ECStore, ECStoreConfig
from ecstore.format import codec
from ecstore.testing.store_contract import BIG, MODEL, StoreContract


def _open(cfg: ECStoreConfig, caps: dict[str, Any]) -> ECStore:
    caps.setdefault("dtype", torch.bfloat16)
    caps.setdefault("model", MODEL)
    return ECStore(cfg, **caps)


class TestMemoryOnly(StoreContract):
    """local_cpu=True, no local_disk: a per-process LRU bounded in tensor bytes."""

    def make_store(self, tmp_path: Path, **caps: Any) -> ECStore:
        cap = caps.pop("cap_bytes", BIG)
        return _open(ECStoreConfig(local_cpu=True, max_local_cpu_size=gib(cap)), caps)

    def cost(self, store, identifier, tensor):
        return tensor.numel() * tensor.element_size()

    def used_bytes(self, stats):
        return stats.memory_bytes

    def tier_entries(self, store):
        return store.memory.keys()

    def test_nothing_touches_disk(self, tmp_path, monkeypatch):
        def no_lmdb(*a, **k):
            raise AssertionError("memory-only store opened an LMDB environment")

        monkeypatch.setattr(lmdb, "open", no_lmdb)
        monkeypatch.chdir(tmp_path)
        with self.make_store(tmp_path) as store:
            assert store.disk is None and store._writer is None
            for i in range(5):
                store.put(f"m{i}", make_tensor(i))
            store.flush()
            assert store.delete("m0")
            assert_same(store.get("m1"), make_tensor(1))
            assert store.stats().disk_bytes == 0
        assert list(tmp_path.iterdir()) == []


class TestLMDBOnly(StoreContract):
    """local_cpu=False: every read goes to LMDB (or the writer's queue)."""

    def make_store(self, tmp_path: Path, **caps: Any) -> ECStore:
        cap = caps.pop("cap_bytes", BIG)
        cfg = ECStoreConfig(local_cpu=False, local_disk=str(tmp_path / "ec"), max_local_disk_size=gib(cap))
        return _open(cfg, caps)

    def cost(self, store, identifier, tensor):
        return len(codec.encode(tensor.contiguous(), identifier=store.stored_name(identifier), model=store.model))

    def used_bytes(self, stats):
        return stats.disk_bytes

    def tier_entries(self, store):
        return store.disk.lru_keys()

    def test_memory_tier_disabled(self, tmp_path):
        with self.make_store(tmp_path) as store:
            assert store.memory is None
            store.put("a", make_tensor(1))
            store.flush()
            st = store.stats()
            assert (st.memory_entries, st.memory_bytes, st.memory_capacity_bytes) == (0, 0, 0)
            assert st.disk_entries == 1

    def test_file_uri_local_disk(self, tmp_path):
        cfg = ECStoreConfig(local_cpu=False, local_disk=(tmp_path / "uri").as_uri(), max_local_disk_size=gib(BIG))
        with ECStore(cfg, model=MODEL, dtype=torch.bfloat16) as store:
            store.put("a", make_tensor(1))
        assert (tmp_path / "uri" / "data.mdb").is_file()

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
    def test_blobs_are_safetensors(self, tmp_path, dtype):
        with self.make_store(tmp_path, dtype=dtype) as store:
            ident = "img/with@odd\x00chars"
            t = make_tensor(4, 6, 32, dtype)
            store.put(ident, t)
            store.flush()
            blob = bytes(store.disk.blob_bytes(store.key(ident)))
            assert_same(safetensors.torch.load(blob)["ec"], t)
            path = tmp_path / "blob.safetensors"
            path.write_bytes(blob)
            with safetensors.safe_open(str(path), framework="pt") as f:
                meta = f.metadata()
                assert list(f.keys()) == ["ec"]
                assert_same(f.get_tensor("ec"), t)
            assert meta["format"] == "ecstore/1"
            assert meta["identifier"] == f"{store.namespace}/{ident}"  # the stored name
            assert meta["model"] == MODEL
            assert meta["dtype"] == str(dtype).removeprefix("torch.")
            assert store.stats().disk_bytes == len(blob)

    def test_corrupt_blob_is_a_miss_and_is_dropped(self, tmp_path, caplog):
        with self.make_store(tmp_path) as store:
            t = make_tensor(1)
            store.put("c", t)
            store.put("ok", make_tensor(2))
            store.flush()
            key = store.key("c")
            blob = bytearray(store.disk.blob_bytes(key))
            blob[-1] ^= 0xFF
            with store.disk.env.begin(write=True) as txn:
                txn.put(key.encode(), bytes(blob), db=store.disk._dbs.blobs)
            assert store.get("c") is None
            assert not store.contains("c")
            st = store.stats()
            assert st.corrupt_dropped == 1 and st.disk_entries == 1
            assert st.disk_bytes == len(store.disk.blob_bytes(store.key("ok")))
            assert_same(store.get("ok"), make_tensor(2))


class TestCombined(StoreContract):
    """Memory tier above the LMDB tier. ``cap_bytes`` bounds the disk tier
    (which decides survival); the memory tier gets an eighth of it, so it
    only ever holds a subset of the most recently used entries."""

    def make_store(self, tmp_path: Path, **caps: Any) -> ECStore:
        cap = caps.pop("cap_bytes", BIG)
        cfg = ECStoreConfig(local_cpu=True, max_local_cpu_size=gib(cap // 8),
                            local_disk=str(tmp_path / "ec"), max_local_disk_size=gib(cap))
        return _open(cfg, caps)

    cost = TestLMDBOnly.cost
    used_bytes = TestLMDBOnly.used_bytes
    tier_entries = TestLMDBOnly.tier_entries

    def test_memory_bound_and_disk_promotion(self, tmp_path):
        t = make_tensor(0)
        nbytes = t.numel() * t.element_size()
        cfg = ECStoreConfig(local_cpu=True, max_local_cpu_size=gib(2 * nbytes + nbytes // 2),
                            local_disk=str(tmp_path / "ec"), max_local_disk_size=gib(BIG))
        with ECStore(cfg, model=MODEL, dtype=torch.bfloat16) as store:
            ts = {f"p{i}": make_tensor(i) for i in range(5)}
            for h, x in ts.items():
                store.put(h, x)
                assert store.stats().memory_bytes <= 2 * nbytes + nbytes // 2
            store.flush()
            st = store.stats()
            assert st.memory_entries == 2 and st.disk_entries == 5
            assert store.memory.keys() == [store.key("p3"), store.key("p4")]
            assert st.memory_evictions == 3 and st.disk_evictions == 0
            assert_same(store.get("p0"), ts["p0"])  # disk hit, promoted
            assert store.memory.keys() == [store.key("p4"), store.key("p0")]
            assert_same(store.get("p0"), ts["p0"])  # memory hit now
            st = store.stats()
            assert (st.disk_hits, st.memory_hits) == (1, 1)
