"""Handles still open when the interpreter exits are closed then.

A handle with a disk or remote tier writes in the background; its pending
puts used to be lost with the process when the caller forgot ``close`` (the
writer is a daemon thread), and a writer stopped inside a torch call at
finalization could abort the interpreter. :func:`track` holds the handle
weakly and its background part (writer, LMDB and remote tiers: what its
threads hold anyway, not the memory tier) strongly, until its ``close``
calls :func:`forget`. At exit (``atexit``: after non-daemon threads were
joined, before the buffer pool's thread stops) each one left is closed on a
thread of its own, waiting at most :data:`EXIT_CLOSE_SECONDS`: a handle
still alive as ``close`` would, one dropped without ``close`` through its
background part. Where no thread can start at exit (Python 3.12) the closes
run in the exiting thread, unbounded. Thread-safe; a forked child forgets
its parent's handles (their ``close`` there would only mark them closed).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Protocol

import ecstore.pool  # noqa: F401 - registers its atexit hook first, so it runs after close_all

log = logging.getLogger("ecstore")

#: How long the exit waits for the handles left open to close (seconds):
#: past it the process exits anyway (what was still pending is lost, logged).
EXIT_CLOSE_SECONDS = 120.0


class Closable(Protocol):
    def close(self) -> None: ...


@dataclass
class _Left:
    handle: weakref.ref[Closable]
    background: Closable
    closed: bool = False  # the handle's own close began (forget), or the background was closed

    def close(self) -> None:
        handle = self.handle()
        if handle is not None:
            handle.close()  # idempotent; waits for a close running in another thread
        elif not self.closed:
            self.closed = True
            self.background.close()


_open: dict[int, _Left] = {}  # by token, until the handle's close calls forget
_tokens = itertools.count()
_lock = threading.Lock()


def track(handle: Closable, background: Closable) -> int:
    """Close ``handle`` at exit (``background``, once the handle is
    garbage) unless :func:`forget` gets the returned token first."""
    token = next(_tokens)
    with _lock:
        _open[token] = _Left(weakref.ref(handle), background)
    return token


def forget(token: int) -> None:
    """The handle of ``token`` is closed (or closing): nothing to do for it at exit."""
    with _lock:
        left = _open.pop(token, None)
        if left is not None:
            left.closed = True


def tracked() -> int:
    """How many handles would be closed at exit now (tests, diagnostics)."""
    return len(_open)


def close_all(timeout: float | None = None) -> bool:
    """Close every tracked handle, waiting up to ``timeout`` seconds (None:
    :data:`EXIT_CLOSE_SECONDS`); whether all closed in time. Registered with
    ``atexit``."""
    with _lock:
        left: list[Closable] = list(_open.values())  # kept in _open: a close meanwhile still marks its entry
    return close_handles(left, EXIT_CLOSE_SECONDS if timeout is None else timeout)


def close_handles(left: list[Closable], timeout: float) -> bool:
    """:func:`close_all`'s work for ``left``, on a thread of its own (an exit
    must not hang on a handle whose close never returns)."""
    if not left:
        return True
    log.debug("ecstore: closing %d store handle(s) left open at exit", len(left))

    def run() -> None:
        for handle in left:
            try:
                handle.close()
            except Exception as e:  # noqa: BLE001 - one handle's failure must not keep the others open
                log.error("ecstore: closing a store left open at exit failed: %s", e)
    closer = threading.Thread(target=run, name="ecstore-exit-close", daemon=True)
    try:
        closer.start()
    except RuntimeError:  # no new thread this late (Python 3.12): close here, unbounded
        run()
        return True
    closer.join(timeout)
    if closer.is_alive():
        log.error("ecstore: %d store handle(s) left open did not close within %.0f s of the exit; "
                  "their pending puts may be lost (close stores before exiting)", len(left), timeout)
        return False
    return True


def _forget_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it
    _open.clear()


os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(close_all)
