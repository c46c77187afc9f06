"""Operator view of a remote tier: the library behind ``ecstore-dump list|stats|verify redis://...``.

Library functions only (:mod:`ecstore.cli.remote` formats their results).
Reads never change anything; ``verify --delete-bad`` is the one write (values
that fail verification, only if unchanged since read; never a non-string key).
A whole command is bounded by a :class:`TimeBound` (``--timeout``, seconds):
socket operations inside :func:`bounded` and the scans stop at it, raising
:class:`StoppedEarly` (:func:`verify` returns its result so far, with
``stopped_early`` set). Passwords are never printed. Behaviour:
docs/remote.md#inspecting-a-remote-ecstore-dump.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ecstore.errors import CorruptEntryError, ECStoreError
from ecstore.key import parse_key
from ecstore.remote import frame
from ecstore.remote.backend import KEY_PREFIX, RedisBackend, RemoteBadReply, RemoteRefused
from ecstore.remote.deadline import deadline, time_left
from ecstore.remote.url import parse_remote_url, supported_scheme

#: Bytes of each value read by list/stats (frame head + record; more is fetched if needed).
HEAD_BYTES = 4096
SCAN_BATCH = 256


@dataclass(frozen=True)
class RemoteEntryInfo:
    """One remote value as ``list`` shows it (sizes in bytes, times in ns since the epoch)."""

    key: str  # the EC key (without KEY_PREFIX)
    model: str | None
    identifier: str | None  # vLLM's item identifier (without the namespace)
    dtype: str | None
    shape: tuple[int, ...] | None
    value_bytes: int
    created_ns: int | None
    ttl_ms: int | None  # None: no expiry
    error: str | None = None
    namespace: str | None = None  # the encoder identity (None: a value written without one)


class StoppedEarly(ECStoreError):
    """A command's :class:`TimeBound` passed before it finished: what it
    found so far is incomplete. The message says after how long and why."""


@dataclass(frozen=True)
class TimeBound:
    """The bound of one whole command: ``seconds`` from ``start`` (monotonic)."""

    seconds: float
    start: float

    @classmethod
    def starting_now(cls, seconds: float) -> TimeBound:
        return cls(seconds, time.monotonic())

    def passed(self) -> bool:
        return time.monotonic() - self.start >= self.seconds

    def stopped(self, doing: str) -> StoppedEarly:
        return StoppedEarly(f"stopped after {self.seconds:g} s, the bound of the whole command (--timeout), "
                            f"{doing}: the results are incomplete")

    def check(self, doing: str) -> None:
        """Raise :class:`StoppedEarly` if the bound has passed."""
        if self.passed():
            raise self.stopped(doing)


@contextlib.contextmanager
def bounded(bound: TimeBound | None) -> Iterator[None]:
    """Every remote socket operation of this thread inside the block ends at
    ``bound`` (none: unbounded)."""
    if bound is None:
        yield
        return
    with deadline(bound.seconds - (time.monotonic() - bound.start)):
        yield


def is_remote(path: object) -> bool:
    """Does a command-line PATH name a remote (redis://, unix://...)?"""
    return supported_scheme(path)


def connect(url: str, timeout_s: float = 10.0) -> RedisBackend:
    target = parse_remote_url(url, "command line", password=os.environ.get("LMCACHE_EC_REMOTE_PASSWORD"))
    return RedisBackend(target, timeout_s)


def _other_type(backend: RedisBackend, raw_key: bytes) -> str | None:
    """Why ``raw_key`` is no ecstore value if it holds another type than a
    string (None: a string, or gone): ecstore writes only strings."""
    kind = backend.client.type(raw_key)
    kind = kind.decode("utf-8", "replace") if isinstance(kind, bytes) else str(kind)
    if kind in ("string", "none"):
        return None
    return f"a {kind}, not an ecstore value (a string): not ecstore's, left alone"


def _info(raw_key: bytes, head: bytes, size: int, pttl: int, error: str | None = None) -> RemoteEntryInfo:
    key = raw_key.decode("utf-8", "replace")[len(KEY_PREFIX):]
    try:
        model: str | None = parse_key(key).model
    except Exception:  # noqa: BLE001  (a foreign key under our prefix: shown, not fatal)
        model = None
    ttl = None if pttl < 0 else pttl
    if error is not None:
        return RemoteEntryInfo(key, model, None, None, None, size, None, ttl, error)
    try:
        rec = frame.unpack_record(head)
    except CorruptEntryError as e:
        return RemoteEntryInfo(key, model, None, None, None, size, None, ttl, str(e))
    return RemoteEntryInfo(key, model, rec.mm_identifier, rec.dtype, rec.shape, size, rec.created_ns, ttl,
                           namespace=rec.namespace)


def iter_entries(backend: RedisBackend, bound: TimeBound | None = None) -> Iterator[RemoteEntryInfo]:
    """Every ecstore value on the server (SCAN; a few KiB read per value),
    each key once. A server that cannot be reached or fails raises
    RemoteUnavailable / RemoteRefused (ECStoreErrors), as every function
    here does; past ``bound``, :class:`StoppedEarly` (after the values
    yielded so far). Call it inside :func:`bounded` (``bound``)."""
    with _client_errors(backend, bound, "while scanning the keys"):
        yield from _iter_entries(backend, bound)


@contextlib.contextmanager
def _client_errors(backend: RedisBackend, bound: TimeBound | None = None, doing: str = "") -> Iterator[None]:
    """The redis client's errors inside the block as the ECStoreError they
    stand for (:meth:`RedisBackend.error_of`); ECStoreErrors pass as they
    are. Any failure once ``bound`` has passed (a socket operation cut at it)
    is :class:`StoppedEarly`."""
    try:
        yield
    except StoppedEarly:
        raise
    except Exception as e:  # noqa: BLE001  (the client's errors)
        left = time_left()
        if bound is not None and (bound.passed() or (left is not None and left <= 0)):
            raise bound.stopped(doing) from None
        if isinstance(e, ECStoreError):
            raise
        raise backend.error_of(e) from None


def _scan(backend: RedisBackend, bound: TimeBound | None, doing: str) -> Iterator[bytes]:
    """The keys under KEY_PREFIX, each once (SCAN may return a key more
    than once), checking ``bound`` at each."""
    seen: set[bytes] = set()
    for k in backend.client.scan_iter(match=KEY_PREFIX + "*", count=1000):
        if bound is not None:
            bound.check(f"{doing} ({len(seen)} keys seen)")
        if k not in seen:
            seen.add(k)
            yield k


def _iter_entries(backend: RedisBackend, bound: TimeBound | None) -> Iterator[RemoteEntryInfo]:
    client = backend.client
    batch: list[bytes] = []

    def flush() -> Iterator[RemoteEntryInfo]:
        pipe = client.pipeline(transaction=False)
        for k in batch:
            pipe.getrange(k, 0, HEAD_BYTES - 1)
            pipe.strlen(k)
            pipe.pttl(k)
        res = pipe.execute(raise_on_error=False)  # a key of another type fails alone
        for i, k in enumerate(batch):
            head, size, pttl = res[3 * i: 3 * i + 3]
            failed = next((x for x in (head, size, pttl) if isinstance(x, Exception)), None)
            if failed is not None:
                other = _other_type(backend, k)
                if other is None:
                    raise failed  # not a WRONGTYPE: the server's error (the caller maps it)
                yield _info(k, b"", 0, pttl if isinstance(pttl, int) else -1, other)
                continue
            if size == 0:
                continue  # evicted or deleted since the scan
            if size > len(head) and frame.record_end(head) > len(head):
                head = client.getrange(k, 0, frame.record_end(head) - 1)
            yield _info(k, head, size, pttl)
        batch.clear()

    for k in _scan(backend, bound, "while scanning the keys"):
        batch.append(k)
        if len(batch) >= SCAN_BATCH:
            yield from flush()
    if batch:
        yield from flush()


def server_info(backend: RedisBackend, bound: TimeBound | None = None) -> dict[str, Any]:
    """Memory, eviction policy and eviction counters of the server (INFO)."""
    info: dict[str, Any] = {}
    with _client_errors(backend, bound, "while reading the server's INFO"):
        if bound is not None:
            bound.check("before reading the server's INFO")
        client = backend.client
        raw = client.info(target_nodes=client.PRIMARIES) if backend.is_cluster else client.info()
    # Every master answers, by node name; one node's answer alone comes flat
    # (a single master; the default target, a random node, always did).
    per_node = bool(raw) and all(isinstance(v, dict) for v in raw.values())
    nodes = list(raw.values()) if backend.is_cluster and per_node else [raw]
    for node in nodes:
        for field in ("redis_version", "maxmemory_policy"):
            info.setdefault(field, node.get(field))
        for field in ("used_memory", "maxmemory", "evicted_keys", "expired_keys", "keyspace_hits",
                      "keyspace_misses"):
            info[field] = info.get(field, 0) + int(node.get(field, 0) or 0)
    return info


@dataclass
class VerifyResult:
    """What :func:`verify` found: values checked, bad ones (key, error),
    deleted, vanished meanwhile, and kept: bad keys ``delete_bad`` left
    alone (keys of another type than a string, not ecstore's; keys whose
    ``GET`` reply was no string)."""

    checked: int = 0
    bad: list[dict[str, str]] | None = None
    deleted: int = 0
    vanished: int = 0
    kept: int = 0
    stopped_early: str | None = None  # why it did not finish (its bound passed); None: it did


def verify(backend: RedisBackend, *, delete_bad: bool = False, bound: TimeBound | None = None) -> VerifyResult:
    """Read every value in full and check it as the remote tier does
    (:func:`frame.check_value`: framing, record, checksum, header, shape)
    and against its key. A key of another type than a string is bad and
    never deleted: ecstore did not write it; so is one whose ``GET``
    reply is no string (:class:`RemoteBadReply`). Past ``bound``: what was found
    so far, ``stopped_early`` saying so. Call it inside :func:`bounded`."""
    result = VerifyResult(bad=[])
    try:
        with _client_errors(backend, bound, "while reading the values"):
            _verify(backend, delete_bad, bound, result)
    except StoppedEarly as e:
        result.stopped_early = str(e)
    return result


def _verify(backend: RedisBackend, delete_bad: bool, bound: TimeBound | None, result: VerifyResult) -> None:
    assert result.bad is not None
    for k in _scan(backend, bound, "while reading the values"):
        key = k.decode("utf-8", "replace")[len(KEY_PREFIX):]
        try:
            value = backend.get(key)
        except RemoteBadReply as e:  # not a bulk string: this key is unreadable, the others may not be
            result.checked += 1
            result.bad.append({"key": key, "error": f"{e}: unreadable, left alone"})
            result.kept += delete_bad
            continue
        except RemoteRefused:
            other = _other_type(backend, k)
            if other is None:
                raise  # not a WRONGTYPE
            result.checked += 1
            result.bad.append({"key": key, "error": other})
            result.kept += delete_bad
            continue
        if value is None:
            result.vanished += 1
            continue
        result.checked += 1
        try:
            frame.check_value(value, key=key)  # the check every remote read runs, and the key
        except CorruptEntryError as e:
            result.bad.append({"key": key, "error": str(e)})
            if delete_bad and _delete_if_unchanged(backend, k, key, value):
                result.deleted += 1


def _delete_if_unchanged(backend: RedisBackend, raw_key: bytes, key: str, value: bytes | memoryview) -> bool:
    """``backend.delete_if_unchanged``; False, not an error, for a key whose
    type changed since it was read (the script's STRLEN fails on it)."""
    try:
        return backend.delete_if_unchanged(key, value)
    except RemoteRefused:
        if _other_type(backend, raw_key) is None:
            raise
        return False
