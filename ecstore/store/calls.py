"""The calls running in one :class:`~ecstore.store.ECStore` handle, so that
``close`` never tears the tiers down under them.

Guarantees (any thread): a call that entered before ``close`` began runs to
its end on open tiers; a call entering after raises ECStoreError("store is
closed"). Exactly one ``close`` performs the teardown; a concurrent one waits
for it, unless its thread is inside a call of this handle (then the teardown
runs when the last running call returns, in that call's thread, an error it
raises logged). No lock on the hot path while the handle is open; how that
stays correct is in docs/architecture.md ("The handle's close").
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
