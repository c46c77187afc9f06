"""Handles still open when the interpreter exits are closed then.

A handle with a disk or remote tier writes in the background; its pending
puts used to be lost with the process when the caller forgot ``close`` (the
writer is a daemon thread), and a writer stopped inside a torch call at
finalization could abort the interpreter. :func:`track` keeps such a handle
(a strong reference: its writer holds its tiers anyway) until its ``close``
calls :func:`forget`; at exit (``atexit``: after non-daemon threads were
joined, before the buffer pool's thread stops) each one left is closed, as
``close`` would, errors logged. Thread-safe; a forked child closes nothing
of its parent's (``close`` there only marks the handle closed).
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Protocol

import ecstore.pool  # noqa: F401 - registers its atexit hook first, so it runs after close_all

log = logging.getLogger("ecstore")


class _Closable(Protocol):
    def close(self) -> None: ...


_open: dict[int, _Closable] = {}
_lock = threading.Lock()


def track(handle: _Closable) -> None:
    """Close ``handle`` at exit unless :func:`forget` is called first."""
    with _lock:
        _open[id(handle)] = handle


def forget(handle: _Closable) -> None:
    """``handle`` is closed (or closing): nothing to do for it at exit."""
    with _lock:
        _open.pop(id(handle), None)


def tracked() -> int:
    """How many handles would be closed at exit now (tests, diagnostics)."""
    return len(_open)


#: How long the exit waits for the handles left open to close (seconds):
#: past it the process exits anyway (what was still pending is lost, logged).
EXIT_CLOSE_SECONDS = 120.0


def close_all(timeout: float = EXIT_CLOSE_SECONDS) -> bool:
    """Close every tracked handle, on a thread of its own, waiting up to
    ``timeout`` seconds (an exit must not hang on a handle whose call never
    returns); whether all closed in time. Registered with ``atexit``."""
    with _lock:
        left = list(_open.values())
        _open.clear()
    return close_handles(left, timeout)


def close_handles(left: list[_Closable], timeout: float) -> bool:
    """:func:`close_all`'s work for ``left``."""
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
    except RuntimeError:  # no new thread this late: close here, unbounded
        run()
        return True
    closer.join(timeout)
    if closer.is_alive():
        log.error("ecstore: %d store handle(s) left open did not close within %.0f s of the exit; "
                  "their pending puts may be lost (close stores before exiting)", len(left), timeout)
        return False
    return True


atexit.register(close_all)
