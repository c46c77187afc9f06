"""The handle's tiers are held in one place (:class:`ecstore.store.tiers.Tiers`):
the read path, the put path, the stats snapshot, verify, delete and close all
work on that one object."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import gib
from helpers.tensors import assert_same, make_tensor

from ecstore import ECStore, ECStoreConfig
from ecstore.store.tiers import Tier, Tiers

MODEL = "tiers/m"


def _store(path: Path) -> ECStore:
    cfg = ECStoreConfig(local_cpu=True, max_local_cpu_size=gib(8 << 20), local_disk=str(path),
                        max_local_disk_size=gib(64 << 20))
    return ECStore(cfg, model=MODEL, dtype=torch.bfloat16)


def test_reads_puts_and_the_handle_share_one_tiers_object(tmp_path: Path) -> None:
    with _store(tmp_path) as s:
        tiers = s._tiers
        assert isinstance(tiers, Tiers)
        assert s._reads.tiers is tiers and s._puts.tiers is tiers
        assert (s.memory, s._writer, s.disk, s.remote) == (tiers.memory, tiers.writer, tiers.disk, None)
        assert all(isinstance(t, Tier) for t in tiers.local()) and len(tiers.local()) == 2
        s.put("a", make_tensor(1))
        s.flush()
        st = s.stats()
        assert (st.memory_entries, st.disk_entries) == (1, 1)
        assert s.verify("a")
        assert tiers.identifier_at(s.key("a")) == s.stored_name("a")
        assert s.delete("a") and tiers.identifier_at(s.key("a")) is None
        assert not s.delete("a") and s.get("a") is None
    assert s.remote is None


def test_delete_of_another_name_keeps_the_entry_under_the_key(tmp_path: Path) -> None:
    """Tiers.delete removes only the named entry: a key holding another name
    (a hash collision) keeps it in every tier."""
    with _store(tmp_path) as s:
        s.put("a", make_tensor(2))
        s.flush()
        key = s.key("a")
        assert not s._tiers.delete(key, s.stored_name("b"))
        assert_same(s.get("a"), make_tensor(2))
        assert s.disk is not None and s.disk.contains(key, s.stored_name("a"))


def test_the_handles_signature_has_no_test_hooks(tmp_path: Path) -> None:
    """Test seams (schema, map size, remote clock) are not ECStore arguments:
    ecstore.testing.stores opens handles with them through an internal seam."""
    import inspect

    from ecstore.testing.stores import open_store_at_schema, open_store_with_map_size

    assert list(inspect.signature(ECStore).parameters) == [
        "config", "model", "dtype", "readonly", "chunk_hasher", "identity"]
    cfg = ECStoreConfig(local_cpu=False, local_disk=str(tmp_path), max_local_disk_size=gib(64 << 20))
    with open_store_at_schema(cfg, 1, model=MODEL, dtype=torch.bfloat16) as s:
        assert s.disk is not None and s.disk.schema_version == 1
    cfg = ECStoreConfig(local_cpu=False, local_disk=str(tmp_path / "b"), max_local_disk_size=gib(64 << 20))
    with open_store_with_map_size(cfg, 4 << 20, model=MODEL, dtype=torch.bfloat16) as s:
        assert s.disk is not None and s.disk.env_info()["map_size"] == 4 << 20
