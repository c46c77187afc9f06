"""File-system fault helpers for tests/store/test_faults.py: flip bytes found in a
data file, a small file system (disk full), a read-only view of a
directory. Real mechanisms only (tmpfs, bind mounts, chmod), cleaned up on
exit."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path


def find_all(data: bytes, needle: bytes) -> list[int]:
    out, i = [], data.find(needle)
    while i >= 0:
        out.append(i)
        i = data.find(needle, i + 1)
    return out


def flip_byte(path: Path, offset: int, mask: int = 0x5A) -> tuple[int, int]:
    """XOR the byte at ``offset`` of ``path`` in place; returns (old, new)."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        old = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([old ^ mask]))
        fh.flush()
        os.fsync(fh.fileno())
    return old, old ^ mask


def _run(*cmd: str | os.PathLike) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True)


def _umount(path: Path) -> None:
    if _run("umount", path).returncode != 0:
        _run("umount", "-l", path)


@functools.lru_cache(maxsize=1)
def can_mount() -> bool:
    """True if this process may mount file systems (root with CAP_SYS_ADMIN)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    probe = Path(f"/tmp/ecstore-mount-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        ok = _run("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", probe).returncode == 0
        if ok:
            _umount(probe)
        return ok
    finally:
        probe.rmdir()


@contextlib.contextmanager
def small_tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` mounted at ``path`` (needs :func:`can_mount`)."""
    path.mkdir(parents=True, exist_ok=True)
    cp = _run("mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", path)
    assert cp.returncode == 0, f"mount tmpfs failed: {cp.stderr}"
    try:
        yield path
    finally:
        _umount(path)


@contextlib.contextmanager
def ramfs(path: Path) -> Iterator[Path]:
    """A ramfs mounted at ``path`` (needs :func:`can_mount`): a real file
    system without ``O_DIRECT`` (an open with it fails with EINVAL *after*
    creating the file, as on tmpfs before Linux 6.6)."""
    path.mkdir(parents=True, exist_ok=True)
    cp = _run("mount", "-t", "ramfs", "ramfs", path)
    assert cp.returncode == 0, f"mount ramfs failed: {cp.stderr}"
    try:
        yield path
    finally:
        _umount(path)


@contextlib.contextmanager
def readonly_view(src: Path, dst: Path) -> Iterator[str]:
    """Make ``dst`` a read-only view of directory ``src``; yields the mechanism.

    As root with mount rights: a read-only bind mount (the real thing: EROFS
    for everyone, root included). Otherwise (not root): a copy with write
    permission removed (EACCES; root would ignore that, hence the mount).
    """
    if can_mount():
        dst.mkdir(parents=True)
        cp = _run("mount", "--bind", src, dst)
        assert cp.returncode == 0, cp.stderr
        try:
            cp = _run("mount", "-o", "remount,bind,ro", dst)
            assert cp.returncode == 0, cp.stderr
            yield "read-only bind mount"
        finally:
            _umount(dst)
        return
    assert os.geteuid() != 0, "root without mount rights: cannot make a read-only directory"
    shutil.copytree(src, dst)
    for p in [*dst.iterdir(), dst]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        yield "chmod a-w"
    finally:
        for p in [dst, *dst.iterdir()]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)
