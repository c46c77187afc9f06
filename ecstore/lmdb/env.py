"""The per-process LMDB environment registry and the checks a store's files
pass before LMDB maps them.

* :class:`_SharedEnv`: one ``lmdb.Environment`` per store directory per
  process, reference counted and shared by every :class:`~ecstore.lmdb.tier.LMDBTier`
  handle of that directory (LMDB forbids opening the same file twice in a
  process), with the process's write lock and the lease environment
  (``leases.mdb``, see :mod:`ecstore.lmdb.leases`). It remembers environments
  inherited across ``fork()`` so a forked child gets a clear StoreOpenError.
* :meth:`_SharedEnv.txn`: the one way ecstore begins a data transaction
  (:mod:`ecstore.lmdb.txngate`: how it meets a map another process grew,
  ``MDB_MAP_RESIZED``).
* :func:`_open_env` / :func:`_check_data_file` / :func:`_open_leases`: the
  file checks (types, owner and mode, truncation) and the ``lmdb.open`` calls;
  a damaged lease file is recreated only while no process has it open.
* :func:`map_size_for` and the map headroom constants: the map size bounds
  the data file (design notes: docs/architecture.md, "The LMDB tier").

Thread-safe: the registry is guarded by a class lock; see each class.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import resource
import struct
import threading

import lmdb

from ecstore.errors import StoreOpenError
from ecstore.lmdb.leases import LeaseTable
from ecstore.lmdb.prealloc import reserve
from ecstore.lmdb.store_files import (
    FilePolicy,
    check_file_types,
    check_writable_location,
    create_store_dir,
    fix_created_modes,
    missing_files,
    readonly_needs_nolock,
)
from ecstore.lmdb.txngate import _Txn, _TxnGate

log = logging.getLogger("ecstore")

MiB = 1 << 20

#: The lease file's map size (bytes), the most it grows to; reserved on disk
#: where it is mapped writable (see _open_lease_env).
LEASE_MAP_SIZE = 64 * MiB

MAP_HEADROOM_FACTOR = 1.25
MAP_HEADROOM_BYTES = 1 * MiB  # floor for small caps (B-tree and meta pages)


def map_size_for(capacity_bytes: int) -> int:
    """LMDB map size (bytes) for a disk cap: bounds the data file size."""
    size = max(int(capacity_bytes * MAP_HEADROOM_FACTOR), capacity_bytes + MAP_HEADROOM_BYTES)
    page = 4096
    return (size + page - 1) // page * page


def _reader_txnids(table: str) -> list[int]:
    """Snapshot (transaction id) of each active read transaction in LMDB's
    reader table (``Environment.readers()``: ``pid thread txnid`` rows; idle
    slots are not listed, or show ``-``)."""
    ids = []
    for line in table.splitlines()[1:]:
        parts = line.split()
        if len(parts) == 3 and parts[2].isdigit():
            ids.append(int(parts[2]))
    return ids


class _SharedEnv:
    """One lmdb.Environment per directory per process, reference counted."""

    _lock = threading.Lock()
    _open: dict[str, _SharedEnv] = {}
    #: Directories whose environment this process inherited across fork()
    #: (path -> pid of the process that opened it).
    _inherited: dict[str, int] = {}

    def __init__(self, path: str, env: lmdb.Environment, leases: lmdb.Environment | None, readonly: bool,
                 policy: FilePolicy | None = None):
        self.path = path
        self.policy = policy or FilePolicy()
        self.env = env
        self.leases = leases
        self.readonly = readonly
        self.refs = 0
        self.pid = os.getpid()
        self.write_lock = threading.Lock()  # LMDB allows one write txn per env
        self.gate = _TxnGate()
        #: The lease table on ``leases`` (set with it; see :mod:`ecstore.lmdb.leases`).
        self.lease_table: LeaseTable | None = None if leases is None else LeaseTable(leases)

    def txn(self, write: bool = False, buffers: bool = False) -> _Txn:
        """A transaction of the data environment (``with shared.txn() as
        txn``): committed when the block ends normally, aborted on an
        exception. The one way ecstore begins one: when another process grew
        the map (``MDB_MAP_RESIZED``), adopts the new size (see
        :class:`_TxnGate`) and retries. Write transactions must be begun
        under ``write_lock``."""
        return _Txn(self, write, buffers)

    @classmethod
    def acquire(cls, path: str, map_size: int, readonly: bool, create: bool,
                policy: FilePolicy | None = None, explicit_mode: bool = True) -> _SharedEnv:
        real = os.path.realpath(path)
        with cls._lock:
            shared = cls._open.get(real)
            if shared is not None and shared.pid != os.getpid():
                cls._open.pop(real)  # inherited across fork: never touch it here
                cls._inherited[real] = shared.pid
                shared = None
            if shared is not None:
                if shared.readonly and not readonly:
                    raise StoreOpenError(
                        f"{path} is already open read-only in this process; close that handle first"
                    )
                shared.refs += 1
                return shared
            try:
                opened = _open_env(real, map_size, readonly, create, policy or FilePolicy(), explicit_mode)
            except StoreOpenError as e:
                parent = cls._inherited.get(real)
                if parent is None:
                    raise
                # py-lmdb refuses a second environment on the same files in one
                # process, and closing the inherited one could hang (a write
                # transaction of a parent thread that does not exist here).
                raise StoreOpenError(
                    f"{path} was open in process {parent} when it forked this process ({os.getpid()}); "
                    f"it cannot be opened again in the forked child ({e}). Open the store in a process "
                    f"started with 'spawn' or 'forkserver', or open it in the parent only after forking"
                ) from None
            shared = cls(real, *opened, readonly=readonly, policy=policy)
            shared.refs = 1
            cls._open[real] = shared
            return shared

    def open_leases(self) -> None:
        """Open leases.mdb (read-write environments only), once."""
        with self._lock:
            if self.leases is None and not self.readonly:
                leases = _open_leases(self.path, self.policy)
                try:
                    self.lease_table = LeaseTable(leases)
                except BaseException:
                    leases.close()
                    raise
                self.leases = leases

    def release(self) -> None:
        with self._lock:
            self.refs -= 1
            if self.refs > 0:
                return
            if self._open.get(self.path) is self:
                del self._open[self.path]
        if self.pid == os.getpid():
            self.env.close()
            if self.leases is not None:
                if self.lease_table is not None:
                    self.lease_table.close()
                self.leases.close()


#: Names a directory may hold besides a store's files and still get a new
#: store created in it (dot-files such as ``.nfs*`` are ignored too).
_FOREIGN_OK = {"lock.mdb", "leases.mdb", "leases.mdb-lock", "lost+found"}
_META = struct.Struct("<II")  # mm_magic, mm_version at offset 16 of a meta page
_LMDB_MAGIC = 0xBEEFC0DE


def _check_data_file(data: str) -> None:
    """Refuse a data.mdb shorter than its own meta pages say it is.

    LMDB trusts the last-page number in the meta page and maps the file: a
    truncated file (copy interrupted, disk trouble) would kill the process
    with SIGBUS on the first read past the end. Reads both meta pages
    (64-bit layout: page header 16 bytes, then magic, version, address,
    map size, two 48-byte DB records -- the first's ``md_pad`` is the page
    size -- then ``mm_last_pg``); anything not an LMDB file is left to LMDB.
    """
    try:
        with open(data, "rb") as fh:
            head = fh.read(256)
            if len(head) < 152:
                return
            magic, _ = _META.unpack_from(head, 16)
            if magic != _LMDB_MAGIC:
                return  # LMDB reports MDB_INVALID
            psize = struct.unpack_from("<I", head, 40)[0]
            if not 512 <= psize <= 1 << 16:
                return
            fh.seek(psize)
            second = fh.read(152)
            # The size last: another process may commit meanwhile, and a live
            # LMDB file only grows (data pages are written before the meta
            # page that names them), so the size taken after both meta pages
            # covers what they say; taken between them, a commit growing the
            # file looked like truncation.
            size = os.fstat(fh.fileno()).st_size
    except OSError:
        return  # let LMDB report it
    pages = [struct.unpack_from("<Q", head, 136)[0]]
    if len(second) == 152 and _META.unpack_from(second, 16)[0] == _LMDB_MAGIC:
        pages.append(struct.unpack_from("<Q", second, 136)[0])
    if max(pages) <= 1:
        # Only the two meta pages: a new environment, maybe being written by
        # another process now (one pwrite of both pages, the size growing by
        # a page). LMDB reads both with pread and refuses a missing one.
        return
    need = (max(pages) + 1) * psize
    if need > size:
        raise StoreOpenError(
            f"{data} is truncated: its LMDB meta page needs {need} bytes, the file has {size}; "
            f"the store is damaged (move it away, or restore a copy)")


def _open_env(path: str, map_size: int, readonly: bool, create: bool, policy: FilePolicy,
              explicit_mode: bool = True) -> tuple[lmdb.Environment, lmdb.Environment | None]:
    data = os.path.join(path, "data.mdb")
    # Before LMDB touches anything: no symlinked or odd store files (LMDB
    # follows links and blocks on FIFOs); read-write: ssh-StrictModes-like
    # owner/mode checks (see store_files and docs/security.md).
    if readonly:
        check_file_types(path)
    else:
        check_writable_location(path, policy, explicit_mode=explicit_mode)  # types too
    fresh = not os.path.exists(data)
    if fresh:
        if not create or readonly:
            if not os.path.exists(path):
                raise StoreOpenError(f"{path}: no such directory")
            raise StoreOpenError(f"{path} is not an ecstore store (no data.mdb)")
        if os.path.isdir(path):
            try:
                names = os.listdir(path)
            except OSError as e:
                raise StoreOpenError(f"cannot read store directory {path}: {e.strerror}") from None
            # data.mdb listed now: another process created the store since the
            # check above (two workers starting together); open it as theirs.
            # Every other store file appears only after data.mdb.
            fresh = "data.mdb" not in names
            others = sorted(n for n in names if n not in _FOREIGN_OK and not n.startswith("."))
            if fresh and others:
                shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
                raise StoreOpenError(
                    f"{path} is not an ecstore store (no data.mdb) and is not empty ({shown}); "
                    f"point local_disk at a new or empty directory")
        if fresh:
            try:
                create_store_dir(path, policy)
            except OSError as e:
                raise StoreOpenError(f"cannot create store directory {path}: {e.strerror}") from None
        # Checked again: since the check above another process may have made
        # the directory (create_store_dir leaves it alone) or the store files.
        check_writable_location(path, policy, explicit_mode=explicit_mode)
    if not fresh:
        if os.path.isdir(data):
            raise StoreOpenError(f"{path} is not an ecstore store ({data} is a directory)")
        if os.path.getsize(data) > 0:
            _check_data_file(data)
            # A map no larger than the file leaves no page for a write: not even
            # the eviction that brings a store reopened with a smaller cap under it.
            map_size = max(map_size, os.path.getsize(data) + MAP_HEADROOM_BYTES)
    # A reader without write access to lock.mdb (another user) reads without
    # LMDB's reader table: it cannot register there; see docs/security.md.
    lock = not (readonly and readonly_needs_nolock(path))
    created = [] if readonly else missing_files(path, ("data.mdb", "lock.mdb"))
    try:
        env = lmdb.open(
            path, map_size=map_size, subdir=True, max_dbs=8, readonly=readonly, lock=lock,
            sync=True, metasync=False, max_readers=256, meminit=False, create=create and not readonly,
            mode=policy.file_mode,
        )
    except lmdb.Error as e:
        raise StoreOpenError(f"cannot open ecstore store at {path}: {e}") from None
    fix_created_modes(path, created, policy)
    # leases.mdb is opened by LMDBTier once the file proved to be an ecstore
    # store (_SharedEnv.open_leases): a foreign LMDB directory gets no new files.
    return env, None


#: LMDB errors opening ``leases.mdb`` that prove the file itself damaged
#: (not an LMDB file, a corrupt or unknown-format meta page): only these
#: let a process recreate it. Anything else (too many open files, no
#: memory, permissions, a full reader table) says nothing about the file.
_LEASE_FILE_DAMAGE = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError,
                      lmdb.PageNotFoundError, lmdb.PanicError)


def _open_leases(path: str, policy: FilePolicy) -> lmdb.Environment:
    """Open ``path``'s lease file, ``leases.mdb`` (read-write handles only).

    A damaged lease file (LMDB says so, or it is shorter than its meta
    page says) is recreated (leases are ephemeral) only if no
    process has it open: a process that has keeps using the file it opened,
    so a new one beside it would split the leases in two and an eviction
    would no longer see the other file's (the lease guarantee of
    :mod:`ecstore.lmdb.leases`). "No process has it open" is LMDB's own
    test: each process with the environment open holds a shared fcntl lock
    on byte 0 of ``leases.mdb-lock``, so an exclusive one is free exactly
    when none does. Opens of the lease file are serialised across processes
    by an flock on the store directory, so no process is half-way into
    opening the old files while another replaces them, and two processes
    meeting the same damage recreate it once. Otherwise StoreOpenError
    (nothing deleted): damaged and in use (stop the store's processes; the
    next open recreates it), or any other LMDB error.
    """
    lpath = os.path.join(path, "leases.mdb")
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise StoreOpenError(f"cannot open the lease file {lpath}: {e.strerror}; nothing was changed") from None
    try:
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX)  # released when dfd is closed
        except OSError as e:
            raise StoreOpenError(f"cannot lock {path} to open its lease file: {e.strerror}") from None
        damage: Exception
        try:
            _check_data_file(lpath)  # truncated: LMDB would map it and die of SIGBUS on a read
            return _open_lease_env(path, policy)
        except StoreOpenError as e:
            damage = e
        except lmdb.Error as e:
            if not isinstance(e, _LEASE_FILE_DAMAGE):
                raise StoreOpenError(
                    f"cannot open the lease file {lpath}: {e}; nothing was changed (if this persists, stop "
                    f"every process using the store, then delete leases.mdb and leases.mdb-lock)") from None
            damage = e
        if not _lease_file_unused(lpath + "-lock"):
            raise StoreOpenError(
                f"the lease file {lpath} is damaged or of another LMDB version ({damage}) and in use by "
                f"another process; stop every process using the store (vLLM, ecstore-dump), then open it "
                f"again: the lease file is recreated")
        log.warning("ecstore: lease file %s is damaged (%s) and unused; recreating it", lpath, damage)
        for p in (lpath, lpath + "-lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        try:
            return _open_lease_env(path, policy)
        except lmdb.Error as e:
            raise StoreOpenError(f"cannot create the lease file {lpath}: {e}") from None
    finally:
        os.close(dfd)


def _open_lease_env(path: str, policy: FilePolicy) -> lmdb.Environment:
    """The lease environment, through a writable map (``MDB_WRITEMAP``: a
    lease commit writes no pages with system calls) where the lease file's
    blocks could be reserved up to its map size (:func:`_reserve_lease_file`),
    else as before (writes with ``pwrite``; a full disk is an error, not a
    SIGBUS). Processes of either kind share the file."""
    created = missing_files(path, ("leases.mdb", "leases.mdb-lock"))
    lpath = os.path.join(path, "leases.mdb")
    writemap = _reserve_lease_file(lpath, policy)
    try:
        env = _lmdb_open_leases(lpath, policy, writemap)
    except lmdb.Error as e:
        if not writemap or isinstance(e, _LEASE_FILE_DAMAGE):
            raise
        log.debug("ecstore: lease file %s through a writable map failed (%s); opened without", lpath, e)
        env = _lmdb_open_leases(lpath, policy, False)
    fix_created_modes(path, created, policy)
    return env


def _lmdb_open_leases(lpath: str, policy: FilePolicy, writemap: bool) -> lmdb.Environment:
    return lmdb.open(lpath, subdir=False, map_size=LEASE_MAP_SIZE, max_dbs=0, sync=False, metasync=False,
                     lock=True, max_readers=256, mode=policy.file_mode, writemap=writemap)


def _reserve_lease_file(lpath: str, policy: FilePolicy) -> bool:
    """Reserve ``leases.mdb``'s blocks up to :data:`LEASE_MAP_SIZE` (creating
    it empty if missing: LMDB initialises an empty file); whether it may be
    mapped writable. Not under a file size limit below the map size (LMDB
    extends the file to it: SIGXFSZ), nor where blocks cannot be reserved
    (:func:`ecstore.lmdb.prealloc.reserve`)."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and limit < LEASE_MAP_SIZE:
        return False
    try:
        fd = os.open(lpath, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, policy.file_mode)
    except OSError:
        return False  # lmdb.open reports why
    try:
        return reserve(fd, LEASE_MAP_SIZE)
    finally:
        os.close(fd)  # leases.mdb holds no fcntl lock of LMDB's (those are on leases.mdb-lock)


def _lease_file_unused(lock_path: str) -> bool:
    """Whether no process has the lease environment open: LMDB's shared lock
    on byte 0 of its lock file can be taken exclusively (then let go: the
    caller holds the open flock, so nobody opens it meanwhile). This process
    has no descriptor of the file open (one lease environment per directory
    per process), so closing the probe's drops no lock LMDB holds."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    except OSError as e:
        raise StoreOpenError(f"cannot check whether {lock_path} is in use: {e.strerror}") from None
    try:
        return try_exclusive(fd)
    except OSError as e:
        raise StoreOpenError(f"cannot check whether {lock_path} is in use: {e.strerror}") from None
    finally:
        os.close(fd)


def try_exclusive(fd: int) -> bool:
    """Try to take LMDB's environment lock (byte 0 of a lock file, open as
    ``fd``) exclusively; False if another process holds it.

    Every process with the environment open holds a shared fcntl lock on
    that byte (LMDB's ``mdb_env_excl_lock``), so this fails exactly when
    another process has the environment open, read-only or not, in any
    container on this kernel. POSIX locks never conflict within one
    process, so this also upgrades this process's own shared lock. Other
    failures raise OSError.
    """
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
