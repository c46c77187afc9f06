"""The remote tier against a real redis-server (started per test on 127.0.0.1).

Stores A and B have their own ``local_disk`` and share one Redis: what A puts
B finds, verified and promoted to B's LMDB. Failures of the remote are misses,
never errors; the circuit breaker is driven with a fake clock (no sleeps).
"""

from __future__ import annotations

import io
import logging
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from conftest import HEALTHY_REMOTE_TIMEOUT_S, gib
from helpers.tensors import make_tensor, same_tensor

from ecstore import ECStore
from ecstore.cli import main as dump_main
from ecstore.config import ECStoreConfig
from ecstore.remote.backend import KEY_PREFIX
from ecstore.remote.breaker import BreakerState
from ecstore.remote.writer import WriteQueue
from ecstore.testing.redis_server import CLUSTER_BUS_OFFSET, RedisServer, free_port
from ecstore.testing.stores import open_store_with_remote_clock

MODEL = "org/tiny-vlm"
DTYPE = torch.bfloat16


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def cfg(tmp_path: Path, name: str, url: str | None, **kw) -> ECStoreConfig:
    """A store's config; ``remote_timeout_seconds`` is HEALTHY_REMOTE_TIMEOUT_S unless given."""
    disk = None if name is None else str(tmp_path / name)
    kw.setdefault("remote_timeout_seconds", HEALTHY_REMOTE_TIMEOUT_S)
    return ECStoreConfig(local_disk=disk, max_local_disk_size=gib(64 << 20) if disk else 0,
                         remote_url=url, **kw)


def open_store(tmp_path: Path, name: str, url: str | None, *, model: str = MODEL,
               dtype: torch.dtype = DTYPE, clock=None, **kw) -> ECStore:
    return open_store_with_remote_clock(cfg(tmp_path, name, url, **kw), clock, model=model, dtype=dtype)


def remote_keys(server: RedisServer) -> list[bytes]:
    return sorted(server.client().keys(KEY_PREFIX + "*"))


# --------------------------------------------------------------------------
# Sharing across "nodes"
# --------------------------------------------------------------------------

def test_wait_committed_makes_puts_visible_to_other_nodes(tmp_path: Path, redis_server: RedisServer) -> None:
    """The visibility an encode-only producer gives at request completion
    (ECStore.wait_committed at its step end) covers the remote tier: when it
    returns, the put was sent, and a store on another node finds it (before,
    only the LMDB commit was waited for; the remote write was still queued).
    Node A is memory + remote: nothing else would make it wait."""
    t = make_tensor(2, rows=64, cols=512)
    with open_store(tmp_path, None, redis_server.url) as a, open_store(tmp_path, "b", redis_server.url) as b:
        for i in range(8):
            assert a.put(f"img-{i}", t)
        a.wait_committed()
        st = a.stats()
        assert (st.remote_puts, st.remote_pending_writes) == (8, 0)
        assert all(b.remote_contains(f"img-{i}") for i in range(8))


def test_put_on_a_is_a_verified_hit_on_b_and_promoted_to_b_lmdb(tmp_path: Path, redis_server: RedisServer) -> None:
    t = make_tensor(1, rows=32, cols=128)
    with open_store(tmp_path, "a", redis_server.url) as a:
        assert a.put("img-1", t)
        a.flush()  # the remote write is sent (or dropped) by flush
        assert a.stats().remote_puts == 1
    assert len(remote_keys(redis_server)) == 1
    with open_store(tmp_path, "b", redis_server.url) as b:
        assert b.contains("img-1")
        assert b.remote_contains("img-1")
        assert not b.disk.contains(b.key("img-1"), b.stored_name("img-1"))
        got = b.get("img-1")
        assert same_tensor(got, t)
        b.flush()
        s = b.stats()
        assert (s.hits, s.remote_hits, s.disk_hits, s.remote_errors) == (1, 1, 0, 0)
        assert b.disk.contains(b.key("img-1"), b.stored_name("img-1"))  # promoted to B's LMDB
        assert s.remote_puts == 0  # a promoted entry is not written back
    # B's LMDB alone (no remote) now serves it bit-exact.
    with open_store(tmp_path, "b", None) as local_only:
        assert same_tensor(local_only.get("img-1"), t)


def test_a_remote_hit_handed_out_is_not_the_pending_lmdb_writes_tensor(tmp_path: Path,
                                                                       redis_server: RedisServer) -> None:
    """``get`` hands out a remote hit as a tensor of the caller's own (like a
    disk hit): it viewed the blob queued for B's LMDB, so a caller changing
    it in place changed what the next ``get`` served and what LMDB then
    committed, under a fresh checksum (every process on the node served
    the wrong tensor from then on). B's writer is held (a busy disk) so the
    write is still pending while the caller changes its tensor."""
    t = make_tensor(3, rows=32, cols=64)
    with open_store(tmp_path, "a", redis_server.url) as a:
        assert a.put("img", t)
        a.flush()
    with open_store(tmp_path, "b", redis_server.url, local_cpu=False) as b:
        go = threading.Event()
        real_write = b._writer._write

        def held_write(*args):  # the writer's own arguments and result, passed through
            assert go.wait(60)
            return real_write(*args)

        b._writer._write = held_write
        try:
            got = b.get("img")
            assert same_tensor(got, t)
            got.mul_(0)  # the caller reuses the tensor it got
            assert same_tensor(b.get("img"), t)  # served from the pending write
        finally:
            go.set()
        b.flush()
    with open_store(tmp_path, "b", None, local_cpu=False) as local_only:
        assert same_tensor(local_only.get("img"), t)


def test_remote_only_store_without_local_disk(tmp_path: Path, redis_server: RedisServer) -> None:
    t = make_tensor(2)
    with open_store(tmp_path, None, redis_server.url) as a:
        assert a.put("x", t)
        a.flush()
    with open_store(tmp_path, None, redis_server.url) as b:
        assert same_tensor(b.get("x"), t)
        assert b.get("y") is None
        assert b.stats().remote_misses == 1


def test_same_entry_from_two_producers_is_written_once(tmp_path: Path, redis_server: RedisServer) -> None:
    t = make_tensor(3)
    with open_store(tmp_path, "a", redis_server.url) as a, open_store(tmp_path, "b", redis_server.url) as b:
        assert a.put("same", t)
        a.flush()
        assert b.put("same", t)  # new for B's local tiers
        b.flush()
        assert (a.stats().remote_puts, b.stats().remote_puts) == (1, 0)
    assert len(remote_keys(redis_server)) == 1


def test_negative_cache_answers_repeated_lookups_without_the_server(tmp_path: Path,
                                                                   redis_server: RedisServer) -> None:
    clock = FakeClock()
    with open_store(tmp_path, "b", redis_server.url, clock=clock) as b:
        assert not b.contains("absent")
        assert not b.contains("absent")
        r = b.remote.stats()
        assert (r.lookups, r.negative_cached) == (1, 1)
        with open_store(tmp_path, "a", redis_server.url) as a:
            a.put("absent", make_tensor(4))
            a.flush()
        assert not b.contains("absent")  # still remembered as missing
        clock.advance(1.5)  # past NEGATIVE_TTL_S
        assert b.contains("absent")


# --------------------------------------------------------------------------
# Failure is a miss, never an error
# --------------------------------------------------------------------------

def test_redis_killed_mid_run_misses_and_local_hits_keep_working(tmp_path: Path,
                                                                  redis_server: RedisServer) -> None:
    clock = FakeClock()
    with open_store(tmp_path, "a", redis_server.url) as a:
        a.put("shared", make_tensor(5))
        a.flush()
    local = make_tensor(6)
    with open_store(tmp_path, "b", redis_server.url, clock=clock) as b:
        assert b.put("local", local)
        b.flush()
        redis_server.kill()
        assert b.get("shared") is None  # only the remote had it: a miss
        assert not b.contains("shared")
        assert same_tensor(b.get("local"), local)  # the local tiers keep working
        assert b.put("new-while-down", make_tensor(7))
        b.flush()  # never raises for the remote
        s = b.stats()
        assert s.remote_errors >= 1
        assert s.remote_puts_dropped == 1
        assert b.remote.breaker.state is BreakerState.OPEN
        errors = s.remote_errors
        for _ in range(5):  # open circuit: no more calls, no more errors, still misses
            assert b.get("shared") is None
        assert b.stats().remote_errors == errors
        assert same_tensor(b.get("new-while-down"), make_tensor(7))


def test_restarted_redis_is_used_again_after_the_backoff(tmp_path: Path, redis_server: RedisServer,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    t = make_tensor(8)
    with open_store(tmp_path, "b", redis_server.url, clock=clock) as b:
        assert not b.contains("later")  # a pooled connection exists
        redis_server.kill()
        while b.remote.breaker.state is not BreakerState.OPEN:  # bounded by the threshold
            assert b.get("later") is None
            assert b.stats().remote_errors <= 3
        redis_server.restart()  # empty, same port
        with open_store(tmp_path, "a", redis_server.url) as a:
            a.put("later", t)
            a.flush()
            assert a.stats().remote_puts == 1
        assert b.get("later") is None  # still inside the back-off: not even asked
        clock.advance(b.remote.breaker.base_backoff_s)
        assert same_tensor(b.get("later"), t)  # the probe reconnects
        assert b.remote.breaker.state is BreakerState.CLOSED
    assert "unreachable" in caplog.text and "reachable again" in caplog.text


def test_failed_probe_doubles_the_backoff(tmp_path: Path, redis_server: RedisServer) -> None:
    clock = FakeClock()
    with open_store(tmp_path, None, redis_server.url, clock=clock) as b:
        redis_server.kill()
        while b.remote.breaker.state is not BreakerState.OPEN:
            b.get("x")
        base = b.remote.breaker.base_backoff_s
        clock.advance(base)
        errors = b.stats().remote_errors
        assert b.get("x") is None  # the probe fails
        assert b.stats().remote_errors == errors + 1
        clock.advance(base)  # not enough now: 2 x base
        assert b.get("x") is None
        assert b.stats().remote_errors == errors + 1
        clock.advance(base)
        b.get("x")
        assert b.stats().remote_errors == errors + 2


def test_corrupt_remote_value_is_a_miss_and_deleted(tmp_path: Path, redis_server: RedisServer) -> None:
    t = make_tensor(9, rows=8, cols=64)
    with open_store(tmp_path, "a", redis_server.url) as a:
        a.put("c1", t)
        a.put("c2", t)
        a.flush()
        k1, k2 = KEY_PREFIX + a.key("c1"), KEY_PREFIX + a.key("c2")
    r = redis_server.client()
    value = bytearray(r.get(k1))
    value[-3] ^= 0x40  # one bit of tensor data
    r.set(k1, bytes(value))
    r.set(k2, b"not an ecstore value")
    with open_store(tmp_path, "b", redis_server.url) as b:
        assert b.get("c1") is None
        assert b.get("c2") is None
        assert b.stats().remote_corrupt_dropped == 2
        b.flush()
        assert not b.disk.contains(b.key("c1"), b.stored_name("c1"))  # garbage never reaches B's LMDB
    assert r.exists(k1) == 0 and r.exists(k2) == 0


@pytest.mark.parametrize("other", ["identifier", "model", "dtype"])
def test_value_of_another_identity_is_a_miss_and_kept(tmp_path: Path, redis_server: RedisServer,
                                                      other: str) -> None:
    t = make_tensor(10)
    with open_store(tmp_path, "a", redis_server.url) as a:
        a.put("img", t)
        a.flush()
        src = KEY_PREFIX + a.key("img")
    model, dtype, ident = MODEL, DTYPE, "img"
    if other == "identifier":
        ident = "other-img"
    elif other == "model":
        model = "org/another-model"
    else:
        dtype = torch.float16
    with open_store(tmp_path, "b", redis_server.url, model=model, dtype=dtype) as b:
        dst = KEY_PREFIX + b.key(ident)
        r = redis_server.client()
        r.set(dst, r.get(src))  # A's value under the key B asks for
        assert b.get(ident) is None
        assert b.remote.stats().foreign == 1
        b.flush()
        assert b.disk.entry_count() == 0
    assert r.exists(dst) == 1


def forged_value(name: str, tensor: torch.Tensor, *, model: str = MODEL) -> bytes:
    """A remote value with a valid frame, record and checksum for ``tensor``
    (of any shape, even one ``put`` refuses), as anyone able to write to the
    server could make it."""
    from ecstore.format import codec
    from ecstore.remote import frame

    blob = codec.encode(tensor, identifier=name, model=model)
    parts = frame.pack(name, blob, tensor.dtype, tuple(tensor.shape))
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


@pytest.mark.parametrize("shape", [(0, 16), (16, 0), (0,), (4,), (2, 3, 4), (), (1, 1, 1, 1, 1, 1, 1, 1)])
def test_well_formed_value_of_a_shape_put_never_writes_is_a_miss_and_deleted(
        tmp_path: Path, redis_server: RedisServer, shape: tuple[int, ...]) -> None:
    """A value with a valid frame, checksum and identity whose tensor is not
    what ``put`` stores (2-D, no empty dimension) is unusable: a miss, never
    an exception (an empty one escaped ``ECStore.get`` as torch's ValueError,
    which the vLLM worker does not catch), and deleted like any corrupt value."""
    with open_store(tmp_path, "b", redis_server.url) as b:
        k = KEY_PREFIX + b.key("img")
        r = redis_server.client()
        r.set(k, forged_value(b.stored_name("img"), torch.ones(shape, dtype=DTYPE)))
        assert b.get("img") is None
        st = b.remote.stats()
        assert (st.misses, st.hits, st.foreign, st.corrupt_dropped) == (1, 0, 0, 1)
        b.flush()
        assert b.disk.entry_count() == 0
    assert r.exists(k) == 0


@pytest.mark.parametrize("field", ["identifier", "dtype", "shape"])
def test_value_whose_record_disagrees_with_its_blob_is_corrupt_not_foreign(
        tmp_path: Path, redis_server: RedisServer, field: str) -> None:
    """One flipped bit in the record (which the blob's checksum does not
    cover) makes a value whose record and blob disagree: corrupt, so deleted,
    and a producer that recomputes the entry stores it again. It was called
    "foreign" when the record's identifier or dtype differed from the one
    asked for (checked before the blob): never deleted, a warning on every
    read, and SET NX kept every later put of the key out."""
    t = make_tensor(4, rows=8, cols=64)
    with open_store(tmp_path, None, redis_server.url) as a:
        a.put("img", t)
        a.flush()
        k, name = KEY_PREFIX + a.key("img"), a.stored_name("img")
    r = redis_server.client()
    value = bytearray(r.get(k))
    if field == "identifier":
        at = bytes(value).index(name.encode()) + len(name) - 1  # the record's copy comes first
    elif field == "dtype":
        at = bytes(value).index(b"bfloat16") + 1
    else:  # the first dimension (u64 right after the record's fixed part)
        import struct
        at = 4 + 1 + 4 + struct.calcsize("<BQQQQQQQBHI")
    value[at] ^= 0x01
    r.set(k, bytes(value))
    with open_store(tmp_path, "p", redis_server.url) as p:  # a producer recomputes the entry
        assert p.get("img") is None
        st = p.remote.stats()
        assert (st.foreign, st.corrupt_dropped) == (0, 1)
        assert r.exists(k) == 0
        assert p.put("img", t)
        p.flush()
    with open_store(tmp_path, None, redis_server.url) as b:
        assert same_tensor(b.get("img"), t)


def test_foreign_value_warning_is_rate_limited(tmp_path: Path, redis_server: RedisServer,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """A valid value of another identity is kept (not ours to delete) and
    read again by every get of its key: one warning per LOG_EVERY_S (the
    tier's clock), not one per read."""
    from ecstore.remote.tier import LOG_EVERY_S

    caplog.set_level(logging.WARNING, logger="ecstore")
    clock = FakeClock()
    with open_store(tmp_path, None, redis_server.url, clock=clock) as b:
        k = KEY_PREFIX + b.key("img")
        redis_server.client().set(k, forged_value(b.stored_name("other"), make_tensor(1)))
        for _ in range(5):
            assert b.get("img") is None
        assert b.remote.stats().foreign == 5
        assert caplog.text.count("treated as a miss") == 1
        clock.advance(LOG_EVERY_S)
        assert b.get("img") is None
        assert caplog.text.count("treated as a miss") == 2
        assert "4 more" in caplog.text  # the next warning says how many were not logged
    assert redis_server.client().exists(k) == 1


def test_maxmemory_eviction_under_churn_gives_misses_not_errors(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", extra=["--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru"])
    server.workdir.mkdir()
    server.start()
    try:
        tensors = {f"e{i}": make_tensor(100 + i, rows=64, cols=512) for i in range(40)}  # 64 KiB each
        with open_store(tmp_path, None, server.url, local_cpu=False) as a:
            for name, t in tensors.items():
                a.put(name, t)
            a.flush()
            assert a.stats().remote_errors == 0
        with open_store(tmp_path, None, server.url, local_cpu=False) as b:
            got = {name: b.get(name) for name in tensors}
            s = b.stats()
        hits = [n for n, v in got.items() if v is not None]
        assert all(same_tensor(got[n], tensors[n]) for n in hits)
        assert 0 < len(hits) < len(tensors)  # some evicted by Redis, the rest intact
        assert s.remote_errors == 0 and s.remote_corrupt_dropped == 0
    finally:
        server.kill()


def test_full_redis_with_noeviction_refuses_writes_without_failing(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", extra=["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"])
    server.workdir.mkdir()
    server.start()
    try:
        with open_store(tmp_path, "a", server.url) as a:
            for i in range(40):
                assert a.put(f"e{i}", make_tensor(200 + i, rows=64, cols=512))
            a.flush()
            s = a.stats()
            assert s.remote_errors >= 1 and s.remote_puts_dropped >= 1
            assert a.remote.breaker.state is BreakerState.CLOSED  # the server answered: not "down"
            assert same_tensor(a.get("e39"), make_tensor(239, rows=64, cols=512))  # local tiers have all
    finally:
        server.kill()


# --------------------------------------------------------------------------
# Credentials
# --------------------------------------------------------------------------

SECRET = "s3cr3t-Pa55word"


def test_password_protected_server_and_no_password_in_logs_or_config(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.DEBUG, logger="ecstore")
    server = RedisServer(tmp_path / "redis", password=SECRET)
    server.workdir.mkdir()
    server.start()
    try:
        t = make_tensor(11)
        assert SECRET in server.url
        with open_store(tmp_path, "a", server.url) as a:
            a.put("p", t)
            a.flush()
            assert a.stats().remote_puts == 1
        # The password from the environment instead of the URL.
        bare = server.url.replace(f":{SECRET}@", "")
        c = ECStoreConfig(remote_url=bare, remote_password=SECRET, remote_timeout_seconds=HEALTHY_REMOTE_TIMEOUT_S)
        with ECStore(c, model=MODEL, dtype=DTYPE) as b:
            assert same_tensor(b.get("p"), t)
        # A wrong password: a miss, logged without any password.
        wrong = ECStoreConfig(remote_url=server.url.replace(SECRET, "wrong-" + SECRET[::-1]),
                              remote_timeout_seconds=HEALTHY_REMOTE_TIMEOUT_S)
        with ECStore(wrong, model=MODEL, dtype=DTYPE) as w:
            assert w.get("p") is None
            assert w.stats().remote_errors == 1
        server.kill()  # errors while down are logged too
        with open_store(tmp_path, "b", server.url, clock=FakeClock()) as d:
            while d.remote.breaker.state is not BreakerState.OPEN:
                d.get("p")
        assert "unreachable" in caplog.text
        assert SECRET not in caplog.text and SECRET[::-1] not in caplog.text
        assert SECRET not in repr(c) and SECRET not in repr(ECStoreConfig(remote_url=server.url))

        for var in [v for v in __import__("os").environ if v.startswith("LMCACHE_")]:
            monkeypatch.delenv(var)
        monkeypatch.setenv("LMCACHE_EC_REMOTE_URL", server.url)
        monkeypatch.setenv("LMCACHE_EC_REMOTE_PASSWORD", SECRET)
        for args in (["config"], ["config", "--json"]):
            out = io.StringIO()
            with redirect_stdout(out):
                assert dump_main(args) == 0
            assert SECRET not in out.getvalue()
            assert "redis://:***@127.0.0.1" in out.getvalue()
    finally:
        server.kill()


def test_password_holding_url_delimiters_works_and_never_shows(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A real server whose password holds '@', ':' and '/' (percent-encoded,
    as it must be): the store authenticates with it, and no piece of it
    appears in the backend's description, any log line (the tail after an
    '@' was shown in every one: "redis://:***@tail@127.0.0.1..."), or
    ``ecstore-dump stats``."""
    from urllib.parse import quote

    pieces = ("Hq4pw", "Tl5pw", "Rz6pw")
    password = f"{pieces[0]}@{pieces[1]}:{pieces[2]}/x"
    caplog.set_level(logging.DEBUG, logger="ecstore")
    server = RedisServer(tmp_path / "redis", password=password)
    server.workdir.mkdir()
    server.start()
    try:
        url = f"redis://default:{pieces[0]}@{pieces[1]}:{quote(pieces[2] + '/x', safe='')}@127.0.0.1:{server.port}/0"
        t = make_tensor(13)
        with open_store(tmp_path, "a", url) as a:
            assert a.remote.backend.description == f"redis://default:***@127.0.0.1:{server.port}/0"
            a.put("p", t)
            a.flush()
            assert a.stats().remote_puts == 1
        rc, out = dump("stats", url)
        assert rc == 0 and not any(p in out for p in pieces)
        server.kill()
        with open_store(tmp_path, "b", url, clock=FakeClock()) as d:
            while d.remote.breaker.state is not BreakerState.OPEN:
                d.get("p")
        assert "unreachable" in caplog.text
        assert not any(p in caplog.text for p in pieces), caplog.text
    finally:
        server.kill()


def test_unix_socket_url(tmp_path: Path) -> None:
    sock = tmp_path / "r.sock"
    server = RedisServer(tmp_path / "redis", extra=["--unixsocket", str(sock), "--unixsocketperm", "700"])
    server.workdir.mkdir()
    server.start()
    try:
        t = make_tensor(12)
        with open_store(tmp_path, "a", f"unix://{sock}?db=2") as a:
            a.put("u", t)
            a.flush()
            assert a.stats().remote_puts == 1
        with open_store(tmp_path, "b", f"unix://{sock}?db=2") as b:
            assert same_tensor(b.get("u"), t)
        assert server.client().execute_command("SELECT", 2) and len(server.client().keys("*")) == 0
    finally:
        server.kill()


# --------------------------------------------------------------------------
# ecstore-dump list / stats / verify of a remote
# --------------------------------------------------------------------------

def dump(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = dump_main(list(args))
    return rc, out.getvalue()


def test_dump_list_stats_verify_a_remote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    server = RedisServer(tmp_path / "redis", password=SECRET)
    server.workdir.mkdir()
    server.start()
    try:
        with open_store(tmp_path, "a", server.url) as a:
            for i in range(3):
                a.put(f"img-{i}", make_tensor(300 + i, rows=32, cols=128))
            a.flush()
            bad_key = KEY_PREFIX + a.key("img-2")
        rc, out = dump("list", server.url, "--json")
        assert rc == 0 and SECRET not in out
        listed = json.loads(out)["entries"]
        assert sorted(e["identifier"] for e in listed) == ["img-0", "img-1", "img-2"]
        assert all(e["model"] == MODEL and e["dtype"] == "bfloat16" and e["shape"] == [32, 128]
                   and e["ttl_ms"] is None for e in listed)
        rc, out = dump("stats", server.url)
        assert rc == 0 and SECRET not in out and "redis://:***@127.0.0.1" in out
        rc, out = dump("stats", server.url, "--json")
        assert json.loads(out)["groups"] == [{"model": MODEL, "dtype": "bfloat16", "entries": 3,
                                              "bytes": sum(e["value_bytes"] for e in listed)}]
        assert dump("verify", server.url)[0] == 0
        r = server.client()
        value = bytearray(r.get(bad_key))
        value[-1] ^= 1
        r.set(bad_key, bytes(value))
        rc, out = dump("verify", server.url, "--json")
        assert rc == 1 and json.loads(out)["bad"][0]["key"] == bad_key[len(KEY_PREFIX):]
        assert r.exists(bad_key) == 1  # verify alone changes nothing
        # The password from the environment instead of the URL.
        monkeypatch.setenv("LMCACHE_EC_REMOTE_PASSWORD", SECRET)
        rc, out = dump("verify", server.url.replace(f":{SECRET}@", ""), "--delete-bad")
        assert rc == 1 and "1 deleted" in out and r.exists(bad_key) == 0
        assert dump("verify", server.url)[0] == 0
    finally:
        server.kill()


def test_dump_of_a_remote_holding_keys_of_other_types_under_the_prefix(tmp_path: Path,
                                                                      redis_server: RedisServer) -> None:
    """Keys under ``ecstore:1:`` that are not strings (a list, a hash: not
    ecstore's, which writes only strings) are shown as unreadable by
    ``list``/``stats`` and as bad by ``verify``, and every command goes on
    (a pipelined GETRANGE's WRONGTYPE ended each with exit 2). ``verify
    --delete-bad`` deletes the bad ecstore values but leaves such keys alone."""
    import json

    with open_store(tmp_path, "a", redis_server.url) as a:
        a.put("good", make_tensor(1))
        a.put("bad", make_tensor(2))
        a.flush()
        good, bad = a.key("good"), a.key("bad")
    r = redis_server.client()
    value = bytearray(r.get(KEY_PREFIX + bad))
    value[-1] ^= 1
    r.set(KEY_PREFIX + bad, bytes(value))
    r.rpush(KEY_PREFIX + "junk-list", b"x")
    r.hset(KEY_PREFIX + "junk-hash", "f", "v")
    url = redis_server.url
    rc, out = dump("list", url, "--json")
    assert rc == 0
    listed = {e["key"]: e for e in json.loads(out)["entries"]}
    assert set(listed) == {good, bad, "junk-list", "junk-hash"}
    assert listed[good]["error"] is None and listed[good]["identifier"] == "good"
    assert "a list" in listed["junk-list"]["error"] and "a hash" in listed["junk-hash"]["error"]
    rc, out = dump("list", url)
    assert rc == 0 and "(unreadable: a list" in out and "4 entries" in out
    rc, out = dump("stats", url, "--json")
    assert rc == 0 and json.loads(out)["unreadable"] == 2
    rc, out = dump("verify", url, "--json")
    res = json.loads(out)
    assert rc == 1 and res["checked"] == 4
    assert {b["key"] for b in res["bad"]} == {bad, "junk-list", "junk-hash"}
    rc, out = dump("verify", url, "--delete-bad")
    assert rc == 1 and "3 bad, 1 deleted, 2 left alone" in out
    assert r.exists(KEY_PREFIX + bad) == 0
    assert r.exists(KEY_PREFIX + "junk-list") == 1 and r.exists(KEY_PREFIX + "junk-hash") == 1
    with open_store(tmp_path, "b", url) as b:  # the remote tier reads past them too
        assert b.get("good") is not None


@pytest.mark.parametrize("command", ["list", "stats", "verify"])
def test_dump_of_an_unreachable_remote_is_one_clear_error(tmp_path: Path, command: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A server that is down (its port closed after it stopped): exit 2 and
    one line naming the server, password masked; no traceback of the redis
    client (it escaped as redis.exceptions.ConnectionError before)."""
    server = RedisServer(tmp_path / "redis", password=SECRET)
    server.workdir.mkdir()
    server.start()
    url = server.url
    server.kill()
    rc, out = dump(command, url)
    err = capsys.readouterr().err
    assert rc == 2 and out == ""
    assert err.startswith("ecstore-dump: error: redis://:***@127.0.0.1") and SECRET not in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------
# A real Redis Cluster (three masters)
# --------------------------------------------------------------------------

def test_a_cluster_node_gets_a_port_with_a_valid_free_bus_port() -> None:
    """A cluster node listens on port + 10000 too: an ephemeral port above
    55535 has no such port and redis-server exits; one with its bus port
    taken cannot start either (a likely cause of one failure of the cluster
    test below on a busy machine: its node had five tries at a port)."""
    ports = {free_port(bus_offset=CLUSTER_BUS_OFFSET) for _ in range(300)}
    assert all(1024 <= p and p + CLUSTER_BUS_OFFSET <= 65535 for p in ports)
    assert len(ports) > 1  # ephemeral picks, not one fixed port


def test_cluster_shares_entries_across_slots_and_survives_a_dead_master(tmp_path: Path) -> None:
    import json

    from ecstore.testing.redis_server import start_cluster

    nodes = start_cluster(tmp_path / "cluster")
    try:
        p = [n.port for n in nodes]
        tensors = {f"img-{i}": make_tensor(400 + i, rows=16, cols=64) for i in range(24)}
        with open_store(tmp_path, "a", f"redis+cluster://127.0.0.1:{p[0]}") as a:
            for name, t in tensors.items():
                a.put(name, t)
            a.flush()
            assert a.stats().remote_puts == len(tensors)
        per_node = [len(n.client().keys(KEY_PREFIX + "*")) for n in nodes]
        assert sum(per_node) == len(tensors) and sum(1 for c in per_node if c) >= 2  # spread over slots
        clock = FakeClock()
        with open_store(tmp_path, "b", f"redis://127.0.0.1:{p[2]},127.0.0.1:{p[1]}", clock=clock) as b:
            assert all(same_tensor(b.get(name), t) for name, t in tensors.items())  # comma seed list
            rc, out = dump("list", f"redis+cluster://127.0.0.1:{p[1]}", "--json")
            assert rc == 0 and len(json.loads(out)["entries"]) == len(tensors)
            rc, out = dump("stats", f"redis+cluster://127.0.0.1:{p[1]}", "--json")  # an AttributeError before
            stats = json.loads(out)
            assert rc == 0 and stats["groups"][0]["entries"] == len(tensors)
            assert stats["server"]["used_memory"] > 0 and stats["server"]["redis_version"]
            nodes[0].kill()  # a master (and its slots) gone: misses, never an exception
            with open_store(tmp_path, "c", f"redis+cluster://127.0.0.1:{p[1]}", clock=clock) as c:
                got = [c.get(name) for name in tensors]
                assert all(g is None or same_tensor(g, tensors[n]) for g, n in zip(got, tensors))
                assert any(g is None for g in got)
                assert c.stats().remote_errors >= 1
            assert same_tensor(b.get("img-0"), tensors["img-0"])  # B's local tiers still serve
    finally:
        for n in nodes:
            n.kill()


def test_cluster_down_at_open_is_misses_then_used_once_back(tmp_path: Path) -> None:
    """A cluster no seed node of which answers when the store opens (e.g. a
    vLLM engine starting during a Redis outage): the store opens and the
    remote is a miss (redis-py's RedisCluster connects when built, and its
    RedisClusterException escaped ECStore(), failing the engine's start);
    once the nodes are back, the remote is used after the back-off."""
    from ecstore.testing.redis_server import start_cluster

    nodes = start_cluster(tmp_path / "cluster")
    try:
        for n in nodes:
            n.kill()
        clock = FakeClock()
        t = make_tensor(16, rows=16, cols=64)
        with open_store(tmp_path, "a", f"redis+cluster://127.0.0.1:{nodes[0].port}", clock=clock) as a:
            assert a.get("img") is None and not a.remote_contains("img")
            assert a.put("img", t)
            a.flush()
            st = a.stats()
            assert st.remote_errors >= 1 and st.remote_puts == 0
            assert same_tensor(a.get("img"), t)  # the local tiers serve meanwhile
            for n in nodes:
                n.restart()  # same ports and nodes.conf: the cluster comes back (empty)
            deadline = time.monotonic() + 60
            while not all(b"cluster_state:ok" in n.client().execute_command("CLUSTER", "INFO") for n in nodes):
                assert time.monotonic() < deadline, "the restarted cluster did not become ok"
                time.sleep(0.05)  # polling a condition with a bound
            clock.advance(a.remote.breaker.max_backoff_s)
            assert not a.remote_contains("other")  # the probe builds the client
            assert a.remote.breaker.state is BreakerState.CLOSED
            assert a.put("img-2", t)
            a.flush()
            assert a.stats().remote_puts == 1
    finally:
        for n in nodes:
            n.kill()


def test_tls_server_with_rediss_url(tmp_path: Path) -> None:
    from ecstore.testing.redis_server import self_signed_cert

    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis", password=SECRET, tls=self_signed_cert(tmp_path / "redis"))
    server.start()
    try:
        t = make_tensor(13, rows=32, cols=128)
        assert server.url.startswith("rediss://")
        with open_store(tmp_path, "a", server.url) as a:
            a.put("tls", t)
            a.flush()
            assert a.stats().remote_puts == 1
        with open_store(tmp_path, "b", server.url) as b:
            assert same_tensor(b.get("tls"), t)
        plain = server.url.replace("rediss://", "redis://").split("?")[0]  # no TLS: cannot talk to it
        with open_store(tmp_path, "c", plain, remote_timeout_seconds=2) as c:
            assert c.get("tls") is None and c.stats().remote_errors == 1
    finally:
        server.kill()


def test_tls_cluster_with_rediss_cluster_url(tmp_path: Path) -> None:
    """A TLS Redis Cluster (``rediss+cluster://``, as managed services run
    it): entries are shared through it, password and CA from the URL. A
    one-node cluster holding every slot; the cluster client's connections
    are the deadline-bounded TLS ones."""
    import shutil
    import subprocess

    from ecstore.testing.redis_server import self_signed_cert

    (tmp_path / "redis").mkdir()
    cert = self_signed_cert(tmp_path / "redis")
    server = RedisServer(tmp_path / "redis", password=SECRET, tls=cert,
                         extra=["--cluster-enabled", "yes", "--tls-cluster", "yes",
                                "--cluster-config-file", str(tmp_path / "redis" / "nodes.conf")])
    server.start()
    try:
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
        assert cli is not None
        subprocess.run([cli, "--tls", "--cacert", str(cert[0]), "-p", str(server.port), "-a", SECRET,
                        "--no-auth-warning", "CLUSTER", "ADDSLOTSRANGE", "0", "16383"],
                       check=True, timeout=60, capture_output=True)
        client = server.client()
        give_up = time.monotonic() + 60
        while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
            assert time.monotonic() < give_up, "the one-node cluster never took its slots"
            time.sleep(0.05)  # polling a condition with a bound (as start_cluster does)
        url = server.url.replace("rediss://", "rediss+cluster://")
        t = make_tensor(14, rows=32, cols=128)
        with open_store(tmp_path, "a", url) as a:
            a.put("tls-cluster", t)
            a.flush()
            assert a.stats().remote_puts == 1 and a.stats().remote_errors == 0
        with open_store(tmp_path, "b", url) as b:
            assert same_tensor(b.get("tls-cluster"), t)
            assert b.stats().remote_hits == 1
    finally:
        server.kill()


def test_hung_server_is_a_miss_after_the_timeout(tmp_path: Path, redis_server: RedisServer) -> None:
    import os
    import signal

    t = make_tensor(14)
    with open_store(tmp_path, "b", redis_server.url, remote_timeout_seconds=0.2, clock=FakeClock()) as b:
        b.put("local", t)
        b.flush()
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # accepts connections, never answers
        try:
            while b.remote.breaker.state is not BreakerState.OPEN:
                assert b.get("elsewhere") is None
            assert b.stats().remote_errors == 3
            assert not b.contains("elsewhere")
            assert same_tensor(b.get("local"), t)
            assert b.put("new", make_tensor(15))
            b.flush()
            assert b.stats().remote_puts_dropped == 1
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)


def test_threads_hammering_two_stores_while_redis_dies_and_returns(tmp_path: Path,
                                                                   redis_server: RedisServer) -> None:
    """No call raises and every hit is bit-exact while the server is killed and
    restarted under load (threads on two stores sharing the remote: A with
    local tiers, B remote only)."""
    import threading

    tensors = {f"h{i}": make_tensor(500 + i, rows=8, cols=64) for i in range(16)}
    errors: list[BaseException] = []
    wrong: list[str] = []
    phase_done = [threading.Barrier(5) for _ in range(3)]

    def worker(store: ECStore, seed: int) -> None:
        try:
            names = list(tensors)
            for phase in range(3):
                for i in range(60):
                    name = names[(seed * 7 + i) % len(names)]
                    if i % 3 == 0:
                        store.put(name, tensors[name])
                    got = store.get(name)
                    if got is not None and not same_tensor(got, tensors[name]):
                        wrong.append(name)
                    store.contains(names[(seed + i) % len(names)])
                phase_done[phase].wait(timeout=300)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            for b in phase_done:
                b.abort()

    with open_store(tmp_path, "a", redis_server.url, remote_timeout_seconds=2) as a, \
            open_store(tmp_path, None, redis_server.url, remote_timeout_seconds=2, local_cpu=False) as b:
        for name, t in tensors.items():  # the remote holds everything before phase 0
            a.put(name, t)
        a.flush()
        threads = [threading.Thread(target=worker, args=(st, i)) for i, st in enumerate([a, b, a, b])]
        for t in threads:
            t.start()
        phase_done[0].wait(timeout=300)
        redis_server.kill()  # phase 1 runs against a dead server
        phase_done[1].wait(timeout=300)
        redis_server.restart()  # phase 2 against an empty, restarted one
        phase_done[2].wait(timeout=300)
        for t in threads:
            t.join(timeout=300)
        a.flush()
        b.flush()
        assert b.stats().remote_errors >= 1  # B (remote only) saw the dead server
        assert b.stats().remote_hits >= 1
    assert errors == [] and wrong == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64, torch.bool,
                                   torch.uint8, torch.float8_e4m3fn, torch.float8_e8m0fnu])
def test_every_storable_dtype_round_trips_bit_exact(tmp_path: Path, redis_server: RedisServer,
                                                    dtype: torch.dtype) -> None:
    t = make_tensor(600, rows=5, cols=24, dtype=dtype)
    with open_store(tmp_path, None, redis_server.url, dtype=dtype, local_cpu=False) as a:
        a.put("d", t)
        a.flush()
    with open_store(tmp_path, "b", redis_server.url, dtype=dtype) as b:
        got = b.get("d")
        assert same_tensor(got, t)
        b.flush()
    with open_store(tmp_path, "b", None, dtype=dtype) as local:  # the promoted LMDB copy too
        assert same_tensor(local.get("d"), t)


# --------------------------------------------------------------------------
# The remote writer against concurrent putters
# --------------------------------------------------------------------------

def write_queue(store: ECStore) -> WriteQueue:
    """The remote tier's write queue of ``store`` (tests hook its send)."""
    assert store.remote is not None and store.remote._writes is not None
    return store.remote._writes


def test_wait_committed_returns_while_other_threads_keep_putting(tmp_path: Path,
                                                                  redis_server: RedisServer) -> None:
    """``wait_committed``/``flush`` waits for the remote writes queued before
    its call, not for an empty queue: the batch holding the put made before
    the call is sent, then every later batch finds a new put queued by
    another thread. The call must return while that next batch is still
    held (hooked around the real pipelined send), with the earlier put on
    the server. Events only; ``bound_s`` only bounds a broken build."""
    import threading

    bound_s = 60.0
    t = make_tensor(3, rows=8, cols=32)
    with open_store(tmp_path, None, redis_server.url) as a:
        q = write_queue(a)
        real_send = q._send
        in_first, go_first, returned, release = (threading.Event() for _ in range(4))
        batches = 0
        fed: list[str] = []

        def feed_one() -> None:  # a put after the call
            fed.append(f"f{len(fed)}")
            assert a.put(fed[-1], t)

        def hooked(batch) -> None:
            nonlocal batches
            batches += 1
            if batches == 1:  # everything queued before the call
                in_first.set()
                assert go_first.wait(bound_s)
            elif not release.is_set():
                feed_one()  # the writer will find a put queued after this batch too
                release.wait(bound_s)
            real_send(batch)

        q._send = hooked
        errors: list[BaseException] = []

        def waiter() -> None:
            try:
                a.wait_committed()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
            returned.set()

        try:
            assert a.put("p0", t)
            assert in_first.wait(bound_s)
            th = threading.Thread(target=waiter)
            th.start()
            with q._cv:  # the call has begun (it waits in the queue's drain)
                assert q._cv.wait_for(lambda: q.drainers == 1, timeout=bound_s)
            feed_one()
            go_first.set()
            done = returned.wait(bound_s)
            on_server = redis_server.client().exists(KEY_PREFIX + a.key("p0")) if done else None
            release.set()
            th.join(bound_s)
            assert done, "wait_committed() did not return while another thread kept putting"
            assert not errors
            assert on_server == 1
        finally:
            release.set()
            go_first.set()
    with open_store(tmp_path, "b", redis_server.url) as b:  # close sent the rest
        assert all(b.remote_contains(n) for n in ["p0", *fed])


def test_flush_sends_a_batch_the_writer_thread_has_not_taken_itself(tmp_path: Path,
                                                                   redis_server: RedisServer) -> None:
    """A put's batch still queued when ``flush`` is called (the writer thread
    not scheduled yet: on a busy machine waking it, then the caller, cost ms
    each) is sent by the flushing thread itself. The test holds the queue's
    lock (re-entrant) so that the writer thread cannot take the batch first;
    before, flush waited in the queue's condition (which lets go of the lock)
    and the writer thread sent it."""
    import threading

    t = make_tensor(3, rows=8, cols=32)
    with open_store(tmp_path, None, redis_server.url) as a:
        q = write_queue(a)
        real_send = q._send
        senders: list[threading.Thread] = []

        def hooked(batch) -> None:
            senders.append(threading.current_thread())
            real_send(batch)

        q._send = hooked
        with q._cv:  # the writer thread cannot take anything meanwhile
            assert a.put("p0", t)
            a.flush()
            assert senders == [threading.current_thread()]
            assert q.pending == 0
        assert redis_server.client().exists(KEY_PREFIX + a.key("p0")) == 1
        assert a.stats().remote_puts == 1


def test_flush_does_not_send_a_second_batch_while_one_is_in_flight(tmp_path: Path,
                                                                  redis_server: RedisServer) -> None:
    """One batch in flight at a time, whoever sends it: while the writer
    thread's batch is held, a flush waits for it, and sends the put queued
    behind it itself (before its call) once the first is done."""
    import threading

    t = make_tensor(3, rows=8, cols=32)
    with open_store(tmp_path, None, redis_server.url) as a:
        q = write_queue(a)
        real_send = q._send
        in_first, go = threading.Event(), threading.Event()
        senders: list[threading.Thread] = []
        in_flight = [0]
        most = [0]

        def hooked(batch) -> None:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            senders.append(threading.current_thread())
            if len(senders) == 1:
                in_first.set()
                assert go.wait(60.0)
            real_send(batch)
            in_flight[0] -= 1

        q._send = hooked
        assert a.put("p0", t)
        assert in_first.wait(60.0)  # the writer thread sends p0, held
        with q._cv:
            assert a.put("p1", t)  # queued behind it
        flusher = threading.Thread(target=a.flush)
        flusher.start()
        with q._cv:  # the flush has begun (it waits in the queue's drain)
            assert q._cv.wait_for(lambda: q.drainers == 1, timeout=60.0)
        go.set()
        flusher.join(60.0)
        assert not flusher.is_alive()
        assert most[0] == 1 and len(senders) == 2
        assert all(redis_server.client().exists(KEY_PREFIX + a.key(n)) == 1 for n in ("p0", "p1"))


def test_remote_back_pressure_counts_the_batch_being_sent(tmp_path: Path, redis_server: RedisServer) -> None:
    """``remote_max_queue`` bounds the tensor bytes waiting for the remote,
    the batch being sent included: while one entry's worth is in flight, a
    put finds no room (here it is dropped at once: no wait allowed). It was
    queued as soon as the queue itself was empty (up to twice the bound held
    in memory)."""
    import threading

    t = make_tensor(3, rows=8, cols=32)
    with open_store(tmp_path, None, redis_server.url) as a:
        q = write_queue(a)
        real_send = q._send
        in_first, go = threading.Event(), threading.Event()

        def hooked(batch) -> None:
            in_first.set()
            assert go.wait(60.0)
            real_send(batch)

        q._send = hooked
        q.max_bytes = t.numel() * t.element_size()  # room for one entry
        q.wait_s = 0.0
        try:
            assert a.put("p0", t)
            assert in_first.wait(60.0)  # p0 is being sent; nothing else is queued
            assert a.put("p1", t)  # stored locally; the remote write finds no room
            assert q.pending == 0
        finally:
            go.set()
        a.wait_committed()
    with open_store(tmp_path, "b", redis_server.url) as b:
        assert b.remote_contains("p0") and not b.remote_contains("p1")
