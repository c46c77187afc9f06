"""ecstore.lmdb.blobfiles: large blob files written with ``O_DIRECT`` (past
the page cache), what stays buffered, the fall-back where a file system
refuses it, and the pool's aligned slabs that make it possible. Residency in
the page cache is read with ``mincore(2)`` on a real mapping of the file."""

from __future__ import annotations

import errno
import logging
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import xxhash
from helpers import fault_fs
from helpers.blobfiles_parent import read_back
from helpers.pages import filled, resident_pages

from ecstore.errors import StoreFullError
from ecstore.lmdb import blobfiles, direct
from ecstore.lmdb.blobfiles import DIRECT_ALIGN, DIRECT_FROM, BlobFiles
from ecstore.pool import BufferPool

MiB = 1 << 20
PAGE = mmap.PAGESIZE
def second_write_does(second: Callable[..., int]) -> tuple[Callable[[int, object], int], list[int]]:
    """An ``os.write`` for monkeypatching whose second call is
    ``second(real_write, fd, data)``, and the list of every call's length."""
    real_write = os.write
    calls: list[int] = []

    def write(fd: int, data) -> int:
        calls.append(len(data))
        return second(real_write, fd, data) if len(calls) == 2 else real_write(fd, data)
    return write, calls


@pytest.fixture
def store(tmp_path: Path) -> str:
    path = tmp_path / "store"
    path.mkdir()
    return str(path)


def test_pool_slabs_start_aligned_for_direct_writes():
    pool = BufferPool()
    for nbytes in (64 * 1024, MiB + 3, 8 * MiB + 1, 34_300_000):
        assert pool.buffer(nbytes).ctypes.data % DIRECT_ALIGN == 0
        blob, view = pool.typed_buffer(nbytes, 128, torch.uint8, (nbytes - 128,))
        assert blob.ctypes.data % DIRECT_ALIGN == 0 and view.data_ptr() == blob.ctypes.data + 128
        del blob, view
    pool.prefault_soon(8 * MiB, (64, torch.bfloat16, (4 * MiB - 32,)))  # a slab made ready off the thread
    assert pool.wait_prefaulted(60)
    blob, view = pool.typed_buffer(8 * MiB, 64, torch.bfloat16, (4 * MiB - 32,))
    assert pool.reused >= 1 and blob.ctypes.data % DIRECT_ALIGN == 0


@pytest.mark.parametrize("tail", [0, 123])
def test_a_large_aligned_blob_is_written_past_the_page_cache(store, tail):
    """Before O_DIRECT every page of a new blob file sat in the page cache
    (on the benchmark VM the buffered write of a new 34 MB file took 10-20x
    the direct one); now only its unaligned tail page does."""
    files = BlobFiles(store, readonly=False)
    assert files.direct_from == DIRECT_FROM
    data = filled(DIRECT_FROM + 2 * MiB + tail, 1)
    ref = files.write(data)
    cached, pages = resident_pages(os.path.join(files.dir, ref.name))
    assert pages == -(-data.nbytes // PAGE) and cached <= (1 if tail else 0)
    assert read_back(files, ref) == data.tobytes()
    files.sync([ref.name])
    files.close()


def test_small_unaligned_or_switched_off_blobs_go_through_the_page_cache(store):
    files = BlobFiles(store, readonly=False)
    big = filled(DIRECT_FROM + MiB + 1, 2)
    small = filled(DIRECT_FROM - DIRECT_ALIGN, 3)
    unaligned = big[1:]  # not aligned in memory: O_DIRECT would refuse it
    refs = [files.write(small), files.write(unaligned)]
    off = BlobFiles(store, readonly=False, direct_from=None)
    refs.append(off.write(big))
    for ref, data, f in zip(refs, (small, unaligned, big), (files, files, off), strict=True):
        cached, pages = resident_pages(os.path.join(files.dir, ref.name))
        assert cached == pages, ref  # written through the page cache
        assert read_back(f, ref) == data.tobytes()
    assert files.direct_from == DIRECT_FROM  # not switched off by those
    files.close()
    off.close()


def test_a_file_system_refusing_o_direct_gets_buffered_writes_logged_once(store, monkeypatch, caplog):
    """Some file systems (and older tmpfs) refuse O_DIRECT at open with
    EINVAL: the blob is written buffered, and so is every later one."""
    real_open = os.open
    refused = []

    def open_without_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:  # as Linux does: the file is created, then the open fails
            refused.append(path)
            os.close(real_open(path, flags & ~os.O_DIRECT, *args, **kwargs))
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(blobfiles.os, "open", open_without_direct)
    files = BlobFiles(store, readonly=False)
    data = filled(DIRECT_FROM + MiB, 4)
    with caplog.at_level(logging.INFO, logger="ecstore"):
        first = files.write(data)
        second = files.write(data)
    assert len(refused) == 1 and files.direct_from is None
    assert [r.message for r in caplog.records if "O_DIRECT" in r.message] and \
        len([r for r in caplog.records if "O_DIRECT" in r.message]) == 1
    monkeypatch.undo()
    for ref in (first, second):
        assert read_back(files, ref) == data.tobytes()
        cached, pages = resident_pages(os.path.join(files.dir, ref.name))
        assert cached == pages
    assert sorted(n for n in os.listdir(files.dir) if not n.endswith(".lock")) == sorted([first.name, second.name])
    files.close()


@pytest.mark.skipif(not fault_fs.can_mount(), reason="needs root to mount a ramfs")
def test_a_real_file_system_without_o_direct_takes_the_first_large_blob(tmp_path):
    """ramfs (like tmpfs before Linux 6.6) creates the file, then refuses
    the O_DIRECT open with EINVAL: that first blob is still written (not a
    failed put with "File exists"), and no empty file is left behind."""
    with fault_fs.ramfs(tmp_path / "mnt") as mnt:
        files = BlobFiles(str(mnt), readonly=False)
        data = filled(DIRECT_FROM + 5, 8)
        ref = files.write(data)
        assert files.direct_from is None
        assert read_back(files, ref) == data.tobytes()
        assert [n for n in os.listdir(files.dir) if not n.endswith(".lock")] == [ref.name]
        files.sync([ref.name])
        files.close()


def test_a_direct_write_the_file_system_refuses_midway_finishes_buffered(store, monkeypatch):
    """EINVAL from a write (alignment a file system does not take) turns
    O_DIRECT off for the rest of the file and the handle; the file is whole."""
    def refuse(real_write, fd, data):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
    write, calls = second_write_does(refuse)
    files = BlobFiles(store, readonly=False)
    data = filled(3 * blobfiles.WRITEBACK_CHUNK + 77, 5)
    monkeypatch.setattr(blobfiles.os, "write", write)
    ref = files.write(data)
    monkeypatch.undo()
    assert files.direct_from is None and len(calls) >= 3
    assert read_back(files, ref) == data.tobytes()
    files.close()


@pytest.mark.skipif(not fault_fs.can_mount(), reason="needs root to mount a small tmpfs")
@pytest.mark.parametrize("preallocate", [True, False])
def test_a_full_disk_under_a_direct_write_is_store_full_and_leaves_no_partial_file(tmp_path, monkeypatch,
                                                                                 preallocate):
    """With ``fallocate`` the disk is found full before any write; without
    it (a file system that has none) by the direct writes themselves."""
    if not preallocate:
        monkeypatch.setattr(blobfiles, "_preallocate", None)
    with fault_fs.small_tmpfs(tmp_path / "mnt", DIRECT_FROM + 2 * MiB) as mnt:
        files = BlobFiles(str(mnt), readonly=False)
        with pytest.raises(StoreFullError, match="disk full while writing blob file"):
            files.write(filled(DIRECT_FROM + 4 * MiB, 6))
        assert [n for n in os.listdir(files.dir) if not n.endswith(".lock")] == []
        data = filled(DIRECT_FROM + MiB, 7)
        ref = files.write(data)  # the partial file's space is free again
        assert read_back(files, ref) == data.tobytes()
        files.close()


def test_a_platform_without_o_direct_writes_every_blob_through_the_page_cache(store, monkeypatch):
    """Where ``os`` has no ``O_DIRECT`` (not Linux) no open asks for it and
    no fcntl clears it; the handle keeps its setting (nothing was refused)."""
    monkeypatch.setattr(blobfiles, "_O_DIRECT", 0)
    real_open = os.open
    direct_opens = []

    def recording_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            direct_opens.append(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(blobfiles.os, "open", recording_open)
    files = BlobFiles(store, readonly=False)
    data = filled(DIRECT_FROM + MiB, 9)
    ref = files.write(data)
    monkeypatch.undo()
    assert direct_opens == [] and files.direct_from == DIRECT_FROM
    cached, pages = resident_pages(os.path.join(files.dir, ref.name))
    assert cached == pages
    assert read_back(files, ref) == data.tobytes()
    files.close()


@pytest.mark.parametrize("use_odirect", [True, False])
def test_the_use_odirect_setting_reaches_a_stores_blob_files(tmp_path, use_odirect):
    """End to end: a put's blob (built in the pool by the codec) of 4 MiB
    and more is written past the page cache with the default setting, and
    through it with ``use_odirect: false``."""
    from ecstore import ECStore, ECStoreConfig

    cfg = ECStoreConfig(local_disk=str(tmp_path / "s"), max_local_disk_size=0.25, local_cpu=False,
                        use_odirect=use_odirect)
    t = torch.arange((DIRECT_FROM + MiB) // 4, dtype=torch.float32).view(-1, 512)
    with ECStore(cfg, model="m", dtype=torch.float32) as st:
        st.put("big", t)
        st.flush()
        (blob,) = [p for p in (tmp_path / "s").rglob("*.ecb")]
        cached, pages = resident_pages(str(blob))
        got = st.get("big")
    assert got is not None and torch.equal(got, t)
    assert cached == pages if not use_odirect else cached <= 1


# --------------------------------------------------------------------------- through the staging buffers
@pytest.mark.parametrize("size", [DIRECT_FROM, direct.CHUNK, direct.CHUNK + DIRECT_ALIGN, 3 * direct.CHUNK + 77])
def test_direct_writes_go_through_the_huge_page_buffers_and_the_file_is_whole(store, size):
    """A direct write is copied chunk by chunk into the process's staging
    buffers and written from there by the lane thread; the file holds the
    blob's bytes exactly and the blob's own memory is not changed."""
    files = BlobFiles(store, readonly=False)
    data = filled(size, 11)
    before, writes = data.tobytes(), direct.DIRECT.writes
    ref = files.write(data)
    assert direct.DIRECT.writes == writes + 1
    assert read_back(files, ref) == before and data.tobytes() == before
    files.close()


def test_a_short_direct_write_in_the_lane_finishes_through_the_page_cache(store, monkeypatch):
    """A write the device takes only partly (the lane's second chunk) stops
    the staged writes; the rest of the file goes through the page cache.
    The hasher, fed the staged chunks as they went, still sees the whole
    blob once, in order."""
    write, calls = second_write_does(lambda real_write, fd, data: real_write(fd, memoryview(data)[:DIRECT_ALIGN]))
    files = BlobFiles(store, readonly=False)
    data = filled(3 * direct.CHUNK + 77, 12)
    hasher = xxhash.xxh3_64()
    monkeypatch.setattr(blobfiles.os, "write", write)
    ref = files.write(data, hasher=hasher)
    monkeypatch.undo()
    assert calls[:2] == [direct.CHUNK, direct.CHUNK] and len(calls) >= 3
    assert read_back(files, ref) == data.tobytes()
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(data)
    assert files.direct_from == DIRECT_FROM  # a short write turns nothing off
    files.close()


def test_a_write_while_another_thread_holds_the_buffers_goes_straight_from_the_blob(store):
    """One write at a time uses the staging buffers: another thread's write
    meanwhile is made straight from its own memory, and is just as whole."""
    files = BlobFiles(store, readonly=False)
    data = filled(2 * direct.CHUNK + 5, 13)
    writes = direct.DIRECT.writes
    with direct.DIRECT._lock:  # as a write in progress on another thread holds it
        ref = files.write(data)
    assert direct.DIRECT.writes == writes
    assert read_back(files, ref) == data.tobytes()
    files.close()
