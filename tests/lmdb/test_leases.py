"""The lease table and its eviction-marker (tombstone) protocol across
processes (see :mod:`ecstore.lmdb.leases`).

The interleavings are driven deterministically: the other evictor is a real
process (``helpers/paused_evictor.py``) that stops at a chosen step and goes
on when told; this process's steps are hooked. No timing is involved.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch

from ecstore.format import PendingPut, PutOutcome
from ecstore.key import make_key
from ecstore.lmdb import BatchPut, LMDBTier
from ecstore.testing import faults as fc

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
MiB = 1 << 20
CAP = 64 * MiB


def key(idx: int) -> str:
    return make_key(fc.MODEL, f"{idx:016x}", "bfloat16")


def name(idx: int) -> str:
    return f"{0:032x}/img-{idx}"


class _Abort(Exception):
    """Ends a write transaction by aborting it (as a write meeting MDB_MAP_FULL does)."""


def _expect(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdout is not None
    got = proc.stdout.readline().strip()
    assert got == line, f"evictor said {got!r}, expected {line!r}"


def _say(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def test_aborted_eviction_never_clears_another_processes_tombstone(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's eviction marks the LRU head and its transaction aborts
    (the entry stays). Before it clears its tombstones, an evictor in
    another process chooses the same entry, marks it and re-checks the
    leases (steps 2-3). Clearing by key removed *that* process's tombstone
    too, so a loader pinning the entry then saw no marker and the entry
    still there: ``pin_if_present`` answered True, and the other evictor's
    commit deleted the entry under the lease. A process must clear only the
    tombstones it wrote."""
    path = str(tmp_path / "s")
    a = LMDBTier(path, CAP)
    evictor = None
    try:
        for i in range(2):
            req = BatchPut(PendingPut(key(i), name(i), fc.entry_tensor(i, 4)), fc.MODEL)
            a.write_batch([req])
            assert req.outcome is PutOutcome.STORED
        evictor = subprocess.Popen([sys.executable, str(HELPERS / "paused_evictor.py"), path, str(CAP)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        _expect(evictor, "ready")

        table = a._leases
        assert table is not None
        real_clear = table.clear_tombstones

        def clear_after_the_other_evictor_marked() -> None:
            _say(evictor)  # our transaction has ended: the other evictor takes the write lock
            _expect(evictor, "marked")  # ... and has marked key(0) and re-checked the leases
            real_clear()

        monkeypatch.setattr(table, "clear_tombstones", clear_after_the_other_evictor_marked)
        with pytest.raises(_Abort):
            with a._writing() as w:
                assert w.evict(1) > 0  # marks key(0), the LRU head, and removes it ...
                raise _Abort  # ... in a transaction that aborts: key(0) stays
        monkeypatch.undo()
        assert a.contains(key(0), name(0))

        pinned = a.pin_if_present(key(0), name(0), 60)
        _say(evictor)  # the other evictor commits its removal of key(0)
        assert evictor.stdout is not None
        assert evictor.stdout.readline().startswith("evicted ")
        assert evictor.wait(timeout=60) == 0
        # A True answer guarantees that no process evicts the entry while leased.
        assert not pinned or a.contains(key(0), name(0)), "pin_if_present said yes; the entry was evicted"
        fc.audit(path, CAP, tier=a).check()
    finally:
        if evictor is not None and evictor.poll() is None:
            evictor.kill()
            evictor.wait()
        a.close()


def test_lease_taken_while_expired_rows_are_collected_survives(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``leased_keys`` (an evictor's step 1 and 3) reads the lease table,
    then deletes, in a second transaction, the rows it found without a live
    lease. A loader leasing one of those keys in between lost its fresh
    lease with the row: eviction no longer saw it, and an entry the loader
    was promised (``pin_if_present`` True) could be evicted under it. Rows
    are deleted only if they are still as read."""
    import ecstore.lmdb.leases as leases_mod

    path = str(tmp_path / "s")
    a = LMDBTier(path, CAP)
    try:
        for i in range(2):
            req = BatchPut(PendingPut(key(i), name(i), fc.entry_tensor(i, 4)), fc.MODEL)
            a.write_batch([req])
            assert req.outcome is PutOutcome.STORED
        a.lease([key(0)], 0)  # expired at once: its row is collected by the next leased_keys
        a.lease([key(1)], 60)  # a live lease (read after key(0)'s row: keys in byte order)
        assert key(0).encode() < key(1).encode()
        real_alive = leases_mod._pid_alive
        taken: list[bool] = []

        def alive_and_a_loader_leases_key0(pid: int) -> bool:
            # Called while leased_keys reads key(1)'s row, after it found key(0)'s
            # row dead and before it deletes it: a loader pins key(0) now.
            if not taken:
                taken.append(a.pin_if_present(key(0), name(0), 60))
            return real_alive(pid)

        monkeypatch.setattr(leases_mod, "_pid_alive", alive_and_a_loader_leases_key0)
        a.leased_keys()
        monkeypatch.undo()
        assert taken == [True]
        assert key(0).encode() in a.leased_keys(), "the loader's fresh lease was deleted"
        a._evict_to(0)  # evict everything evictable
        assert a.contains(key(0), name(0)), "a leased entry was evicted"
        fc.audit(path, CAP, tier=a).check()
    finally:
        a.close()


@pytest.mark.parametrize("ttl", [float("inf"), float("nan"), -1.0, 1e12, 86400.5, "60", True])
def test_a_lease_time_the_table_cannot_hold_is_an_invalid_entry_error(tmp_path: Path, ttl: object) -> None:
    """``lease``/``pin_if_present`` took any ``ttl_s``: infinity, NaN, a
    string or a time past the u64 nanosecond expiry escaped as
    OverflowError, ValueError, TypeError or struct.error (none an
    ECStoreError). They are refused with InvalidEntryError, as the config
    refuses lease_seconds outside [0, 86400], and nothing is leased."""
    import torch

    from ecstore import ECStore, ECStoreConfig, InvalidEntryError

    cfg = ECStoreConfig(local_cpu=False, local_disk=str(tmp_path / "s"), max_local_disk_size=CAP / 2**30)
    with ECStore(cfg, model=fc.MODEL, dtype=torch.bfloat16) as store:
        store.put("img", fc.entry_tensor(0, 4))
        store.flush()
        with pytest.raises(InvalidEntryError, match="ttl_s"):
            store.lease(["img"], ttl)  # type: ignore[arg-type]
        with pytest.raises(InvalidEntryError, match="ttl_s"):
            store.pin_if_present("img", ttl)  # type: ignore[arg-type]
        assert store.disk is not None and store.disk.leased_keys() == set()
        store.lease(["img"], 86400)  # the longest lease the config allows
        assert store.pin_if_present("img", 0.0)


@pytest.mark.parametrize("readonly", [False, True], ids=["read-write", "read-only"])
@pytest.mark.parametrize("ids", ["abc", b"abc", 7], ids=["str", "bytes", "int"])
def test_lease_and_release_refuse_an_identifier_given_for_the_list(tmp_path: Path, ids: object,
                                                                   readonly: bool) -> None:
    """``lease("abc")`` leased the identifiers "a", "b" and "c" (a str is a
    sequence of characters) and ``release("abc")`` released them: a single
    identifier, or anything else that is not a collection of them, is
    refused with InvalidEntryError, and nothing is leased or released."""
    import torch

    from ecstore import ECStore, ECStoreConfig, InvalidEntryError

    cfg = ECStoreConfig(local_cpu=False, local_disk=str(tmp_path / "s"), max_local_disk_size=CAP / 2**30)
    with ECStore(cfg, model=fc.MODEL, dtype=torch.bfloat16) as store:
        for n in ("a", "b", "c"):
            store.put(n, fc.entry_tensor(0, 4))
        store.flush()
        store.lease(["a"])
        leased = store.disk.leased_keys() if store.disk is not None else set()
        with ECStore(cfg, model=fc.MODEL, dtype=torch.bfloat16, readonly=readonly) as other:
            with pytest.raises(InvalidEntryError, match="list of mm identifiers"):
                other.lease(ids)  # type: ignore[arg-type]
            with pytest.raises(InvalidEntryError, match="list of mm identifiers"):
                other.release(ids)  # type: ignore[arg-type]
        assert store.disk is not None and store.disk.leased_keys() == leased == {store.key("a").encode()}


# ------------------------------------------------------ the lease file itself
def _opener(path: str, mode: str, *hold: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(HELPERS / "lease_file_opener.py"), path, str(CAP), mode, *hold],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _report(proc: subprocess.Popen[str]) -> dict:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"opener exited {proc.wait(timeout=60)} without a report"
    out = json.loads(line)
    assert "foreign" not in out, f"a non-ECStoreError escaped: {out['foreign']}"
    return out


def _finish(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=120) == 0


def _two_entries_first_pinned(path: str) -> LMDBTier:
    a = LMDBTier(path, CAP)
    for i in range(2):
        req = BatchPut(PendingPut(key(i), name(i), fc.entry_tensor(i, 4)), fc.MODEL)
        a.write_batch([req])
        assert req.outcome is PutOutcome.STORED
    assert a.pin_if_present(key(0), name(0), 600)
    return a


def test_a_transient_error_opening_the_lease_file_never_deletes_it(tmp_path: Path) -> None:
    """Opening ``leases.mdb`` deleted it (and its lock file) on any LMDB
    error, here "too many open files" in another process: this process's
    lease stayed in the unlinked file, that process made a new one, and its
    eviction took the entry this process had pinned. A lease file is
    recreated only when it is damaged and unused; any other error is a
    StoreOpenError and nothing is deleted."""
    path = str(tmp_path / "s")
    a = _two_entries_first_pinned(path)
    try:
        inode = os.stat(os.path.join(path, "leases.mdb")).st_ino
        out = _report(_opener(path, "scarce-fds"))
        assert out["opened"]
        # One attempt got as far as the lease file (the scenario happened) ...
        assert any("leases.mdb" in msg for _, msg in out["errors"]), out["errors"]
        assert all(t == "StoreOpenError" for t, _ in out["errors"]), out["errors"]
        # ... and left it alone: one lease file, shared by both processes.
        assert not out["inode_changed"] and out["leases_inode"] == inode
        assert out["evicted"] == 1
        assert a.contains(key(0), name(0)), "the entry pinned by pin_if_present was evicted"
        assert not a.contains(key(1), name(1))
        fc.audit(path, CAP, tier=a).check()
    finally:
        a.close()


def test_a_damaged_lease_file_in_use_by_another_process_is_refused_not_replaced(tmp_path: Path) -> None:
    """``leases.mdb`` unreadable for a new process (here replaced under a
    running one, which keeps its open file) while another process still
    holds leases in the file it has open: deleting and recreating it split
    the leases across two files, and the new process evicted the pinned
    entry. The new process gets a StoreOpenError naming the file and what
    to do; nothing is deleted or evicted."""
    path = str(tmp_path / "s")
    a = _two_entries_first_pinned(path)
    try:
        lpath = os.path.join(path, "leases.mdb")
        with open(lpath + ".new", "wb") as fh:
            fh.write(b"\xa5" * 16384)
        os.replace(lpath + ".new", lpath)
        damaged = os.stat(lpath).st_ino
        out = _report(_opener(path, "plain"))
        assert not out["opened"] and out["evicted"] == 0
        [(kind, msg)] = out["errors"]
        assert kind == "StoreOpenError" and "leases.mdb" in msg and "in use" in msg, msg
        assert os.stat(lpath).st_ino == damaged  # left for the operator, as the message says
        assert a.contains(key(0), name(0)) and a.contains(key(1), name(1))
        assert key(0).encode() in a.leased_keys()
    finally:
        a.close()


@pytest.mark.parametrize("damage", ["garbage", "empty-meta", "truncated"])
def test_a_damaged_unused_lease_file_is_recreated_once_for_all_processes(tmp_path: Path, damage: str) -> None:
    """Leases are ephemeral: a damaged ``leases.mdb`` that no process has
    open (e.g. after a machine crash: it is written without fsync) is
    recreated by the first process that opens the store. Two processes
    opening it at once end up on one new file (the repair is serialised),
    and each sees the other's lease. A truncated lease file (shorter than
    its meta page says) killed a process with SIGBUS at its first lease: it
    counts as damaged."""
    path = str(tmp_path / "s")
    a = LMDBTier(path, CAP)
    a.lease([f"k{i}" for i in range(2000)], 600)  # a lease file of some pages
    a.close()
    lpath = os.path.join(path, "leases.mdb")
    assert os.path.getsize(lpath) > 16384
    with open(lpath, "r+b") as fh:
        if damage == "garbage":
            fh.write(b"\x5a" * 8192)
        elif damage == "empty-meta":
            fh.write(b"\x00" * 8192)  # both meta pages zeroed
        else:
            fh.truncate(8192)  # the meta pages only
    first = _opener(path, "plain", "hold", key(0))
    second = _opener(path, "plain", "hold", key(1))
    try:
        got = [_report(first), _report(second)]
        assert all(o["opened"] and not o["errors"] for o in got), got
        assert got[0]["leases_inode"] == got[1]["leases_inode"] == os.stat(lpath).st_ino
        a = LMDBTier(path, CAP)
        try:
            assert {key(0).encode(), key(1).encode()} <= a.leased_keys()
        finally:
            a.close()
    finally:
        _finish(first)
        _finish(second)


def test_a_lease_file_error_clearing_tombstones_never_undoes_a_committed_put(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The put that evicts commits, then clearing its tombstones fails (the
    lease file's map is full, or its disk: the lease file is a second LMDB
    file and fails on its own). That error escaped the committed write: the
    put was reported failed, and its blob file, taken for nobody's, was
    deleted under the committed entry (the next read found it missing and
    dropped the entry). The commit stands: the put is stored, its file
    kept, the tombstones left to expire or to be cleared by the next write."""
    path = str(tmp_path / "s")
    cap = 12 * MiB
    a = LMDBTier(path, cap, file_blobs_from=0)
    try:
        for i in range(3):  # ~4 MiB each: the third put fills the cap
            req = BatchPut(PendingPut(key(i), name(i), fc.entry_tensor(i, 4096)), fc.MODEL)
            a.write_batch([req])
            assert req.outcome is PutOutcome.STORED
        table = a._leases
        assert table is not None
        real_clear = table.clear_tombstones
        failed = []

        def clear_fails_once() -> None:
            if table._tombstones and not failed:
                failed.append(len(table._tombstones))
                raise lmdb.MapFullError("mdb_put: MDB_MAP_FULL: Environment mapsize limit reached")
            real_clear()

        monkeypatch.setattr(table, "clear_tombstones", clear_fails_once)
        req = BatchPut(PendingPut(key(3), name(3), fc.entry_tensor(3, 4096)), fc.MODEL)
        a.write_batch([req])  # evicts key(0): tombstone written, data committed, clearing fails
        assert failed, "the put evicted nothing: the test's sizes no longer reach the cap"
        assert req.outcome is PutOutcome.STORED, req.error
        got = a.get(key(3), name(3))
        assert got is not None and torch.equal(got.view(torch.int16), fc.entry_tensor(3, 4096).view(torch.int16))
        assert not a.contains(key(0), name(0))
        # The tombstones are cleared by the next write transaction.
        monkeypatch.undo()
        a.delete(key(1))
        assert not table._tombstones and not table.evicting(a._k(key(0)))
        fc.audit(path, cap, tier=a).check()
    finally:
        a.close()


def test_a_pin_answers_with_the_record_whether_or_not_a_write_committed_since_its_first_read(
        tmp_path: Path, monkeypatch) -> None:
    """Step (c) of a pin reuses the record of its first read only while no
    write transaction committed since (the environment's last one is that
    read's snapshot); after a commit, of another entry or of a touch of this
    one, it reads again and answers with the record as it is now. The only
    hook commits a real write right after this process's real lease."""
    from ecstore.lmdb.batch import Touch
    from ecstore.lmdb.leases import Pin

    tier = LMDBTier(str(tmp_path / "s"), CAP)
    table = tier._leases
    assert table is not None
    try:
        tier.write_batch([BatchPut(PendingPut(key(1), name(1), fc.entry_tensor(1, 4)), fc.MODEL)])
        quiet = tier.pin_entry(key(1), name(1), 60)
        assert quiet.pin is Pin.HELD and quiet.record == tier.record(key(1))
        real_try_pin = table.try_pin
        writes = iter([
            lambda: tier.write_batch([BatchPut(PendingPut(key(2), name(2), fc.entry_tensor(2, 4)), fc.MODEL)]),
            lambda: tier.write_batch([], {key(1): Touch(name(1), 5, 2**62, (0,), 0, (5,))}),
        ])

        def lease_then_commit(*args):
            taken = real_try_pin(*args)
            next(writes)()
            return taken

        monkeypatch.setattr(table, "try_pin", lease_then_commit)
        other = tier.pin_entry(key(1), name(1), 60)  # another entry committed in between
        assert other.pin is Pin.HELD and other.record == tier.record(key(1))
        before = tier.record(key(1))
        touched = tier.pin_entry(key(1), name(1), 60)  # this entry touched in between
        after = tier.record(key(1))
        assert before is not None and after is not None and after.hits == before.hits + 5
        assert touched.pin is Pin.HELD and touched.record == after
    finally:
        tier.close()


def test_pin_entries_leases_a_steps_worth_in_one_commit(tmp_path: Path, monkeypatch) -> None:
    """``ECStore.pin_entries``: one lease per occurrence, releases first, in
    one lease-file commit; an absent entry, one being evicted (a live
    tombstone) and one deleted between the lease and the entry check are
    ``ABSENT`` and keep no lease. The only hook deletes a real entry right
    after this process's real lease write."""
    from ecstore import ECStore, ECStoreConfig, InvalidEntryError
    from ecstore.lmdb.leases import Pin

    cfg = ECStoreConfig(local_cpu=False, local_disk=str(tmp_path / "s"), max_local_disk_size=CAP / 2**30)
    with ECStore(cfg, model=fc.MODEL, dtype=torch.bfloat16) as store:
        for n in ("a", "b", "c", "d"):
            store.put(n, fc.entry_tensor(0, 4))
        store.flush()
        disk = store.disk
        assert disk is not None and disk._leases is not None
        table, lease_env = disk._leases, disk._leases.env

        def leased() -> set[str]:
            keys = disk.leased_keys()
            return {n for n in ("a", "b", "c", "d") if store.key(n).encode() in keys}

        store.lease(["d"])
        table.mark_evicting([store.key("c").encode()])
        before = lease_env.info()["last_txnid"]
        assert store.pin_entries(["a", "a", "b", "zz", "c"], release=["d"]) == [
            Pin.HELD, Pin.HELD, Pin.HELD, Pin.ABSENT, Pin.ABSENT]
        assert lease_env.info()["last_txnid"] == before + 1  # pins and the release: one commit
        assert leased() == {"a", "b"}
        store.release(["a"])
        assert leased() == {"a", "b"}  # "a" was leased twice
        store.release(["a", "b"])
        assert leased() == set()
        table.clear_tombstones()

        real = table.try_pin_many

        def lease_then_delete(*args):
            taken = real(*args)
            with ECStore(cfg, model=fc.MODEL, dtype=torch.bfloat16) as other:
                assert other.delete("b")
            return taken

        monkeypatch.setattr(table, "try_pin_many", lease_then_delete)
        assert store.pin_entries(["a", "b"]) == [Pin.HELD, Pin.ABSENT]
        assert leased() == {"a"}  # the lease of the entry found gone is dropped again
        monkeypatch.undo()
        for bad in ("abc", ["a", 7]):
            with pytest.raises(InvalidEntryError, match="identifier"):
                store.pin_entries(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidEntryError, match="ttl_s"):
            store.pin_entries(["a"], ttl_s=float("nan"))
        assert leased() == {"a"}
