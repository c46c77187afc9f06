"""The maintenance library (``ecstore.maintenance``) used directly, without
argparse: typed results of verify, page statistics, purge and compact on
real stores. ``tests/cli/test_cli.py`` covers the same work through the CLI."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest
import torch

from ecstore import ECStore, ECStoreConfig, maintenance


def cfg(path: Path) -> ECStoreConfig:
    return ECStoreConfig(local_cpu=False, local_disk=str(path), max_local_disk_size=1.0)


def tensor_for(i: int) -> torch.Tensor:
    return torch.arange(256, dtype=torch.float32).reshape(16, 16) + i


def fill(path: Path, model: str, n: int, dtype: torch.dtype = torch.float32) -> list[str]:
    with ECStore(cfg(path), model=model, dtype=dtype) as s:
        for i in range(n):
            s.put(f"img-{i}", tensor_for(i).to(dtype))
        s.flush()
        return [s.key(f"img-{i}") for i in range(n)]


def flip_data_byte(path: Path, key: str) -> None:
    """Change one tensor byte of ``key``'s blob, leaving its record (and so
    its checksum) as it was: what a bad disk sector does."""
    env = lmdb.open(str(path), max_dbs=8)
    try:
        blobs = env.open_db(b"blobs")
        with env.begin(write=True) as txn:
            blob = bytearray(txn.get(key.encode(), db=blobs))
            blob[-5] ^= 0xFF
            txn.put(key.encode(), bytes(blob), db=blobs)
    finally:
        env.close()


def test_verify_reports_what_get_refuses(tmp_path: Path) -> None:
    store = tmp_path / "store"
    keys = fill(store, "org/m", 4)
    flip_data_byte(store, keys[2])
    with maintenance.open_readonly(str(store)) as tier:
        res = maintenance.verify(tier)
    assert isinstance(res, maintenance.VerifyResult)
    assert (res.checked, res.ok, res.vanished, res.problems) == (4, 3, 0, [])
    assert [(b.key, b.identifier) for b in res.bad] == [(keys[2], "img-2")]
    assert res.bad[0].error.startswith("checksum mismatch (record ") and not res.clean
    with ECStore(cfg(store), model="org/m", dtype=torch.float32) as s:  # the same check: a miss
        assert s.get("img-2") is None
        assert torch.equal(s.get("img-1"), tensor_for(1))


def test_purge_by_model_keeps_accounting_exact(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fill(store, "org/a", 5)
    kept = fill(store, "org/b", 3, torch.float16)
    with maintenance.open_readonly(str(store)) as tier:
        victims = maintenance.select_victims(tier, maintenance.PurgeCriteria(model="org/a"))
        version, total = tier.schema_version, tier.total_bytes()
    assert sorted(r.model for r in victims) == ["org/a"] * 5
    removed: list[str] = []
    res = maintenance.purge(str(store), victims, schema_version=version, on_removed=removed.append,
                            capacity=maintenance.purge_capacity(str(store), None, total))
    assert (res.removed, res.skipped) == (5, 0) and sorted(removed) == sorted(r.key for r in victims)
    assert res.freed == sum(r.rec.blob_size for r in victims if r.rec)
    with maintenance.open_readonly(str(store)) as tier:
        st = maintenance.store_report(tier)
        assert maintenance.verify(tier).clean
    assert sorted(r.key for r in st.rows) == sorted(kept)
    assert [(g.model, g.dtype, g.entries) for g in st.by_model] == [("org/b", "float16", 3)]
    assert st.pages.accounted_bytes == st.bytes == total - res.freed
    assert st.pages.tree_pages <= st.pages.file_pages and "accounted_bytes" not in st.pages.as_json()


def test_compact_refuses_an_open_store_then_shrinks_it(tmp_path: Path) -> None:
    store = tmp_path / "store"
    keys = fill(store, "org/m", 40)
    with maintenance.open_readonly(str(store)) as tier:
        victims = maintenance.select_victims(tier, maintenance.PurgeCriteria(keys=frozenset(keys[:30])))
        version, total = tier.schema_version, tier.total_bytes()
    maintenance.purge(str(store), victims, schema_version=version,
                      capacity=maintenance.purge_capacity(str(store), None, total))
    with ECStore(cfg(store), model="org/m", dtype=torch.float32):
        with pytest.raises(maintenance.StoreBusyError):
            maintenance.compact(str(store))
    res = maintenance.compact(str(store))
    assert isinstance(res, maintenance.CompactResult) and res.entries == 10 and res.after < res.before
    with ECStore(cfg(store), model="org/m", dtype=torch.float32) as s:
        assert torch.equal(s.get("img-35"), tensor_for(35)) and s.get("img-0") is None


def test_entry_detail_reads_record_header_and_check(tmp_path: Path) -> None:
    store = tmp_path / "store"
    keys = fill(store, "org/m", 2)
    flip_data_byte(store, keys[1])
    with maintenance.open_readonly(str(store)) as tier:
        rows, how = maintenance.find_entries(tier, "img-0")
        good = maintenance.entry_detail(tier, rows[0])
        bad = maintenance.entry_detail(tier, maintenance.find_entries(tier, keys[1])[0][0])
        gone = maintenance.entry_detail(tier, maintenance.Row("org/m@1@0@0000000000000000@float32", None))
    assert how == "identifier" and isinstance(good, maintenance.EntryDetail)
    assert good.present and good.problem is None and good.header_error is None
    assert good.row.key == keys[0] and good.row.rec is not None and good.row.rec.mm_identifier == "img-0"
    assert good.header is not None and good.header["ec"]["shape"] == [16, 16]
    assert good.data_offset == good.header_bytes + 8 and good.blob_bytes == good.row.rec.blob_size
    # A flipped tensor byte: the header still parses, the check (the one get runs) fails.
    assert bad.present and bad.problem is not None and bad.problem.startswith("checksum mismatch")
    assert bad.header is not None
    assert not gone.present and gone.problem is None and gone.header is None
