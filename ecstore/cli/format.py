"""Output helpers of ``ecstore-dump``: escaping, sizes, ages, tables, JSON, progress.

Everything writes to ``sys.stdout`` (results) or ``sys.stderr`` (errors,
warnings, the progress bar); nothing here reads a store.
"""

from __future__ import annotations

import datetime as _dt
import json
import shlex
import sys
import time
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from ecstore.cli.exitcodes import PROG, OutputError
from ecstore.maintenance import key_bytes


def one_line(text: str) -> str:
    """``text`` on one line (newlines and carriage returns become spaces)."""
    return " ".join(str(text).split("\n")).replace("\r", " ")


def printable(text: str) -> str:
    """``text`` with control characters escaped (identifiers may hold any)
    and bytes that were not UTF-8 (surrogate escapes) shown as ``\\xNN``."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else escape_char(c) for c in text)


def escape_char(c: str) -> str:
    """One character as an escape: ``\\xNN`` for a non-UTF-8 byte, else Python's escape."""
    if 0xDC80 <= ord(c) <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{ord(c) - 0xDC00:02x}"
    return c.encode("unicode_escape").decode("ascii")


def json_key(key: str) -> str:
    """A key for JSON output: bytes that are not UTF-8 shown as ``\\xNN``
    (``key_hex`` then carries the exact bytes)."""
    return key if is_utf8(key) else "".join(
        escape_char(c) if 0xDC80 <= ord(c) <= 0xDCFF else c for c in key)


def is_utf8(key: str) -> bool:
    """Is ``key`` valid UTF-8 (no surrogate-escaped bytes)?"""
    try:
        key.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def shell_arg(text: str) -> str:
    """``text`` quoted for a POSIX shell; non-UTF-8 bytes as ``$'\\xNN'``."""
    if is_utf8(text) and text.isprintable():
        return shlex.quote(text)
    return "$'" + "".join(
        f"\\x{b:02x}" if b < 0x20 or b >= 0x7F or chr(b) in "'\\" else chr(b) for b in key_bytes(text)) + "'"


def err(message: str) -> None:
    """``ecstore-dump: error: MESSAGE`` on stderr, one line."""
    sys.stderr.write(f"{PROG}: error: {one_line(message)}\n")
    sys.stderr.flush()


def warn(message: str) -> None:
    """``ecstore-dump: warning: MESSAGE`` on stderr, one line."""
    sys.stderr.write(f"{PROG}: warning: {one_line(message)}\n")
    sys.stderr.flush()


def n_entries(n: int) -> str:
    """``"1 entry"`` / ``"N entries"``."""
    return f"{n} entry" if n == 1 else f"{n} entries"


def write_out(text: str) -> None:
    """``text`` on stdout; a failure to write it (a full disk, an I/O error)
    is an :class:`OutputError` (BrokenPipeError passes: a reader that went
    away, e.g. ``| head``, is no error)."""
    try:
        sys.stdout.write(text)
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OutputError(e) from None


def write_binary_out(data: Any) -> None:
    """Bytes on stdout (``export -``), flushed; failures as :func:`write_out`."""
    try:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OutputError(e) from None


def note(message: str) -> None:
    """A line of results on stderr (when stdout carries data: ``export -``)."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def flush_out() -> None:
    """Flush stdout (what is buffered is written here, not at exit): as :func:`write_out`."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OutputError(e) from None


def out(line: str = "") -> None:
    """One line of results on stdout."""
    write_out(line + "\n")


def json_out(obj: Any) -> None:
    """``obj`` as indented JSON on stdout."""
    write_out(json.dumps(obj, indent=2) + "\n")


def human_size(n: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units, like the GiB of the config)."""
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    v = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        v /= 1024
        if v < 1024 or unit == "PiB":
            return f"{v:.1f} {unit}"
    raise AssertionError("unreachable")


def human_age(ns: int | None, now_ns: int) -> str:
    """How long before ``now_ns`` the instant ``ns`` was: ``"3m ago"``."""
    if ns is None:
        return "?"
    s = (now_ns - ns) / 1e9
    if s < 0:
        return "in future"
    for limit, div, unit in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h"),
                             (7 * 86400, 86400, "d"), (float("inf"), 7 * 86400, "w")):
        if s < limit:
            return f"{int(s // div)}{unit} ago"
    raise AssertionError("unreachable")


def iso(ns: int | None) -> str | None:
    """Nanoseconds since the epoch -> ISO 8601 UTC, microsecond precision."""
    if ns is None:
        return None
    sec, rest = divmod(int(ns), 10**9)
    t = _dt.datetime.fromtimestamp(sec, tz=_dt.UTC) + _dt.timedelta(microseconds=rest // 1000)
    return t.isoformat(timespec="microseconds")


def print_table(headers: Sequence[str], rows: Iterable[Sequence[str]], right: AbstractSet[int] = frozenset()) -> None:
    """A left-aligned text table on stdout; columns in ``right`` are right-aligned."""
    rows = [list(r) for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))

    def fmt(cells: Sequence[str]) -> str:
        parts = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)]
        return "  ".join(parts).rstrip()

    out(fmt(headers))
    for r in rows:
        out(fmt(r))


def isatty(stream: Any) -> bool:
    """Is ``stream`` a terminal (False for anything that cannot tell)?"""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal.

    Redrawn at most every 0.1 s; cleared on close. Piped output never sees it.
    """

    WIDTH = 28

    def __init__(self, label: str, total: int | None, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = isatty(self.stream)
        self.label = label
        self.total = total
        self.done = 0
        self._last_draw = 0.0
        self._width = 0
        if self.enabled:
            self._draw()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.enabled and (time.monotonic() - self._last_draw >= 0.1 or self.done == self.total):
            self._draw()

    def _draw(self) -> None:
        if self.total:
            frac = min(1.0, self.done / self.total)
            fill = int(frac * self.WIDTH)
            text = (f"{self.label} [{'#' * fill}{'.' * (self.WIDTH - fill)}] "
                    f"{self.done}/{self.total} {frac * 100:3.0f}%")
        else:
            text = f"{self.label} {self.done}"
        self._width = max(self._width, len(text))
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._last_draw = time.monotonic()

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0

