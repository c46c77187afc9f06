"""A real TCP server on 127.0.0.1 that speaks just enough RESP for redis-py
to connect, then misbehaves: the slow and the hung remotes of the timeout
tests, with counts of what it was sent.

It answers the connection handshake (HELLO, CLIENT ..., AUTH, SELECT, PING)
and then, by ``mode``:

* ``"silent"``: never answers any other command (a server that hangs after
  accepting; unlike a SIGSTOPped redis-server it still reads, so the commands
  that reached it can be counted);
* ``"drip"``: answers GET with a bulk of ``chunks`` KiB sent one KiB every
  ``gap_s`` seconds (a server, or a link, slower than the timeout while every
  single read still returns in time) and anything else with ``+OK``;
* ``"reply"``: answers each command named in ``replies`` (upper case) with
  its raw RESP bytes (e.g. ``{"GET": b":8000000000\r\n"}``: a reply of
  the wrong type) and anything else with ``+OK``;
* ``"trickle"``: the same replies, each sent one byte every ``gap_s``
  seconds (every read returns in time, the whole reply takes long).

``accepted`` counts connections, ``commands`` the commands received (upper
case names). Both are final once :meth:`close` returned: it shuts every
connection and waits for its handler.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from typing import Any

HANDSHAKE = {b"HELLO", b"CLIENT", b"AUTH", b"SELECT", b"PING", b"READONLY"}
HELLO_REPLY = (b"%3\r\n$6\r\nserver\r\n$5\r\nredis\r\n$7\r\nversion\r\n$5\r\n7.0.0\r\n"
               b"$5\r\nproto\r\n:3\r\n")


class FakeRedis:
    def __init__(self, mode: str, *, chunks: int = 20, gap_s: float = 0.25,
                 replies: dict[str, bytes] | None = None) -> None:
        assert mode in ("silent", "drip", "reply", "trickle")
        self.mode, self.chunks, self.gap_s = mode, chunks, gap_s
        self.replies = {k.encode(): v for k, v in (replies or {}).items()}
        self.accepted = 0
        self.commands: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._handlers: list[threading.Thread] = []
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._srv.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> FakeRedis:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting, shut every connection and wait for the handlers."""
        try:
            self._srv.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not)
        except OSError:
            pass
        self._srv.close()
        self._acceptor.join(10)
        with self._lock:
            conns, handlers = list(self._conns), list(self._handlers)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in handlers:
            t.join(10)
        for c in conns:
            c.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            handler = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            with self._lock:
                self.accepted += 1
                self._conns.append(conn)
                self._handlers.append(handler)
            handler.start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while True:
                line = reader.readline()
                if not line.startswith(b"*"):
                    return  # EOF (or not RESP)
                args = []
                for _ in range(int(line[1:])):
                    size = int(reader.readline()[1:])
                    args.append(reader.read(size + 2)[:-2])
                name = args[0].upper()
                with self._lock:
                    self.commands[name.decode()] += 1
                if name == b"HELLO":
                    conn.sendall(HELLO_REPLY)
                elif name in HANDSHAKE:
                    conn.sendall(b"+OK\r\n")
                elif self.mode == "silent":
                    continue
                elif self.mode == "reply":
                    conn.sendall(self.replies.get(name, b"+OK\r\n"))
                elif self.mode == "trickle":
                    for i in range(len(reply := self.replies.get(name, b"+OK\r\n"))):
                        time.sleep(self.gap_s)  # the slowness being simulated, not a synchronisation
                        conn.sendall(reply[i:i + 1])
                elif name == b"GET":
                    self._drip(conn)
                else:
                    conn.sendall(b"+OK\r\n")
        except (OSError, ValueError):
            return
        finally:
            reader.close()

    def _drip(self, conn: socket.socket) -> None:
        conn.sendall(b"$%d\r\n" % (self.chunks * 1024))
        for _ in range(self.chunks):
            time.sleep(self.gap_s)  # the slowness being simulated, not a synchronisation
            conn.sendall(b"x" * 1024)
        conn.sendall(b"\r\n")
