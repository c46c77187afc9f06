"""Rewriting ``data.mdb`` compactly (LMDB files never shrink by themselves).

:func:`compact` refuses unless it can take LMDB's ``lock.mdb`` byte-0 lock
exclusively (a /proc scan names other users, Linux-only, best effort), copies
with ``env.copy(compact=True)`` beside the store, checks the copy, invalidates
``lock.mdb``'s header and atomically replaces ``data.mdb``; ``leases.mdb`` is
left alone. Needs POSIX fcntl locks (local filesystems). The lock protocol:
docs/cli.md#compacting-the-file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import struct
import tempfile
import threading
from dataclasses import dataclass

import lmdb

from ecstore.errors import ECStoreError, StoreOpenError
from ecstore.lmdb import LMDBTier
from ecstore.lmdb.env import _SharedEnv, try_exclusive
from ecstore.lmdb.txn import Dbs
from ecstore.maintenance.entries import open_readonly
from ecstore.maintenance.inspect import page_stats
from ecstore.maintenance.progress import ProgressFactory

COMPACT_PREFIX = ".ecstore-compact-"


class StoreBusyError(ECStoreError):
    """The store is open in another process (or in this one): compact
    refused and changed nothing. ``users``: (pid, command) seen in /proc."""

    def __init__(self, message: str, users: list[tuple[int, str]] | None = None) -> None:
        super().__init__(message)
        self.users = users or []


class CompactCheckError(ECStoreError):
    """The compacted copy did not match the store; nothing was changed."""


@dataclass
class CompactResult:
    """data.mdb's size (bytes) before and after, and the entries it holds."""

    path: str
    before: int
    after: int
    entries: int


def proc_users(path: str) -> list[tuple[int, str]]:
    """(pid, command) of other processes that have data.mdb or lock.mdb of
    ``path`` open or mapped, from /proc (Linux; processes of other users or
    PID namespaces may be invisible: the fcntl check covers those)."""
    files = set()
    for name in ("data.mdb", "lock.mdb"):
        with contextlib.suppress(OSError):
            files.add(os.path.realpath(os.path.join(path, name)))
    if not files or not os.path.isdir("/proc"):
        return []
    me = os.getpid()
    users = []
    for pid_s in os.listdir("/proc"):
        if not pid_s.isdigit() or int(pid_s) == me:
            continue
        hit = False
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid_s}/maps", "rb") as fh:
                for line in fh:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and os.fsdecode(parts[5].strip().removesuffix(b" (deleted)")) in files:
                        hit = True
                        break
        if not hit:
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid_s}/fd"):
                    with contextlib.suppress(OSError):
                        if os.readlink(f"/proc/{pid_s}/fd/{fd}") in files:
                            hit = True
                            break
        if hit:
            cmd = ""
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid_s}/cmdline", "rb") as fh:
                    cmd = " ".join(fh.read().replace(b"\0", b" ").decode("utf-8", "replace").split())[:80]
            users.append((int(pid_s), cmd))
    return sorted(users)


def _busy(path: str, users: list[tuple[int, str]]) -> StoreBusyError:
    who = "; ".join(f"pid {p} ({c})" if c else f"pid {p}" for p, c in users) or "a process not visible here"
    return StoreBusyError(f"store {path} is open in another process ({who}); stop it (e.g. vLLM) and retry. "
                          f"Nothing was changed", users)


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy(tier: LMDBTier, tmp: str, new: str, progress: ProgressFactory | None) -> None:
    """``env.copy(tmp, compact=True)``; with ``progress``, MiB written against
    the live pages to copy (the copy runs in a thread; py-lmdb releases the
    GIL while LMDB copies; progress is reported from the calling thread)."""
    if progress is None:
        tier.env.copy(tmp, compact=True)
        return
    total_mib = max(1, page_stats(tier).tree_pages * tier.env_info()["psize"] >> 20)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            tier.env.copy(tmp, compact=True)
        except BaseException as e:  # re-raised in the caller's thread  # noqa: BLE001
            failure.append(e)

    worker = threading.Thread(target=run, name="ecstore-compact")
    with progress("compacting (MiB)", total_mib) as prog:
        done = 0
        worker.start()
        try:
            while worker.is_alive():
                worker.join(0.1)
                with contextlib.suppress(OSError):
                    now = min(total_mib, os.path.getsize(new) >> 20)
                    prog.advance(max(0, now - done))
                    done = max(done, now)
        finally:
            worker.join()
    if failure:
        raise failure[0]


def _db_summary(env: lmdb.Environment) -> tuple[int, int | None, bytes | None]:
    """(entries, total_bytes, schema_version) of an environment."""
    dbs = Dbs.open(env, None, 1)  # the sub-databases every schema has
    with env.begin() as txn:
        raw = txn.get(b"total_bytes", db=dbs.meta)
        return (txn.stat(dbs.entries)["entries"], None if raw is None else struct.unpack("<Q", raw)[0],
                txn.get(b"schema_version", db=dbs.meta))


def compact(path: str, progress: ProgressFactory | None = None) -> CompactResult:
    """Rewrite the store at ``path`` compactly under the lock protocol of
    this module's docstring. Raises :class:`StoreBusyError` (nothing changed)
    when any other process, or this one, has the store open;
    :class:`CompactCheckError` if the copy does not match (nothing changed);
    StoreOpenError / SchemaError for what is not a store we support."""
    with open_readonly(path):  # validates: a store, schema we support
        pass
    if os.path.realpath(path) in _SharedEnv._open:
        raise StoreBusyError(f"store {path} is open in this process; close it before compacting")
    data = os.path.join(path, "data.mdb")
    lock_path = os.path.join(path, "lock.mdb")
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError as e:
        raise StoreOpenError(f"cannot open {lock_path}: {e.strerror or e}") from None
    try:
        users = proc_users(path)
        if not try_exclusive(fd) or users:
            raise _busy(path, users)
        before = os.path.getsize(data)
        # LMDB's open in this process takes the same lock byte (no conflict
        # with ours) and downgrades it to shared; fd stays open until the
        # environment is closed, since closing any descriptor of lock.mdb
        # drops this process's locks on it.
        tier = LMDBTier(path, 0, readonly=True, create=False, schema_target=1)
        try:
            users = proc_users(path)
            if not try_exclusive(fd) or users:
                raise _busy(path, users)
            orig = _db_summary(tier.env)
            for leftover in os.listdir(path):  # from an interrupted compact
                if leftover.startswith(COMPACT_PREFIX):
                    shutil.rmtree(os.path.join(path, leftover), ignore_errors=True)
            tmp = tempfile.mkdtemp(prefix=COMPACT_PREFIX, dir=path)
            try:
                new = os.path.join(tmp, "data.mdb")
                _copy(tier, tmp, new, progress)
                _fsync_path(new)
                copy_env = lmdb.open(tmp, readonly=True, lock=False, subdir=True, max_dbs=8)
                try:
                    copied = _db_summary(copy_env)
                finally:
                    copy_env.close()
                if copied != orig:
                    raise CompactCheckError(f"compacted copy does not match the store ({copied} vs {orig}); "
                                            f"nothing was changed")
                # LMDB creates the copy with 0666 & ~umask: keep the store's mode.
                os.chmod(new, stat.S_IMODE(os.stat(data).st_mode))
                os.pwrite(fd, b"\0\0\0\0", 0)  # invalidate lock.mdb's header (see module docstring)
                os.replace(new, data)
                _fsync_path(path, directory=True)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            tier.close()
    finally:
        os.close(fd)
    return CompactResult(path, before, os.path.getsize(data), orig[0])
