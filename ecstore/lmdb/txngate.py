"""How one process's transactions of an LMDB environment meet a map that
another process grew: :class:`_TxnGate` (transactions versus the resize) and
:class:`_Txn` (the one way ecstore begins a transaction, see
:meth:`ecstore.lmdb.env._SharedEnv.txn`)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Literal, overload

import lmdb

from ecstore.errors import StoreOpenError

if TYPE_CHECKING:
    from ecstore.lmdb.env import _SharedEnv


#: How often a transaction is retried after adopting a map another process
#: grew (each retry needs that process to grow the map again meanwhile).
MAX_MAP_RESIZED_RETRIES = 16


class _TxnGate:
    """Transactions of one environment in this process versus a map resize.

    Another process may grow the LMDB map past this process's: beginning a
    transaction then fails with ``MDB_MAP_RESIZED``, and LMDB's remedy,
    ``mdb_env_set_mapsize(0)``, remaps the file, which is only safe while no
    transaction of this process is open (their pages would be unmapped under
    them). Every transaction enters the gate (shared); a resize waits until
    none is open and holds new ones back meanwhile (exclusive). A thread
    that itself holds a transaction of the environment (nested transactions:
    tooling only, e.g. a ``snapshot()`` or ``iter_records()`` loop calling
    the tier; no serving path nests) cannot wait for that: it is not held
    back by a pending resize (it would deadlock with the resizer), and when
    it meets ``MDB_MAP_RESIZED`` itself it gets StoreOpenError (an
    ECStoreError) and may retry once its transaction ended. Thread-safe.

    No lock while no resize is pending (every begin and end, the usual
    case): a transaction announces itself by appending to ``_open`` (a list:
    ``append`` and ``pop`` are each one C call, atomic under the GIL, which
    also orders every read and write of these attributes as the threads run
    them), then reads ``_resizing``; a resizer sets ``_resizing`` first,
    then reads ``_open`` (under the lock). So either the resizer sees the
    transaction (and waits for it to end) or the transaction sees the
    resizer (and withdraws, under the lock, then waits in the slow path).
    An ending transaction pops first, then reads ``_resizing``: if set, it
    notifies under the lock, which the resizer holds from its ``_open``
    check until it waits, so no wake-up is lost.
    """

    def __init__(self) -> None:
        # The condition's own lock, held directly on the slow paths: a
        # ``with`` on a plain lock is C code, ``with`` on a Condition is not.
        self._mutex = threading.Lock()
        self._cv = threading.Condition(self._mutex)
        #: One item per open transaction (its length is the count; see the
        #: class doc for why a list and not an int).
        self._open: list[None] = []
        self._resizing = False
        self._mine = threading.local()

    @property
    def _active(self) -> int:
        """Transactions of this process open now (diagnostics, tests)."""
        return len(self._open)

    def enter(self) -> None:
        local = self._mine
        mine = getattr(local, "depth", 0)
        self._open.append(None)  # announce, then look: see the class doc
        if self._resizing:
            self._enter_during_resize(mine)
        local.depth = mine + 1

    def _enter_during_resize(self, mine: int) -> None:
        """enter()'s slow path: a resize is pending or running; the caller
        has announced itself in ``_open`` (withdrawn here unless let in)."""
        with self._mutex:
            self._open.pop()
            if not self._open:
                self._cv.notify_all()  # the resizer may wait for our announcement to go
            # A thread that holds a transaction does not wait for a pending
            # resize: the resize waits for that very transaction to end. It
            # is safe to let it in while any transaction is open, as the
            # resize happens only once none is (under this condition's lock).
            while self._resizing and not (mine > 0 and self._open):
                self._cv.wait()
            self._open.append(None)

    def leave(self) -> None:
        # max(): a transaction of an abandoned generator may be finalized by
        # the garbage collector in another thread.
        local = self._mine
        local.depth = max(0, getattr(local, "depth", 0) - 1)
        self._open.pop()  # pop, then look: see the class doc
        if self._resizing:  # only a resize waits for no transaction
            with self._mutex:
                if not self._open:
                    self._cv.notify_all()

    def adopt_new_size(self, env: lmdb.Environment, path: str) -> None:
        """``env.set_mapsize(0)`` (adopt the size another process set) once no
        transaction of this process is open."""
        if getattr(self._mine, "depth", 0) > 0:
            raise StoreOpenError(
                f"the LMDB map of {path} was grown by another process while this thread holds a "
                f"transaction of it; retry the call")
        with self._mutex:
            if self._resizing:  # another thread is adopting it: wait for that, then retry
                while self._resizing:
                    self._cv.wait()
                return
            self._resizing = True  # set, then look at _open: see the class doc
            try:
                while self._open:
                    self._cv.wait()
                env.set_mapsize(0)
            finally:
                self._resizing = False
                self._cv.notify_all()


@overload
def begin_read(shared: _SharedEnv, buffers: Literal[False] = False) -> lmdb.Transaction[bytes]: ...


@overload
def begin_read(shared: _SharedEnv, buffers: Literal[True]) -> lmdb.Transaction[memoryview]: ...


def begin_read(shared: _SharedEnv, buffers: bool = False) -> lmdb.Transaction[Any]:
    """A read transaction of ``shared``'s environment, begun as :class:`_Txn`
    begins one (inside the gate; a map another process grew is adopted)
    but without a context manager: the serving path's lookups, each a
    microsecond cheaper. The caller must end it with :func:`end_read`
    (``try``/``finally``): that also leaves the gate."""
    return _begin(shared, False, buffers)


def _begin(shared: _SharedEnv, write: bool, buffers: bool) -> lmdb.Transaction[Any]:
    """A transaction of ``shared``'s environment begun inside its gate (left
    again if the begin fails); a map another process grew is adopted and the
    begin retried. The caller leaves the gate when the transaction ends."""
    gate = shared.gate
    for _ in range(MAX_MAP_RESIZED_RETRIES):
        gate.enter()
        try:
            return shared.env.begin(write=write, buffers=True) if buffers else shared.env.begin(write=write)
        except lmdb.MapResizedError:
            gate.leave()
            gate.adopt_new_size(shared.env, shared.path)
        except BaseException:
            gate.leave()
            raise
    raise StoreOpenError(f"the LMDB map of {shared.path} keeps growing under this process; retry")


def end_read(shared: _SharedEnv, txn: lmdb.Transaction[Any]) -> None:
    """End a read transaction of :func:`begin_read` (its values, with
    ``buffers``, are invalid from then on) and leave the gate."""
    try:
        txn.abort()
    finally:
        shared.gate.leave()


class _Txn:
    """The context manager of :meth:`_SharedEnv.txn` (a class, not a
    ``contextlib`` generator: every read begins one, and this costs about a
    microsecond less per read)."""

    __slots__ = ("shared", "write", "buffers", "txn")

    def __init__(self, shared: _SharedEnv, write: bool, buffers: bool) -> None:
        self.shared = shared
        self.write = write
        self.buffers = buffers

    def __enter__(self) -> lmdb.Transaction:
        txn = _begin(self.shared, self.write, self.buffers)
        try:
            txn.__enter__()
        except BaseException:
            self.shared.gate.leave()
            raise
        self.txn = txn
        return txn

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.txn.__exit__(exc_type, exc, tb)  # commit, or abort on an exception
        finally:
            self.shared.gate.leave()
