"""Regression tests for the storage-core defects of issue 14 ("Hardening").

Each test names the defect number it covers. Everything runs on real LMDB
files; damage is planted with real write transactions on the store's own
sub-databases (what an attacker with write access to ``data.mdb`` could do),
and processes that might crash on today's code run in worker processes.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import hostile
from helpers.fault_workers import open_store
from helpers.tensors import assert_same, make_tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ecstore import StoreFullError
from ecstore.errors import CorruptEntryError
from ecstore.format import blob_check, blob_read, codec
from ecstore.identity import library_identity, qualify
from ecstore.key import dtype_name
from ecstore.lmdb import LMDBTier
from ecstore.lmdb.env import _SharedEnv
from ecstore.lmdb.txn import _SEQ, _U64
from ecstore.testing import faults as fc

MiB = 1 << 20
KiB = 1 << 10


def cost(ident: str, rows: int = 4, cols: int = 16, dtype: torch.dtype = torch.bfloat16) -> int:
    """Blob bytes of ``make_tensor(_, rows, cols, dtype)`` put as ``ident`` by
    a store opened without an identity (it stores ``"<namespace>/<ident>"``)."""
    name = qualify(library_identity(fc.MODEL, dtype_name(dtype)).namespace, ident)
    return codec.blob_size(make_tensor(0, rows, cols, dtype), identifier=name, model=fc.MODEL)


def corrupt_record(tier: LMDBTier, key: str) -> None:
    """Make ``key``'s packed record unreadable: an unknown record version
    (the identifier stays readable, as after a flipped first byte)."""
    with tier._write_txn() as txn:
        raw = txn.get(key.encode(), db=tier._entries)
        assert raw is not None
        txn.put(key.encode(), b"\x09" + bytes(raw)[1:], db=tier._entries)


def delete_record_only(tier: LMDBTier, key: str) -> None:
    """Remove ``key``'s record and blob but leave its LRU row (and total_bytes
    as it was): the dangling state the old ``_remove`` left behind."""
    with tier._write_txn() as txn:
        rec = codec.unpack_record(txn.get(key.encode(), db=tier._entries))
        txn.delete(key.encode(), db=tier._entries)
        txn.delete(key.encode(), db=tier._blobs)
        total = _U64.unpack(txn.get(b"total_bytes", db=tier._meta))[0]
        txn.put(b"total_bytes", _U64.pack(total - rec.blob_size), db=tier._meta)
        assert txn.get(_SEQ.pack(rec.lru_seq), db=tier._lru) == key.encode()


def lru_rows(tier: LMDBTier) -> list[bytes]:
    with tier.snapshot() as (txn, dbs):
        return [bytes(v) for _, v in txn.cursor(db=dbs["lru"])]


# ===========================================================================
# Defect 1: one unreadable record stops all eviction
# ===========================================================================

def test_d1_dropping_an_unreadable_record_removes_its_lru_row_and_eviction_goes_on(tmp_path):
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


def test_d1_dangling_lru_row_left_by_an_old_version_is_cleaned_by_eviction(tmp_path):
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


def test_d1_corrupt_record_still_present_is_evicted_not_fatal(tmp_path):
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


def test_d1_removing_an_unreadable_record_reports_its_bytes(tmp_path):
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


def test_d1_touch_of_a_corrupt_record_does_not_fail_the_batch(tmp_path):
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
# Defect 2: a failing open leaks the shared environment
# ===========================================================================

def test_d2_reopen_with_smaller_cap_over_a_corrupt_record_opens_and_leaks_nothing(tmp_path):
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
# Defect 3: back-pressure drifts
# ===========================================================================

def test_d3_replacing_a_queued_put_keeps_queued_bytes_exact(tmp_path):
    """Two puts of one key both reach the writer queue (two threads passed
    the presence check at once); the second replaces the first, and
    ``queued_bytes`` must count it once and return to zero."""
    from ecstore.store.writer import PendingPut

    with open_store(tmp_path / "s") as s:
        w = s._writer
        t = make_tensor(1)
        nbytes = codec.tensor_nbytes(t)
        key = s.key("dup")
        with s.disk._shared.write_lock:  # the writer cannot commit meanwhile
            s.put("first", make_tensor(0))  # occupies the writer (waits for the lock)
            with w.cv:
                while "first" not in [it.mm_hash for it in w.inflight.values()]:
                    w.cv.wait(0.05)  # the writer takes it without notifying
            name = s.stored_name("dup")
            w.submit(key, PendingPut(name, t, nbytes))
            w.submit(key, PendingPut(name, t.clone(), nbytes))
            assert s.stats().pending_bytes == 2 * nbytes  # "first" in flight + one "dup"
        s.flush()
        assert s.stats().pending_bytes == 0
        assert s.stats().pending_writes == 0
        assert_same(s.get("dup"), t)


# ===========================================================================
# Defect 5: eviction gives up when chosen victims get leased meanwhile
# ===========================================================================

def test_d5_victims_leased_after_selection_are_replaced(tmp_path):
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
# Defect 6: a disk hit aliases the memory-tier copy
# ===========================================================================

def test_d6_modifying_a_disk_hit_does_not_change_later_hits(tmp_path):
    path = tmp_path / "s"
    with open_store(path) as s:
        s.put("e0", make_tensor(0))
    with open_store(path, cpu=8 * MiB) as s:
        got = s.get("e0")  # disk hit, promoted to the memory tier
        assert s.stats().disk_hits == 1
        got.fill_(0)
        again = s.get("e0")
        assert s.stats().memory_hits == 1
        assert_same(again, make_tensor(0))


# ===========================================================================
# Defect 7: flush() loses an error appended while it swaps the list
# ===========================================================================

def test_d7_every_write_error_is_reported_by_exactly_one_flush(tmp_path):
    """Errors recorded by the writer while flush() takes them are never lost:
    a thread records 5000 errors the way the writer does while the main
    thread takes them the way flush() does; every one is taken once."""
    import sys

    with open_store(tmp_path / "s") as s:
        w = s._writer
        n = 5000
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            done = threading.Event()

            def record() -> None:
                for i in range(n):
                    w.add_error(StoreFullError(str(i)))
                done.set()

            th = threading.Thread(target=record)
            th.start()
            taken = 0
            while not done.is_set():
                taken += len(w.take_errors())
            th.join()
            taken += len(w.take_errors())
        finally:
            sys.setswitchinterval(old)
        assert taken == n


def test_d1_d7_purge_key_of_an_unreadable_record_repairs_and_reports_its_bytes(tmp_path, capsys):
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
# Defects 9 and 10: hostile entries (record + blob agree, checksum recomputed)
# ===========================================================================

@pytest.mark.parametrize("case", sorted(hostile.CASES))
def test_d9_d10_hostile_entry_is_a_miss_and_dropped(tmp_path, case):
    """Each hostile header (table in tests/helpers/hostile.py) planted over a
    float32 [4, 16] entry: ``get`` returns a miss (no exception, no crash,
    never another model's, dtype's or shape's tensor, never header bytes as
    data), the entry is dropped, the other entry is intact. Runs in a worker
    process: before the fix, quantized dtypes corrupted the heap (SIGABRT)."""
    r = fc.run_forked(hostile.get_hostile, str(tmp_path / "s"), case, timeout=180).ok()
    assert r == {"get": "miss", "still_stored": False, "corrupt_dropped": 1, "bystander_ok": True}, r


def test_d9_d10_entry_check_is_public_and_names_the_mismatch():
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
def test_d9_d10_any_hostile_header_is_refused_or_read_exactly(edits, data_len):
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


# ===========================================================================
# Defects 4 and 15: another process grows the map (MDB_MAP_RESIZED)
# ===========================================================================

GROW = str(Path(__file__).resolve().parents[1] / "helpers" / "grow_store.py")


def grow_from_another_process(path, mib: int, prefix: str = "grow") -> int:
    """Another process puts ``mib`` 1 MiB entries with a large cap; returns
    the data file's size afterwards."""
    cp = subprocess.run([sys.executable, GROW, str(path), str(mib), prefix], capture_output=True, text=True,
                        timeout=300)
    assert cp.returncode == 0, cp.stderr
    return int(cp.stdout.split()[-1])


def test_d4_d15_long_lived_handle_works_after_another_process_grew_the_map(tmp_path):
    """This process opened the store with a small map (1 MiB cap); another
    process then grows the file past it. Every kind of transaction in this
    process still works: opening another handle (schema check), contains,
    get, a tooling scan, a put that evicts, a flush."""
    path = tmp_path / "s"
    s = open_store(path, cap=1 * MiB)
    try:
        s.put("mine", make_tensor(0))
        s.flush()
        small_map = s.disk.env_info()["map_size"]
        assert grow_from_another_process(path, 8) > small_map
        with open_store(path, cap=256 * MiB) as other:  # ensure_schema in this process
            assert other.contains("grow-3")
        assert s.contains("grow-0") and s.contains("mine")
        assert fc.tensor_bytes(s.get("grow-7")) == fc.tensor_bytes(fc.entry_tensor(7, 1024))
        assert len(list(s.disk.iter_records())) == 9
        s.put("mine-2", make_tensor(2))
        s.flush()  # evicts down to the 1 MiB cap
        assert_same(s.get("mine-2"), make_tensor(2))
        assert s.disk.total_bytes() <= 1 * MiB
        assert s.disk.env_info()["map_size"] > small_map  # adopted the other process's size
        fc.audit(path, 1 * MiB, tier=s.disk).check()
    finally:
        s.close()


def _readonly_reader_after_growth(path: str) -> list[str]:
    """Worker: a read-only handle (as ``ecstore-dump`` and the tooling open
    one) whose map is the file's size at open; another process grows it."""
    from helpers.fault_workers import open_store as open_

    out = []
    with open_(path, cap=1 * MiB, readonly=True) as ro:
        out.append(f"before {ro.contains('grow-0')}")
        grow_from_another_process(path, 6, "more")
        out.append(f"after {ro.contains('more-5')} {ro.get('more-5') is not None}")
        out.append(f"scan {len(list(ro.disk.iter_records()))}")
    return out


def test_d4_readonly_handle_adopts_a_grown_map(tmp_path):
    path = tmp_path / "s"
    with open_store(path, cap=256 * MiB) as s:
        s.put("grow-0", make_tensor(0))
    r = fc.run_forked(_readonly_reader_after_growth, str(path), timeout=300).ok()
    assert r == ["before True", "after True True", "scan 7"], r


def test_d15_small_cap_four_writing_processes_puts_evict_and_proceed(tmp_path):
    """4 MiB cap, entries up to 1 MiB, 4 processes putting, reading, pinning,
    deleting and shrinking at once (tools/stress_concurrency.py): every put
    evicts and proceeds (no flush raises StoreFullError: the map filled with
    pages that other processes' read snapshots still held, and the writer
    gave up), accounting exact, verify clean."""
    from ecstore.testing import stress_concurrency

    s = stress_concurrency.run(procs=4, ops=500, seed=2, mode="evict", root=tmp_path, cap=4 * MiB,
                               max_bytes=1 * MiB, log=print)
    assert s["disk_evictions"] > 0 and s["ops"]["put_new"] > 0


def test_d2_connector_starts_over_a_store_whose_open_evicts_damaged_entries(tmp_path, tiny_model_dir):
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
