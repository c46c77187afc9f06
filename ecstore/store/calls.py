"""The calls running in one :class:`~ecstore.store.ECStore` handle, so that
``close`` never tears the tiers down under them.

    public call ──► CallGate.enter ──► ... tiers ... ──► CallGate.leave
    close       ──► CallGate.close: refuse new calls, wait for running ones,
                    then the teardown (flush, stop the writers, release LMDB)

Without it, ``close`` in one thread released the LMDB environment while
another thread was inside a read transaction, copying a tensor out of a
memory-mapped blob: the map was unmapped under the copy (a segfault), or the
call met a closed environment (a foreign ``lmdb.Error``).

Guarantees (any thread):

* A call that entered before ``close`` began runs to its end on open tiers;
  a call entering after raises ECStoreError("store is closed").
* Exactly one ``close`` call performs the teardown. A concurrent ``close``
  waits until that teardown finished, then returns (no error, nothing done
  twice) -- unless its thread is itself inside a call of this handle (see
  below): then it returns at once.
* ``close`` called from within a call of the same handle (a callback such as
  a ``chunk_hasher``, in the thread running the call) cannot wait for that
  call: the handle is closing at once (new calls refused), and the teardown
  runs when the last running call returns, in that call's thread (an error it
  raises is logged, not raised into that call).

Cost on the hot path: ``enter``/``leave`` take no lock while the handle is
open: one ``deque.append`` and one ``deque.remove`` (atomic in CPython, also
in free-threaded builds) of the caller's thread id and one flag read each;
the condition is used only once closing began. Correctness (no lost wake-up):
a call publishes itself (append) before it reads the flag, ``close`` sets the
flag before it reads the running calls, and a call that finds the flag set
after removing itself notifies under the condition ``close`` waits on.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from ecstore.errors import ECStoreError

log = logging.getLogger("ecstore")


class CallGate:
    """Counts the running calls of one handle (see the module doc).

    ``enter()`` returns a token to hand to ``leave()``; bracket every public
    call with them (``try``/``finally``). Re-entrant: a call may enter again
    in the same thread (a nested public call) while the handle is open.
    """

    def __init__(self) -> None:
        self._running: deque[int] = deque()  # thread id of each call running (one per nesting level)
        self._cv = threading.Condition()
        self.closing = False  # close() began: new calls are refused
        self.closed = False  # the teardown finished (or failed)
        self._deferred: Callable[[], None] | None = None  # teardown left to the last call to leave
        self.waiting_closers = 0  # close() calls waiting for another one's teardown (diagnostics, tests)

    def enter(self) -> int:
        """Admit a call of the current thread; ECStoreError once closing began."""
        me = threading.get_ident()
        self._running.append(me)
        if self.closing:
            self.leave(me)
            raise ECStoreError("store is closed")
        return me

    def leave(self, me: int) -> None:
        """The call admitted with token ``me`` ended."""
        self._running.remove(me)
        if self.closing:
            self._left_while_closing()

    def _left_while_closing(self) -> None:
        with self._cv:
            if self._running:
                return
            self._cv.notify_all()  # a close() waiting for the running calls
            teardown, self._deferred = self._deferred, None
        if teardown is not None:  # close() was called from within a call: finish it here
            try:
                self._finish(teardown)
            except Exception as e:  # noqa: BLE001 - the call that ends here succeeded
                log.error("ecstore: closing the store failed: %s", e)

    def close(self, teardown: Callable[[], None]) -> None:
        """Refuse new calls, wait for the running ones, then ``teardown()``
        (once per gate; see the module doc for concurrent and re-entrant
        calls). An exception of ``teardown`` propagates; the gate is closed
        anyway."""
        me = threading.get_ident()
        with self._cv:
            inside = me in self._running
            if self.closing:  # another caller performs the teardown
                if not inside:
                    self.waiting_closers += 1
                    self._cv.notify_all()
                    try:
                        self._cv.wait_for(lambda: self.closed)
                    finally:
                        self.waiting_closers -= 1
                return
            self.closing = True
            self._cv.notify_all()
            if inside:  # called from within a call of ours: cannot wait for it
                self._deferred = teardown
                return
            self._cv.wait_for(lambda: not self._running)
        self._finish(teardown)

    def abandon(self) -> None:
        """Mark the gate closed without a teardown (a forked child: the
        parent's threads, and the calls they were running, are gone)."""
        self.closing = self.closed = True

    def _finish(self, teardown: Callable[[], None]) -> None:
        try:
            teardown()
        finally:
            with self._cv:
                self.closed = True
                self._cv.notify_all()
