"""Blob files and LMDB's ``metasync=False``: a blob file may be deleted only
once the commit that removed its entry is durable. Until the next fsync of
``data.mdb`` that commit's meta page is only in the page cache; a power cut
would bring the store back to the commit before, whose entry still points to
the file. The kernel tells whether a page of ``data.mdb`` is dirty
(``cachestat``, Linux 6.5+): it must be clean when the file is unlinked."""

from __future__ import annotations

import ctypes
import os
import platform
import sys

import pytest

from ecstore.format import PendingPut, PutOutcome
from ecstore.lmdb import BatchPut, LMDBTier
from ecstore.testing.tier_contract import KEY_A, KEY_B, NAME_A, NAME_B, tensor

MiB = 1 << 20
_NR_CACHESTAT = {"x86_64": 451, "aarch64": 451}.get(platform.machine())


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


def unsynced_pages(path: str, nbytes: int) -> int:
    """Pages of the first ``nbytes`` of ``path`` not yet on disk (dirty or
    under writeback), from the kernel's ``cachestat``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        rng, st = _Range(0, nbytes), _Stat()
        if libc.syscall(_NR_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
            pytest.skip(f"cachestat: {os.strerror(ctypes.get_errno())}")
        return st.nr_dirty + st.nr_writeback
    finally:
        os.close(fd)


_watch: dict[str, object] = {}


def _hook(event: str, args: tuple) -> None:
    if event == "os.remove" and _watch.get("on") and str(args[0]).endswith(".ecb"):
        _watch["seen"].append(unsynced_pages(_watch["data"], 2 * 4096))  # type: ignore[attr-defined]


sys.addaudithook(_hook)


def _put(tier: LMDBTier, key: str, name: str, seed: int) -> None:
    p = BatchPut(PendingPut(key, name, tensor(seed, rows=256, cols=512)), "org/model")
    tier.write_batch([p])
    assert p.outcome is PutOutcome.STORED, p.error


@pytest.mark.skipif(sys.platform != "linux" or _NR_CACHESTAT is None, reason="cachestat is Linux-only")
@pytest.mark.parametrize("how", ["remove", "evict"])
def test_a_blob_file_is_deleted_only_after_the_removing_commit_is_durable(tmp_path, how):
    path = str(tmp_path / "store")
    cap = 300 * 1024  # one 256 KiB entry: the second put evicts the first
    tier = LMDBTier(path, cap if how == "evict" else 16 * MiB, file_blobs_from=0)
    try:
        _put(tier, KEY_A, NAME_A, 1)
        tier.sync()
        _watch.update(on=True, seen=[], data=os.path.join(path, "data.mdb"))
        try:
            if how == "remove":
                assert tier.remove(KEY_A) is not None
            else:
                _put(tier, KEY_B, NAME_B, 2)
                assert tier.identifier_at(KEY_A) is None
        finally:
            _watch["on"] = False
        assert _watch["seen"], "no blob file was deleted"
        assert _watch["seen"] == [0] * len(_watch["seen"]), (
            "a blob file was unlinked while the commit removing its entry was not yet on disk "
            f"(unsynced pages of data.mdb's meta: {_watch['seen']})")
    finally:
        tier.close()


@pytest.mark.skipif(sys.platform != "linux" or _NR_CACHESTAT is None, reason="cachestat is Linux-only")
def test_the_sweep_deletes_a_file_only_after_the_commit_unreferencing_it_is_durable(tmp_path):
    """A writer killed between the commit that removed an entry and the
    delete of its file (here: that commit made without ``files``, the state
    such a kill leaves) leaves the file to the sweep of the next open, which
    must not unlink it while that commit is not on disk either."""
    from ecstore.lmdb.txn import WriteTxn

    path = str(tmp_path / "store")
    tier = LMDBTier(path, 16 * MiB, file_blobs_from=0)
    try:
        _put(tier, KEY_A, NAME_A, 1)
        tier.sync()
        with WriteTxn.open(tier._write_txn(), tier._dbs, path=tier.path, leases=tier._leases,
                           pinned=tier.leased_keys, record_version=tier.record_version,
                           counters=tier.counters) as w:  # no ``files``: the delete never happens
            w.remove(KEY_A.encode())
        tier.files.close()  # the writer is gone: its token is dead
        assert [n for n in os.listdir(tier.files.dir) if n.endswith(".ecb")]
        _watch.update(on=True, seen=[], data=os.path.join(path, "data.mdb"))
        try:
            LMDBTier(path, 16 * MiB, file_blobs_from=0).close()  # sweeps at open
        finally:
            _watch["on"] = False
        assert _watch["seen"], "the sweep deleted nothing"
        assert _watch["seen"] == [0] * len(_watch["seen"]), (
            f"the sweep unlinked a blob file before the commit unreferencing it was on disk: {_watch['seen']}")
    finally:
        tier.close()


@pytest.mark.parametrize("store", ["new", "blobs/ made by a process that died"])
def test_the_store_directory_is_synced_before_a_commit_references_a_blob_file(tmp_path, monkeypatch, store):
    """``blobs/`` is a directory entry of the store directory: until that
    directory is fsynced, a power cut may drop ``blobs/`` with every file in
    it while the synced ``data.mdb`` still points to them (each such entry a
    miss). Only the blob directory was fsynced. Every handle's first batch
    of files syncs the store directory too, also when ``blobs/`` already
    existed (its creator may have died before syncing it)."""
    path = tmp_path / "store"
    if store != "new":
        LMDBTier(str(path), 16 * MiB, file_blobs_from=0).close()
        assert (path / "blobs").is_dir()
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    tier = LMDBTier(str(path), 16 * MiB, file_blobs_from=0)
    try:
        monkeypatch.setattr(os, "fsync", spy)
        _put(tier, KEY_A, NAME_A, 1)
        assert str(path) in synced, f"fsynced: {synced}"
        assert str(path / "blobs") in synced
        synced.clear()
        _put(tier, KEY_B, NAME_B, 2)
        assert str(path) not in synced, "the store directory is synced once per handle, not per batch"
    finally:
        monkeypatch.undo()
        tier.close()
