"""Peers and helpers for ``tools/bench.py`` (not part of ecstore).

* :class:`RawFileStore` -- **a small re-implementation written for this
  benchmark** of the design of LMCache's local-disk backend: one file of raw
  tensor bytes per entry, an in-memory ``dict`` index (LRU, size-capped) under
  a lock, shape/dtype kept in the index. It is *not* LMCache's code: it models
  the design's costs (one ``write`` per entry, optional ``fsync``, one
  ``readinto`` per hit, a dict lookup per ``contains``) so that ecstore can be
  compared with it on the same machine. ``fsync=True`` makes every put
  durable when it returns (match with ecstore's ``put`` + ``flush``);
  ``fsync=False`` leaves the data in the page cache (not durable).
* :class:`DiskCachePeer` -- ``diskcache.Cache(dir)`` with the tensor bytes as
  values (``bytes``; reads go through ``get(read=True)`` + ``readinto``, the
  cheapest read diskcache offers), LRU eviction at the same size cap.
* :func:`example_save` / :func:`example_load` -- drive vLLM's real
  ``ECExampleConnector`` (worker role) the way the model runner does.
* :func:`drop_page_cache` / :func:`resident_bytes` -- cold-cache helpers
  (``posix_fadvise(DONTNEED)`` after ``fsync`` + ``os.sync()``; residency via
  util-linux ``fincore`` when installed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections import OrderedDict
from collections.abc import Iterable

import torch


def tensor_u8(t: torch.Tensor):
    """A uint8 numpy view of a contiguous CPU tensor's bytes (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------
# LMCache-local-disk-like raw file store (re-implementation, see module doc)
# ---------------------------------------------------------------------------
class RawFileStore:
    """One raw-bytes file per entry + in-memory LRU index (LMCache-like design)."""

    def __init__(self, directory: str, capacity_bytes: int, *, fsync: bool) -> None:
        self.dir = directory
        self.capacity_bytes = int(capacity_bytes)
        self.fsync = fsync
        os.makedirs(directory, exist_ok=True)
        self._index: OrderedDict[str, tuple[str, tuple[int, ...], torch.dtype, int]] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self.evictions = 0

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key + ".bin")

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        nb = nbytes_of(tensor)
        if nb > self.capacity_bytes:
            return False
        with self._lock:
            if key in self._index:
                return False
            while self._used + nb > self.capacity_bytes and self._index:
                _, (vpath, _, _, vnb) = self._index.popitem(last=False)
                self._used -= vnb
                self.evictions += 1
                try:
                    os.unlink(vpath)
                except FileNotFoundError:
                    pass
        path = self._path(key)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(tensor_u8(tensor))
            off = 0
            while off < nb:
                off += os.write(fd, view[off:])
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        with self._lock:
            self._index[key] = (path, tuple(tensor.shape), tensor.dtype, nb)
            self._used += nb
        return True

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            item = self._index.get(key)
            if item is None:
                return None
            self._index.move_to_end(key)
        path, shape, dtype, nb = item
        out = torch.empty(shape, dtype=dtype)
        with open(path, "rb", buffering=0) as f:
            got = f.readinto(tensor_u8(out))
        if got != nb:
            return None
        return out

    def files(self) -> list[str]:
        with self._lock:
            return [p for p, *_ in self._index.values()]

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------
# diskcache
# ---------------------------------------------------------------------------
class DiskCachePeer:
    """``diskcache.Cache`` with tensor bytes as values, LRU at a size cap."""

    def __init__(self, directory: str, capacity_bytes: int) -> None:
        import diskcache

        self.dir = directory
        self.cache = diskcache.Cache(directory, size_limit=int(capacity_bytes),
                                     eviction_policy="least-recently-used")
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def contains(self, key: str) -> bool:
        return key in self.cache

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        self._meta[key] = (tuple(tensor.shape), tensor.dtype)
        return self.cache.set(key, tensor_u8(tensor).tobytes())

    def get(self, key: str) -> torch.Tensor | None:
        meta = self._meta.get(key)
        if meta is None:
            return None
        val = self.cache.get(key, default=None, read=True)
        if val is None:
            return None
        out = torch.empty(meta[0], dtype=meta[1])
        if isinstance(val, (bytes, bytearray, memoryview)):  # small values live in SQLite
            tensor_u8(out)[:] = torch.frombuffer(bytearray(val), dtype=torch.uint8).numpy()
            return out
        with val:
            val.readinto(tensor_u8(out))
        return out

    def files(self) -> list[str]:
        return list(walk_files(self.dir))

    def close(self) -> None:
        self.cache.close()


# ---------------------------------------------------------------------------
# vLLM's ECExampleConnector (the real class), worker role
# ---------------------------------------------------------------------------
def example_save(conn, mm_hash: str, tensor: torch.Tensor) -> None:
    conn.save_caches({mm_hash: tensor}, mm_hash)


def example_load(conn, mm_hash: str, num_tokens: int) -> torch.Tensor:
    from vllm.distributed.ec_transfer.ec_connector.example_connector import (
        ECExampleConnectorMetadata,
        MMMeta,
    )

    meta = ECExampleConnectorMetadata()
    meta.add_mm_data(MMMeta.make_meta(mm_hash, num_tokens))
    conn.bind_connector_metadata(meta)
    cache: dict[str, torch.Tensor] = {}
    conn.start_load_caches(cache)
    conn.clear_connector_metadata()
    return cache[mm_hash]


def example_file(conn, mm_hash: str) -> str:
    return conn._generate_filename_debug(mm_hash)


# ---------------------------------------------------------------------------
# page cache helpers
# ---------------------------------------------------------------------------
def walk_files(root: str) -> Iterable[str]:
    for d, _, names in os.walk(root):
        for n in names:
            yield os.path.join(d, n)


def drop_page_cache(paths: Iterable[str]) -> None:
    """fsync each file, ``os.sync()``, then ``POSIX_FADV_DONTNEED`` each file.

    Pages still mapped by a live mmap (an open LMDB environment) cannot be
    dropped: close stores before calling this.
    """
    paths = [p for p in paths if os.path.isfile(p)]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_FINCORE = shutil.which("fincore")


def resident_bytes(paths: Iterable[str]) -> int | None:
    """Bytes of ``paths`` resident in the page cache (util-linux fincore), or None."""
    paths = [p for p in paths if os.path.isfile(p)]
    if not _FINCORE or not paths:
        return None
    total = 0
    for i in range(0, len(paths), 200):
        try:
            out = subprocess.run([_FINCORE, "--bytes", "--noheadings", "--raw", "--output", "RES",
                                  *paths[i:i + 200]], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        for line in out.stdout.split():
            try:
                total += int(line)
            except ValueError:
                return None
    return total


def dir_footprint(root: str) -> tuple[int, int]:
    """(sum of apparent sizes, sum of allocated bytes st_blocks*512) under ``root``."""
    size = alloc = 0
    for p in walk_files(root):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        size += st.st_size
        alloc += st.st_blocks * 512
    return size, alloc


def tensor_touch(t: torch.Tensor) -> torch.Tensor:
    """Read one byte of every 4 KiB page of ``t`` (forces an mmap-backed tensor,
    such as ``safetensors.torch.load_file``'s on CPU, to be faulted in) and
    return ``t``."""
    u = t.reshape(-1).view(torch.uint8)
    int(u[::4096].sum()) + int(u[-1])
    return t
