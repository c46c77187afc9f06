"""Blob buffers and page-cache residency for the blob file tests."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from ecstore.pool import POOL, BufferPool

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)


def resident_pages(path: str) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of ``path``) by mincore."""
    size = os.path.getsize(path)
    pages = -(-size // PAGE)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) as m:
        vec = (ctypes.c_ubyte * pages)()
        ptr = ctypes.c_void_p(np.frombuffer(m, dtype=np.uint8).ctypes.data)
        assert _libc.mincore(ptr, ctypes.c_size_t(size), vec) == 0, os.strerror(ctypes.get_errno())
        return sum(v & 1 for v in vec), pages


def filled(nbytes: int, seed: int, *, pool: BufferPool = POOL) -> np.ndarray:
    """A pooled (aligned) buffer of ``nbytes`` with a pattern of ``seed``."""
    buf = pool.buffer(nbytes)
    buf[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return buf
