"""Read one RESP reply to ``GET`` from a socket straight into reused memory.

:func:`read_bulk` accepts exactly a bulk string or a null (RESP2 or RESP3)
and nothing after it, receiving the value in one pass into a buffer of
:data:`ecstore.pool.POOL`; anything else raises (an error line as redis-py's
exception, any other reply :class:`BadReply`, nothing allocated) and the
caller must drop the connection. One call per connection at a time; the
socket's deadline is the caller's (:mod:`ecstore.remote.deadline`). Details:
docs/architecture.md#remote-calls.
"""

from __future__ import annotations

from typing import Any

from ecstore.pool import POOL

#: The first receive of a reply: its header line and, for a small value, all
#: of it (the part after the header is copied once into the value's buffer).
FIRST_READ_BYTES = 64 * 1024
#: The longest header or error line accepted (bytes).
MAX_LINE_BYTES = FIRST_READ_BYTES
#: A bulk length above this is a bad reply, nothing allocated for it (bytes;
#: redis-server stores at most ``proto-max-bulk-len``, 512 MB by default).
MAX_VALUE_BYTES = 16 << 30


class BadReply(Exception):
    """A reply that is not a bulk string or the null bulk."""


def read_bulk(sock: Any, parse_error: Any, closed: type[Exception]) -> memoryview | None:
    """The value of a bulk reply read from ``sock`` (a writable memoryview of
    ``len`` bytes over a buffer of its own), None for a null.

    ``parse_error(text)``: the exception an error line stands for (raised);
    ``closed``: the exception class raised when the server closed the
    connection. Raises :class:`BadReply` for any other reply."""
    head = bytearray(FIRST_READ_BYTES)
    hv = memoryview(head)
    got = 0
    while True:
        n = sock.recv_into(hv[got:])
        if not n:
            raise closed("Connection closed by server.")
        scan_from = max(0, got - 1)
        got += n
        eol = head.find(b"\r\n", scan_from, got)
        if eol >= 0:
            break
        if got >= MAX_LINE_BYTES:
            raise BadReply(f"no reply line in its first {MAX_LINE_BYTES} bytes")
    kind, line = head[0:1], bytes(hv[1:eol])
    start = eol + 2
    if kind == b"-":
        if got != start:
            raise BadReply("bytes after an error reply")
        raise parse_error(line.decode("utf-8", "replace"))
    if kind == b"_" and eol == 1:  # RESP3's null
        if got != start:
            raise BadReply("bytes after a null reply")
        return None
    if kind != b"$":
        raise BadReply(f"{_KINDS.get(bytes(kind), 'a malformed')} reply, not a string")
    try:
        size = int(line)
    except ValueError:
        raise BadReply(f"a bulk length {line[:32]!r} that is no number") from None
    if size == -1:
        if got != start:
            raise BadReply("bytes after a null reply")
        return None
    if size < 0 or size > MAX_VALUE_BYTES:
        raise BadReply(f"a bulk length {size} out of range (at most {MAX_VALUE_BYTES})")
    value = memoryview(POOL.buffer(size)).cast("B") if size else memoryview(bytearray(0))  # type: ignore[arg-type]  # ndarray: a buffer
    have = min(got - start, size)
    value[:have] = hv[start:start + have]
    tail = hv[start + have:got]  # bytes after the value already received (its \r\n)
    while have < size:
        n = sock.recv_into(value[have:])
        if not n:
            raise closed("Connection closed by server.")
        have += n
    end = bytearray(tail)
    while len(end) < 2:
        more = sock.recv(2 - len(end))
        if not more:
            raise closed("Connection closed by server.")
        end += more
    if end != b"\r\n":
        raise BadReply("a string not ended by \\r\\n, or bytes after it")
    return value


_KINDS = {b"+": "a status", b":": "an integer", b"*": "an array", b"_": "a malformed null (RESP3)",
          b"%": "a map (RESP3)", b">": "a push (RESP3)", b"~": "a set (RESP3)", b",": "a double (RESP3)",
          b"#": "a boolean (RESP3)", b"!": "a blob error (RESP3)", b"=": "a verbatim string (RESP3)",
          b"(": "a big number (RESP3)", b"|": "an attribute (RESP3)"}
