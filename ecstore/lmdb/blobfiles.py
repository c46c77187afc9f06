"""Large blobs as plain files in ``<store>/blobs/``, next to ``data.mdb``.

:class:`BlobFiles` writes each blob once (``<token>-<n>.ecb``, never changed),
syncs it after the LMDB commit that points to it (:func:`pack_ref`), discards
it after a failed commit and sweeps dead writers' leftovers; all by directory
descriptor, never by path. A large blob is copied into a spare file made
ahead (:data:`SPARE_FROM`, :mod:`ecstore.lmdb.spare`), else written with
``O_DIRECT``. Threads: ``write``/``discard``/``open``/``sync`` are safe
across threads of one handle, ``close`` must not race a ``write``; any
number of processes may ``sweep`` at once, a live writer's files are never
removed. Design: docs/architecture.md#blob-files; format: docs/format.md.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import logging
import os
import re
import secrets
import stat
import struct
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ecstore.errors import (
    CorruptEntryError,
    ECStoreError,
    InvalidEntryError,
    StoreFullError,
    StoreOpenError,
    check_same_process,
)
from ecstore.lmdb import direct
from ecstore.lmdb import spare as spare_mod
from ecstore.lmdb.spare import AVAILABLE as _SPARES_AVAILABLE
from ecstore.lmdb.spare import Hasher, SpareFile
from ecstore.lmdb.store_files import DEFAULT_FILE_MODE, FilePolicy

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger("ecstore")

#: First 8 bytes of a pointer value (never the start of a safetensors blob).
POINTER_MAGIC = b"\xff\xff\xff\xffECFP"
_SIZE = struct.Struct("<Q")
_HEAD = len(POINTER_MAGIC) + _SIZE.size
#: A blob file's name: ``<token>-<counter>.ecb`` (token: 16 lowercase hex digits).
_NAME = re.compile(r"[0-9a-f]{16}-[0-9]{1,19}\.ecb", re.ASCII)
#: The token of any file of the directory: a blob file, a partial one, a lock file.
_TOKEN_OF = re.compile(r"([0-9a-f]{16})(?:-|\.lock\Z)", re.ASCII)
#: A spare file's name: ``<token>-<counter>.spare`` (swept like a partial file).
_SPARE_SUFFIX = ".spare"
#: Blob files are written in pieces of this many bytes (bytes); after each the
#: kernel is asked to start writing it back (``sync_file_range`` with
#: ``SYNC_FILE_RANGE_WRITE``, which does not wait), so the disk works while
#: the next piece (the next file) is copied and the ``fdatasync`` of
#: :meth:`BlobFiles.sync` has little left to do -- RocksDB's
#: ``bytes_per_sync`` and PostgreSQL's ``*_flush_after`` do the same.
#: Durability still comes from the ``fdatasync`` alone (measured:
#: docs/benchmarks.md, "blobs in files of their own, early writeback"). Only
#: where the sync comes before the commit: a file committed first (the
#: store's writer, its sync on a thread of its own) is written without it,
#: since there the hint made the commit's own sync wait behind the blob's
#: writeback (docs/benchmarks.md, 2026-12-02).
WRITEBACK_CHUNK = 8 << 20


def _writeback_starter() -> Callable[[int, int, int], object] | None:
    """``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)`` through
    libc (releases the GIL), or None where libc has none (not Linux)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return lambda fd, offset, nbytes: fn(fd, offset, nbytes, 2)  # 2: SYNC_FILE_RANGE_WRITE


_start_writeback = _writeback_starter()

#: ``O_DIRECT`` writes of blob files: memory, file offset and length in
#: multiples of this many bytes (the largest logical block size in use).
DIRECT_ALIGN = 4096
#: Blobs of at least this many bytes are written with ``O_DIRECT`` by
#: default (the ``use_odirect`` setting): no page-cache copy, and none of
#: the buffered path's stalls on new page-cache pages (docs/benchmarks.md, O_DIRECT).
DIRECT_FROM = 4 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none (not Linux): never direct


def _preallocator() -> Callable[[int, int], int] | None:
    """``fallocate(fd, 0, 0, nbytes)`` through libc (releases the GIL; never
    glibc's ``posix_fallocate``, which writes zeros where the file system
    cannot allocate): a new blob file's blocks are allocated in one call
    instead of page by page as it is written (less CPU per write:
    docs/benchmarks.md). Returns 0 or the errno; None where libc has none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return lambda fd, nbytes: 0 if fn(fd, 0, 0, nbytes) == 0 else ctypes.get_errno()


_preallocate = _preallocator()

#: Blobs of at least this many bytes are written into a spare file (bytes;
#: the ``spare_blob_files`` setting): a file of this handle's made ahead on
#: a thread of its own (``ecstore-spare``), its blocks allocated and its
#: pages already in the page cache, so the write is a copy into memory that
#: exists, and renamed to its blob name. New page-cache pages are what makes a
#: buffered write into a new file slow, and an ``O_DIRECT`` write waits for
#: the device (docs/benchmarks.md, spare blob files).
SPARE_FROM = 4 << 20
#: Spare sizes are rounded up to this many bytes.
SPARE_ROUND = 1 << 20
#: A spare is made as large as the largest of this handle's last this many
#: blobs of at least :data:`SPARE_FROM` bytes.
SPARE_SIZES_KEPT = 8

_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
#: Errors opening a blob file that say nothing about the file: the process or
#: the system is out of descriptors or memory. The read is a miss; the entry
#: is valid and must stay (see :class:`BlobFileUnavailable`).
_TRANSIENT_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR)


class BlobFileUnavailable(ECStoreError):
    """A blob file could not be opened for a transient reason (too many open
    files, no memory): a miss for this read, never damage of the entry."""


@dataclass(frozen=True)
class FileRef:
    """A blob stored as a file: ``name`` inside ``blobs/``, ``size`` bytes."""

    name: str
    size: int


def pack_ref(ref: FileRef) -> bytes:
    """The LMDB value pointing at ``ref``: magic, u64 LE size, ascii name."""
    return POINTER_MAGIC + _SIZE.pack(ref.size) + ref.name.encode("ascii")


def unpack_ref(value: bytes | memoryview) -> FileRef | None:
    """The :class:`FileRef` an LMDB value points at; None if the value does
    not start with :data:`POINTER_MAGIC` (an inline blob). CorruptEntryError
    if it does but is malformed (short, a name that is not a blob file's)."""
    mv = memoryview(value)
    if mv[:len(POINTER_MAGIC)] != POINTER_MAGIC:
        return None
    if len(mv) <= _HEAD:
        raise CorruptEntryError(f"blob file pointer of {len(mv)} bytes is too short")
    raw = bytes(mv[_HEAD:])
    try:
        name = raw.decode("ascii")
    except UnicodeDecodeError:
        name = ""
    if not _NAME.fullmatch(name):
        raise CorruptEntryError(f"blob file pointer names no blob file: {raw[:80]!r}")
    return FileRef(name, _SIZE.unpack_from(mv, len(POINTER_MAGIC))[0])


def _write_error(what: str, path: str, e: OSError) -> StoreFullError:
    reason = e.strerror or str(e)
    if e.errno in _FULL_ERRNOS:
        limit = " (file size limit, RLIMIT_FSIZE)" if e.errno == errno.EFBIG else ""
        return StoreFullError(f"disk full while writing {what} {path}: {reason}{limit}")
    return StoreFullError(f"cannot write {what} {path}: {reason}")


def _sync_path(path: str, flags: int, sync: Callable[[int], None], what: str, *,
               name: str | None = None, dir_fd: int | None = None, missing_ok: bool = False) -> None:
    """Open ``name`` in directory ``dir_fd`` (else ``path``) read-only (plus
    ``flags``) and ``sync`` it (``os.fsync`` or ``os.fdatasync``);
    StoreFullError naming ``what`` and ``path`` on an OS error
    (``missing_ok``: a file that no longer exists is no error)."""
    try:
        fd = os.open(path if name is None else name, os.O_RDONLY | os.O_CLOEXEC | flags, dir_fd=dir_fd)
        try:
            sync(fd)
        finally:
            os.close(fd)
    except FileNotFoundError:
        if not missing_ok:
            raise _write_error(what, path, FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))) from None
    except OSError as e:
        raise _write_error(what, path, e) from None


_FADV_DONTNEED: int | None = getattr(os, "POSIX_FADV_DONTNEED", None) if hasattr(os, "posix_fadvise") else None
#: At most this many spare-written names wait for their sync (a batch that
#: failed never syncs its files: the set is cleared past this).
UNCACHED_KEPT = 1024


def _sync_uncached(fd: int) -> None:
    """``fdatasync`` ``fd``, then drop its pages from the page cache
    (``POSIX_FADV_DONTNEED``: clean pages only; a hint, whose failure is
    ignored). Pages just freed are the ones the kernel hands out next, still
    backed by the host on a VM whose balloon reports free memory: the next
    spare's fill takes them instead of new ones (docs/benchmarks.md)."""
    os.fdatasync(fd)
    if _FADV_DONTNEED is not None:
        try:
            os.posix_fadvise(fd, 0, 0, _FADV_DONTNEED)
        except OSError:
            pass


#: Threads that sync a batch's blob files together (:meth:`BlobFiles.sync`).
SYNC_THREADS = 4
_POOLS: dict[str, ThreadPoolExecutor] = {}  # by thread name; made on first use; a forked child starts without
_POOLS_LOCK = threading.Lock()


def _threads(name: str, count: int) -> ThreadPoolExecutor:
    """The process's pool of ``count`` threads named ``name``, made on first use."""
    pool = _POOLS.get(name)
    if pool is None:
        with _POOLS_LOCK:
            pool = _POOLS.get(name)
            if pool is None:
                pool = _POOLS[name] = ThreadPoolExecutor(count, thread_name_prefix=name)
    return pool


def _syncers() -> ThreadPoolExecutor:
    """The process's :data:`SYNC_THREADS` threads that sync blob files (``ecstore-fsync``)."""
    return _threads("ecstore-fsync", SYNC_THREADS)


def _each_on_syncers(fn: Callable[[str], None], names: list[str]) -> None:
    """``fn(name)`` for each of ``names`` on the sync threads, every one
    finished before it returns, then the first error raised. What the pool
    refuses (the interpreter is exiting: a store closed at exit) runs in this
    thread; a name the pool took although it refused it (a thread that could
    not start after the job was queued) still runs once."""
    lock = threading.Lock()
    runs: dict[str, threading.Event] = {}
    failed: dict[str, BaseException] = {}

    def once(name: str) -> None:
        with lock:
            ran = runs.get(name)
            if ran is None:
                ran = runs[name] = threading.Event()
                mine = True
            else:
                mine = False
        if not mine:
            ran.wait()  # the other run of this name syncs it: its error is this one's
            err = failed.get(name)
            if err is not None:
                raise err
            return
        try:
            fn(name)
        except BaseException as e:
            failed[name] = e
            raise
        finally:
            ran.set()

    jobs: list[Future[None]] = []
    rest: list[str] = []
    for i, name in enumerate(names):
        try:
            jobs.append(_syncers().submit(once, name))
        except RuntimeError:
            rest = names[i:]
            break
    errors: list[BaseException | None] = []
    for name in rest:
        try:
            once(name)
        except Exception as e:  # noqa: BLE001 - raised below, once every job finished
            errors.append(e)
    errors[:0] = [f.exception() for f in jobs]
    for err in errors:
        if err is not None:
            raise err


def _preparer() -> ThreadPoolExecutor:
    """The process's one thread that makes every handle's spare files (``ecstore-spare``)."""
    return _threads("ecstore-spare", 1)


def _byte_view(blob: Buffer) -> memoryview:
    """``blob``'s bytes; InvalidEntryError for a buffer that is not C-contiguous."""
    try:
        return memoryview(blob).cast("B")
    except (TypeError, ValueError) as e:
        raise InvalidEntryError(f"a blob must be a C-contiguous buffer: {e}") from None


def _unlink(path: str, *, name: str | None = None, dir_fd: int | None = None) -> bool:
    """Remove ``name`` in directory ``dir_fd`` (else ``path``): True if this
    call removed it; gone already: False; any other error is logged
    (naming ``path``; the file stays a leftover), never raised."""
    try:
        os.unlink(path if name is None else name, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("ecstore: cannot remove %s: %s", path, e.strerror or e)
        return False


class BlobFiles:
    """The blob files of one store handle (one per LMDBTier; a process may
    hold several, each with its own token). See docs/architecture.md#blob-files."""

    def __init__(self, store_dir: str, *, readonly: bool, file_mode: int | None = None,
                 direct_from: int | None = DIRECT_FROM, spare_from: int | None = SPARE_FROM) -> None:
        self.dir = os.path.join(store_dir, "blobs")
        self.readonly = readonly
        #: Blobs of at least this many bytes are written with ``O_DIRECT``
        #: (None: never); set to None once the file system refused it.
        self.direct_from = direct_from
        #: Blobs of at least this many bytes are written into a spare file
        #: where one is ready (None: never); set to None where the system
        #: cannot make one (no ``fallocate`` or ``MADV_POPULATE_WRITE``).
        self.spare_from = spare_from if _SPARES_AVAILABLE else None
        self._spare: SpareFile | None = None
        self._spare_job: Future[None] | None = None
        self._spare_sizes: deque[int] = deque(maxlen=SPARE_SIZES_KEPT)
        #: Blob files written through a spare and not synced yet, where new
        #: pages are dear (:data:`~ecstore.lmdb.spare.NEW_PAGES_DEAR`): their
        #: pages leave the page cache once :meth:`sync` made them durable.
        self._uncached_at_sync: set[str] = set()
        self._policy = FilePolicy(DEFAULT_FILE_MODE if file_mode is None else file_mode)
        self._lock = threading.Lock()
        self._counter = itertools.count()
        self._token: str | None = None
        self._lock_fd: int | None = None
        self._closed = False
        self._pid = os.getpid()
        self._logged: set[int] = set()  # errnos open() has logged
        self._store_dir_synced = False  # see sync()
        self._store_fd: int | None = None  # the store directory, as opened
        self._dir_fd: int | None = None  # its blobs/ (None: not there yet, read-only handles)
        _LIVE.add(self)
        try:
            self._store_fd = os.open(store_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise StoreOpenError(f"cannot open the store directory {store_dir}: {e.strerror or e}") from None
        try:
            if not readonly:
                self._make_dir()
            self._blobs_fd()
        except BaseException:
            self._close_fds()
            raise

    def _close_fds(self) -> None:
        for fd in (self._dir_fd, self._store_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._dir_fd = self._store_fd = None

    def _blobs_fd(self) -> int | None:
        """The descriptor of ``blobs/`` in the store directory as opened (opened
        on first need: a read-only handle's store may get it later); None
        while there is none. StoreOpenError if it is not a real directory."""
        if self._dir_fd is None and self._store_fd is not None:
            try:
                self._dir_fd = os.open("blobs", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                       dir_fd=self._store_fd)
            except FileNotFoundError:
                return None
            except OSError as e:
                if e.errno in (errno.ENOTDIR, errno.ELOOP):
                    raise StoreOpenError(f"{self.dir} is not a directory (a symlink or a file); the store is "
                                         f"damaged: move it away if you did not put it there") from None
                raise StoreOpenError(f"cannot open the blob directory {self.dir}: {e.strerror or e}") from None
        return self._dir_fd

    def _make_dir(self) -> None:
        """Create ``blobs/`` with exactly the store's directory mode; an
        existing one must be a real directory (not a symlink)."""
        try:
            try:
                os.mkdir("blobs", self._policy.dir_mode, dir_fd=self._store_fd)
                # the umask may have removed group bits
                os.chmod("blobs", self._policy.dir_mode, dir_fd=self._store_fd)
            except FileExistsError:
                pass
            st = os.lstat("blobs", dir_fd=self._store_fd)
        except OSError as e:
            raise StoreOpenError(f"cannot create the blob directory {self.dir}: {e.strerror or e}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise StoreOpenError(f"{self.dir} is not a directory (a symlink or a file); the store is damaged: "
                                 f"move it away if you did not put it there")

    def _path(self, name: str) -> str:
        """``name``'s path, for messages only (operations use the descriptors)."""
        return os.path.join(self.dir, name)

    def _dirfd(self) -> int:
        """``blobs/``'s descriptor for an operation; OSError(ENOENT) if none."""
        fd = self._blobs_fd()
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), self.dir)
        return fd

    def _unlink_name(self, name: str) -> bool:
        fd = self._blobs_fd()
        return False if fd is None else _unlink(self._path(name), name=name, dir_fd=fd)

    def _new_file(self, name: str, flags: int) -> int:
        fd = os.open(name, flags | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, self._policy.file_mode,
                     dir_fd=self._dirfd())
        if self._policy.file_mode & 0o070:
            try:
                os.fchmod(fd, self._policy.file_mode)  # the umask may have removed group bits
            except OSError:
                os.close(fd)
                self._unlink_name(name)
                raise
        return fd

    def _forget_inherited_token(self) -> None:
        """In a forked child: close the inherited copy of the token's lock
        descriptor (the parent's lock stays: it belongs to the parent's
        descriptor too). Else the child would keep the lock taken after the
        parent died, so the parent's leftovers would never be swept."""
        fd, self._lock_fd = self._lock_fd, None
        self._lock = threading.Lock()  # a lock held at fork time is never released in the child
        spare, self._spare, self._spare_job = self._spare, None, None  # the parent's file: closed, not removed
        self._uncached_at_sync = set()  # the parent's files: its own to sync
        if spare is not None:
            spare.close()
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _take_token(self) -> str:
        """This handle's token, taken on first use (call under ``_lock``).
        The lock file is created, flocked, then checked to still be the file
        at its name: a sweeper that took the lock between creation and flock
        removed it (so its files could never look dead); then a new token."""
        if self._closed or self.readonly:
            raise ECStoreError(f"blob files of {self.dir} are {'closed' if self._closed else 'read-only'}")
        if self._token is not None:
            return self._token
        while True:
            token = secrets.token_hex(8)
            path = self._path(token + ".lock")
            try:
                fd = self._new_file(token + ".lock", os.O_RDWR)
            except OSError as e:
                raise _write_error("the blob writer lock", path, e) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # waits only for a sweeper about to remove it
                st, own = os.lstat(token + ".lock", dir_fd=self._dirfd()), os.fstat(fd)
                if (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino):
                    self._token, self._lock_fd = token, fd
                    return token
            except FileNotFoundError:
                pass
            except OSError as e:
                os.close(fd)
                raise _write_error("the blob writer lock", path, e) from None
            os.close(fd)

    def write(self, blob: Buffer, *, writeback: bool = True, hasher: Hasher | None = None) -> FileRef:
        """Write ``blob`` (any C-contiguous buffer) to a new file and
        (``writeback``) start its writeback as it goes; it is durable only
        after :meth:`sync`. ``writeback=False`` leaves the file's pages to
        that sync: for a file committed before it is synced, whose writeback
        would otherwise compete with the commit's own sync. A blob of at
        least ``direct_from`` bytes in :data:`DIRECT_ALIGN`-aligned memory is
        written with ``O_DIRECT`` (all but its unaligned tail; see
        :data:`DIRECT_ALIGN`), where the file system takes it. StoreFullError
        on any OS error ("disk full while writing ..." for ENOSPC/EFBIG/EDQUOT),
        with no partial file left; InvalidEntryError for a non-contiguous buffer.
        ``hasher`` (an ``xxhash.xxh3_64``) is fed the whole blob, in order:
        with a spare file, each piece while it is in the caches."""
        check_same_process(self._pid, f"blob files of {self.dir}")
        data = _byte_view(blob)
        size = len(data)
        spare = self._claim_spare(size)
        name = self._new_name(spare)
        path = self._path(name)
        if spare is not None:
            return self._write_spare(spare, name, [data], writeback, hasher)
        self._note_size(size)
        direct = (size // DIRECT_ALIGN * DIRECT_ALIGN) if self._direct_for(data) else 0
        try:
            fd = self._new_file(name, os.O_WRONLY | (_O_DIRECT if direct else 0))
        except OSError as e:
            if not (direct and e.errno == errno.EINVAL):
                raise _write_error("blob file", path, e) from None
            self._no_direct(e)  # the file system has no O_DIRECT: buffered from now on
            direct = 0
            self._unlink_name(name)  # Linux created the file before refusing the flag
            try:
                fd = self._new_file(name, os.O_WRONLY)
            except OSError as e2:
                raise _write_error("blob file", path, e2) from None
        done = hashed = 0
        try:
            try:
                if _preallocate is not None and size:
                    err = _preallocate(fd, size)
                    if err in _FULL_ERRNOS:  # not room for it: nothing written yet
                        raise OSError(err, os.strerror(err))
                    # any other failure (EOPNOTSUPP...): the writes allocate as they go
                if direct:
                    done, hashed = self._write_direct(fd, data, direct, hasher)
                while done < size:
                    # short writes: once the disk or RLIMIT_FSIZE is reached
                    n = os.write(fd, data[done:done + WRITEBACK_CHUNK])
                    if n <= 0:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    if writeback and not direct and _start_writeback is not None:
                        _start_writeback(fd, done, n)  # a hint: its result does not matter
                    done += n
            finally:
                os.close(fd)
        except OSError as e:
            self.discard([name])
            raise _write_error("blob file", path, e) from None
        if hasher is not None:
            hasher.update(data[hashed:])  # the part the direct write did not hash as it went
        return FileRef(name, size)

    def write_parts(self, parts: Sequence[Buffer], *, writeback: bool = True,
                    hasher: Hasher | None = None) -> FileRef | None:
        """:meth:`write` of the blob made of ``parts`` (C-contiguous buffers,
        in order: a blob's head, then the tensor's bytes where they lie), if
        a spare file holds them: no copy of the blob is made to write it.
        None, with nothing done, where no spare is ready or large enough (the
        caller encodes the blob and calls :meth:`write`). Errors as :meth:`write`."""
        check_same_process(self._pid, f"blob files of {self.dir}")
        views = [_byte_view(part) for part in parts]
        spare = self._claim_spare(sum(len(v) for v in views))
        if spare is None:
            return None
        return self._write_spare(spare, self._new_name(spare), views, writeback, hasher)

    def _new_name(self, spare: SpareFile | None) -> str:
        """A new blob file's name (``spare``, claimed: dropped if that fails)."""
        with self._lock:
            try:
                return f"{self._take_token()}-{next(self._counter)}.ecb"
            except BaseException:
                if spare is not None:
                    self._drop_spare(spare)
                raise

    def _write_spare(self, spare: SpareFile, name: str, parts: list[memoryview], writeback: bool,
                     hasher: Hasher | None) -> FileRef:
        """:meth:`write` through ``spare``: the blob's ``parts`` copied into
        its pages (:meth:`SpareFile.fill`), the file renamed ``name``."""
        size = sum(len(v) for v in parts)
        try:
            try:
                spare.fill(parts, hasher)
                if writeback and _start_writeback is not None:
                    _start_writeback(spare.fd, 0, size)  # a hint: its result does not matter
            finally:
                spare.close()
            dir_fd = self._dirfd()
            os.rename(spare.name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as e:
            self._unlink_name(spare.name)
            raise _write_error("blob file", self._path(name), e) from None
        self._note_size(size)
        if spare_mod.NEW_PAGES_DEAR:
            with self._lock:
                if len(self._uncached_at_sync) >= UNCACHED_KEPT:  # never synced (a failed batch): forget them
                    self._uncached_at_sync.clear()
                self._uncached_at_sync.add(name)
        return FileRef(name, size)

    def spares_from(self, size: int) -> bool:
        """Whether a blob of ``size`` bytes is one a spare file is made for
        (spares on, and at least ``spare_from`` bytes)."""
        return self.spare_from is not None and size >= self.spare_from

    def _claim_spare(self, size: int) -> SpareFile | None:
        """The ready spare if it holds ``size`` bytes (taken: the next call
        gets another), else None."""
        if not self.spares_from(size):
            return None
        with self._lock:
            spare = self._spare
            if spare is None or spare.capacity < size:
                return None
            self._spare = None
            return spare

    def _note_size(self, size: int) -> None:
        """Note a blob of ``size`` bytes written: the next spare holds the
        largest of the last :data:`SPARE_SIZES_KEPT`."""
        if self.spare_from is not None and size >= self.spare_from:
            with self._lock:
                self._spare_sizes.append(size)

    def prepare_spare(self) -> None:
        """Have a spare made on the ``ecstore-spare`` thread for the next
        large blob (returns at once), unless one as large is ready or being
        made, or no large blob was written yet. The store's writer calls it
        when it goes idle: made while saves queue up, spares would take the
        cores from them."""
        if self.spare_from is None:
            return
        with self._lock:
            if self._closed or self._spare_job is not None or not self._spare_sizes:
                return
            want = -(-max(self._spare_sizes) // SPARE_ROUND) * SPARE_ROUND
            if self._spare is not None and self._spare.capacity >= want:
                return
            try:
                self._spare_job = _preparer().submit(self._make_spare, want)
            except RuntimeError as e:  # no thread can be started, or the interpreter is exiting
                log.debug("ecstore: no spare blob file for %s: %s", self.dir, e)

    def wait_spare(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no bound) for the spare
        being made, if any; whether one is ready (tests, benchmarks)."""
        with self._lock:
            job = self._spare_job
        if job is not None:
            futures.wait([job], timeout)
        with self._lock:
            return self._spare is not None

    def _make_spare(self, capacity: int) -> None:
        """On the ``ecstore-spare`` thread: make a spare of ``capacity``
        bytes and keep it (an older, smaller one is removed). A failure is no
        error: the next blob is written as if there were no spares (a system
        that cannot make them at all stops trying, logged once)."""
        try:
            name: str | None = None
            fd: int | None = None
            try:
                with self._lock:
                    if self._closed:
                        return
                    name = f"{self._take_token()}-{next(self._counter)}{_SPARE_SUFFIX}"
                fd = self._new_file(name, os.O_RDWR)
                made = SpareFile(name, fd, capacity)
            except (OSError, ECStoreError) as e:
                if fd is not None:
                    os.close(fd)
                if name is not None:
                    self._unlink_name(name)
                if isinstance(e, OSError) and e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    self.spare_from = None
                    log.info("ecstore: %s cannot hold spare blob files (%s): each blob file is written new",
                             self.dir, e.strerror or e)
                else:
                    log.debug("ecstore: no spare blob file in %s: %s", self.dir, e)
                return
            with self._lock:
                if self._closed or os.getpid() != self._pid:
                    old: SpareFile | None = made
                else:
                    old, self._spare = self._spare, made
            if old is not None:
                self._drop_spare(old)
        finally:
            with self._lock:
                self._spare_job = None

    def _drop_spare(self, spare: SpareFile) -> None:
        """Close and remove ``spare``."""
        spare.close()
        self._unlink_name(spare.name)

    def _direct_for(self, data: memoryview) -> bool:
        """Whether ``data`` is written with ``O_DIRECT``: large enough, and
        its memory aligned (blobs built in :data:`ecstore.pool.POOL` are)."""
        if not _O_DIRECT or self.direct_from is None or len(data) < max(self.direct_from, DIRECT_ALIGN):
            return False
        return int(np.frombuffer(data, dtype=np.uint8).ctypes.data) % DIRECT_ALIGN == 0

    def _write_direct(self, fd: int, data: memoryview, end: int, hasher: Hasher | None) -> tuple[int, int]:
        """Write ``data[:end]`` (``end`` a multiple of :data:`DIRECT_ALIGN`)
        through ``fd`` opened with ``O_DIRECT`` (through the handle's
        process's huge-page staging buffers, :mod:`ecstore.lmdb.direct`; straight from
        ``data`` while another thread uses them), then turn ``O_DIRECT`` off
        for the tail. A write the file system refuses (EINVAL: alignment it
        does not take) turns it off at once, for this handle too; the rest
        is written buffered, as after a short write. ``hasher`` is fed what
        goes through the staging buffers as it goes. Returns the bytes
        written and the bytes from the start hashed (0 straight from ``data``)."""
        done = hashed = 0
        try:
            staged = direct.DIRECT.write(fd, data, end, hasher)
            if staged is not None:
                done, hashed = staged.done, staged.hashed
                if staged.error is not None:
                    raise staged.error
                # short of ``end``: a short write; the rest goes through the page cache
            while staged is None and done < end:  # another thread is using the buffers: from ``data``
                n = os.write(fd, data[done:min(end, done + WRITEBACK_CHUNK)])
                if n <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += n
                if n % DIRECT_ALIGN:  # a short write: the rest is not aligned any more
                    break
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._no_direct(e)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
        return done, hashed

    def _no_direct(self, e: OSError) -> None:
        """``O_DIRECT`` refused here: this handle writes buffered from now on."""
        if self.direct_from is not None:
            self.direct_from = None
            log.info("ecstore: %s does not take O_DIRECT writes (%s): blob files are written through the "
                     "page cache", self.dir, e.strerror or e)

    def sync(self, names: Iterable[str], *, missing_ok: bool = False) -> None:
        """Make the named files (written by :meth:`write`) durable:
        ``fdatasync`` each (several at once on the process's sync threads,
        :data:`SYNC_THREADS`: the file system joins concurrent syncs into one
        journal commit and device flush), then ``fsync`` the blob directory (their names),
        and on a handle's first call the store directory (``blobs/`` itself).
        One call per batch: the writeback :meth:`write` started runs for all
        of them meanwhile. StoreFullError on an OS error (the caller discards
        the files). ``missing_ok``: a file already removed (its entry,
        committed before this call, evicted meanwhile) is skipped. Where new
        pages are dear (a VM that reports free memory to its host), a file
        written through a spare then leaves the page cache (its clean pages:
        :func:`_sync_uncached`), as an ``O_DIRECT`` one never enters it."""
        try:
            dir_fd = self._dirfd()
        except OSError as e:
            raise _write_error("the directory", self.dir, e) from None
        todo = list(names)
        with self._lock:
            uncache = self._uncached_at_sync.intersection(todo)
            self._uncached_at_sync.difference_update(uncache)

        def one(name: str) -> None:
            _sync_path(self._path(name), os.O_NOFOLLOW, _sync_uncached if name in uncache else os.fdatasync,
                       "blob file", name=name, dir_fd=dir_fd, missing_ok=missing_ok)
        if len(todo) < 2:
            for name in todo:
                one(name)
        else:
            _each_on_syncers(one, todo)
        self.sync_store_dir()
        try:
            os.fsync(dir_fd)
        except OSError as e:
            raise _write_error("the directory", self.dir, e) from None

    def sync_store_dir(self) -> None:
        """Once per handle, ``fsync`` the store directory (its entry for
        ``blobs/``): before any commit references a file in ``blobs/`` (the
        process that created it may have died before this, so every handle
        does it once rather than only the creator). StoreFullError on an OS error."""
        if self._store_dir_synced:
            return
        path = os.path.dirname(self.dir)
        try:
            if self._store_fd is None:
                raise OSError(errno.EBADF, "closed", path)
            os.fsync(self._store_fd)
        except OSError as e:
            raise _write_error("the directory", path, e) from None
        self._store_dir_synced = True

    def discard(self, names: Iterable[str]) -> None:
        """Unlink the named blob files; one already gone is no error, any
        other failure is logged (the file is a leftover :meth:`sweep` removes
        once this handle closed). Never raises an OSError."""
        names = list(names)
        with self._lock:
            self._uncached_at_sync.difference_update(names)
        for name in names:
            if _NAME.fullmatch(name):
                self._unlink_name(name)
            else:
                log.warning("ecstore: not discarding %r: not a blob file name", name)

    def open(self, ref: FileRef) -> int | None:
        """A read-only descriptor (``O_CLOEXEC``) of ``ref``'s file, which the
        caller closes; None if it does not exist, or cannot be opened (then
        logged once per handle and errno); :class:`BlobFileUnavailable` if
        the process or system is out of descriptors or memory (the file may
        be fine: the caller must not take it for damage)."""
        try:
            # O_NONBLOCK: a FIFO planted under the name must not block the open
            return os.open(ref.name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                           dir_fd=self._dirfd())
        except FileNotFoundError:
            return None
        except OSError as e:
            path = self._path(ref.name)
            if e.errno not in self._logged:
                self._logged.add(e.errno or 0)
                log.warning("ecstore: cannot open blob file %s: %s (read as a miss)", path, e.strerror or e)
            if e.errno in _TRANSIENT_ERRNOS:
                raise BlobFileUnavailable(f"cannot open blob file {path}: {e.strerror or e}") from None
            return None

    def _dead(self, token: str) -> bool:
        """Whether ``token``'s writer is gone: its lock file is missing, or
        can be flocked (then it is removed under the lock, so a writer that
        created it but had not flocked it yet takes a new token)."""
        path = self._path(token + ".lock")
        fd = None
        try:
            fd = os.open(token + ".lock", os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=self._dirfd())
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                log.warning("ecstore: cannot check blob writer lock %s: %s", path, e.strerror or e)
            if fd is not None:
                os.close(fd)
            return False
        self._unlink_name(token + ".lock")  # under the lock: see the docstring
        os.close(fd)
        return True

    def sweep(self, referenced: Callable[[], set[str]]) -> int:
        """Remove the files of dead writers that no committed entry
        references (``referenced()``: the blob file names of the store's
        entries, called only if a dead writer left files); returns how many
        blob or partial files were removed (lock files not counted). A
        read-only handle sweeps nothing (0). Never raises for a file that
        vanished meanwhile (another process sweeping)."""
        if self.readonly:
            return 0
        check_same_process(self._pid, f"blob files of {self.dir}")
        try:
            names = os.listdir(self._dirfd())
        except OSError as e:
            log.warning("ecstore: cannot list blob directory %s: %s", self.dir, e.strerror or e)
            return 0
        by_token: dict[str, list[str]] = {}
        for name in names:
            m = _TOKEN_OF.match(name)
            if m and m.group(1) != self._token:
                files = by_token.setdefault(m.group(1), [])
                if name[len(m.group(1))] == "-":
                    files.append(name)
        # A listing taken while files are created may miss a lock file but
        # show a later file: _dead looks at the lock file itself.
        garbage = [n for token, files in by_token.items() if self._dead(token) for n in files]
        if not garbage:
            return 0
        keep = referenced()
        return sum(self._unlink_name(name) for name in garbage if name not in keep)

    def size(self, name: str) -> int | None:
        """Bytes of the blob file ``name``; None if it is not there (or not a
        blob file name)."""
        if not _NAME.fullmatch(name):
            return None
        try:
            return os.stat(name, dir_fd=self._dirfd()).st_size
        except (OSError, ECStoreError):
            return None

    def sizes(self) -> dict[str, int]:
        """name -> bytes of every blob file in the directory (tooling:
        ``ecstore-dump stats``); empty if there is no directory. Files
        vanishing during the listing are left out."""
        try:
            names = os.listdir(self._dirfd())
        except (OSError, ECStoreError):
            return {}
        return {name: size for name in names if (size := self.size(name)) is not None}

    def close(self) -> None:
        """Release the token: remove and close the lock file (the files this
        handle wrote stay). Idempotent; in a forked child a no-op (its
        inherited descriptor was closed at fork; the parent holds the token).
        A spare file is removed (waiting for one being made)."""
        with self._lock:
            self._closed = True
            job = self._spare_job
        if job is not None and os.getpid() == self._pid:
            job.result()
        with self._lock:
            spare, self._spare = self._spare, None
            if spare is not None and os.getpid() == self._pid:
                self._drop_spare(spare)
            fd, self._lock_fd = self._lock_fd, None
            if fd is not None:
                if os.getpid() == self._pid and self._token is not None:
                    self._unlink_name(self._token + ".lock")
                os.close(fd)
            self._close_fds()


#: Every BlobFiles of this process: a forked child closes their inherited
#: token descriptors (:meth:`BlobFiles._forget_inherited_token`).
_LIVE: weakref.WeakSet[BlobFiles] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _POOLS_LOCK
    _POOLS.clear()  # the parent's threads are not in the child
    _POOLS_LOCK = threading.Lock()
    for files in list(_LIVE):
        files._forget_inherited_token()


os.register_at_fork(after_in_child=_after_fork_in_child)
