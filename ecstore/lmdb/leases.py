"""The lease table (``leases.mdb``): pins against eviction, and eviction markers.

:class:`LeaseTable`, one per lease environment per process, leases entry keys
(``ttl_s`` in seconds) and marks entries an evictor is deleting.
Every method is its own lease-file transaction; writes take the lease write
lock (a thread lock, then an ``flock``), and :meth:`LeaseTable.try_lease`
waits at most :data:`LEASE_LOCK_WAIT_S` for it. Row format:
docs/format.md#the-lease-file; the evictor/pinner protocol and the locking:
docs/architecture.md#leases-and-eviction-markers.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import lmdb

from ecstore.errors import StoreOpenError
from ecstore.format import Record

_LEASE = struct.Struct("<IQ")  # pid, expiry (ns since epoch)
#: Lease-file keys under this prefix are eviction tombstones (docs/format.md#the-lease-file).
_TOMB = b"\x00evicting\x00"
TOMBSTONE_MAX_AGE_NS = 60 * 10**9
#: lease() prunes dead and expired leases once the lease table holds more
#: keys than this (and then at twice the live count): leases that are never
#: released cannot grow the file or the cost of a pin without bound.
LEASE_PRUNE_MIN = 1024
#: A lease write counts the lease table's keys (``txn.stat()``, a sizeable
#: part of a pin: docs/benchmarks.md) only when this process's own count of them may pass
#: the prune threshold, or once it added this many keys since it last
#: counted: keys other processes add are seen within that many of its own.
LEASE_COUNT_EVERY = 64
#: The longest :meth:`LeaseTable.try_lease` waits for the lease write lock
#: (seconds) before it gives up: another process's lease transactions last
#: microseconds (no fsync), so only a stopped or stuck one outlasts it.
LEASE_LOCK_WAIT_S = 0.02
#: After a bounded wait for the lease write lock timed out, bounded calls try
#: the lock once (no wait) for this many seconds: a scheduler step asking about
#: many items pays one :data:`LEASE_LOCK_WAIT_S`, not one per item.
LEASE_BUSY_HOLD_S = 1.0
_LOCK_POLL_S = 0.0005


class Pin(enum.Enum):
    """The answer of a pin (``LMDBTier.pin`` / ``ECStore.pin``)."""

    #: The entry is there and leased: no process evicts it before the lease ends.
    HELD = "held"
    #: The entry is not there (or is being evicted, or is gone since the lease): nothing leased.
    ABSENT = "absent"
    #: The entry is there but the lease write lock stayed held (another
    #: process inside, or stopped inside, a lease write): nothing leased;
    #: ask again later.
    BUSY = "busy"


@dataclass(frozen=True)
class PinAnswer:
    """A pin's answer with the entry's record: ``pin`` as :class:`Pin`;
    ``record`` the entry's for ``HELD`` (read after the lease; None where the
    tier keeps no records: memory-only stores), else None. A caller checks
    the entry's shape or identity against it without another read."""

    pin: Pin
    record: Record | None = None


PIN_ABSENT = PinAnswer(Pin.ABSENT)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LeaseTable:
    """The lease rows and eviction tombstones of one ``leases.mdb``
    environment (``env``); keys are entry keys as bytes. See the module
    docstring for the format and the protocol."""

    def __init__(self, env: lmdb.Environment) -> None:
        """Opens a descriptor of ``leases.mdb`` for the lease write lock
        (StoreOpenError if that fails: no descriptor left, say); call
        :meth:`close` with the environment."""
        self.env = env
        self._lock_fd: int | None = self._open_lock_fd()
        self._thread_lock = threading.Lock()
        #: time.monotonic() until which a bounded call tries the lock once
        #: instead of waiting (a wait timed out just before; see
        #: LEASE_BUSY_HOLD_S). A plain float: a racing update only moves when
        #: the next wait happens.
        self._busy_until = 0.0
        #: Lease-table size above which lease() prunes dead and expired leases.
        self.prune_at = LEASE_PRUNE_MIN
        #: The key count of the lease table when this process last counted
        #: it, and the keys its lease writes added since (an upper bound of
        #: the count but for other processes' keys; see LEASE_COUNT_EVERY).
        self._counted = 0
        self._added = 0
        #: (key, stamp) of the tombstones this process wrote (mark_evicting)
        #: and has not cleared yet.
        self._tombstones: list[tuple[bytes, bytes]] = []

        _LIVE.add(self)

    def _open_lock_fd(self) -> int:
        path = self.env.path()
        try:
            return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise StoreOpenError(f"cannot open the lease file {path} to lock it: {e.strerror}") from None

    def close(self) -> None:
        """Close the lock descriptor (with the lease environment)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _forget_inherited_lock(self) -> None:
        """In a forked child: close the inherited copy of the flock's
        descriptor (it shares the parent's open file description, so the
        child would hold the parent's flock after the parent died inside a
        lease write, blocking every process's lease writes while it lives)
        and renew the thread lock (one held at fork time is never released
        in the child). A lease write of the child opens a descriptor of its own."""
        fd, self._lock_fd = self._lock_fd, None
        self._thread_lock = threading.Lock()
        self._busy_until = 0.0
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _lock(self, wait: bool) -> bool:
        """Take the lease write lock (this process's thread lock, then the
        flock): waiting, or (``wait=False``) polling both for at most
        :data:`LEASE_LOCK_WAIT_S` together; whether it was taken. For
        :data:`LEASE_BUSY_HOLD_S` after such a poll timed out, a
        ``wait=False`` call tries each lock once instead (no wait): a caller
        asking about many items pays one wait, and a lock that came free is
        taken at once. Release it with :meth:`_unlock`."""
        if not wait and self._thread_lock.acquire(False):  # uncontended, the usual case: both at once
            taken = False
            try:
                if self._lock_fd is not None:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    self._busy_until = 0.0
                    taken = True
                    return True
            except BlockingIOError:  # another process's lease write
                if time.monotonic() < self._busy_until:  # the one try the busy hold allows
                    return False
                # else poll below
            except OSError:
                pass  # the poll below tries again and reports it
            finally:
                if not taken:
                    self._thread_lock.release()
        holding = False
        if wait:
            self._thread_lock.acquire()
        else:
            now = time.monotonic()
            holding = now < self._busy_until
            deadline = now if holding else now + LEASE_LOCK_WAIT_S
            taken = (self._thread_lock.acquire(blocking=False) if holding
                     else self._thread_lock.acquire(timeout=LEASE_LOCK_WAIT_S))
            if not taken:
                if not holding:
                    self._busy_until = time.monotonic() + LEASE_BUSY_HOLD_S
                return False
        try:
            if self._lock_fd is None:  # closed in a forked child: a descriptor of its own
                self._lock_fd = self._open_lock_fd()
            if wait:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
                return True
            while True:
                try:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    self._busy_until = 0.0
                    return True
                except BlockingIOError:  # another process's lease write
                    if time.monotonic() >= deadline:
                        if not holding:
                            self._busy_until = time.monotonic() + LEASE_BUSY_HOLD_S
                        self._thread_lock.release()
                        return False
                    time.sleep(_LOCK_POLL_S)
        except OSError as e:
            self._thread_lock.release()
            raise StoreOpenError(f"cannot lock the lease file {self.env.path()}: {e.strerror}") from None
        except BaseException:
            self._thread_lock.release()
            raise

    def _unlock(self) -> None:
        try:
            if self._lock_fd is not None:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    @contextlib.contextmanager
    def _write(self) -> Iterator[lmdb.Transaction]:
        """``with self._write() as txn``: :meth:`_locked_write` as a block (waits)."""
        self._lock(True)
        try:
            with self.env.begin(write=True) as txn:
                yield txn
        finally:
            self._unlock()

    def _locked_write(self, body: Callable[[lmdb.Transaction], None], wait: bool = True) -> bool:
        """``body(txn)`` in a lease write transaction begun under the lease
        write lock (committed if it returns, aborted if it raises); False
        (nothing begun) if ``wait=False`` and the lock stayed held."""
        if not self._lock(wait):
            return False
        try:
            with self.env.begin(write=True) as txn:
                body(txn)
            return True
        finally:
            self._unlock()

    def lease(self, keys: list[bytes], ttl_s: float, pid: int) -> None:
        """Pin ``keys`` for ``ttl_s`` seconds (or until released, or until
        process ``pid`` dies); waits for the lease write lock."""
        self._locked_write(lambda txn: self._lease_in(txn, keys, ttl_s, pid))

    def try_lease(self, keys: list[bytes], ttl_s: float, pid: int) -> bool:
        """:meth:`lease`, unless another process (or thread) holds the lease
        write lock for more than :data:`LEASE_LOCK_WAIT_S`: then nothing is
        leased and the answer is False."""
        return self._locked_write(lambda txn: self._lease_in(txn, keys, ttl_s, pid), wait=False)

    def try_pin(self, k: bytes, ttl_s: float, pid: int) -> bool | None:
        """Steps (a) and (b) of the protocol in one lease write transaction:
        lease ``k`` unless it carries a live tombstone (True: leased; False:
        being evicted, nothing leased). Writers of the lease file are
        serialised, so the tombstone check sees every tombstone committed
        before this lease, and an evictor whose tombstone comes later sees
        this lease in its step (3). None (nothing leased) when the lease
        write lock stays held, as for :meth:`try_lease`."""
        if not self._lock(False):
            return None
        try:
            with self.env.begin(write=True) as txn:  # _locked_write's transaction, inline (every hit pins)
                if self._evicting_in(txn, k):
                    return False
                self._lease_in(txn, [k], ttl_s, pid)
            return True
        finally:
            self._unlock()

    def try_pin_many(self, keys: list[bytes], ttl_s: float, pid: int,
                     release: list[bytes] | None = None) -> list[bool] | None:
        """:meth:`try_pin` for each of ``keys`` (a key given twice is leased
        twice) after dropping one lease of ``pid`` on each of ``release``,
        all in one lease write transaction; per key, whether it was leased.
        None (nothing leased, nothing released) when the lease write lock
        stays held, as for :meth:`try_lease`."""
        if not self._lock(False):
            return None
        try:
            out: list[bool] = []
            with self.env.begin(write=True) as txn:
                if release:
                    self._release_in(txn, release, pid)
                live: list[bytes] = []
                for k in keys:
                    ok = not self._evicting_in(txn, k)
                    out.append(ok)
                    if ok:
                        live.append(k)
                if live:
                    self._lease_in(txn, live, ttl_s, pid)
            return out
        finally:
            self._unlock()

    def _lease_in(self, txn: lmdb.Transaction, keys: list[bytes], ttl_s: float, pid: int) -> None:
        now = time.time_ns()
        expiry = now + int(ttl_s * 1e9)
        for k in keys:
            cur = txn.get(k)
            self._added += cur is None
            # Expired leases of this key go (a pin costs what is live).
            kept = b"" if cur is None else b"".join(
                bytes(cur[i:i + _LEASE.size]) for i in range(0, len(cur) - _LEASE.size + 1, _LEASE.size)
                if _LEASE.unpack_from(cur, i)[1] > now)
            txn.put(k, kept + _LEASE.pack(pid, expiry))
        # Counted only when the table may have passed prune_at (this
        # process's count is exact but for other processes' keys, which it
        # sees within LEASE_COUNT_EVERY of its own). A count of a write that
        # then fails to commit is too low by what it added: that is seen
        # again at the next count.
        if self._counted + self._added > self.prune_at or self._added >= LEASE_COUNT_EVERY:
            entries: int = txn.stat()["entries"]
            if entries > self.prune_at:
                entries = self._prune(txn, now)
                self.prune_at = max(LEASE_PRUNE_MIN, 2 * entries)
            self._counted, self._added = entries, 0

    def _prune(self, txn: lmdb.Transaction, now: int) -> int:
        """Drop expired leases and leases of dead processes inside the lease
        write transaction ``txn``; returns the keys left (tombstones too)."""
        alive: dict[int, bool] = {}
        dead: list[bytes] = []
        rewrite: list[tuple[bytes, bytes]] = []
        left = 0
        for k, v in txn.cursor():
            if bytes(k).startswith(_TOMB):
                left += 1
                continue
            items = [_LEASE.unpack_from(v, i) for i in range(0, len(v) - _LEASE.size + 1, _LEASE.size)]
            for p, _ in items:
                if p not in alive:
                    alive[p] = _pid_alive(p)
            keep = [(p, e) for p, e in items if e > now and alive[p]]
            if not keep:
                dead.append(bytes(k))
            else:
                left += 1
                if len(keep) != len(items):
                    rewrite.append((bytes(k), b"".join(_LEASE.pack(p, e) for p, e in keep)))
        for k in dead:
            txn.delete(k)
        for k, v in rewrite:
            txn.put(k, v)
        return left

    def release(self, keys: list[bytes], pid: int, *, wait: bool = True) -> bool:
        """Drop one lease of ``pid`` on each of ``keys``. ``wait=False``: as
        :meth:`try_lease`, give up (False, nothing released) when the lease
        write lock stays held for :data:`LEASE_LOCK_WAIT_S`."""
        return self._locked_write(lambda txn: self._release_in(txn, keys, pid), wait=wait)

    @staticmethod
    def _release_in(txn: lmdb.Transaction, keys: list[bytes], pid: int) -> None:
        for k in keys:
            cur = txn.get(k)
            if cur is None:
                continue
            items = [_LEASE.unpack_from(cur, i) for i in range(0, len(cur), _LEASE.size)]
            for i, (p, _) in enumerate(items):
                if p == pid:
                    del items[i]
                    break
            if items:
                txn.put(k, b"".join(_LEASE.pack(*it) for it in items))
            else:
                txn.delete(k)

    def evicting(self, k: bytes) -> bool:
        """Step (b) of the protocol: whether ``k`` carries a live tombstone."""
        with self.env.begin() as txn:
            return self._evicting_in(txn, k)

    @classmethod
    def _evicting_in(cls, txn: lmdb.Transaction, k: bytes) -> bool:
        """Whether ``k`` carries a live tombstone, read in ``txn``."""
        tomb = txn.get(_TOMB + k)
        return tomb is not None and cls._tombstone_live(bytes(tomb))

    @staticmethod
    def _tombstone_live(raw: bytes) -> bool:
        pid, t_ns = _LEASE.unpack(raw)
        return time.time_ns() - t_ns < TOMBSTONE_MAX_AGE_NS and _pid_alive(pid)

    def leased_keys(self) -> set[bytes]:
        """Keys with at least one live lease (unexpired, owner alive); rows
        with none left are deleted, each only if it is still as read (a
        loader may have leased the key again in between)."""
        now = time.time_ns()
        live: set[bytes] = set()
        dead: list[tuple[bytes, bytes]] = []
        alive_cache: dict[int, bool] = {}
        with self.env.begin() as txn:
            for k, v in txn.cursor():
                if k.startswith(_TOMB):
                    continue
                ok = False
                for i in range(0, len(v), _LEASE.size):
                    pid, exp = _LEASE.unpack_from(v, i)
                    if exp > now:
                        if pid not in alive_cache:
                            alive_cache[pid] = _pid_alive(pid)
                        ok = ok or alive_cache[pid]
                if ok:
                    live.add(bytes(k))
                else:
                    dead.append((bytes(k), bytes(v)))
        if dead:
            with self._write() as txn:
                for k, v in dead:
                    if txn.get(k) == v:
                        txn.delete(k)
        return live

    def mark_evicting(self, keys: list[bytes]) -> None:
        """Step (2) of the protocol: tombstones for ``keys``, stamped with
        this process and now; remembered until :meth:`clear_tombstones`."""
        stamp = _LEASE.pack(os.getpid(), time.time_ns())
        with self._write() as ltxn:
            for k in keys:
                ltxn.put(_TOMB + k, stamp)
        self._tombstones.extend((k, stamp) for k in keys)

    def clear_tombstones(self) -> None:
        """Step (5) of the protocol: after the eviction committed (or aborted).

        Clears only the tombstones this process wrote: once its data
        transaction ended, an evictor of another process may have chosen the
        same entry (this one's eviction aborted) and overwritten the marker
        with its own, which must stay until that evictor commits."""
        if not self._tombstones:
            return
        with self._write() as ltxn:
            for k, stamp in self._tombstones:
                if ltxn.get(_TOMB + k) == stamp:
                    ltxn.delete(_TOMB + k)
        self._tombstones = []


#: Every LeaseTable of this process: a forked child closes their inherited
#: lock descriptors (:meth:`LeaseTable._forget_inherited_lock`).
_LIVE: weakref.WeakSet[LeaseTable] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for table in list(_LIVE):
        table._forget_inherited_lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
