"""ecstore.lmdb.blobfiles: pointer values, blob files, and the sweep of dead
writers' leftovers, with real files, real processes (tests/helpers/blobfiles_child.py)
and, where this process may mount, a real full file system."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import fault_fs
from helpers.blobfiles_child import pattern
from helpers.blobfiles_parent import CHILD, child

from ecstore.errors import CorruptEntryError, ECStoreError, InvalidEntryError, StoreFullError
from ecstore.format import blob_check, codec
from ecstore.lmdb.blobfiles import POINTER_MAGIC, BlobFiles, FileRef, pack_ref, unpack_ref

MiB = 1 << 20
NAME = "0123456789abcdef-17.ecb"


def finish(p: subprocess.Popen) -> None:
    """Let a ``write`` child close its handle and exit cleanly."""
    assert p.stdin is not None
    p.stdin.close()
    assert p.wait() == 0


def read_file(files: BlobFiles, ref: FileRef) -> bytes:
    fd = files.open(ref)
    assert fd is not None
    try:
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read()
    finally:
        os.close(fd)


class Referenced:
    """A ``referenced`` callback that counts its calls."""

    def __init__(self, names: set[str]) -> None:
        self.names, self.calls = names, 0

    def __call__(self) -> set[str]:
        self.calls += 1
        return self.names


@pytest.fixture
def store(tmp_path: Path) -> str:
    path = tmp_path / "store"
    path.mkdir()
    return str(path)


# -- pointer values -----------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 123_456_789, (1 << 64) - 1])
def test_pointer_round_trip(size):
    ref = FileRef(NAME, size)
    value = pack_ref(ref)
    assert value.startswith(POINTER_MAGIC) and len(POINTER_MAGIC) == 8
    assert unpack_ref(value) == ref
    assert unpack_ref(memoryview(value)) == ref
    assert unpack_ref(memoryview(b"xx" + value)[2:]) == ref


def test_an_inline_blob_is_no_pointer():
    blob = codec.encode(torch.arange(64, dtype=torch.float32).reshape(8, 8), identifier="img-1", model="m")
    assert unpack_ref(blob.tobytes()) is None
    assert unpack_ref(memoryview(blob)) is None
    # a blob starts with its header length: never the magic
    assert int.from_bytes(POINTER_MAGIC, "little") > blob_check.MAX_HEADER_BYTES
    for short in (b"", b"\xff", POINTER_MAGIC[:7]):
        assert unpack_ref(short) is None


@pytest.mark.parametrize("tail", [
    b"", b"\x01\x00\x00", b"\x05" + b"\x00" * 7,  # short: no size or no name
    b"x" * 8 + b"../0123456789abcdef-1.ecb", b"x" * 8 + b"0123456789abcdef-1.ecb/x",
    b"x" * 8 + b"a/b", b"x" * 8 + "0123456789abcdéf-1.ecb".encode(), b"x" * 8 + b"\xff\xfe",
    b"x" * 8 + b"0123456789abcdef-1.ecb\x00", b"x" * 8 + b"0123456789ABCDEF-1.ecb",
    b"x" * 8 + b"0123456789abcdef.lock", b"x" * 8 + b"0123456789abcdef-1.ecb\n", b"x" * 8 + b"..",
])
def test_malformed_pointer_is_corrupt(tail):
    with pytest.raises(CorruptEntryError):
        unpack_ref(POINTER_MAGIC + tail)


# -- writing and reading ------------------------------------------------------

def test_write_open_read_back(store):
    files = BlobFiles(store, readonly=False)
    assert files.dir == os.path.join(store, "blobs")
    assert stat.S_IMODE(os.stat(files.dir).st_mode) == 0o700
    refs = [files.write(b"hello blob"), files.write(memoryview(b"")), files.write(pattern(3, MiB + 7))]
    assert [r.size for r in refs] == [10, 0, MiB + 7]
    assert len({r.name for r in refs}) == 3
    assert read_file(files, refs[0]) == b"hello blob"
    assert read_file(files, refs[1]) == b""
    assert read_file(files, refs[2]) == pattern(3, MiB + 7).tobytes()
    for r in refs:
        assert stat.S_IMODE(os.stat(os.path.join(files.dir, r.name)).st_mode) == 0o600
        assert unpack_ref(pack_ref(r)) == r
    token = refs[0].name.split("-")[0]
    assert all(r.name.startswith(token + "-") for r in refs)
    assert os.path.exists(os.path.join(files.dir, token + ".lock"))  # held while open
    files.sync([r.name for r in refs])
    assert files.open(FileRef("0123456789abcdef-0.ecb", 1)) is None  # no such file: a miss
    files.close()
    files.close()  # idempotent
    assert sorted(os.listdir(files.dir)) == sorted(r.name for r in refs)  # lock released, blobs stay
    with pytest.raises(ECStoreError, match="closed"):
        files.write(b"x")


def test_a_batch_syncs_on_the_sync_threads_and_reports_a_missing_file(store, monkeypatch):
    """Several files sync at once on the process's ``ecstore-fsync`` threads;
    a file removed meanwhile is StoreFullError unless ``missing_ok``."""
    files = BlobFiles(store, readonly=False)
    refs = [files.write(pattern(i, 3 * MiB + i)) for i in range(4)]
    threads: list[str] = []
    real = os.fdatasync

    def recording(fd: int) -> None:
        threads.append(threading.current_thread().name)
        real(fd)
    monkeypatch.setattr(os, "fdatasync", recording)
    files.sync([r.name for r in refs])
    assert len(threads) == 4 and all(t.startswith("ecstore-fsync") for t in threads)
    os.unlink(os.path.join(files.dir, refs[1].name))
    with pytest.raises(StoreFullError, match=refs[1].name):
        files.sync([r.name for r in refs])
    files.sync([r.name for r in refs], missing_ok=True)
    assert [read_file(files, r) for r in refs[2:]] == [pattern(i, 3 * MiB + i).tobytes() for i in (2, 3)]
    files.close()


_SYNC_AT_EXIT = """
import atexit, sys
from ecstore.lmdb.blobfiles import BlobFiles
files = BlobFiles(sys.argv[1], readonly=False)
names = [files.write(bytes([i]) * (3 << 20)).name for i in range(3)]
files.sync(names[:2])  # the sync threads run
def at_exit():
    files.sync(names)
    print("synced", flush=True)
atexit.register(at_exit)  # as a store closed at exit does it
"""


def test_a_batch_synced_at_interpreter_exit_is_synced_in_the_calling_thread(store):
    """At exit (``atexit``: a store closed there, by the connector's shutdown
    or :mod:`ecstore.store.left_open`) the process's thread pools refuse work:
    a batch of blob files failed ("cannot schedule new futures after
    shutdown", every entry of the last batch logged as not made durable).
    The calling thread now syncs what the pool refused."""
    r = subprocess.run([sys.executable, "-c", _SYNC_AT_EXIT, store], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (0, "synced\n", "")


def test_a_sync_the_pool_took_after_refusing_it_still_reports_its_error(store, monkeypatch):
    """submit queues a job before it starts a thread: a refusal from the
    thread's start (RuntimeError) leaves the job queued, and a busy worker
    may run it before the caller's own run of that name, which then waited
    and returned: the file's sync error was lost. (The refusal is simulated
    on the real pool: a thread that cannot start is not made on purpose.)"""
    from concurrent import futures

    from ecstore.lmdb import blobfiles as bf

    real = bf._syncers()

    class RefusesAfterQueueing:
        def submit(self, fn, name):
            job = real.submit(fn, name)  # queued: a worker runs it
            if name == "b":
                futures.wait([job])  # ... before the caller's own run of "b"
                raise RuntimeError("can't start new thread")
            return job

    def sync(name: str) -> None:
        if name == "b":
            raise StoreFullError("EIO on b")
    monkeypatch.setattr(bf, "_syncers", lambda: RefusesAfterQueueing())
    with pytest.raises(StoreFullError, match="EIO on b"):
        bf._each_on_syncers(sync, ["a", "b", "c"])


def test_a_forked_child_syncs_a_batch_on_threads_of_its_own(store):
    """The parent's sync threads do not exist in a child forked after them:
    the child makes its own (without that, its first batch waited forever
    on the parent's idle threads; the alarm turns a hang into a failure)."""
    files = BlobFiles(store, readonly=False)
    files.sync([files.write(b"a").name, files.write(b"b").name])  # the pool's threads now run
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(120)
            own = BlobFiles(store, readonly=False)
            own.sync([own.write(b"c").name, own.write(b"d").name])
            own.close()
            code = 0
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    files.close()


def test_write_numpy_views_and_refuse_strided(store):
    files = BlobFiles(store, readonly=False)
    base = pattern(9, 4096)
    view = base[100:3000]  # a view into the middle of an array
    grid = base.reshape(64, 64)[10:20]  # 2-D, C-contiguous rows
    for arr in (view, grid, codec.encode(torch.ones(3, 5), identifier="i", model="m")):
        ref = files.write(arr)
        assert ref.size == arr.nbytes and read_file(files, ref) == arr.tobytes()
    with pytest.raises(InvalidEntryError, match="C-contiguous"):
        files.write(base[::2])
    with pytest.raises(InvalidEntryError):
        files.write(base.reshape(64, 64)[:, :10])
    files.close()


def test_group_file_mode_gives_group_bits_whatever_the_umask(store):
    old = os.umask(0o077)
    try:
        files = BlobFiles(store, readonly=False, file_mode=0o660)
        ref = files.write(b"shared")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(files.dir).st_mode) == 0o770
    assert stat.S_IMODE(os.stat(os.path.join(files.dir, ref.name)).st_mode) == 0o660
    files.close()


def test_threads_write_distinct_files(store):
    files = BlobFiles(store, readonly=False)
    out: dict[int, list[FileRef]] = {}

    def work(t: int) -> None:
        out[t] = [files.write(pattern(t * 100 + k, 1000 + k)) for k in range(20)]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    names = [r.name for refs in out.values() for r in refs]
    assert len(set(names)) == 120
    for t, refs in out.items():
        for k, r in enumerate(refs):
            assert read_file(files, r) == pattern(t * 100 + k, 1000 + k).tobytes()
    files.close()


def test_discard_removes_and_ignores_missing_and_foreign_names(store, caplog):
    files = BlobFiles(store, readonly=False)
    a, b = files.write(b"a"), files.write(b"b")
    outside = Path(store) / "data.mdb"
    outside.write_bytes(b"keep")
    files.discard([a.name, a.name, "../data.mdb", "0123456789abcdef-5.ecb"])
    assert files.open(a) is None and read_file(files, b) == b"b"
    assert outside.read_bytes() == b"keep"
    assert "not a blob file name" in caplog.text
    files.close()


FULL_DISK = ["rlimit-fsize"] + (["tmpfs-enospc"] if fault_fs.can_mount() else [])


@pytest.mark.parametrize("how", FULL_DISK)
def test_full_disk_raises_store_full_and_leaves_no_partial_file(tmp_path, how):
    """``rlimit-fsize``: a child whose files may not pass 1 MiB (EFBIG after a
    short write); ``tmpfs-enospc``: a real 2 MiB file system filling up."""
    if how == "rlimit-fsize":
        path = tmp_path / "s"
        path.mkdir()
        with child("fsize", str(path), str(MiB), str(3 * MiB)) as (p, r):
            assert p.wait() == 0
        assert isinstance(r, dict)
        assert r["error"].startswith("disk full while writing blob file") and "RLIMIT_FSIZE" in r["error"], r
        assert [n for n in r["files"] if not n.endswith(".lock")] == []
        return
    with fault_fs.small_tmpfs(tmp_path / "mnt", 2 * MiB) as mnt:
        files = BlobFiles(str(mnt), readonly=False)
        kept = files.write(pattern(1, MiB // 2))
        with pytest.raises(StoreFullError, match="disk full while writing blob file") as err:
            files.write(pattern(2, 3 * MiB))
        print(err.value)
        assert sorted(n for n in os.listdir(files.dir) if not n.endswith(".lock")) == [kept.name]
        again = files.write(pattern(3, MiB // 2))  # the space of the partial file is free again
        assert read_file(files, kept) == pattern(1, MiB // 2).tobytes()
        assert read_file(files, again) == pattern(3, MiB // 2).tobytes()
        files.close()


# -- sweeping -----------------------------------------------------------------

def test_sweep_removes_a_killed_writers_unreferenced_files(store):
    with child("write", store, "4", "5000") as (p, names):
        assert isinstance(names, list)
        p.kill()
        p.wait()
    token = names[0].split("-")[0]
    blobs = Path(store) / "blobs"
    (blobs / f"{token}-9.ecb.tmp").write_bytes(b"partial")  # a partial file of the dead writer
    (blobs / "notes.txt").write_bytes(b"not ours")
    files = BlobFiles(store, readonly=False)
    mine = files.write(b"mine, unreferenced, live")
    referenced = Referenced({names[0], names[2]})
    assert files.sweep(referenced) == 3
    assert referenced.calls == 1
    assert sorted(os.listdir(blobs)) == sorted([names[0], names[2], mine.name, "notes.txt",
                                                mine.name.split("-")[0] + ".lock"])
    assert read_file(files, FileRef(names[2], 5000)) == pattern(2, 5000).tobytes()
    # The dead writer's referenced files stay, so each sweep scans again; gone: no scan.
    assert files.sweep(referenced) == 0 and referenced.calls == 2
    files.discard([names[0], names[2]])
    assert files.sweep(referenced) == 0 and referenced.calls == 2
    files.close()


def test_a_forked_child_does_not_keep_a_dead_writers_files_alive(store):
    """Regression: a child forked (no exec) after its parent took a writer
    token inherited the token's flock descriptor, so once the parent died
    its token still looked alive for as long as the child lived and its
    leftovers were never swept. Children now close their copy at fork."""
    with child("forkwrite", store) as (p, out):
        assert isinstance(out, list)
        name, grandchild = out
        p.kill()
        p.wait()
    try:
        files = BlobFiles(store, readonly=False)
        assert files.sweep(Referenced(set())) == 1  # the grandchild still runs
        assert not (Path(store) / "blobs" / name).exists()
        files.close()
    finally:
        os.kill(grandchild, signal.SIGKILL)


def test_sweep_never_touches_a_live_writer_and_sweeps_it_once_closed(store):
    files = BlobFiles(store, readonly=False)
    other = BlobFiles(store, readonly=False)  # another live handle of this process
    theirs = other.write(b"other handle")
    with child("write", store, "3", "100") as (p, names):
        assert isinstance(names, list)
        referenced = Referenced(set())
        assert files.sweep(referenced) == 0
        assert referenced.calls == 0  # only live writers: no scan
        assert all((Path(files.dir) / n).exists() for n in names)
        finish(p)  # the writer closes cleanly: its lock file is gone
    assert not any(n.endswith(".lock") and n.startswith(names[0].split("-")[0]) for n in os.listdir(files.dir))
    referenced = Referenced({names[1]})
    assert files.sweep(referenced) == 2 and referenced.calls == 1
    assert sorted(n for n in os.listdir(files.dir) if n.endswith(".ecb")) == sorted([names[1], theirs.name])
    other.close()
    assert files.sweep(Referenced({names[1]})) == 1  # the other handle closed too
    assert sorted(n for n in os.listdir(files.dir) if n.endswith(".ecb")) == [names[1]]
    files.close()


def test_an_unlocked_lock_file_is_a_dead_writer(store):
    """A lock file nobody holds (a writer killed between creating and locking
    it, or an old one) is removed with its token's unreferenced files."""
    files = BlobFiles(store, readonly=False)
    blobs = Path(files.dir)
    (blobs / "fedcba9876543210.lock").write_bytes(b"")
    (blobs / "fedcba9876543210-0.ecb").write_bytes(b"x")
    (blobs / "fedcba9876543211.lock").write_bytes(b"")  # no files at all
    assert files.sweep(Referenced(set())) == 1
    assert os.listdir(blobs) == []
    files.close()


def test_two_processes_sweeping_concurrently_both_succeed(store):
    names: list[str] = []
    for _ in range(3):
        with child("write", store, "30", "2000") as (p, written):
            assert isinstance(written, list)
            names += written
            p.kill()
    keep = set(names[::3])
    sweepers = [subprocess.Popen([sys.executable, CHILD, "sweep", store, json.dumps(sorted(keep))],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for s in sweepers:
            assert s.stdout is not None and json.loads(s.stdout.readline()) == "ready"
        for s in sweepers:
            assert s.stdin is not None
            s.stdin.write("go\n")
            s.stdin.flush()
        counts = [json.loads(s.communicate()[0]) for s in sweepers]
        assert [s.returncode for s in sweepers] == [0, 0]
    finally:
        for s in sweepers:
            if s.poll() is None:
                s.kill()
            s.wait()
    assert sum(counts) == len(names) - len(keep)  # each file removed exactly once
    assert sorted(os.listdir(Path(store) / "blobs")) == sorted(keep)


def test_readonly_handle_creates_and_removes_nothing(store):
    ro = BlobFiles(store, readonly=True)
    assert not os.path.exists(ro.dir)
    assert ro.open(FileRef(NAME, 1)) is None
    assert ro.sweep(Referenced(set())) == 0
    with pytest.raises(ECStoreError, match="read-only"):
        ro.write(b"x")
    ro.close()
    assert os.listdir(store) == []
    with child("write", store, "2", "10") as (p, names):
        p.kill()
    before = sorted(os.listdir(Path(store) / "blobs"))
    ro = BlobFiles(store, readonly=True)
    referenced = Referenced(set())
    assert ro.sweep(referenced) == 0 and referenced.calls == 0
    assert isinstance(names, list) and read_file(ro, FileRef(names[1], 10)) == pattern(1, 10).tobytes()
    ro.close()
    assert sorted(os.listdir(Path(store) / "blobs")) == before


def test_blob_dir_that_is_a_symlink_is_refused(store, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", Path(store) / "blobs")
    with pytest.raises(ECStoreError, match="not a directory"):
        BlobFiles(store, readonly=False)


def test_forked_child_neither_writes_nor_releases_the_parents_token(store):
    files = BlobFiles(store, readonly=False)
    ref = files.write(b"parent")
    lock = os.path.join(files.dir, ref.name.split("-")[0] + ".lock")
    pid = os.fork()
    if pid == 0:  # the child: only os-level calls, then _exit with a verdict
        code = 0
        try:
            files.write(b"child")
            code = 1
        except ECStoreError as e:
            code = 0 if "forked child" in str(e) else 2
        files.close()
        os._exit(code if os.path.exists(lock) else 3)
    assert os.waitpid(pid, 0)[1] == 0
    assert os.path.exists(lock)  # still the parent's: its files are not swept
    sweeper = BlobFiles(store, readonly=False)
    assert sweeper.sweep(Referenced(set())) == 0 and read_file(files, ref) == b"parent"
    files.close()
    assert sweeper.sweep(Referenced(set())) == 1
    sweeper.close()


def test_a_blob_file_that_cannot_be_opened_is_logged_once_with_its_path(store, tmp_path, caplog):
    files = BlobFiles(store, readonly=False)
    ref = files.write(b"payload")
    path = Path(files.dir) / ref.name
    (tmp_path / "target").write_bytes(b"payload")
    path.unlink()
    path.symlink_to(tmp_path / "target")  # opened with O_NOFOLLOW: ELOOP, not the target
    with caplog.at_level("WARNING", logger="ecstore"):
        assert files.open(ref) is None
        assert files.open(ref) is None
    lines = [r.getMessage() for r in caplog.records if "cannot open blob file" in r.getMessage()]
    assert len(lines) == 1 and str(path) in lines[0]
    files.close()
