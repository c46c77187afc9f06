"""Fault tests: ecstore keeps LMDB's ACID promise end to end.

An encoder cache may lose performance, never correctness, never the engine.
Every test here uses real LMDB files and real processes (killed with
SIGKILL, dying with a read transaction open, forked, limited by
RLIMIT_FSIZE); no sleeps order anything: processes report progress over
pipes and the parent acts on what they report.

The crash and concurrency tests run the same code as the stress scripts
(tools/stress_crash.py, tools/stress_concurrency.py), with smaller knobs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch
from helpers import fault_fs
from helpers import fault_workers as fw
from helpers.fault_workers import blob_tensor, cfg, open_store
from helpers.tensors import assert_same, make_tensor, stored_name

from ecstore import ECStore, ECStoreError, ForkedStoreError, StoreFullError, StoreOpenError
from ecstore.format import codec
from ecstore.testing import faults as fc
from ecstore.testing import stress_concurrency, stress_crash  # noqa: E402
from ecstore.testing.stores import open_store_with_map_size

MODEL = fc.MODEL
MiB = 1 << 20
KiB = 1 << 10


# ===========================================================================
# Crash during writes
# ===========================================================================

def test_sigkill_during_writes_loses_nothing_flushed(tmp_path):
    """20 rounds of 2 writer processes on one store, each SIGKILLed at a
    random moment (after N of its progress reports, N from a seeded RNG),
    entries 4 KiB..24 MiB, eviction active on one store, none possible on
    the other. After every round: the store opens, nothing is partial,
    accounting is exact, the bound holds, every entry flushed before the
    kill is bit-exact or (evicting store only) was evicted, in LRU order,
    when what had been committed exceeded the cap."""
    summary = stress_crash.run(kills=20, writers=2, seed=20240611, root=tmp_path, verify_every=0, log=print)
    assert summary["kills"] == 20 and summary["processes_killed"] == 40
    ev, roomy = summary["stores"]["evicting"], summary["stores"]["roomy"]
    assert ev["flushed"] > 0 and roomy["flushed"] > 0
    assert ev["max_evicted_flushed"] > 0, "the evicting store never evicted: the test lost its teeth"
    assert roomy["max_evicted_flushed"] == 0


def _meta_txnids(data: bytes, psize: int = 4096) -> list[int]:
    """Transaction ids in LMDB's two meta pages (64-bit layout: mm_txnid at
    byte 144 of each page)."""
    return [int.from_bytes(data[p * psize + 144: p * psize + 152], "little") for p in (0, 1)]


def test_power_loss_before_the_last_meta_page_is_synced_reverts_one_commit(tmp_path):
    """Simulated power cut. The store runs with metasync=False: each commit
    fsyncs its data pages, but its meta page (which makes it current) only
    reaches the disk with the next commit's fsync or ``flush()``. So a power
    cut can lose exactly the last unflushed commit. Simulate it: after three
    commits, put the meta page the last commit wrote back to its previous
    bytes. The store must open at the commit before, consistent and exact."""
    path = tmp_path / "s"
    data_file = path / "data.mdb"
    with open_store(path) as s:
        s.put("e1", make_tensor(1))
        s.flush()
        s.put("e2", make_tensor(2))
        s.flush()
        before_last = data_file.read_bytes()
        s.put("e3", make_tensor(3))
        s.flush()
    after = data_file.read_bytes()
    old_ids, new_ids = _meta_txnids(before_last), _meta_txnids(after)
    assert max(new_ids) == max(old_ids) + 1, (old_ids, new_ids)  # exactly one commit to undo
    page = new_ids.index(max(new_ids))
    with open(data_file, "r+b") as fh:  # the last meta write "never reached the disk"
        fh.seek(page * 4096)
        fh.write(before_last[page * 4096:(page + 1) * 4096])
    assert max(_meta_txnids(data_file.read_bytes())) == max(old_ids)
    with open_store(path) as s:
        assert_same(s.get("e1"), make_tensor(1))
        assert_same(s.get("e2"), make_tensor(2))
        assert s.get("e3") is None  # the lost commit, whole
        fc.audit(path, 64 * MiB, tier=s.disk).check()
        s.put("e3", make_tensor(3))  # and the store goes on
        s.flush()
        assert_same(s.get("e3"), make_tensor(3))


# ===========================================================================
# Concurrency
# ===========================================================================

@pytest.mark.parametrize("mode,file_blobs", [("roomy", False), ("evict", False), ("evict", True)])
def test_concurrent_processes_share_one_store(tmp_path, mode, file_blobs):
    """4 processes x 300 operations put/get/delete/pin (and, evicting,
    shrink) on one store, all putting the same shared entries as
    tensor-parallel ranks do, while a reader checks accounting and the bound
    in every snapshot. No error, no wrong byte, no committed entry lost
    (roomy), exact accounting at the end, ``ecstore-dump verify`` clean.
    ``file_blobs``: every blob in a file of its own (``min_file_blob_size``
    0): evictions and deletes of one process remove files other processes
    are about to read; at the end no file is left that no entry references."""
    s = stress_concurrency.run(procs=4, ops=300, seed=7, mode=mode, root=tmp_path, log=print,
                               file_blob_bytes=0 if file_blobs else 4 * MiB)
    assert s["reader_checks"] > 0 and s["ops"]["hit"] > 0
    if mode == "evict":
        assert s["ops"]["shrink_evicted"] + s["disk_evictions"] > 0
    if file_blobs:
        a = fc.audit(tmp_path / "store-evict").check()
        assert a.entries and not a.unreferenced_files
        assert {n for n in os.listdir(tmp_path / "store-evict" / "blobs") if n.endswith(".ecb")}


def test_opening_a_handle_while_another_commits_does_not_deadlock(tmp_path):
    """Regression: LMDBTier opened its sub-databases with a bare
    ``env.open_db()``, which takes LMDB's write lock *holding the GIL*; with
    a writer thread of another handle holding that lock and waiting for the
    GIL, the process hung, and every other process with it."""
    path = str(tmp_path / "s")
    open_store(path).close()
    r = fc.run_forked(fw.open_while_other_handle_commits, path, timeout=120)
    assert r.ok() == 120
    fc.audit(path, 4 * MiB).check()


# ===========================================================================
# A process dies holding a read transaction
# ===========================================================================

HOLD_READER = r"""
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, max_dbs=8, lock=True, subdir=True)
txn = env.begin()                      # a read transaction pinning this snapshot
txn.stat(env.open_db(b"entries", txn=txn, create=False))
print(env.info()["last_txnid"], flush=True)
sys.stdin.read()                       # hold it until killed
"""


def _kill_a_reader_of(path: Path) -> int:
    """Start a process that opens a read transaction on ``path`` and SIGKILL
    it once it reports the transaction open. Returns its pid."""
    p = subprocess.Popen([sys.executable, "-c", HOLD_READER, str(path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.strip().isdigit(), f"reader child failed: {line!r}"
    p.kill()
    p.wait()
    p.stdin.close()
    p.stdout.close()
    return p.pid


def _reader_pids(store: ECStore) -> set[int]:
    pids = set()
    for line in store.disk.env.readers().splitlines()[1:]:
        parts = line.split()
        if parts and parts[0].isdigit():
            pids.add(int(parts[0]))
    return pids


def _churn(store: ECStore, rounds: int, tag: str, kib: int = 256) -> int:
    """Put, flush and delete ``rounds`` entries; returns data.mdb's size."""
    for j in range(rounds):
        ident = f"churn-{tag}-{j}"
        assert store.put(ident, blob_tensor(j, kib))
        store.flush()
        assert store.delete(ident)
    return os.path.getsize(Path(store.disk.path) / "data.mdb")


def test_dead_reader_slot_is_reclaimed_and_pages_reused(tmp_path):
    path = tmp_path / "s"
    with open_store(path, cap=8 * MiB) as store:
        for i in range(4):
            store.put(f"keep-{i}", blob_tensor(i, 256))
        store.flush()
        dead = _kill_a_reader_of(path)
        assert dead in _reader_pids(store), "the killed reader's slot should still be in the table"
        # While the stale slot pins its snapshot, freed pages cannot be reused.
        s0 = _churn(store, 2, "warm")
        pinned = _churn(store, 8, "pinned")
        assert pinned > s0, "a dead reader pins pages: the file should grow (test lost its teeth)"
        # Any new handle (a restarted engine, another model) clears dead readers.
        with open_store(path, cap=8 * MiB, model="another/model") as other:
            assert dead not in _reader_pids(other)
        assert dead not in _reader_pids(store)
        after_warm = _churn(store, 8, "reuse-warm")
        after_many = _churn(store, 40, "reuse")
        assert after_many == after_warm, f"file grew from {after_warm} to {after_many}: pages not reused"
        for i in range(4):
            assert_same(store.get(f"keep-{i}"), blob_tensor(i, 256))
        fc.audit(path, 8 * MiB, tier=store.disk).check()


def test_dead_reader_never_cleared_by_hand_map_full_recovers(tmp_path):
    """Nobody opens a new handle: churn fills the map behind the dead
    reader's snapshot; the full map makes the store clear dead readers
    (reader_check) and go on, without evicting what fits."""
    path = tmp_path / "s"
    cap = 4 * MiB
    with open_store(path, cap=cap) as store:
        store.put("keep", blob_tensor(1, 512))
        store.flush()
        dead = _kill_a_reader_of(path)
        map_size = store.disk.env_info()["map_size"]
        rounds = 2 * map_size // (256 * KiB)  # twice the map in churn
        size = _churn(store, rounds, "fill")
        assert dead not in _reader_pids(store)
        assert size <= map_size
        assert store.stats().write_errors == 0
        assert_same(store.get("keep"), blob_tensor(1, 512))  # fits the cap: never evicted
        assert store.stats().disk_evictions == 0
        fc.audit(path, cap, tier=store.disk).check()


# ===========================================================================
# Corruption
# ===========================================================================

PROBE_ID = "probe-image-0f3a9c"
PROBE_NAME = stored_name(PROBE_ID, fc.MODEL).encode()  # what the entry stores (namespace/identifier)
MARKER = b"<<ECSTORE-CORRUPTION-PROBE-7d1e>>"


def _probe_tensor() -> torch.Tensor:
    raw = bytearray((MARKER * 600)[: 64 * 128 * 2])
    return torch.frombuffer(raw, dtype=torch.uint8).view(torch.bfloat16).reshape(64, 128).clone()


def _write_probe_store(path: Path) -> dict[str, torch.Tensor]:
    others = {f"other-{i}": make_tensor(i, 8, 64) for i in range(3)}
    with open_store(path, cap=4 * MiB) as s:
        for k, t in others.items():
            s.put(k, t)
        s.flush()
        s.put(PROBE_ID, _probe_tensor())  # last, alone in its commit: one copy of each of its pages
    return others


def _corrupt(path: Path, where: str) -> int:
    """Flip one byte in every copy of the probe's bytes found in data.mdb.

    LMDB may leave stale copies of page contents in unused parts of pages
    (meminit=False) and freed pages, so the pattern can occur more than
    once: flipping every occurrence certainly hits the live one. Returns the
    number of bytes flipped."""
    data_file = path / "data.mdb"
    data = data_file.read_bytes()
    if where == "tensor-data":
        offsets = [h + 1000 for h in fault_fs.find_all(data, MARKER * 40)]  # inside the tensor bytes
    elif where == "blob-header":
        prefix = b'"identifier":"'
        offsets = [h + len(prefix) + 3 for h in fault_fs.find_all(data, prefix + PROBE_NAME)]
    else:  # the record's checksum field (record = 64-byte fixed part, shape, dtype, identifier)
        offsets = []
        for h in fault_fs.find_all(data, b"bfloat16" + PROBE_NAME):
            start = h - 2 * 8 - 64  # fixed part + shape (2 x u64) before the dtype
            if data[start] == codec.RECORD_VERSION:  # record version byte
                offsets.append(start + 1 + 6 * 8)  # version, created, last, hits, seq, nbytes, blob_size: checksum
    assert offsets, f"probe bytes ({where}) not found in data.mdb"
    for off in offsets:
        fault_fs.flip_byte(data_file, off)
    return len(offsets)


@pytest.mark.parametrize("where", ["tensor-data", "blob-header", "record-checksum"])
def test_flipped_bytes_are_detected_by_get_and_verify(tmp_path, caplog, where):
    path = tmp_path / "s"
    others = _write_probe_store(path)
    _corrupt(path, where)

    cp = fc.run_verify_cli(path)
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert "BAD" in cp.stdout and "checksum mismatch" in cp.stdout, cp.stdout
    assert "Traceback" not in cp.stderr

    with open_store(path, cap=4 * MiB) as s:
        before = s.stats()
        caplog.clear()
        assert s.get(PROBE_ID) is None  # a miss, never garbage
        warnings = [r for r in caplog.records if r.name == "ecstore" and r.levelno == logging.WARNING
                    and "corrupt entry" in r.getMessage()]
        assert warnings, [r.getMessage() for r in caplog.records]
        assert not s.contains(PROBE_ID)  # dropped
        after = s.stats()
        assert after.corrupt_dropped == 1
        assert after.disk_entries == before.disk_entries - 1
        for k, t in others.items():
            assert_same(s.get(k), t)
        a = fc.audit(path, 4 * MiB, tier=s.disk).check()
        assert PROBE_ID not in a.identifiers
        s.put(PROBE_ID, _probe_tensor())  # the slot is usable again
        s.flush()
        assert_same(s.get(PROBE_ID), _probe_tensor())
    assert fc.run_forked(fw.verify_in_process, str(path)).ok()[0] == 0


def _make_case(base: Path, case: str) -> Path:
    """Build one damaged/foreign store directory; returns it."""
    d = base / case
    if case == "only-other-files":
        d.mkdir()
        (d / "notes.txt").write_text("not a store\n")
        (d / "model.safetensors").write_bytes(b"\0" * 100)
        return d
    if case == "data-mdb-is-a-directory":
        (d / "data.mdb").mkdir(parents=True)
        return d
    if case in ("foreign-lmdb", "foreign-lmdb-with-meta"):
        d.mkdir()
        env = lmdb.open(str(d), max_dbs=4, map_size=8 * MiB)
        with env.begin(write=True) as txn:
            txn.put(b"somebody", b"else's data")
            if case == "foreign-lmdb-with-meta":
                txn.put(b"k", b"v", db=env.open_db(b"meta", txn=txn))
        env.close()
        return d
    if case == "new-environment-first-page-only":  # left so by a creator that died mid-write
        d.mkdir()
        lmdb.open(str(d), max_dbs=8, map_size=8 * MiB).close()
        os.truncate(d / "data.mdb", 4096)
        return d
    src = base / "good"
    if not src.exists():
        with open_store(src, cap=16 * MiB) as s:
            for i in range(20):
                s.put(f"e{i}", blob_tensor(i, 200))
    subprocess.run(["cp", "-r", str(src), str(d)], check=True)
    data = d / "data.mdb"
    size = data.stat().st_size
    if case.startswith("truncated-"):
        keep = {"truncated-to-100-bytes": 100, "truncated-to-2-pages": 8192,
                "truncated-to-half": size // 2, "truncated-by-one-page": size - 4096}[case]
        os.truncate(data, keep)
    elif case == "garbage":
        data.write_bytes(random.Random(case).randbytes(size))
    elif case == "garbage-after-meta-pages":
        with open(data, "r+b") as fh:
            fh.seek(8192)
            fh.write(random.Random(case).randbytes(size - 8192))
    elif case == "newer-schema":
        env = lmdb.open(str(d), max_dbs=8, map_size=max(size, 64 * MiB))
        with env.begin(write=True) as txn:
            txn.put(b"schema_version", b"99", db=env.open_db(b"meta", txn=txn))
        env.close()
    return d


DAMAGED = {
    # case: expected exception class on open (read-write and read-only)
    "only-other-files": "StoreOpenError",
    "data-mdb-is-a-directory": "StoreOpenError",
    "foreign-lmdb": "StoreOpenError",
    "foreign-lmdb-with-meta": "StoreOpenError",
    "truncated-to-100-bytes": "StoreOpenError",
    "truncated-to-2-pages": "StoreOpenError",
    "truncated-to-half": "StoreOpenError",
    "truncated-by-one-page": "StoreOpenError",
    "new-environment-first-page-only": "StoreOpenError",
    "garbage": "StoreOpenError",
    "garbage-after-meta-pages": "StoreOpenError",
    "newer-schema": "SchemaError",
}


def test_damaged_btree_page_gives_ecstore_errors_never_a_foreign_exception(tmp_path):
    """Beyond blob bytes: damage the LMDB leaf page holding an entry's record
    (its page-type flags). LMDB answers MDB_CORRUPTED / MDB_BAD_TXN; every
    ECStore call must surface that as an ECStoreError (which the connector
    treats as a miss) or succeed -- never an lmdb exception, never a crash."""
    path = tmp_path / "s"
    with open_store(path, cap=4 * MiB) as s:
        s.put(PROBE_ID, make_tensor(1))
    data_file = path / "data.mdb"
    data = data_file.read_bytes()
    hits = fault_fs.find_all(data, b"bfloat16" + PROBE_NAME)  # the record, in an 'entries' leaf page
    assert hits
    with open(data_file, "r+b") as fh:
        for h in hits:
            fh.seek(h // 4096 * 4096 + 10)  # mp_flags of the page header
            fh.write(b"\xff\x7f")
    outcomes = fc.run_forked(fw.ops_on_damaged_store, str(path), PROBE_ID, timeout=120).ok()
    print(outcomes)
    assert not [o for o in outcomes if "FOREIGN" in o], outcomes
    assert any("StoreOpenError" in o for o in outcomes), outcomes  # the damage was noticed


def _files(d: Path) -> dict[str, str | None]:
    """name -> content hash of each file (lock.mdb: presence only, its reader
    table changes on every open)."""
    import hashlib

    return {p.name: None if p.name == "lock.mdb" or not p.is_file() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.iterdir())}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_or_foreign_store_fails_clearly_on_open(tmp_path, case):
    """Each open runs in its own process with a timeout: a SIGBUS/SIGSEGV or a
    hang would show up as such instead of taking the test run down. Nothing
    in the directory is written (no leases.mdb in a foreign LMDB directory)."""
    d = _make_case(tmp_path, case)
    before = _files(d)
    for readonly in (False, True):
        r = fc.run_forked(fw.open_case, str(d), readonly, timeout=60)
        outcome = r.ok()
        assert outcome.startswith(DAMAGED[case] + ":"), f"readonly={readonly}: {outcome}"
        assert str(d) in outcome, outcome  # says which store
    assert _files(d) == before, "a refused open changed the directory"
    rc, out = fc.run_forked(fw.verify_in_process, str(d), timeout=60).ok()
    assert rc == 2 and "error" in out and "Traceback" not in out, out


# ===========================================================================
# Exhaustion: full map, full disk, read-only file system
# ===========================================================================

def test_full_map_evicts_and_proceeds(tmp_path):
    """A map of 4 MiB under a cap of 64 MiB (``open_store_with_map_size``): the map
    fills long before the cap; puts evict and go on."""
    path = tmp_path / "s"
    cap, map_size = 64 * MiB, 4 * MiB
    with open_store_with_map_size(cfg(path, cap), map_size, model=MODEL, dtype=torch.bfloat16) as s:
        assert s.disk.env_info()["map_size"] == map_size
        for i in range(48):  # 12 MiB of puts through a 4 MiB map
            assert s.put(f"m{i}", blob_tensor(i, 256))
            s.flush()  # never raises
            assert_same(s.get(f"m{i}"), blob_tensor(i, 256))
        st = s.stats()
        assert st.write_errors == 0 and st.disk_evictions > 0
        assert st.disk_bytes < map_size < cap
        a = fc.audit(path, cap, tier=s.disk).check()
        assert a.file_size <= map_size
        present = [i for i in range(48) if s.contains(f"m{i}")]
        assert present == list(range(present[0], 48)), "evictions must be LRU"


def test_entry_larger_than_the_map_fails_cleanly_and_keeps_the_rest(tmp_path, caplog):
    """With every blob inside LMDB (``min_file_blob_size`` above the entry)."""
    path = tmp_path / "s"
    cap, map_size = 64 * MiB, 4 * MiB
    inline = dataclasses.replace(cfg(path, cap), min_file_blob_size=64.0)
    with open_store_with_map_size(inline, map_size, model=MODEL, dtype=torch.bfloat16) as s:
        for i in range(4):
            s.put(f"m{i}", blob_tensor(i, 256))
        s.flush()
        assert s.put("huge", blob_tensor(99, 6 * 1024))  # 6 MiB: under the cap, over the map
        with pytest.raises(StoreFullError, match="never fit in the LMDB map"):
            s.flush()
        assert s.get("huge") is None
        for i in range(4):
            assert_same(s.get(f"m{i}"), blob_tensor(i, 256))  # nothing evicted for it
        s.put("after", blob_tensor(5, 256))
        s.flush()
        assert_same(s.get("after"), blob_tensor(5, 256))
        fc.audit(path, cap, tier=s.disk).check()


def test_entry_larger_than_the_map_is_stored_in_a_file(tmp_path):
    """The same entry with the default ``min_file_blob_size`` (4 MiB): its
    blob goes to a file of its own, so the LMDB map does not bound it."""
    path = tmp_path / "s"
    with open_store_with_map_size(cfg(path, 64 * MiB), 4 * MiB, model=MODEL, dtype=torch.bfloat16) as s:
        s.put("huge", blob_tensor(99, 6 * 1024))
        s.flush()
        assert_same(s.get("huge"), blob_tensor(99, 6 * 1024))
        assert s.disk is not None and len(s.disk.referenced_files()) == 1
        fc.audit(path, 64 * MiB, tier=s.disk).check()


FULL_DISK = ["rlimit-fsize"] + (["tmpfs-enospc"] if fault_fs.can_mount() else [])


@pytest.mark.parametrize("how", FULL_DISK + (["tmpfs-enospc-files"] if fault_fs.can_mount() else []))
def test_full_disk_fails_the_flush_clearly_and_keeps_earlier_entries(tmp_path, how):
    """``rlimit-fsize`` (data.mdb may not grow past its size + 3 MiB) runs
    everywhere; ``tmpfs-enospc`` (a real 6 MiB file system filling up) is
    generated only where this process may mount (root); ``-files``: every
    blob in a file of its own (no partial file is left behind)."""
    files = how.endswith("-files")
    if how == "rlimit-fsize":
        mount, path, headroom, why = contextlib.nullcontext(), tmp_path / "s", 3 * MiB, "file size limit"
    else:
        mount, path, headroom, why = (fault_fs.small_tmpfs(tmp_path / "mnt", 6 * MiB), tmp_path / "mnt" / "s",
                                      None, "disk full")
    with mount:
        r = fc.run_forked(fw.fill_until_full, str(path), headroom, 0.0 if files else 4.0, timeout=300).ok()
        print(r["error"])
        assert r["error"].startswith("1 write(s) failed") and why in r["error"], r["error"]
        assert r["flushed"], "nothing fitted before the disk filled up"
        assert r["readable"] and r["small_ok"]  # the handle keeps working
        with open_store(path, cap=256 * MiB) as s:  # a fresh view, no limit
            for i in range(4):
                assert_same(s.get(f"pre-{i}"), blob_tensor(i, 64))
            for i in r["flushed"]:
                assert_same(s.get(f"full-{i}"), blob_tensor(100 + i, 512))
            assert s.get(f"full-{r['failed']}") is None
            assert_same(s.get("small-after"), blob_tensor(7, 4))
            a = fc.audit(path, 256 * MiB, tier=s.disk).check()
            assert not a.unreferenced_files  # the failed put's partial file was removed
            if files:
                assert len(s.disk.referenced_files()) == 4 + len(r["flushed"]) + 1


def test_failed_puts_that_nobody_flushes_keep_no_blob(tmp_path):
    """Regression: each failed put's error was kept, with its traceback,
    until a flush, and a traceback's frames (the tier's, the blob file's
    write) held the failed batch's blobs: a producer on a full disk (the
    connector never flushes) kept every failed save's pooled buffer. The
    writer keeps the last few errors without their frames' locals; flush
    still counts every failure."""
    r = fc.run_forked(fw.failed_puts_unflushed, str(tmp_path / "s"), 256 << 10, 24, timeout=300).ok()
    assert r["failed"] == r["blobs"] == 24, r  # each put's blob file was refused
    assert r["held"] == 0, r
    assert r["error"].startswith("24 write(s) failed") and "file size limit" in r["error"], r


def test_readonly_handle_reads_and_changes_nothing(tmp_path):
    path = tmp_path / "s"
    with open_store(path) as s:
        for i in range(3):
            s.put(f"r{i}", make_tensor(i))
    before = (path / "data.mdb").read_bytes()
    with open_store(path, readonly=True) as ro:
        for i in range(3):
            assert_same(ro.get(f"r{i}"), make_tensor(i))
        with pytest.raises(ECStoreError, match="read-only"):
            ro.put("new", make_tensor(9))
        with pytest.raises(ECStoreError, match="read-only"):
            ro.delete("r0")
        ro.flush()
    assert (path / "data.mdb").read_bytes() == before  # not even an LRU update


def test_readonly_filesystem_opens_readonly_or_fails_clearly(tmp_path):
    src = tmp_path / "src"
    with open_store(src) as s:
        for i in range(3):
            s.put(f"r{i}", make_tensor(i))
    with fault_fs.readonly_view(src, tmp_path / "ro") as how:
        print("read-only mechanism:", how)
        ro_dir = tmp_path / "ro"
        with open_store(ro_dir, readonly=True) as ro:
            for i in range(3):
                assert_same(ro.get(f"r{i}"), make_tensor(i))
        with pytest.raises(StoreOpenError, match=re.escape(str(ro_dir))):
            open_store(ro_dir)
        with pytest.raises(StoreOpenError):
            open_store(ro_dir / "new-store")  # cannot be created either


# ===========================================================================
# fork()
# ===========================================================================

def test_store_used_across_fork_raises_in_child_and_parent_keeps_working(tmp_path):
    path = tmp_path / "s"
    store = open_store(path, cpu=1 * MiB)
    try:
        store.put("before-fork", make_tensor(1))
        store.flush()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: report, never return into pytest
            code, report = 1, []
            try:
                for name, call in [("get", lambda: store.get("before-fork")),
                                   ("contains", lambda: store.contains("before-fork")),
                                   ("put", lambda: store.put("from-child", make_tensor(2))),
                                   ("delete", lambda: store.delete("before-fork")),
                                   ("flush", store.flush), ("stats", store.stats),
                                   ("lease", lambda: store.lease(["before-fork"])),
                                   ("write_lru_soon", store.write_lru_soon),
                                   ("disk.get", lambda: store.disk.get(store.key("x"), store.stored_name("x")))]:
                    try:
                        call()
                        report.append(f"{name}:no-error")
                    except ForkedStoreError:
                        report.append(f"{name}:ForkedStoreError")
                store.close()  # a no-op in the child: must not touch the parent's environment
                try:  # the same directory cannot be opened again in a forked child: a clear error
                    open_store(path).close()
                    report.append("reopen:opened")
                except StoreOpenError as e:
                    report.append("reopen:StoreOpenError" + (" (explains fork)" if "forked" in str(e) else str(e)))
                with open_store(path.parent / "child-own") as own:  # any other store works
                    own.put("from-child", make_tensor(2))
                    own.flush()
                    assert_same(own.get("from-child"), make_tensor(2))
                report.append("own-store:ok")
                code = 0
            except BaseException:  # noqa: BLE001
                import traceback

                report.append(traceback.format_exc())
            finally:
                os.write(w, "\n".join(report).encode())
                os._exit(code)
        os.close(w)
        with os.fdopen(r) as fh:
            report = fh.read().splitlines()
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "\n".join(report)
        assert report == ["get:ForkedStoreError", "contains:ForkedStoreError", "put:ForkedStoreError",
                          "delete:ForkedStoreError", "flush:ForkedStoreError", "stats:ForkedStoreError",
                          "lease:ForkedStoreError", "write_lru_soon:ForkedStoreError", "disk.get:ForkedStoreError",
                          "reopen:StoreOpenError (explains fork)", "own-store:ok"]
        # The parent's handle is unharmed.
        assert_same(store.get("before-fork"), make_tensor(1))
        assert not store.contains("from-child")
        store.put("after-fork", make_tensor(3))
        store.flush()
        assert_same(store.get("after-fork"), make_tensor(3))
        fc.audit(path, 64 * MiB, tier=store.disk).check()
    finally:
        store.close()
