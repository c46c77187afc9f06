"""Whole-call deadlines for redis-py connections.

A thread sets a deadline (:func:`deadline`, monotonic seconds) around one
remote call; every socket operation of that thread on a
:func:`deadline_class` connection (connect, TLS handshake, send, every chunk
of the reply) waits at most until then, and each byte moved extends it by
``1 /`` :data:`MIN_RATE_BYTES_PER_S` seconds. Per thread; without a deadline
connections behave as plain redis-py ones. Design and cost:
docs/architecture.md#remote-calls; what users see: docs/remote.md.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any


class _Local(threading.local):
    at: float | None = None  # the thread's deadline (monotonic seconds), None: none


_local = _Local()
_monotonic = time.monotonic


class Deadline:
    """Bound the remote calls this thread makes inside the ``with`` block to
    ``seconds`` from entering it, together (an enclosing deadline that ends
    sooner wins). A class, not a generator: it is on every remote call."""

    __slots__ = ("seconds", "_previous")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._previous: float | None = None

    def __enter__(self) -> None:
        previous = self._previous = _local.at
        at = _monotonic() + self.seconds
        _local.at = at if previous is None or at < previous else previous

    def __exit__(self, *exc: object) -> None:
        _local.at = self._previous


def time_left() -> float | None:
    """Seconds until the calling thread's deadline (may be <= 0), None if none."""
    at = _local.at
    return None if at is None else at - _monotonic()


#: Each byte a call moves extends its deadline by 1 / this many seconds
#: (bytes per second): the slowest transfer rate a call is allowed beyond
#: ``remote_timeout_seconds``.
MIN_RATE_BYTES_PER_S = 64 << 20


def _moved(n: int) -> None:
    """``n`` bytes moved: extend the calling thread's deadline, if any."""
    at = _local.at
    if at is not None and n > 0:
        _local.at = at + n / MIN_RATE_BYTES_PER_S


#: An operation ends at most this long after the deadline (or times out at
#: most this long before it): the socket's timeout is set again only when
#: it is off by more (seconds).
SLACK_S = 0.002


def _expired() -> socket.timeout:
    return TimeoutError("the remote call's deadline (remote_timeout_seconds) passed")


class DeadlineSocket:
    """A socket (plain or TLS) whose reads and writes stop at the calling
    thread's deadline. Everything else is the wrapped socket's.

    ``settimeout``/``gettimeout`` keep the timeout redis-py asked for; each
    operation applies the smaller of that and the time left, to within
    :data:`SLACK_S` (so that back-to-back operations cost no ``settimeout``
    system call each).
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._timeout: float | None = sock.gettimeout()  # what redis-py asked for
        self._real = self._timeout  # what the socket has now
        self._pending: Callable[[], int] | None = getattr(sock, "pending", None)  # TLS only

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    # Asked on every pooled connection's check: defined here, not looked up.
    def fileno(self) -> int:
        return self._sock.fileno()

    def pending(self) -> int:
        """Decrypted bytes buffered above the socket (TLS), else 0."""
        return 0 if self._pending is None else self._pending()

    def settimeout(self, value: float | None) -> None:
        self._sock.settimeout(value)
        self._timeout = self._real = value

    def gettimeout(self) -> float | None:
        return self._timeout

    def _set(self, value: float | None) -> None:
        self._sock.settimeout(value)
        self._real = value

    def _arm(self, grant: int = 0) -> None:
        """Set the real socket's timeout for one operation (raises
        socket.timeout once the deadline passed, unless non-blocking).
        ``grant``: bytes the operation moves as a whole (``sendall``), whose
        time at MIN_RATE_BYTES_PER_S extends both the deadline and the
        socket's own timeout for it (Python bounds a whole ``sendall`` by
        that timeout)."""
        at = _local.at
        wanted = self._timeout
        if at is None or wanted == 0:
            if self._real != wanted:
                self._set(wanted)
            return
        left = at - _monotonic()
        if left <= 0:
            raise _expired()
        if grant > 0:
            _moved(grant)
            extra = grant / MIN_RATE_BYTES_PER_S
            left += extra
            if wanted is not None:
                wanted += extra
        target = wanted if wanted is not None and wanted <= left else left
        real = self._real
        if real is None or real == 0 or abs(real - target) > SLACK_S:
            self._set(target)

    # The optional arguments are passed on only when given: an SSL socket
    # reads ``recv_into(buf, 0)`` as "read 0 bytes".
    def recv(self, bufsize: int, *flags: int) -> bytes:
        self._arm()
        data = self._sock.recv(bufsize, *flags)
        _moved(len(data))
        return data

    def recv_into(self, buffer: Any, *args: int) -> int:
        self._arm()
        n = self._sock.recv_into(buffer, *args)
        _moved(n)
        return n

    def send(self, data: Any, *flags: int) -> int:
        self._arm()
        n = self._sock.send(data, *flags)
        _moved(n)
        return n

    def sendall(self, data: Any, *flags: int) -> None:
        # Python bounds a whole sendall by the timeout set before it: what
        # it may take at MIN_RATE_BYTES_PER_S is granted up front (once the
        # deadline has passed, nothing is granted: it fails at once).
        self._arm(grant=memoryview(data).nbytes)
        self._sock.sendall(data, *flags)


_CLASSES: dict[type, type] = {}
_CLASSES_LOCK = threading.Lock()


def deadline_class(base: type) -> type:
    """A subclass of the redis-py connection class ``base`` (``Connection``,
    ``SSLConnection``, ``UnixDomainSocketConnection``) whose sockets are
    :class:`DeadlineSocket` and whose connect is cut to the deadline."""
    with _CLASSES_LOCK:
        cls = _CLASSES.get(base)
        if cls is None:
            cls = type(f"Deadline{base.__name__}", (base,), {"_connect": _connect_of(base)})
            _CLASSES[base] = cls
        return cls


def _connect_of(base: Any) -> Callable[[Any], DeadlineSocket]:
    """The ``_connect`` of :func:`deadline_class` (``base``): the base's,
    with its connect timeout and the socket timeout of the TLS handshake
    that follows cut to the time left; the socket wrapped."""
    def _connect(self: Any) -> DeadlineSocket:
        left = time_left()
        if left is None:
            return DeadlineSocket(base._connect(self))
        if left <= 0:
            raise _expired()
        connect_s, timeout_s = self.socket_connect_timeout, self.socket_timeout
        if connect_s is None or left < connect_s:
            self.socket_connect_timeout = left
        if timeout_s is None or left < timeout_s:
            self.socket_timeout = left
        try:
            sock = DeadlineSocket(base._connect(self))
        finally:
            self.socket_connect_timeout, self.socket_timeout = connect_s, timeout_s
        sock.settimeout(timeout_s)  # later operations: cut by _arm
        return sock
    return _connect


#: ``with deadline(seconds):`` reads as the call it is.
deadline = Deadline
