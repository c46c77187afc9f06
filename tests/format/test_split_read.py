"""``split_read.read_hashed``: a large blob file read by the caller and a
helper thread (ecstore/format/split_read.py), against real files. The bytes and the
hash must be exactly a one-core read's; a busy helper must not hold the
read up; a failed read must leave the destination alone once it raised."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import xxhash

from ecstore.format import split_read

CHUNK = 1 << 20
#: Safety bound (s) on every wait: reached only by a broken build.
BOUND_S = 60.0


def _file(tmp_path, n: int, seed: int = 0) -> tuple[str, bytes]:
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    path = str(tmp_path / f"blob-{n}")
    with open(path, "wb") as f:
        f.write(b"H" * 100 + data)
    return path, data


def _read(path: str, n: int, h) -> np.ndarray:
    """``split_read.read_hashed`` of the ``n`` data bytes of ``path`` (after
    its 100-byte head) into fresh memory, fed to ``h``; the destination."""
    dst = np.zeros(n, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        split_read.read_hashed(fd, memoryview(dst), 100, h.update, CHUNK)
    finally:
        os.close(fd)
    return dst


@pytest.mark.parametrize("n", [split_read.SPLIT_READ_BYTES, split_read.SPLIT_READ_BYTES + 12345, 3 * CHUNK + 1])
def test_bytes_and_hash_are_a_one_core_reads(tmp_path, n):
    path, data = _file(tmp_path, n)
    h = xxhash.xxh3_64(b"head")
    dst = _read(path, n, h)
    assert dst.tobytes() == data
    assert h.intdigest() == xxhash.xxh3_64(b"head" + data).intdigest()


def test_a_busy_helper_does_not_hold_the_read_up(tmp_path):
    """The helper thread is taken by another task for the whole read: the
    caller reads every chunk itself (else it would wait forever here)."""
    path, data = _file(tmp_path, split_read.SPLIT_READ_BYTES + 7)
    release = threading.Event()
    busy = split_read._helper_pool().submit(release.wait, BOUND_S)
    try:
        h = xxhash.xxh3_64()
        dst = _read(path, len(data), h)
        assert not busy.done()  # the helper never got to this read
        assert dst.tobytes() == data and h.intdigest() == xxhash.xxh3_64(data).intdigest()
    finally:
        release.set()
        busy.result(BOUND_S)


def test_a_short_file_raises_and_nothing_is_written_after(tmp_path):
    """The file ends before the destination is full: EOFError, raised only
    once the helper stopped writing (a destination goes back to the pool)."""
    path, data = _file(tmp_path, split_read.SPLIT_READ_BYTES)
    dst = np.zeros(len(data) + 5 * CHUNK, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(EOFError):
            split_read.read_hashed(fd, memoryview(dst), 100, xxhash.xxh3_64().update, CHUNK)
        dst[:] = 7  # the caller reuses the memory at once
        split_read._helper_pool().submit(lambda: None).result(BOUND_S)  # whatever the helper had queued ran
    finally:
        os.close(fd)
    assert (dst == 7).all()


@pytest.mark.parametrize("split", [True, False])
def test_the_split_reads_setting_chooses_the_reader(tmp_path, monkeypatch, split):
    """``split_reads`` (default true) reads large blob files on two cores;
    false keeps every read on the caller's core. Either way the hit is the
    tensor put."""
    import torch

    from ecstore import ECStore, ECStoreConfig

    calls: list[int] = []
    real = split_read.read_hashed

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(split_read, "read_hashed", spy)
    cfg = ECStoreConfig(local_disk=str(tmp_path / "s"), max_local_disk_size=0.25, local_cpu=False,
                        split_reads=split)
    t = torch.arange(split_read.SPLIT_READ_BYTES // 2 + 512 * 3, dtype=torch.float32).view(-1, 512)
    with ECStore(cfg, model="m", dtype=torch.float32) as st:
        st.put("big", t)
        st.flush()
        got = st.get("big")
    assert got is not None and torch.equal(got, t)
    assert bool(calls) is split


def test_a_failed_read_lets_go_of_its_destination_without_the_cyclic_collector(tmp_path):
    """A read that fails (the file is shorter than the record says) must not
    keep its destination, a pool slab of up to 128 MiB, alive: the helper's
    stored error held a traceback through frames holding it (a reference
    cycle, freed only when the cyclic collector ran)."""
    import gc
    import weakref

    path, _ = _file(tmp_path, CHUNK)  # one chunk of data; the destination wants 16
    fd = os.open(path, os.O_RDONLY)
    survived = 0
    gc.disable()
    try:
        for _ in range(20):
            dst = np.zeros(16 * CHUNK, np.uint8)
            ref = weakref.ref(dst)
            with pytest.raises(EOFError):
                split_read.read_hashed(fd, memoryview(dst), 100, xxhash.xxh3_64().update, CHUNK)
            del dst
            survived += ref() is not None
    finally:
        gc.enable()
        os.close(fd)
    assert survived == 0, f"{survived}/20 destinations still alive after the failed read"


def test_a_read_while_the_interpreter_shuts_down_is_read_on_one_core(tmp_path, monkeypatch):
    """After concurrent.futures' exit hook ran (interpreter shutdown), its
    executors refuse new work with RuntimeError, which escaped the read
    (not an ECStoreError). The caller then reads every chunk itself."""
    from concurrent.futures import ThreadPoolExecutor

    closed = ThreadPoolExecutor(max_workers=1)
    closed.shutdown()
    monkeypatch.setattr(split_read, "_helper_pool", lambda: closed)
    path, data = _file(tmp_path, split_read.SPLIT_READ_BYTES)
    h = xxhash.xxh3_64()
    dst = _read(path, len(data), h)
    assert dst.tobytes() == data and h.intdigest() == xxhash.xxh3_64(data).intdigest()

