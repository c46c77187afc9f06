"""ecstore.lmdb.spare and BlobFiles' spare files: a large blob copied into a
file made ahead with its pages in the page cache; what the file holds, its
checksum, sizes, failures, sweeping, close and fork, and the store's writer
making one when it goes idle. Real files, a real child process, real
page-cache residency (mincore)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import torch
import xxhash
from helpers import fault_fs
from helpers.blobfiles_parent import child, read_back
from helpers.encodes import count_encodes
from helpers.pages import filled, resident_pages

from ecstore import ECStore, ECStoreConfig
from ecstore.errors import ECStoreError, StoreFullError
from ecstore.lmdb import blobfiles, direct, spare
from ecstore.lmdb.blobfiles import SPARE_FROM, SPARE_ROUND, BlobFiles
from ecstore.lmdb.check import check_store

MiB = 1 << 20
BIG = SPARE_FROM + 3 * MiB + 123  # not a multiple of a page: the spare is cut to it


@pytest.fixture
def store(tmp_path: Path) -> str:
    path = tmp_path / "store"
    path.mkdir()
    return str(path)


def names(files: BlobFiles, suffix: str) -> list[str]:
    return sorted(n for n in os.listdir(files.dir) if n.endswith(suffix))


def with_spare(files: BlobFiles, size: int = BIG) -> str:
    """Write a first blob of ``size`` bytes, have a spare made; its name."""
    files.write(filled(size, 0))
    files.prepare_spare()
    assert files.wait_spare(60)
    (name,) = names(files, ".spare")
    return name


def test_the_next_large_blob_goes_into_the_spare_whole_and_in_the_page_cache(store):
    """A spare has the largest recent blob's size rounded up, every page in
    the page cache; the next blob is copied into it, cut to its size,
    renamed to a blob file name, and its pages stay cached (an O_DIRECT
    write leaves none: test_blobfiles_direct.py)."""
    files = BlobFiles(store, readonly=False)
    name = with_spare(files)
    assert os.path.getsize(os.path.join(files.dir, name)) == -(-BIG // SPARE_ROUND) * SPARE_ROUND
    cached, pages = resident_pages(os.path.join(files.dir, name))
    assert cached == pages
    data = filled(BIG, 1)
    hasher = xxhash.xxh3_64()
    ref = files.write(data, writeback=False, hasher=hasher)
    assert names(files, ".spare") == []  # taken
    assert ref.size == BIG and os.path.getsize(os.path.join(files.dir, ref.name)) == BIG
    assert read_back(files, ref) == data.tobytes()
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(data)
    cached, pages = resident_pages(os.path.join(files.dir, ref.name))
    assert cached == pages
    assert len(names(files, ".ecb")) == 2
    files.sync([ref.name])
    files.close()


def test_where_new_pages_are_dear_a_spare_written_blob_leaves_the_page_cache_once_synced(store, monkeypatch):
    """On a VM that reports free memory to its host, a spare-written blob's
    pages are dropped once it is durable (as an O_DIRECT blob never has
    any), and it still reads back whole; a small blob written through the
    page cache keeps its pages. A reader that takes the pages in again
    keeps them (a second sync drops nothing)."""
    monkeypatch.setattr(spare, "NEW_PAGES_DEAR", True)
    files = BlobFiles(store, readonly=False)
    with_spare(files)
    data = filled(BIG, 5)
    ref = files.write(data, writeback=False)
    small = files.write(filled(SPARE_FROM - 1, 6))  # under spare_from: buffered, kept cached
    path, small_path = os.path.join(files.dir, ref.name), os.path.join(files.dir, small.name)
    assert resident_pages(path)[0] == resident_pages(path)[1]
    files.sync([ref.name, small.name])
    assert resident_pages(path)[0] == 0
    assert resident_pages(small_path)[0] == resident_pages(small_path)[1]
    assert read_back(files, ref) == data.tobytes()  # read again from the device, whole
    files.sync([ref.name])  # synced again: nothing dropped a second time
    assert resident_pages(path)[0] == resident_pages(path)[1]
    files.close()


def test_elsewhere_a_spare_written_blob_stays_in_the_page_cache(store, monkeypatch):
    """Where new pages are cheap, a blob written through a spare keeps its
    pages after its sync: a consumer on the same machine reads it from memory."""
    monkeypatch.setattr(spare, "NEW_PAGES_DEAR", False)
    files = BlobFiles(store, readonly=False)
    with_spare(files)
    ref = files.write(filled(BIG, 7), writeback=False)
    files.sync([ref.name])
    cached, pages = resident_pages(os.path.join(files.dir, ref.name))
    assert cached == pages
    files.close()


def _balloon(root: Path, name: str, device: str, features: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "device").write_text(device + "\n")
    (root / name / "features").write_text(features + "\n")


def test_free_page_reporting_is_read_from_the_balloons_feature_bits(tmp_path):
    """Feature bit 5 of virtio device 5 (the memory balloon); another device
    with that bit, a balloon without it, or no virtio devices: no."""
    assert spare.free_page_reporting(str(tmp_path / "none")) is False
    _balloon(tmp_path / "a", "virtio0", "0x0002", "0000010000")  # a block device
    _balloon(tmp_path / "a", "virtio1", "0x0005", "0110000000")  # stats, deflate on OOM
    assert spare.free_page_reporting(str(tmp_path / "a")) is False
    _balloon(tmp_path / "a", "virtio2", "0x0005", "0110010100")  # + reporting
    assert spare.free_page_reporting(str(tmp_path / "a")) is True


@pytest.mark.parametrize("how", ["spare", "direct", "direct, several chunks", "buffered"])
def test_the_hasher_sees_the_whole_blob_on_every_path(store, how):
    files = BlobFiles(store, readonly=False, direct_from=None if how == "buffered" else blobfiles.DIRECT_FROM)
    if how == "spare":
        with_spare(files)
    data = filled(2 * direct.CHUNK + 123 if how == "direct, several chunks" else BIG, 2)
    hasher = xxhash.xxh3_64()
    ref = files.write(data, hasher=hasher)
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(data)
    assert read_back(files, ref) == data.tobytes()
    files.close()


def test_a_smaller_blob_is_cut_to_size_and_a_larger_one_leaves_the_spare(store):
    files = BlobFiles(store, readonly=False)
    name = with_spare(files)
    larger = filled(BIG + SPARE_ROUND, 3)
    ref = files.write(larger)  # does not fit: written as without spares
    assert names(files, ".spare") == [name]
    assert read_back(files, ref) == larger.tobytes()
    smaller = filled(SPARE_FROM, 4)
    ref = files.write(smaller)
    assert names(files, ".spare") == []
    assert os.path.getsize(os.path.join(files.dir, ref.name)) == SPARE_FROM
    assert read_back(files, ref) == smaller.tobytes()
    # The next spare holds the largest of the recent blobs.
    files.prepare_spare()
    assert files.wait_spare(60)
    (name,) = names(files, ".spare")
    assert os.path.getsize(os.path.join(files.dir, name)) == -(-(BIG + SPARE_ROUND) // SPARE_ROUND) * SPARE_ROUND
    files.close()


def test_small_blobs_and_a_switched_off_handle_make_no_spare(store):
    files = BlobFiles(store, readonly=False)
    files.write(filled(SPARE_FROM - 1, 5))
    files.prepare_spare()  # no large blob yet: nothing to size a spare by
    assert not files.wait_spare(60)
    off = BlobFiles(store, readonly=False, spare_from=None)
    off.write(filled(BIG, 6))
    off.prepare_spare()
    assert not off.wait_spare(60)
    assert names(files, ".spare") == []
    files.close()
    off.close()


def test_close_removes_the_spare_and_waits_for_one_being_made(store):
    files = BlobFiles(store, readonly=False)
    with_spare(files)
    files.close()
    assert names(files, ".spare") == []
    files = BlobFiles(store, readonly=False)
    files.write(filled(BIG, 7))
    files.prepare_spare()
    files.close()  # while it is made, or before: either way nothing is left
    assert names(files, ".spare") == []


def test_a_failed_copy_into_the_spare_is_store_full_and_leaves_no_file(store, monkeypatch):
    files = BlobFiles(store, readonly=False)
    with_spare(files)
    before = names(files, ".ecb")

    real = os.pwrite

    def pwrite(fd: int, data, offset: int) -> int:  # the device fails after the first piece
        if offset:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, data, offset)
    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(StoreFullError, match="cannot write blob file .*Input/output error"):
        files.write(filled(BIG, 8))
    monkeypatch.undo()
    assert names(files, ".ecb") == before and names(files, ".spare") == []
    ref = files.write(filled(BIG, 9))  # the handle goes on
    assert read_back(files, ref) == filled(BIG, 9).tobytes()
    files.close()


def test_a_kernel_without_populate_write_gets_no_spares_logged_once(store, monkeypatch, caplog):
    """Before Linux 5.14 ``MADV_POPULATE_WRITE`` is EINVAL: the handle stops
    making spares, logs it once and writes every blob as before."""
    monkeypatch.setattr(spare, "_MADV_POPULATE_WRITE", 12345)  # an advice no kernel has: EINVAL
    files = BlobFiles(store, readonly=False)
    with caplog.at_level(logging.INFO, logger="ecstore"):
        files.write(filled(BIG, 10))
        files.prepare_spare()
        assert not files.wait_spare(60)
        files.prepare_spare()
        assert not files.wait_spare(60)
    assert files.spare_from is None
    assert [r.getMessage() for r in caplog.records if "spare" in r.getMessage()] == [
        f"ecstore: {files.dir} cannot hold spare blob files (Invalid argument): each blob file is written new"]
    assert names(files, ".spare") == []
    ref = files.write(filled(BIG, 11))
    assert read_back(files, ref) == filled(BIG, 11).tobytes()
    files.close()


@pytest.mark.skipif(not fault_fs.can_mount(), reason="needs mount (root)")
def test_a_spare_that_does_not_fit_on_the_disk_is_not_made(tmp_path):
    """A full file system: fallocate fails (ENOSPC), no file is left, and
    the blobs that fit are written as without spares."""
    with fault_fs.small_tmpfs(tmp_path / "fs", 2 * BIG + 2 * MiB) as fs:
        files = BlobFiles(str(fs), readonly=False)
        files.write(filled(BIG, 12))
        files.write(filled(BIG, 13))
        files.prepare_spare()
        assert not files.wait_spare(60)
        assert names(files, ".spare") == []
        files.close()


def test_a_killed_writers_spare_is_swept_and_a_live_ones_is_not(store):
    with child("spare", store, str(BIG)) as (p, (blob, ready)):
        assert ready
        files = BlobFiles(store, readonly=False)
        assert files.sweep(lambda: set()) == 0  # a live writer's spare stays
        (theirs,) = names(files, ".spare")
        assert theirs.split("-")[0] == blob.split("-")[0]
        p.kill()
        p.wait()
    assert files.sweep(lambda: set()) == 2  # its blob (unreferenced here) and its spare
    assert names(files, ".spare") == [] and blob not in names(files, ".ecb")
    files.close()


def test_a_forked_child_never_uses_or_removes_the_parents_spare(store):
    """A forked child cannot write through its parent's handle (the token is
    the parent's); its close must not remove the parent's spare either."""
    files = BlobFiles(store, readonly=False)
    name = with_spare(files)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                files.write(filled(BIG, 14))
                code = 3
            except ECStoreError:
                files.close()
                code = 0 if name in os.listdir(files.dir) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert names(files, ".spare") == [name]
    ref = files.write(filled(BIG, 15))  # the parent's spare, still its own
    assert names(files, ".spare") == [] and read_back(files, ref) == filled(BIG, 15).tobytes()
    files.close()


def store_after_one_large_put(tmp_path: Path, spares: bool) -> tuple[ECStore, torch.Tensor]:
    """An ECStore (``spare_blob_files=spares``) that committed one large
    put, its writer idle and done making a spare (if on); and a second
    tensor of that size, not put yet."""
    cfg = ECStoreConfig(local_disk=str(tmp_path / "s"), max_local_disk_size=1.0, local_cpu=False,
                        spare_blob_files=spares)
    st = ECStore(cfg, model="m", dtype=torch.bfloat16)
    rows = -(-BIG // (2 * 3584))
    a, b = (torch.randn(rows, 3584, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16) for i in (1, 2))
    st.put("a", a)
    st.wait_committed()
    assert st.disk.files.wait_spare(60) is spares
    return st, b


@pytest.mark.parametrize("setting", [True, False])
def test_the_store_writer_readies_a_spare_when_idle_and_the_next_put_uses_it(tmp_path, setting, monkeypatch):
    """Through ECStore: after a large put is committed the idle writer has
    a spare made (setting ``spare_blob_files``); the next put lands in it
    (the spare's file becomes its blob file; once flushed, durable, it
    left the page cache, where new pages are dear, like the first one,
    written with O_DIRECT), reads
    back equal, and the store checks clean with the new spare beside it."""
    st, b = store_after_one_large_put(tmp_path, setting)
    files = st.disk.files
    monkeypatch.setattr(spare, "NEW_PAGES_DEAR", True)  # as on the benchmark VM
    spares = [os.stat(os.path.join(files.dir, n)).st_ino for n in names(files, ".spare")]
    assert len(spares) == (1 if setting else 0)
    st.put("b", b)
    st.flush()
    ref_names = names(files, ".ecb")
    assert len(ref_names) == 2
    assert sum(os.stat(os.path.join(files.dir, n)).st_ino in spares for n in ref_names) == len(spares)
    # Before any read: at most the page of an O_DIRECT write's unaligned tail (written buffered).
    assert all(resident_pages(os.path.join(files.dir, n))[0] <= 1 for n in ref_names)
    got = st.get("b")
    assert got is not None and torch.equal(got, b)
    assert files.wait_spare(60) is setting  # one more for the put after
    audit = check_store(st.disk)
    assert audit.clean and audit.checked == 2 and audit.unreferenced_files == []
    st.close()
    assert names(files, ".spare") == []


def test_write_parts_fills_a_ready_spare_and_does_nothing_without_one(store):
    """``write_parts`` (a blob's head, then a tensor's bytes where they lie):
    the file is the concatenation, the hasher saw it whole and in order;
    with no spare ready (or too small) it returns None and leaves no file."""
    files = BlobFiles(store, readonly=False, spare_from=SPARE_FROM)
    head, body = filled(320, 3), filled(BIG - 320, 4)
    assert files.write_parts([head, body]) is None  # no large blob written yet: no spare
    assert names(files, ".ecb") == []
    with_spare(files)
    assert files.write_parts([head, filled(BIG + SPARE_ROUND, 5)]) is None  # larger than the spare
    h = xxhash.xxh3_64()
    ref = files.write_parts([head, body], hasher=h)
    assert ref is not None and ref.size == BIG
    whole = head.tobytes() + body.tobytes()
    assert read_back(files, ref) == whole and h.intdigest() == xxhash.xxh3_64(whole).intdigest()
    assert names(files, ".spare") == []  # taken
    files.close()


@pytest.mark.parametrize("case", ["spare ready", "larger than the spare", "spares off", "negative view"])
def test_a_handed_over_tensor_is_written_from_where_it_lies_into_a_ready_spare(tmp_path, monkeypatch, case):
    """``put(copy=False)`` of a large CPU tensor: with a spare ready the
    writer writes the blob file from the blob's head and the tensor's own
    bytes, and no copy of the entry is made (``encode_view`` is never
    called). With spares on but none that holds it, with spares off, or
    for a tensor whose bytes are not its values (a negative view: torch
    applies the sign when it copies) it encodes the tensor first, as
    before. Either way the entry reads back equal, passes ``verify`` and
    the store checks clean."""
    st, b = store_after_one_large_put(tmp_path, case != "spares off")
    if case == "larger than the spare":
        b = torch.cat([b, b[: -(-2 * SPARE_ROUND // (2 * 3584))]])
    elif case == "negative view":
        b = torch._neg_view(b)
        assert b.is_neg() and b.is_contiguous()
    encodes = count_encodes(monkeypatch)
    assert st.put("b", b, copy=False)
    st.wait_committed()
    assert encodes == ([] if case == "spare ready" else [tuple(b.shape)])
    monkeypatch.undo()
    st.flush()
    got = st.get("b")
    assert got is not None and torch.equal(got, b) and st.verify("b")
    audit = check_store(st.disk)
    assert audit.clean and audit.checked == 2
    st.close()
