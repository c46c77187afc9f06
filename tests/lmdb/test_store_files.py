"""Odd, planted or tampered store files.

Each case is a real store directory prepared the way an attacker with write
access, a damaged disk or another user would leave it; opening it must give
a clear ECStoreError (never a hang, a followed symlink, a silent
re-migration or a leaked environment), and read-only tools must work for a
user who may read but not write the store.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch

from ecstore import ECStore, ECStoreConfig
from ecstore.errors import ECStoreError
from ecstore.lmdb import LMDBTier
from ecstore.lmdb.env import _SharedEnv
from ecstore.store import handle as handle_mod

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
MODEL = "org/files"
STORE_FILES = ["data.mdb", "lock.mdb", "leases.mdb", "leases.mdb-lock"]
NOBODY = 65534


def cfg_for(path: Path, **kw: object) -> ECStoreConfig:
    return ECStoreConfig(local_cpu=False, local_disk=str(path), max_local_disk_size=0.01, **kw)  # type: ignore[arg-type]


def tensor_for(i: int) -> torch.Tensor:
    return (torch.arange(32, dtype=torch.float32).reshape(4, 8) + i).to(torch.float16)


def make_store(path: Path, n: int = 4) -> None:
    with ECStore(cfg_for(path), model=MODEL, dtype=torch.float16) as s:
        for i in range(n):
            s.put(f"img-{i}", tensor_for(i))
        s.flush()


def open_fails(path: Path, *needles: str) -> str:
    """ECStore(path) raises an ECStoreError naming every needle, leaves no
    environment open, and a retry fails the same way (nothing leaked)."""
    for _ in range(2):
        with pytest.raises(ECStoreError) as info:
            ECStore(cfg_for(path), model=MODEL, dtype=torch.float16)
        msg = str(info.value)
        for needle in needles:
            assert needle in msg, msg
        assert not _SharedEnv._open, "a failed open left the environment open"
    return msg


# --------------------------------------------------------------------------
# Symlinked store files are refused, never followed
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", STORE_FILES)
@pytest.mark.parametrize("existing", [False, True], ids=["new-store", "existing-store"])
def test_symlinked_store_file_is_refused(tmp_path: Path, name: str, existing: bool) -> None:
    store = tmp_path / "store"
    if existing:
        make_store(store)
        (store / name).unlink()
    else:
        store.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, store / name)
    open_fails(store, name, "symbolic link")
    assert victim.read_bytes() == b"precious"
    assert (store / name).is_symlink()


# --------------------------------------------------------------------------
# Odd file types, tampered meta
# --------------------------------------------------------------------------


def test_data_file_as_fifo_does_not_hang(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    os.mkfifo(store / "data.mdb")
    open_fails(store, "data.mdb", "not a regular file")
    r = subprocess.run([sys.executable, "-m", "ecstore.cli", "list", str(store)], capture_output=True, text=True,
                       timeout=120, check=False, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize("name", ["leases.mdb", "leases.mdb-lock", "lock.mdb"])
def test_store_file_as_directory_is_refused_without_leak(tmp_path: Path, name: str) -> None:
    store = tmp_path / "store"
    make_store(store)
    (store / name).unlink()
    (store / name).mkdir()
    open_fails(store, name, "not a regular file")
    shutil.rmtree(store / name)
    with ECStore(cfg_for(store), model=MODEL, dtype=torch.float16) as s:  # the store itself is fine
        assert s.get("img-1") is not None


def _set_meta(store: Path, key: bytes, value: bytes | None) -> None:
    env = lmdb.open(str(store), max_dbs=8)
    try:
        meta = env.open_db(b"meta")
        with env.begin(write=True) as txn:
            if value is None:
                txn.delete(key, db=meta)
            else:
                txn.put(key, value, db=meta)
    finally:
        env.close()


def _meta(store: Path) -> dict[bytes, bytes]:
    env = lmdb.open(str(store), max_dbs=8, readonly=True, lock=False)
    try:
        meta = env.open_db(b"meta", create=False)
        with env.begin() as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor(db=meta)}
    finally:
        env.close()


@pytest.mark.parametrize("key, value, needle", [
    (b"schema_version", b"0", "schema_version"),
    (b"schema_version", b"-1", "schema_version"),
    (b"schema_version", b" 2", "schema_version"),
    (b"total_bytes", b"abc", "total_bytes"),
    (b"total_bytes", None, "total_bytes"),
    (b"next_seq", None, "next_seq"),
    (b"next_seq", b"\x01\x02", "next_seq"),
])
def test_tampered_meta_is_a_clear_error_and_nothing_is_rewritten(tmp_path: Path, key: bytes,
                                                                 value: bytes | None, needle: str) -> None:
    store = tmp_path / "store"
    make_store(store)
    _set_meta(store, key, value)
    before = _meta(store)
    msg = open_fails(store, needle, str(store))
    assert "damaged" in msg
    assert _meta(store) == before  # no silent re-migration, total_bytes not reset
    with pytest.raises(ECStoreError, match=needle):
        LMDBTier(str(store), 0, readonly=True, create=False)
    assert not _SharedEnv._open


# --------------------------------------------------------------------------
# An open that fails after LMDB opened releases what it opened
# --------------------------------------------------------------------------

def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ecstore-writer"]


def test_an_open_whose_writer_thread_cannot_start_releases_the_store(tmp_path, monkeypatch):
    """Regression: a process at its thread limit got the bare RuntimeError of
    ``Thread.start`` from ``ECStore(...)``, and the LMDB environment the open
    had just made stayed open in the process for good (no handle held it)."""
    store = tmp_path / "store"
    make_store(store)
    started = threading.Thread.start

    def cannot_start(thread: threading.Thread) -> None:
        if thread.name == "ecstore-writer":
            raise RuntimeError("can't start new thread")
        started(thread)

    monkeypatch.setattr(threading.Thread, "start", cannot_start)
    open_fails(store, "cannot start the store's writer thread", "can't start new thread", str(store))
    monkeypatch.undo()
    with ECStore(cfg_for(store), model=MODEL, dtype=torch.float16) as s:  # nothing lost, nothing held
        assert torch.equal(s.get("img-1"), tensor_for(1))


def test_an_open_interrupted_after_its_writer_started_stops_the_writer(tmp_path, monkeypatch):
    """Regression: an exception after the writer thread started (Ctrl-C while
    the open ends) left the thread running and the environment open."""
    store = tmp_path / "store"
    make_store(store)
    before = _writer_threads()

    def interrupted(nbytes: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(handle_mod.POOL, "keep_at_least", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ECStore(cfg_for(store, pooled_blobs=True), model=MODEL, dtype=torch.float16)
    assert not _SharedEnv._open, "the interrupted open left the environment open"
    assert _writer_threads() == before, "the interrupted open left its writer thread running"


# --------------------------------------------------------------------------
# Read-only tools for a user who may not write; bounded leases
# --------------------------------------------------------------------------


@pytest.fixture
def shared_store() -> Iterator[Path]:
    """A store in a directory other users can reach (not under pytest's
    0700 temporary root), files readable but not writable by others."""
    base = Path(tempfile.mkdtemp(prefix="ecstore-ro-"))
    try:
        base.chmod(0o755)
        store = base / "store"
        make_store(store, n=5)
        store.chmod(0o755)
        for p in store.iterdir():
            p.chmod(0o644)
        yield store
    finally:
        shutil.rmtree(base, ignore_errors=True)


def as_nobody(*args: str, groups: str = "-") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HELPERS / "as_user.py"), str(NOBODY), str(NOBODY), groups, *args],
                          capture_output=True, text=True, timeout=180, check=False, cwd="/",
                          env={k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")},
                          stdin=subprocess.DEVNULL)


def test_readonly_tools_work_without_write_access(shared_store: Path) -> None:
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in shared_store.iterdir()}
    # Sanity: nobody really cannot write here.
    r = as_nobody("open", str(shared_store))
    assert r.returncode == 2 and "error:" in r.stdout, r.stdout + r.stderr
    r = as_nobody("dump", "list", str(shared_store), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["totals"]["entries"] == 5
    key = doc["entries"][0]["key"]
    for cmd in (["stats", str(shared_store), "--json"], ["verify", str(shared_store)],
                ["show", str(shared_store), key]):
        r = as_nobody("dump", *cmd)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (cmd, r.stderr)
    out_dir = Path(tempfile.mkdtemp(prefix="ecstore-out-"))
    try:
        out_dir.chmod(0o777)
        r = as_nobody("dump", "export", str(shared_store), key, str(out_dir / "e.safetensors"))
        assert r.returncode == 0, r.stderr
        assert (out_dir / "e.safetensors").stat().st_uid == NOBODY
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    after = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in shared_store.iterdir()}
    assert after == before


def test_leases_never_released_are_pruned_without_eviction(tmp_path: Path) -> None:
    from ecstore.lmdb.leases import LEASE_PRUNE_MIN

    store = tmp_path / "store"
    make_store(store, n=1)
    tier = LMDBTier(str(store), 1 << 30)
    try:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout
        dead_pid = int(dead)
        n = 5 * LEASE_PRUNE_MIN
        for i in range(n):
            # Expired leases of this process, and unexpired ones of a dead process.
            tier.lease([f"gone-{i}"], 0.0)
            tier.lease([f"dead-{i}"], 3600.0, pid=dead_pid)
            tier.lease(["hot"], 0.0)  # one key leased again and again, never released
        tier.lease(["live"], 3600.0)
        assert tier.evictions == 0
        leases = tier._shared.leases
        assert leases is not None and leases.stat()["entries"] <= LEASE_PRUNE_MIN + 3
        assert tier.leased_keys() == {b"live"}
        with leases.begin() as txn:
            hot = txn.get(b"hot")
    finally:
        tier.close()
    # Pruned with the rest, or one record: its expired copies never pile up.
    assert hot is None or len(hot) == struct.calcsize("<IQ")


def test_readonly_open_of_a_missing_lock_file_in_a_readonly_dir(shared_store: Path) -> None:
    (shared_store / "lock.mdb").unlink()
    os.chmod(shared_store, 0o555)
    r = as_nobody("dump", "list", str(shared_store), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["totals"]["entries"] == 5, r.stderr
    assert not (shared_store / "lock.mdb").exists()
    assert stat.S_IMODE(shared_store.stat().st_mode) == 0o555


def test_a_process_that_created_the_store_keeps_lmdbs_lock(tmp_path: Path) -> None:
    """Fixing the modes of new files must not open and close lock.mdb:
    closing any descriptor of it drops the fcntl lock LMDB holds, and
    another process would then take the store for unused (compact) or
    re-initialise the lock file under a live writer."""
    from ecstore.maintenance import try_exclusive as _try_exclusive

    store = tmp_path / "store"
    holder = subprocess.Popen([sys.executable, str(HELPERS / "cli_holder.py"), str(store), "rw"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        assert stat.S_IMODE((store / "lock.mdb").stat().st_mode) == 0o600
        for name in ("lock.mdb", "leases.mdb-lock"):
            fd = os.open(store / name, os.O_RDWR)
            try:
                assert not _try_exclusive(fd), f"{name}: the creating process lost LMDB's lock"
            finally:
                os.close(fd)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(timeout=120) == 0


@pytest.mark.parametrize("value", [b"abc", b"", b"\xff2"])
def test_schema_version_damaged_while_open_is_an_ecstore_error(tmp_path: Path, value: bytes) -> None:
    """Every write re-reads ``schema_version`` (another process may have
    migrated the file). Damaged after the open (not digits), it raised a
    bare ValueError from ``int()`` out of ``delete`` (and out of the
    background write): a StoreOpenError naming the damage, and nothing is
    written."""
    store = tmp_path / "store"
    make_store(store)
    with ECStore(cfg_for(store), model=MODEL, dtype=torch.float16) as s:
        tier = s.disk
        assert tier is not None
        with tier._write_txn() as txn:  # the damage, by a raw write
            txn.put(b"schema_version", value, db=tier._dbs.meta)
        def meta() -> dict[bytes, bytes]:
            with tier.snapshot() as (txn, dbs):
                return {bytes(k): bytes(v) for k, v in txn.cursor(db=dbs.meta)}

        before = meta()
        with pytest.raises(ECStoreError, match="schema_version"):
            s.delete("img-0")
        assert s.contains("img-0")
        assert meta() == before
        with tier._shared.write_lock, tier._begin(write=True) as txn:  # repaired: the handle works again
            txn.put(b"schema_version", str(tier.schema_version).encode(), db=tier._dbs.meta)
        assert s.delete("img-0")


_GROW = """
import lmdb, sys
env = lmdb.open(sys.argv[1], map_size=64 << 20, subdir=False, lock=True)
for i in range(2):  # two commits: both meta pages then name the grown file
    with env.begin(write=True) as txn:
        txn.put(b"grow-%d" % i, b"x" * (2 << 20))
env.close()
"""


def test_size_check_does_not_mistake_a_file_growing_meanwhile_for_a_truncated_one(tmp_path, monkeypatch):
    """The truncation check of data.mdb / leases.mdb reads the file's size
    and its two meta pages while other processes may commit. It took the size
    between the two meta reads: a commit growing the file in that window
    (here a real second process, run right after the size was taken) made a
    healthy, busy file look truncated (StoreOpenError, e.g. a vLLM engine
    failing to start next to busy ones). The size is now taken after both
    meta pages are read (a live LMDB file only grows)."""
    from ecstore.lmdb import env as envmod

    path = tmp_path / "busy.mdb"
    e = lmdb.open(str(path), map_size=64 << 20, subdir=False, lock=True)
    with e.begin(write=True) as txn:
        txn.put(b"k", b"v")
    e.close()

    real_os = envmod.os

    class OsDuringACommit:
        def __getattr__(self, name: str):
            return getattr(real_os, name)

        def fstat(self, fd: int):
            st = real_os.fstat(fd)
            subprocess.run([sys.executable, "-c", _GROW, str(path)], check=True, timeout=120)
            return st

    monkeypatch.setattr(envmod, "os", OsDuringACommit())
    envmod._check_data_file(str(path))  # must not raise
    assert real_os.path.getsize(path) > 4 << 20  # the other process did grow it


def test_a_new_environment_read_between_its_two_meta_pages_is_not_called_truncated(tmp_path):
    """LMDB writes a new environment's two meta pages in one pwrite, the
    file's size growing a page at a time: another process opening the store
    in between saw one page whose meta names two, and refused the new store
    as truncated. Such a file is left to LMDB, which reads both meta pages
    with pread and refuses a missing one (MDB_INVALID: see test_faults'
    new-environment-first-page-only), never SIGBUS."""
    from ecstore.lmdb import env as envmod

    d = tmp_path / "new"
    lmdb.open(str(d), max_dbs=8, map_size=8 << 20).close()
    data = d / "data.mdb"
    assert data.stat().st_size == 8192
    os.truncate(data, 4096)  # what the other process sees half-way through the pwrite
    envmod._check_data_file(str(data))  # must not raise


_CREATE = f"""
import sys, torch
from ecstore import ECStore, ECStoreConfig
cfg = ECStoreConfig(local_cpu=False, local_disk=sys.argv[1], max_local_disk_size=0.01)
with ECStore(cfg, model={MODEL!r}, dtype=torch.float16) as s:
    s.put("theirs", torch.ones(4, 8, dtype=torch.float16))
    s.flush()
"""


class _OsWhile:
    """env's ``os`` with ``hook(path)`` run at the first call of ``at``
    (``listdir`` or ``path.isdir``), inside _open_env's window between its
    checks and its use of the directory."""

    def __init__(self, real: Any, at: str, hook: Callable[[str], None]) -> None:
        self._real, self._at, self._hook, self.taken = real, at, hook, []
        outer = self

        class Path:
            def __getattr__(self, name: str) -> Any:
                return getattr(real.path, name)

            def isdir(self, p: str) -> bool:
                was = real.path.isdir(p)
                outer._take("path.isdir", p)
                return was
        self.path = Path()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _take(self, at: str, p: str) -> None:
        if at == self._at and not self.taken:
            self.taken.append(p)
            self._hook(p)

    def listdir(self, p: str) -> list[str]:
        self._take("listdir", p)
        return self._real.listdir(p)


def _create_elsewhere(path: str) -> None:
    subprocess.run([sys.executable, "-c", _CREATE, path], check=True, timeout=120)


def test_a_store_another_process_creates_meanwhile_is_opened_not_refused(tmp_path, monkeypatch):
    """Two workers started together on one new local_disk: one saw no
    data.mdb, then listed the directory after the other had created the store
    there, and refused it as a foreign non-empty directory ("not an ecstore
    store (no data.mdb) and is not empty (data.mdb)": a CI failure of
    test_two_processes_write_and_read_one_store). Here a real second process
    creates the store right before this one lists the directory; this one now
    opens that store and sees its entry."""
    from ecstore.lmdb import env as envmod

    store = tmp_path / "store"
    store.mkdir()
    fake = _OsWhile(envmod.os, "listdir", _create_elsewhere)
    monkeypatch.setattr(envmod, "os", fake)
    with ECStore(cfg_for(store), model=MODEL, dtype=torch.float16) as s:
        assert fake.taken == [str(store)]  # the window was taken
        assert torch.equal(s.get("theirs"), torch.ones(4, 8, dtype=torch.float16))
        s.put("mine", torch.zeros(2, 8, dtype=torch.float16))
        s.flush()
    monkeypatch.undo()
    with ECStore(cfg_for(store), model=MODEL, dtype=torch.float16) as s:
        assert s.contains("mine") and s.contains("theirs")


def test_store_files_that_appear_meanwhile_get_the_owner_and_mode_checks(tmp_path, monkeypatch):
    """The files another process created inside that window were opened
    unchecked: a data.mdb anyone may write to, refused when it is there at
    the open, was used when it appeared after the check."""
    from ecstore.lmdb import env as envmod

    store = tmp_path / "store"
    store.mkdir()

    def create_loose(path: str) -> None:
        _create_elsewhere(path)
        os.chmod(os.path.join(path, "data.mdb"), 0o666)
    monkeypatch.setattr(envmod, "os", _OsWhile(envmod.os, "listdir", create_loose))
    with pytest.raises(ECStoreError, match="anyone may write to it"):
        ECStore(cfg_for(store), model=MODEL, dtype=torch.float16)


def test_a_store_directory_another_user_makes_meanwhile_is_refused(tmp_path, monkeypatch):
    """local_disk missing at the check, then made by another user before this
    process creates it (a shared /tmp): create_store_dir leaves an existing
    directory alone, and the store was created in the other user's directory."""
    from ecstore.lmdb import env as envmod

    store = tmp_path / "store"

    def made_by_nobody(path: str) -> None:
        os.mkdir(path, 0o700)
        os.chown(path, NOBODY, NOBODY)
    monkeypatch.setattr(envmod, "os", _OsWhile(envmod.os, "path.isdir", made_by_nobody))
    with pytest.raises(ECStoreError, match="belongs to another user"):
        ECStore(cfg_for(store), model=MODEL, dtype=torch.float16)
    assert os.listdir(store) == []  # nothing created in it


def test_leases_another_process_left_are_pruned_by_this_ones_next_leases(tmp_path: Path) -> None:
    # This process counts the lease table only now and then (LEASE_COUNT_EVERY):
    # keys another process added are still seen, and pruned, within that many
    # of its own new keys.
    from ecstore.lmdb.leases import LEASE_COUNT_EVERY, LEASE_PRUNE_MIN

    store = tmp_path / "store"
    make_store(store, n=1)
    tier = LMDBTier(str(store), 1 << 30)
    try:
        tier.lease(["first"], 0.0)  # this process counted the table: nearly empty
        n = 3 * LEASE_PRUNE_MIN
        code = (f"from ecstore.lmdb import LMDBTier\nt = LMDBTier({str(store)!r}, 1 << 30)\n"
                f"t.lease([f'other-{{i}}' for i in range({n})], 3600.0)\nt.close()\n")  # then dead
        subprocess.run([sys.executable, "-c", code], check=True)
        leases = tier._shared.leases
        assert leases is not None and leases.stat()["entries"] >= n
        for i in range(LEASE_COUNT_EVERY):
            tier.lease([f"mine-{i}"], 3600.0)
        assert leases.stat()["entries"] <= LEASE_COUNT_EVERY + 2
    finally:
        tier.close()
