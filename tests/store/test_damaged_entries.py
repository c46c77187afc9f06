"""Damaged entries never stop the store: an unreadable record or an LRU row
whose entry is gone is removed (by a read, eviction, ``purge --key`` or a
reopen with a smaller cap) with its LRU row and its blob's bytes, instead of
raising; eviction replaces victims leased meanwhile; vLLM starts over such a
store.

Everything runs on real LMDB files; damage is planted with real write
transactions on the store's own sub-databases (what an attacker with write
access to ``data.mdb`` could do).
"""

from __future__ import annotations

import torch
from helpers.fault_workers import open_store
from helpers.tensors import assert_same, make_tensor

from ecstore.format import codec
from ecstore.identity import library_identity, qualify
from ecstore.key import dtype_name
from ecstore.lmdb import LMDBTier
from ecstore.lmdb.env import _SharedEnv
from ecstore.lmdb.txn import _SEQ, _U64
from ecstore.testing import faults as fc

MiB = 1 << 20


def cost(ident: str, rows: int = 4, cols: int = 16, dtype: torch.dtype = torch.bfloat16) -> int:
    """Blob bytes of ``make_tensor(_, rows, cols, dtype)`` put as ``ident`` by
    a store opened without an identity (it stores ``"<namespace>/<ident>"``)."""
    name = qualify(library_identity(fc.MODEL, dtype_name(dtype)).namespace, ident)
    return codec.blob_size(make_tensor(0, rows, cols, dtype), identifier=name, model=fc.MODEL)


def corrupt_record(tier: LMDBTier, key: str) -> None:
    """Make ``key``'s packed record unreadable: an unknown record version
    (the identifier stays readable, as after a flipped first byte)."""
    with tier._write_txn() as txn:
        raw = txn.get(key.encode(), db=tier._dbs.entries)
        assert raw is not None
        txn.put(key.encode(), b"\x09" + bytes(raw)[1:], db=tier._dbs.entries)


def delete_record_only(tier: LMDBTier, key: str) -> None:
    """Remove ``key``'s record and blob but leave its LRU row (and total_bytes
    as it was): the dangling state the old ``_remove`` left behind."""
    with tier._write_txn() as txn:
        rec = codec.unpack_record(txn.get(key.encode(), db=tier._dbs.entries))
        txn.delete(key.encode(), db=tier._dbs.entries)
        txn.delete(key.encode(), db=tier._dbs.blobs)
        total = _U64.unpack(txn.get(b"total_bytes", db=tier._dbs.meta))[0]
        txn.put(b"total_bytes", _U64.pack(total - rec.blob_size), db=tier._dbs.meta)
        assert txn.get(_SEQ.pack(rec.lru_seq), db=tier._dbs.lru) == key.encode()


def lru_rows(tier: LMDBTier) -> list[bytes]:
    with tier.snapshot() as (txn, dbs):
        return [bytes(v) for _, v in txn.cursor(db=dbs.lru)]


# ===========================================================================
# An unreadable record or a dangling LRU row: eviction goes on
# ===========================================================================

def test_dropping_an_unreadable_record_removes_its_lru_row_and_eviction_goes_on(tmp_path):
    """get() of an entry whose record is unreadable drops it: its LRU row must
    go too, and puts that need eviction afterwards succeed (flush() does not
    raise, no write errors) with exact accounting."""
    c = cost("e0")
    cap = 6 * c
    with open_store(tmp_path / "s", cap=cap) as s:
        for i in range(6):
            s.put(f"e{i}", make_tensor(i))
        s.flush()
        corrupt_record(s.disk, s.key("e2"))
        assert s.get("e2") is None  # a miss, dropped
        assert s.key("e2").encode() not in lru_rows(s.disk)
        fc.audit(tmp_path / "s", cap, tier=s.disk).check()
        for i in range(6, 20):  # each put now has to evict
            s.put(f"e{i}", make_tensor(i))
            s.flush()
        assert s.stats().write_errors == 0
        assert s.stats().disk_evictions > 0
        for i in range(16, 20):  # the newest (5 fit: ids e10.. make larger blobs)
            assert_same(s.get(f"e{i}"), make_tensor(i))
        fc.audit(tmp_path / "s", cap, tier=s.disk).check()


def test_dangling_lru_row_left_by_an_old_version_is_cleaned_by_eviction(tmp_path):
    """A store already damaged by the old code (an LRU row whose entry is gone)
    still evicts: the dangling row is removed, nothing raises, accounting is
    exact."""
    c = cost("e0")
    cap = 4 * c
    with open_store(tmp_path / "s", cap=cap) as s:
        for i in range(4):
            s.put(f"e{i}", make_tensor(i))
        s.flush()
        delete_record_only(s.disk, s.key("e0"))  # e0 is the LRU head
        for i in range(4, 12):
            s.put(f"e{i}", make_tensor(i))
            s.flush()
        assert s.stats().write_errors == 0
        assert s.key("e0").encode() not in lru_rows(s.disk)
        fc.audit(tmp_path / "s", cap, tier=s.disk).check()


def test_corrupt_record_still_present_is_evicted_not_fatal(tmp_path):
    """A corrupt record nobody read yet, at the LRU head: eviction removes it
    (its blob's bytes leave total_bytes) instead of raising."""
    c = cost("e0")
    cap = 4 * c
    with open_store(tmp_path / "s", cap=cap) as s:
        for i in range(4):
            s.put(f"e{i}", make_tensor(i))
        s.flush()
        key0 = s.key("e0")
        corrupt_record(s.disk, key0)
        for i in range(4, 10):
            s.put(f"e{i}", make_tensor(i))
            s.flush()
        assert s.stats().write_errors == 0
        assert s.disk.record(key0) is None
        assert key0.encode() not in lru_rows(s.disk)
        fc.audit(tmp_path / "s", cap, tier=s.disk).check()


def test_removing_an_unreadable_record_reports_its_bytes(tmp_path):
    """LMDBTier.remove (used by ``ecstore-dump purge --key``) of an entry with
    an unreadable record removes its LRU row and reports the blob's bytes."""
    with open_store(tmp_path / "s") as s:
        s.put("e0", make_tensor(0))
        s.put("e1", make_tensor(1))
        s.flush()
        key0 = s.key("e0")
        corrupt_record(s.disk, key0)
        assert s.disk.remove(key0) == cost("e0")
        assert s.disk.remove(key0) is None
        assert lru_rows(s.disk) == [s.key("e1").encode()]
        fc.audit(tmp_path / "s", tier=s.disk).check()


def test_touch_of_a_corrupt_record_does_not_fail_the_batch(tmp_path):
    """An LRU touch (a read) of a key whose record became unreadable is
    skipped; the puts of the same batch are stored."""
    with open_store(tmp_path / "s") as s:
        s.put("e0", make_tensor(0))
        s.flush()
        assert s.get("e0") is not None  # a read: a pending touch of e0
        corrupt_record(s.disk, s.key("e0"))
        s.put("e1", make_tensor(1))
        s.flush()
        assert s.stats().write_errors == 0
        assert_same(s.get("e1"), make_tensor(1))


# ===========================================================================
# Opening with a smaller cap evicts damaged entries and leaks nothing
# ===========================================================================

def test_reopen_with_smaller_cap_over_a_corrupt_record_opens_and_leaks_nothing(tmp_path):
    """Reopening with a smaller cap evicts at open; a corrupt record at the
    LRU head used to make the constructor raise (a non-ECStoreError) and
    leak one reference to the process's shared environment per attempt."""
    path = tmp_path / "s"
    c = cost("e0")
    keep = open_store(path, cap=64 * MiB)  # holds the shared environment open
    try:
        for i in range(8):
            keep.put(f"e{i}", make_tensor(i))
        keep.flush()
        corrupt_record(keep.disk, keep.key("e0"))
        shared = _SharedEnv._open[str(path.resolve())]
        assert shared.refs == 1
        for _ in range(3):
            with open_store(path, cap=3 * c) as small:
                assert small.disk.total_bytes() <= 3 * c
            assert shared.refs == 1
        fc.audit(path, 3 * c, tier=keep.disk).check()
    finally:
        keep.close()
    assert str(path.resolve()) not in _SharedEnv._open


# ===========================================================================
# Eviction replaces victims leased after their selection
# ===========================================================================

def test_victims_leased_after_selection_are_replaced(tmp_path):
    """Between choosing victims and marking them, another loader leases
    them: eviction must choose other (unleased) entries instead of failing
    the put "pinned by leases"."""
    c = cost("e0")
    cap = 4 * c
    with open_store(tmp_path / "s", cap=cap) as s:
        for i in range(4):
            s.put(f"e{i}", make_tensor(i))
        s.flush()
        tier = s.disk
        real = tier.leased_keys
        calls = {"n": 0}

        def leased_keys_with_a_racing_loader() -> set[bytes]:
            # First call: victim selection. Right after it, a loader in
            # another process leases the LRU head (a real lease).
            got = real()
            calls["n"] += 1
            if calls["n"] == 1:
                tier.lease([s.key("e0")], 60, pid=fc_other_pid())
            return got

        tier.leased_keys = leased_keys_with_a_racing_loader  # type: ignore[method-assign]
        try:
            s.put("e4", make_tensor(4))
            s.flush()  # today: StoreFullError "pinned by leases"
        finally:
            del tier.leased_keys
        assert s.contains("e0") and s.contains("e4")
        assert not s.contains("e1")  # the next least recently used went instead
        fc.audit(tmp_path / "s", cap, tier=tier).check()


def fc_other_pid() -> int:
    """A live process id other than ours (our parent) to own a lease."""
    import os

    return os.getppid()


# ===========================================================================
# ecstore-dump purge --key of an unreadable record
# ===========================================================================

def test_purge_key_of_an_unreadable_record_repairs_and_reports_its_bytes(tmp_path, capsys):
    """``ecstore-dump purge --key`` of an entry whose record is unreadable
    removes it with its LRU row and reports the blob's bytes (was "0 B"),
    after which eviction works."""
    from ecstore import cli

    path = tmp_path / "s"
    c = cost("e0")
    with open_store(path, cap=64 * MiB) as s:
        for i in range(4):
            s.put(f"e{i}", make_tensor(i))
        s.flush()
        key0 = s.key("e0")
        corrupt_record(s.disk, key0)
    capsys.readouterr()
    assert cli.main(["purge", str(path), "--key", key0]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"removed 1 entry ({c} B)"), out
    with open_store(path, cap=3 * c) as s:
        assert key0.encode() not in lru_rows(s.disk)
        s.put("e9", make_tensor(9))
        s.flush()
        fc.audit(path, 3 * c, tier=s.disk).check()


# ===========================================================================
# vLLM start-up over a store whose open evicts damaged entries
# ===========================================================================

def test_connector_starts_over_a_store_whose_open_evicts_damaged_entries(tmp_path, tiny_model_dir):
    """vLLM start-up: both connector roles open a store that must evict at
    open (configured cap smaller than what is stored) while its LRU head is
    damaged. Before the fix the constructor raised a non-ECStoreError and
    vLLM failed to start; now the connectors start and the store is within
    its cap and consistent."""
    from helpers import vllm_objects as vo
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    path = tmp_path / "ec"
    cfg = vo.vllm_config(tiny_model_dir, "ec_both", {"local_disk": str(path), "max_local_disk_size": 0.004})
    model = cfg.model_config.model
    with open_store(path, cap=64 * MiB, model=model, dtype=torch.float32) as s:
        for i in range(8):  # 8 x 1 MiB > the 4 MiB the connector configures
            s.put(f"img-{i}", fc.entry_tensor(i, 512, dtype=torch.float32))
        s.flush()
        corrupt_record(s.disk, s.key("img-0"))
    made = []
    try:
        for role in (ECConnectorRole.SCHEDULER, ECConnectorRole.WORKER):
            made.append(ECConnectorFactory.create_connector(config=cfg, role=role))
    finally:
        for conn in made:
            conn.shutdown()
    assert len(made) == 2
    fc.audit(path, int(0.004 * (1 << 30))).check()
