"""The files of a store directory: their types, owners and modes.

Checked before LMDB opens anything (LMDB follows symlinks, blocks on FIFOs and
creates files with the umask's modes): every open refuses a store file
(:data:`STORE_FILES`) that is a symlink or not a regular file;
:func:`check_writable_location` refuses, like ssh's StrictModes, what another
user owns or may write (old loose modes: a one-time warning);
:func:`create_store_dir` / :func:`fix_created_modes` set ``file_mode`` exactly.
Thread-safe. The model these checks implement: docs/security.md.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import stat
import threading
from dataclasses import dataclass

from ecstore.errors import StoreOpenError

log = logging.getLogger("ecstore")

#: Files LMDB and ecstore keep in a store directory.
STORE_FILES = ("data.mdb", "lock.mdb", "leases.mdb", "leases.mdb-lock")
DEFAULT_FILE_MODE = 0o600

_warned: set[str] = set()
_warned_lock = threading.Lock()


@dataclass(frozen=True)
class FilePolicy:
    """Modes of a store's files (``file_mode``) and its directory (derived:
    each rw file bit pair of a class also grants x on the directory)."""

    file_mode: int = DEFAULT_FILE_MODE

    @property
    def dir_mode(self) -> int:
        mode = 0o700
        if self.file_mode & 0o060:
            mode |= (self.file_mode & 0o060) | 0o010
        return mode

    @property
    def shared_with_group(self) -> bool:
        return bool(self.file_mode & 0o060)


def check_file_mode(mode: int) -> int:
    """``mode`` if it is a valid ``file_mode`` (owner read+write, at most
    group read/write, nothing for others), else ValueError."""
    if isinstance(mode, bool) or not isinstance(mode, int) or mode & ~0o660 or mode & 0o600 != 0o600:
        raise ValueError("the owner needs read and write (0600); a group may get read or write (0640, 0660); "
                         "others nothing")
    return mode


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def check_file_types(path: str) -> None:
    """Refuse store files that are symlinks or not regular files
    (StoreOpenError naming the file and the fix)."""
    for name in STORE_FILES:
        p = os.path.join(path, name)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise StoreOpenError(f"cannot inspect store file {p}: {e.strerror or e}") from None
        if stat.S_ISLNK(st.st_mode):
            raise StoreOpenError(
                f"{p} is a symbolic link (to {os.readlink(p)!r}); ecstore refuses symlinked store files, "
                f"which would redirect its writes. Remove the link (rm {p}) if you did not put it there, "
                f"or point local_disk at the real directory")
        if not stat.S_ISREG(st.st_mode):
            raise StoreOpenError(
                f"{p} is not a regular file ({_kind(st.st_mode)}); the store is damaged or this is not an "
                f"ecstore directory: move it away, or point local_disk at a new directory")


def _owner_ok(st: os.stat_result, policy: FilePolicy) -> bool:
    if st.st_uid == os.geteuid():
        return True
    return policy.shared_with_group and (st.st_gid == os.getegid() or st.st_gid in os.getgroups())


def _describe(p: str, st: os.stat_result) -> str:
    return f"{p} (owner {_user(st.st_uid)}, group {_group(st.st_gid)}, mode {stat.S_IMODE(st.st_mode):04o})"


def check_writable_location(path: str, policy: FilePolicy, *, explicit_mode: bool = True) -> None:
    """The StrictModes checks for opening ``path`` read-write (see
    docs/security.md). Raises StoreOpenError naming the path, what was found
    and the fix; logs a one-time warning for an existing store with modes
    looser than ``policy`` (``explicit_mode`` False: the caller does not
    know the configured mode, e.g. ``ecstore-dump purge`` without a config:
    only refusals, no warning about bits the operator may have chosen)."""
    _check_ancestors(path)
    try:
        dst = os.stat(path)
    except FileNotFoundError:
        return  # created with the policy's mode
    except OSError as e:
        raise StoreOpenError(f"cannot inspect store directory {path}: {e.strerror or e}") from None
    if not stat.S_ISDIR(dst.st_mode):
        raise StoreOpenError(f"{path} is not a directory (local_disk must be a directory)")
    # The directory first: its owner decides whether its files may be looked at.
    _check_owner(path, dst, policy)
    check_file_types(path)
    existing = os.path.exists(os.path.join(path, "data.mdb"))
    found: list[tuple[str, os.stat_result]] = [(path, dst)]
    for name in STORE_FILES:
        p = os.path.join(path, name)
        try:
            found.append((p, os.lstat(p)))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StoreOpenError(f"cannot inspect store file {p}: {e.strerror or e}") from None
    loose: list[str] = []
    for p, st in found:
        is_dir = p == path
        _check_owner(p, st, policy)
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o002:
            raise StoreOpenError(
                f"refusing to open {_describe(p, st)}: anyone may write to it, so anyone could replace "
                f"or poison entries. Fix: chmod {policy.dir_mode if is_dir else policy.file_mode:o} {p}")
        allowed = policy.dir_mode if is_dir else policy.file_mode
        extra = mode & ~allowed & 0o077
        if extra & 0o020 and not existing:
            raise StoreOpenError(
                f"refusing to create a store in {_describe(p, st)}: its group may write to it, beyond "
                f"file_mode {policy.file_mode:04o}. Fix: chmod {allowed:o} {p}, or set file_mode: 0660 "
                f"to share the store with the group on purpose")
        if extra and existing and explicit_mode:
            loose.append(p)
    if loose:
        _warn_once(path, loose, policy)


def _check_owner(p: str, st: os.stat_result, policy: FilePolicy) -> None:
    if not _owner_ok(st, policy):
        me = os.geteuid()
        raise StoreOpenError(
            f"refusing to open {_describe(p, st)}: it belongs to another user than this process "
            f"({_user(me)}), who could replace or poison its entries. Fix: use a store directory of "
            f"your own, or `chown -R {me} {p}` if it should be yours; to share a store with a "
            f"group on purpose set file_mode: 0660 and make the group own it")


def _check_ancestors(path: str) -> None:
    """Refuse a store below a directory anyone may write to without the
    sticky bit (anyone could rename the store directory and plant another)."""
    parent = os.path.dirname(os.path.abspath(path))
    while True:
        try:
            st = os.stat(parent)
        except OSError:
            st = None
        if st is not None and stat.S_IMODE(st.st_mode) & 0o002 and not st.st_mode & stat.S_ISVTX:
            raise StoreOpenError(
                f"refusing to use a store below {_describe(parent, st)}: anyone may write to that "
                f"directory and it has no sticky bit, so anyone could swap the store directory. Fix: "
                f"chmod o-w {parent} (or +t), or put the store elsewhere")
        up = os.path.dirname(parent)
        if up == parent:
            return
        parent = up


def _warn_once(path: str, loose: list[str], policy: FilePolicy) -> None:
    real = os.path.realpath(path)
    with _warned_lock:
        if real in _warned:
            return
        _warned.add(real)
    files = " ".join(p for p in loose if p != path)
    fix = f"chmod {policy.dir_mode:o} {path}" + (f" && chmod {policy.file_mode:o} {files}" if files else "")
    log.warning(
        "ecstore: store %s has looser permissions than file_mode %04o (created by an older ecstore, or "
        "changed by hand): %s. Other users may read its encoder outputs (derived user data) or, with "
        "group write, poison them. Tighten it with: %s  (or set file_mode: 0660 to share it with a group "
        "on purpose)", path, policy.file_mode, ", ".join(loose), fix)


def create_store_dir(path: str, policy: FilePolicy) -> None:
    """Create the store directory and its missing parents, each with exactly
    ``policy.dir_mode`` (whatever the umask); existing ones are left alone."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        try:
            os.mkdir(d, policy.dir_mode)
        except FileExistsError:  # created meanwhile by another process
            continue
        os.chmod(d, policy.dir_mode)  # the umask may have removed group bits


def missing_files(path: str, names: tuple[str, ...] = STORE_FILES) -> list[str]:
    """The store files that do not exist yet (to fix their modes once
    LMDB created them)."""
    return [n for n in names if not os.path.lexists(os.path.join(path, n))]


def fix_created_modes(path: str, names: list[str], policy: FilePolicy) -> None:
    """Give files this process just created exactly ``policy.file_mode``
    (LMDB creates them with ``file_mode & ~umask``: never looser, maybe
    tighter). By path, never by opening them: closing any descriptor of
    ``lock.mdb`` would drop the fcntl lock LMDB holds on it, and another
    process would then re-initialise the lock file under us. A symlink is
    never chmod-ed (the directory is ours and was checked, see above)."""
    for name in names:
        p = os.path.join(path, name)
        try:
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != policy.file_mode:
                os.chmod(p, policy.file_mode)
        except OSError:
            continue  # not created (e.g. leases of a read-only open)


def readonly_needs_nolock(path: str) -> bool:
    """True when a read-only open cannot use LMDB's lock file: it exists but
    this user may not write it, or it is missing and the directory is not
    writable (a user with read access only: ``ecstore-dump list`` as
    another user). Such opens use ``lock=False`` (see the LMDB tier)."""
    lock = os.path.join(path, "lock.mdb")
    if os.path.lexists(lock):
        return not os.access(lock, os.R_OK | os.W_OK)
    return not os.access(path, os.W_OK | os.X_OK)
