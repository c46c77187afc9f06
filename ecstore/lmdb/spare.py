"""Spare blob files: made ahead, their pages already in the page cache.

A :class:`SpareFile` is a file of ``capacity`` bytes in ``blobs/``, its
blocks allocated (``fallocate``) and every page faulted in for writing
through a shared mapping of it (``MADV_POPULATE_WRITE``, which returns an
error where a fault would raise SIGBUS; the mapping is dropped at once).
Writing a blob into it is then a copy into page-cache pages that exist: no
new page (slow on the benchmark VM), no wait for the device as with
``O_DIRECT`` (docs/benchmarks.md, spare blob files). The blob goes in with
``pwrite``, never through a mapping, so no file state can fault the writer.

:class:`~ecstore.lmdb.blobfiles.BlobFiles` makes them (on its
``ecstore-spare`` thread), hands each to one writer and names it. Threads:
one thread at a time uses a SpareFile. Linux only (:data:`AVAILABLE`).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from typing_extensions import Buffer

#: Bytes copied (and hashed) at a time: a chunk is hashed while it is in the caches.
FILL_CHUNK = 1 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels: EINVAL


def _libc() -> tuple[Callable[..., int], Callable[..., int]] | None:
    """libc's ``madvise`` and ``fallocate`` (ctypes releases the GIL around
    each call); None where libc has none (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise, fallocate = libc.madvise, libc.fallocate
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    for fn in (madvise, fallocate):
        fn.restype = ctypes.c_int
    return madvise, fallocate


_LIBC = _libc()
#: Whether this system can make spare files at all.
AVAILABLE = _LIBC is not None


def free_page_reporting(devices: str = "/sys/bus/virtio/devices") -> bool:
    """Whether this machine is a VM whose memory balloon reports free guest
    memory to the host (virtio device 5 with feature bit 5,
    ``VIRTIO_BALLOON_F_REPORTING``): there a page the guest left free for a
    while costs the host's re-backing when it is taken again (about 10 µs
    per 4 KiB page on the benchmark VM: docs/benchmarks.md). False when it
    cannot tell."""
    try:
        names = os.listdir(devices)
    except OSError:
        return False
    for name in names:
        try:
            with open(os.path.join(devices, name, "device")) as f:
                if int(f.read(), 16) != 5:  # 5: the memory balloon
                    continue
            with open(os.path.join(devices, name, "features")) as f:
                bits = f.read().strip()
        except (OSError, ValueError):
            continue
        if len(bits) > 5 and bits[5] == "1":
            return True
    return False


#: :func:`free_page_reporting` of this machine, read once. Where it holds, a
#: blob written through a spare leaves the page cache once durable
#: (:meth:`~ecstore.lmdb.blobfiles.BlobFiles.sync`): the pages it frees, still
#: backed, are the next spare's. Elsewhere it stays cached (new pages are cheap,
#: and a consumer on the same machine reads it from memory).
NEW_PAGES_DEAR = free_page_reporting()


class Hasher(Protocol):
    """What :meth:`SpareFile.fill` feeds the blob to (an ``xxhash.xxh3_64``)."""

    def update(self, data: Buffer, /) -> object: ...


def _oserror() -> OSError:
    err = ctypes.get_errno() or errno.EIO
    return OSError(err, os.strerror(err))


class SpareFile:
    """One spare file: ``name`` in ``blobs/``, open read-write as ``fd``,
    ``capacity`` bytes allocated, every page in the page cache."""

    def __init__(self, name: str, fd: int, capacity: int) -> None:
        """Allocate and populate the file ``fd`` (created empty by the
        caller, who still owns ``fd`` if this raises). OSError: EINVAL or
        EOPNOTSUPP where the kernel or file system cannot (no
        ``MADV_POPULATE_WRITE``, no ``fallocate``), else what failed
        (ENOSPC: not room for it)."""
        if _LIBC is None:
            raise OSError(errno.ENOSYS, "no libc")
        madvise, fallocate = _LIBC
        self.name, self.fd, self.capacity = name, fd, capacity
        if fallocate(fd, 0, 0, capacity) != 0:
            raise _oserror()
        with mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
            view = ctypes.c_char.from_buffer(m)
            try:
                failed = madvise(ctypes.addressof(view), capacity, _MADV_POPULATE_WRITE) != 0
            finally:
                del view  # the mapping can be closed only once nothing exports it
            if failed:
                raise _oserror()

    def fill(self, parts: Sequence[memoryview], hasher: Hasher | None = None) -> None:
        """Write ``parts`` (byte views, at most ``capacity`` bytes in all)
        one after the other from the start of the file, ``hasher`` fed every
        piece right after it is written (still in the caches), then cut the
        file to their length. Not durable until the file is synced. OSError
        from ``pwrite`` or ``ftruncate``."""
        offset = 0
        for data in parts:
            size = len(data)
            assert offset + size <= self.capacity
            done = 0
            while done < size:
                n = os.pwrite(self.fd, data[done:done + FILL_CHUNK], offset + done)
                if n <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                if hasher is not None:
                    hasher.update(data[done:done + n])
                done += n
            offset += size
        if offset < self.capacity:
            os.ftruncate(self.fd, offset)

    def close(self) -> None:
        """Close ``fd``. Idempotent."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
