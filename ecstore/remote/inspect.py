"""Operator view of a remote tier: the library behind ``ecstore-dump list|stats|verify redis://...``.

Library functions only (no argparse, no printing: :mod:`ecstore.cli.remote`
formats their results). Reads
never change anything; ``verify --delete-bad`` is the one write (it removes
values that fail verification, only if unchanged since they were read).

The password comes from the URL, else ``LMCACHE_EC_REMOTE_PASSWORD``; it is
never printed (URLs are shown masked).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .. import blob_check
from ..codec import CorruptBlobError
from ..errors import ECStoreError
from ..key import parse_key
from . import frame
from .backend import KEY_PREFIX, RedisBackend
from .url import parse_remote_url, supported_scheme

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


def is_remote(path: object) -> bool:
    """Does a command-line PATH name a remote (redis://, unix://...)?"""
    return supported_scheme(path)


def connect(url: str, timeout_s: float = 10.0) -> RedisBackend:
    target = parse_remote_url(url, "command line", password=os.environ.get("LMCACHE_EC_REMOTE_PASSWORD"))
    return RedisBackend(target, timeout_s)


def _info(raw_key: bytes, head: bytes, size: int, pttl: int) -> RemoteEntryInfo:
    key = raw_key.decode("utf-8", "replace")[len(KEY_PREFIX):]
    try:
        model: str | None = parse_key(key).model
    except Exception:  # noqa: BLE001  (a foreign key under our prefix: shown, not fatal)
        model = None
    ttl = None if pttl < 0 else pttl
    try:
        rec = frame.unpack_record(head)
    except CorruptBlobError as e:
        return RemoteEntryInfo(key, model, None, None, None, size, None, ttl, str(e))
    return RemoteEntryInfo(key, model, rec.mm_identifier, rec.dtype, rec.shape, size, rec.created_ns, ttl,
                           namespace=rec.namespace)


def iter_entries(backend: RedisBackend) -> Iterator[RemoteEntryInfo]:
    """Every ecstore value on the server (SCAN; a few KiB read per value).
    A server that cannot be reached or fails raises RemoteUnavailable /
    RemoteRefused (ECStoreErrors), as every function here does."""
    with _client_errors(backend):
        yield from _iter_entries(backend)


@contextlib.contextmanager
def _client_errors(backend: RedisBackend) -> Iterator[None]:
    """The redis client's errors inside the block as the ECStoreError they
    stand for (:meth:`RedisBackend.error_of`); ECStoreErrors pass as they are."""
    try:
        yield
    except ECStoreError:
        raise
    except Exception as e:  # noqa: BLE001  (the client's errors)
        raise backend.error_of(e) from None


def _iter_entries(backend: RedisBackend) -> Iterator[RemoteEntryInfo]:
    client = backend.client
    batch: list[bytes] = []

    def flush() -> Iterator[RemoteEntryInfo]:
        pipe = client.pipeline(transaction=False)
        for k in batch:
            pipe.getrange(k, 0, HEAD_BYTES - 1)
            pipe.strlen(k)
            pipe.pttl(k)
        res = pipe.execute()
        for i, k in enumerate(batch):
            head, size, pttl = res[3 * i: 3 * i + 3]
            if size == 0:
                continue  # evicted or deleted since the scan
            if size > len(head) and frame.record_end(head) > len(head):
                head = client.getrange(k, 0, frame.record_end(head) - 1)
            yield _info(k, head, size, pttl)
        batch.clear()

    for k in client.scan_iter(match=KEY_PREFIX + "*", count=1000):
        batch.append(k)
        if len(batch) >= SCAN_BATCH:
            yield from flush()
    if batch:
        yield from flush()


def server_info(backend: RedisBackend) -> dict[str, Any]:
    """Memory, eviction policy and eviction counters of the server (INFO)."""
    info: dict[str, Any] = {}
    with _client_errors(backend):
        raw = backend.client.info()
    nodes = raw.values() if backend.is_cluster else [raw]  # a cluster answers per node
    for node in nodes:
        for field in ("redis_version", "maxmemory_policy"):
            info.setdefault(field, node.get(field))
        for field in ("used_memory", "maxmemory", "evicted_keys", "expired_keys", "keyspace_hits",
                      "keyspace_misses"):
            info[field] = info.get(field, 0) + int(node.get(field, 0) or 0)
    return info


@dataclass
class VerifyResult:
    """What :func:`verify` found: values checked, bad ones (key, error), deleted, vanished meanwhile."""

    checked: int = 0
    bad: list[dict[str, str]] | None = None
    deleted: int = 0
    vanished: int = 0


def verify(backend: RedisBackend, *, delete_bad: bool = False) -> VerifyResult:
    """Read every value in full and check framing, record, checksum and header."""
    with _client_errors(backend):
        return _verify(backend, delete_bad)


def _verify(backend: RedisBackend, delete_bad: bool) -> VerifyResult:
    result = VerifyResult(bad=[])
    assert result.bad is not None
    for k in backend.client.scan_iter(match=KEY_PREFIX + "*", count=1000):
        key = k.decode("utf-8", "replace")[len(KEY_PREFIX):]
        value = backend.get(key)
        if value is None:
            result.vanished += 1
            continue
        result.checked += 1
        try:
            rec, blob = frame.unpack(value)
            blob_check.check_entry(rec, blob, key=key)  # the entry check every read runs
        except CorruptBlobError as e:
            result.bad.append({"key": key, "error": str(e)})
            if delete_bad and backend.delete_if_unchanged(key, value):
                result.deleted += 1
    return result
