"""Disk blocks reserved for a file that LMDB maps writable (``MDB_WRITEMAP``).

A store through a writable map that meets a full disk is a SIGBUS, not an
error: :func:`reserve` allocates a file's blocks up to ``size`` first
(``fallocate`` with ``FALLOC_FL_KEEP_SIZE``: the apparent size is left for
LMDB, which initialises an empty file and then extends it to its map size),
and says whether the writable map is safe. Only on file systems that write
into allocated blocks in place (ext2/3/4, XFS, tmpfs): a copy-on-write one
(btrfs) or a network one can still fail such a store, and gets False, as does
any file system without ``fallocate`` or without the space. Linux only;
elsewhere always False. Thread-safe (no state).
"""

from __future__ import annotations

import ctypes
import os
import sys

#: statfs f_type of the file systems that write into a file's allocated blocks in place.
IN_PLACE_FILE_SYSTEMS = {
    0xEF53: "ext2/3/4",
    0x58465342: "xfs",
    0x01021994: "tmpfs",
}
_FALLOC_FL_KEEP_SIZE = 0x01


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the C library already loaded (no find_library: it runs ldconfig)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def file_system_type(fd: int) -> int | None:
    """The statfs ``f_type`` of the file system holding ``fd`` (None: unknown)."""
    if _LIBC is None:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on 64-bit Linux); f_type first
    if _LIBC.fstatfs(fd, buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def reserve(fd: int, size: int) -> bool:
    """Allocate ``fd``'s blocks in ``[0, size)`` without changing its size;
    whether a writable map of that range can never meet a full disk (False:
    not an in-place file system, no ``fallocate``, no space, a file size
    limit, any other error: nothing to undo; blocks already allocated stay)."""
    if _LIBC is None or file_system_type(fd) not in IN_PLACE_FILE_SYSTEMS:
        return False
    if _LIBC.fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, size) != 0:
        return False
    try:  # the blocks past the end count in st_blocks on these file systems
        return os.fstat(fd).st_blocks * 512 >= size
    except OSError:
        return False
