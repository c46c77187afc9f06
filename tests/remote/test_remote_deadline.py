"""``remote_timeout_seconds`` bounds each remote call as a whole.

Against real sockets: a small RESP server (tests/helpers/fake_redis.py) that
drips its GET reply or never answers, counting what it was sent. The
mechanism is asserted (commands sent, connections made, breaker state), no
wall time (the old code took 10x the timeout for the drip, 2x for a silent
server, 3x for three silent seeds: each of those shows in what the server
saw).
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
import torch
from conftest import gib
from helpers.fake_redis import FakeRedis
from helpers.tensors import make_tensor

from ecstore import ECStore
from ecstore.config import ECStoreConfig
from ecstore.remote import deadline as dl
from ecstore.remote.breaker import BreakerState
from ecstore.testing.stores import open_store_with_remote_clock

MODEL = "org/tiny-vlm"
T = 0.5  # remote_timeout_seconds of these tests


class FakeClock:
    """The breaker's clock: the circuit stays open once opened."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def open_store(tmp_path: Path, url: str, disk: str | None = None) -> ECStore:
    cfg = ECStoreConfig(local_disk=None if disk is None else str(tmp_path / disk),
                        max_local_disk_size=gib(64 << 20) if disk else 0,
                        remote_url=url, remote_timeout_seconds=T)
    return open_store_with_remote_clock(cfg, FakeClock(), model=MODEL, dtype=torch.bfloat16)


def test_a_reply_dripping_slower_than_the_timeout_is_a_failure(tmp_path: Path) -> None:
    # Every 1 KiB chunk comes within the socket timeout; the whole reply takes 20 x 0.25 s.
    with FakeRedis("drip", chunks=20, gap_s=0.25) as server:
        with open_store(tmp_path, server.url) as store:
            for _ in range(3):
                assert store.get("img") is None
            # Counted as failures (the whole reply did not come in time; before,
            # each get read all of it, ~10x the timeout, and the circuit stayed
            # closed): the circuit opened, the remote is not asked any more.
            assert store.stats().remote_errors == 3
            assert store.remote is not None and store.remote.breaker.state is BreakerState.OPEN
            assert store.get("img") is None
    assert server.commands["GET"] == 3


@pytest.mark.parametrize("reply", [b":4000000\r\n", b"*2\r\n:1\r\n:2\r\n"], ids=["integer", "array"])
def test_a_get_answered_with_no_bulk_string_is_a_failure_that_costs_nothing(tmp_path: Path, reply: bytes) -> None:
    """An integer reply to GET (`:8000000000`: 14 bytes) made the backend build bytes(N),
    fail its check, hash it all for delete_if_unchanged (outside the deadline)
    and record a success: a reply that is not a bulk string is a failure."""
    with FakeRedis("reply", replies={"GET": reply}) as server:
        with open_store(tmp_path, server.url) as store:
            for _ in range(3):
                assert store.get("img") is None
            stats = store.stats()
            assert (stats.remote_errors, stats.remote_bytes_read, stats.remote_corrupt_dropped) == (3, 0, 0)
            assert store.remote is not None and store.remote.breaker.state is BreakerState.OPEN
    assert server.commands["GET"] == 3
    assert server.commands["EVALSHA"] + server.commands["EVAL"] == 0  # nothing hashed or deleted


def test_a_timed_out_command_is_not_sent_again(tmp_path: Path) -> None:
    with FakeRedis("silent") as server:
        with open_store(tmp_path, server.url) as store:
            assert store.get("img") is None
            assert not store.remote_contains("other")
    # redis-py's retry re-sent both after the timeout (each call then took 2x the timeout).
    assert (server.commands["GET"], server.commands["EXISTS"]) == (1, 1)


def test_writes_queued_behind_a_timed_out_batch_are_dropped_with_it(tmp_path: Path) -> None:
    """wait_committed with a hung server waits for one batch, not one per queued batch."""
    with FakeRedis("silent") as server:
        with open_store(tmp_path, server.url) as store:
            assert store.remote is not None
            queue = store.remote._writes
            assert queue is not None
            all_queued, first = threading.Event(), []
            send = queue._send

            def hooked(batch) -> None:  # the first batch waits until every put is queued
                if not first:
                    first.append(len(batch))
                    assert all_queued.wait(10)
                send(batch)
            queue._send = hooked
            for i in range(150):  # more than two batches (BATCH_ITEMS = 64) behind the first
                assert store.put(f"img-{i}", make_tensor(i % 7))
            all_queued.set()
            store.wait_committed()
            assert store.stats().remote_puts_dropped == 150
    # Only the first batch was sent (before: every batch, each waiting out the timeout).
    assert server.commands["SET"] == first[0]


def test_cluster_seeds_after_the_deadline_are_not_tried(tmp_path: Path) -> None:
    """Three seed nodes that never answer CLUSTER SLOTS: one timeout, not one per seed."""
    seeds = [FakeRedis("silent") for _ in range(3)]
    try:
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in seeds)
        with open_store(tmp_path, url) as store:
            assert store.get("img") is None
    finally:
        for s in seeds:
            s.close()
    # The first seed tried took the whole timeout; the others were not even connected to.
    assert sum(s.accepted for s in seeds) == 1
    assert sum(s.commands["CLUSTER"] for s in seeds) == 1


def test_a_tls_handshake_that_never_ends_is_one_timeout(tmp_path: Path) -> None:
    """A server that accepts but never answers the TLS hello: the handshake
    counts against the same deadline and the connect is not retried."""
    with FakeRedis("silent") as server:
        with open_store(tmp_path, f"rediss://127.0.0.1:{server.port}/0") as store:
            assert store.get("img") is None
    assert server.accepted == 1  # before: a second connect after the timed-out handshake


@pytest.fixture
def fake_clock_and_socket_pair(monkeypatch):
    """(now, a, b): the deadline module's monotonic clock reads ``now[0]``
    (moved by the test), MIN_RATE_BYTES_PER_S is 1000 (500 bytes buy 0.5
    s), and ``a``/``b`` are the two ends of a socket pair (closed after)."""
    now = [100.0]
    monkeypatch.setattr(dl, "_monotonic", lambda: now[0])
    monkeypatch.setattr(dl, "MIN_RATE_BYTES_PER_S", 1000)
    a, b = socket.socketpair()
    try:
        yield now, a, b
    finally:
        a.close()
        b.close()


def test_bytes_a_call_moves_extend_its_deadline(fake_clock_and_socket_pair) -> None:
    """A large value moving at network speed is not cut off at
    ``remote_timeout_seconds`` (a 130 MB entry takes ~0.5 s on loopback
    here, the default timeout): each byte moved extends the call's deadline
    by 1 / MIN_RATE_BYTES_PER_S seconds, while a call that moves nothing
    still ends at the deadline. A fake monotonic clock and a socket pair:
    the arithmetic, exactly."""
    now, a, b = fake_clock_and_socket_pair
    s = dl.DeadlineSocket(a)
    s.settimeout(5.0)
    with dl.deadline(0.5):  # until 100.5
        b.sendall(b"x" * 500)
        assert s.recv(1000) == b"x" * 500  # until 101.0
        now[0] = 100.9
        b.sendall(b"y" * 10)
        assert s.recv(1000) == b"y" * 10  # past the first deadline: not cut off; until 101.01
        now[0] = 101.02
        b.sendall(b"z")
        with pytest.raises(socket.timeout):
            s.recv(1000)


def test_a_sendall_gets_the_time_its_bytes_take_and_none_after_the_deadline(fake_clock_and_socket_pair) -> None:
    """Python bounds a whole ``sendall`` by the socket's timeout, which
    redis-py sets to remote_timeout_seconds: the time a large SET's bytes
    take at MIN_RATE_BYTES_PER_S must extend that timeout too, not only
    the deadline (a 130 MB put needed 260 MB/s to get through). Once the
    deadline has passed, a sendall fails at once instead of granting
    itself more time. A fake monotonic clock and a socket pair."""
    now, a, b = fake_clock_and_socket_pair
    s = dl.DeadlineSocket(a)
    s.settimeout(0.3)  # redis-py's socket_timeout
    with dl.deadline(0.3):  # until 100.3
        s.sendall(b"x" * 500)
        assert s._real == pytest.approx(0.8)  # the socket's own bound grew with the bytes
        assert dl.time_left() == pytest.approx(0.8)
        now[0] = 101.2  # past the extended deadline
        with pytest.raises(socket.timeout):
            s.sendall(b"y" * 10_000)  # no grant once the deadline passed
    assert b.recv(1000) == b"x" * 500



# ------------------------------------------------- ecstore-dump on a hostile remote
#: A SCAN reply whose cursor is never 0 (always the same key): a scan that never ends.
ENDLESS_SCAN = b"*2\r\n$1\r\n7\r\n*1\r\n$11\r\necstore:1:k\r\n"
#: A SCAN reply that ends the scan at once, with no key.
EMPTY_SCAN = b"*2\r\n$1\r\n0\r\n*0\r\n"
INFO = b"$27\r\nredis_version:7.0.0\r\nfoo:1\r\n\r\n"
#: The key of ENDLESS_SCAN is always gone by the time it is read.
GONE = {"GET": b"$-1\r\n", "GETRANGE": b"$0\r\n\r\n", "STRLEN": b":0\r\n", "PTTL": b":-2\r\n"}


def _dump_bounded(monkeypatch: pytest.MonkeyPatch, bound_s: float, *argv: str) -> tuple[int, str, str]:
    """``ecstore-dump ARGV`` in a thread, its default bound for a whole remote
    command set to ``bound_s``; (status, stdout, stderr). A command still
    running after 60 s fails the test (it looped or waited for ever before)."""
    import contextlib
    import io

    from ecstore.cli import main

    monkeypatch.setattr("ecstore.cli.remote.DEFAULT_TIMEOUT_S", bound_s, raising=False)
    out, err, result = io.StringIO(), io.StringIO(), []

    def run() -> None:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            result.append(main(list(argv)))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), f"ecstore-dump {' '.join(argv)} still running after 60 s"
    return result[0], out.getvalue(), err.getvalue()


@pytest.mark.parametrize("command", ["list", "stats", "verify"])
def test_dump_of_a_remote_whose_scan_never_ends_stops_at_its_bound(command: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A SCAN cursor that never comes back to 0 looped for ever: the whole
    command is bounded, and says that it stopped early (its own exit status)."""
    from ecstore.cli import ExitCode

    with FakeRedis("reply", replies={"SCAN": ENDLESS_SCAN, "INFO": INFO, **GONE}) as server:
        rc, out, err = _dump_bounded(monkeypatch, 1.0, command, server.url)
    assert rc == ExitCode.INCOMPLETE, (out, err)
    assert "stopped after 1 s" in err and "--timeout" in err and "incomplete" in err
    assert server.commands["SCAN"] > 1


@pytest.mark.parametrize("command", ["list", "stats", "verify"])
def test_dump_of_a_remote_dripping_its_replies_stops_at_its_bound(command: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A server sending its replies a byte at a time, each byte well within
    the socket timeout, kept ``stats`` going past 40 s: the bound is on the
    whole command (here 1 s, replies of 20+ bytes at 0.5 s a byte)."""
    from ecstore.cli import ExitCode

    with FakeRedis("trickle", gap_s=0.5, replies={"SCAN": EMPTY_SCAN, "INFO": INFO}) as server:
        rc, out, err = _dump_bounded(monkeypatch, 1.0, command, server.url, "--json")
    assert rc == ExitCode.INCOMPLETE, (out, err)
    assert "stopped after 1 s" in err and "incomplete" in err
    import json
    assert json.loads(out)["complete"] is False


def test_dump_timeout_option_bounds_a_remote_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--timeout SECONDS`` sets the bound (the default is DEFAULT_TIMEOUT_S)."""
    from ecstore.cli import ExitCode

    with FakeRedis("reply", replies={"SCAN": ENDLESS_SCAN, "INFO": INFO, **GONE}) as server:
        rc, out, err = _dump_bounded(monkeypatch, 3600.0, "list", server.url, "--timeout", "0.5", "--json")
    assert rc == ExitCode.INCOMPLETE and "stopped after 0.5 s" in err
    import json
    listed = json.loads(out)
    assert listed["complete"] is False and "0.5 s" in listed["stopped_early"]


@pytest.mark.parametrize("reply", [b":4000000\r\n", b"*2\r\n:1\r\n:2\r\n"], ids=["integer", "array"])
def test_dump_verify_lists_a_key_whose_get_reply_is_no_string_and_goes_on(reply: bytes,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A GET answered with another reply than a bulk string raises
    RemoteBadReply (a RemoteUnavailable): ``verify`` stopped at the first such
    key as if the server could not be reached. Each is now a bad value (never
    deleted: its bytes are unknown) and the other keys are verified."""
    import json

    from ecstore.cli import ExitCode

    scan = b"*2\r\n$1\r\n0\r\n*2\r\n$11\r\necstore:1:a\r\n$11\r\necstore:1:b\r\n"  # two keys, then done
    with FakeRedis("reply", replies={"SCAN": scan, "GET": reply}) as server:
        rc, out, err = _dump_bounded(monkeypatch, 60.0, "verify", server.url, "--delete-bad", "--json")
    assert rc == ExitCode.BAD, (out, err)
    res = json.loads(out)
    assert [b["key"] for b in res["bad"]] == ["a", "b"] and "not a string" in res["bad"][0]["error"]
    assert (res["checked"], res["deleted"], res["kept"], res["complete"]) == (2, 0, 2, True)
    assert server.commands["GET"] == 2 and server.commands["EVALSHA"] + server.commands["EVAL"] == 0
