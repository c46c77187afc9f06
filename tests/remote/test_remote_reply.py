"""The GET reply read in place (ecstore.remote.reply): exactly a bulk string
or the null bulk, anything else a failure with nothing built from it.

``read_bulk`` over a real socket pair (every byte of a reply sent on its own,
hostile replies), then through a store: against a real redis-server (values
around the first read's size, several MB, a tensor handed out stays intact
while later gets reuse memory) and against a small RESP server that answers
GET with a short, unterminated or oversized bulk, or an error.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
import redis
import torch
from conftest import HEALTHY_REMOTE_TIMEOUT_S
from helpers.fake_redis import FakeRedis
from helpers.tensors import make_tensor, same_tensor

from ecstore import ECStore
from ecstore.config import ECStoreConfig
from ecstore.remote import reply
from ecstore.remote.backend import _parse_error
from ecstore.remote.breaker import BreakerState

MODEL = "org/tiny-vlm"


class Closed(Exception):
    pass


def read(chunks: list[bytes], *, close: bool = True) -> memoryview | None:
    """``read_bulk`` of what a peer sends as ``chunks`` (one send each), then
    closes (``close``) or keeps open until the read returned."""
    ours, peer = socket.socketpair()
    ours.settimeout(30)
    done = threading.Event()

    def send() -> None:
        for c in chunks:
            peer.sendall(c)
        if close:
            peer.shutdown(socket.SHUT_WR)
        done.wait(30)
        peer.close()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        return reply.read_bulk(ours, _parse_error, Closed)
    finally:
        done.set()
        sender.join(30)
        ours.close()


def one_byte_each(data: bytes) -> list[bytes]:
    return [data[i:i + 1] for i in range(len(data))]


@pytest.mark.parametrize("size", [0, 1, 5, reply.FIRST_READ_BYTES - 20, reply.FIRST_READ_BYTES,
                                  3 * reply.FIRST_READ_BYTES + 7])
def test_a_bulk_string_is_read_whole_however_it_is_split(size: int) -> None:
    value = bytes(range(256)) * (size // 256) + bytes(size % 256)
    data = b"$%d\r\n%s\r\n" % (size, value)
    assert bytes(read([data], close=False)) == value  # type: ignore[arg-type]
    split = one_byte_each(data) if size < 4096 else [data[:3], data[3:9], data[9:-1], data[-1:]]
    assert bytes(read(split, close=False)) == value  # type: ignore[arg-type]


@pytest.mark.parametrize("null", [b"$-1\r\n", b"_\r\n"], ids=["resp2", "resp3"])
def test_a_null_is_none(null: bytes) -> None:
    assert read([null], close=False) is None
    assert read(one_byte_each(null), close=False) is None


@pytest.mark.parametrize("line, error", [(b"-WRONGTYPE Operation against a key holding the wrong kind of value",
                                          redis.ResponseError),
                                         (b"-NOAUTH Authentication required.", redis.AuthenticationError)])
def test_an_error_reply_is_the_exception_redis_py_makes_of_it(line: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        read([line + b"\r\n"], close=False)


@pytest.mark.parametrize("data", [
    b":4000000\r\n",  # an integer
    b"*2\r\n:1\r\n:2\r\n",  # an array
    b"+OK\r\n",  # a status
    b"_x\r\n",  # a malformed RESP3 null
    b">2\r\n+invalidate\r\n*0\r\n",  # a RESP3 push
    b"$abc\r\n",  # a length that is no number
    b"$-2\r\n",  # a negative length
    b"$%d\r\n" % (reply.MAX_VALUE_BYTES + 1),  # more than any value: nothing allocated, nothing read
    b"$3\r\nabcXY",  # no \r\n after the value
    b"$3\r\nabc\r\n+OK\r\n",  # bytes after the reply
    b"$-1\r\n+OK\r\n",
    b"_\r\n+OK\r\n",
    b"x" * reply.MAX_LINE_BYTES,  # no reply line at all
], ids=["integer", "array", "status", "bad-resp3-null", "push", "nan-length", "negative-length", "oversized",
        "unterminated", "trailing", "trailing-null", "trailing-resp3-null", "no-line"])
def test_any_other_reply_is_a_bad_reply(data: bytes) -> None:
    with pytest.raises(reply.BadReply):
        read([data], close=False)


@pytest.mark.parametrize("data", [b"", b"$10", b"$10\r\nabc", b"$3\r\nabc", b"$3\r\nabc\r"],
                         ids=["nothing", "header", "value", "no-end", "half-end"])
def test_a_reply_cut_short_by_the_server_closing_is_closed(data: bytes) -> None:
    with pytest.raises(Closed):
        read([data])


# --------------------------------------------------------------- through a store
def open_store(url: str, *, timeout_s: float = HEALTHY_REMOTE_TIMEOUT_S) -> ECStore:
    cfg = ECStoreConfig(local_cpu=False, remote_url=url, remote_timeout_seconds=timeout_s)
    return ECStore(cfg, model=MODEL, dtype=torch.bfloat16)


def test_values_of_every_size_come_back_bit_exact_and_stay_private(redis_server) -> None:
    """Sizes around the first read (its bytes copied, the rest received in
    place) and several MB (a reused pool buffer); a tensor handed out is
    not overwritten by later gets of other values, nor by the same one."""
    rows = [1, 2, 1000, 1024, 1100, 4 * 1024]  # 3584 bf16 columns: 7 KB to 29 MB
    tensors = {f"img-{r}": make_tensor(r, rows=r, cols=3584) for r in rows}
    with open_store(redis_server.url) as writer:
        for name, t in tensors.items():
            assert writer.put(name, t)
        writer.flush()
        assert writer.stats().remote_puts == len(rows)
    with open_store(redis_server.url) as reader:
        held = {name: reader.get(name) for name in tensors}
        for _ in range(2):  # more gets of the same sizes while the first results are held
            for name, t in tensors.items():
                assert same_tensor(reader.get(name), t)
        for name, t in tensors.items():
            assert same_tensor(held[name], t), name
        stats = reader.stats()
        assert (stats.remote_hits, stats.remote_errors) == (3 * len(rows), 0)


def test_a_missing_key_is_a_clean_miss(redis_server) -> None:
    with open_store(redis_server.url) as store:
        assert store.get("never-stored") is None
        stats = store.stats()
        assert (stats.remote_misses, stats.remote_errors) == (1, 0)


@pytest.mark.parametrize("get_reply", [b"$10\r\nabc", b"$3\r\nabcXY", b"$%d\r\n" % (reply.MAX_VALUE_BYTES + 1),
                                       b"$-3\r\n"],
                         ids=["short", "unterminated", "oversized", "negative"])
def test_a_short_or_malformed_bulk_is_a_failure_never_garbage(tmp_path: Path, get_reply: bytes) -> None:
    """A reply whose value never comes whole (the deadline ends it), is not
    ended by \\r\\n or claims an impossible length: a miss counted as a
    failure (the circuit opens), nothing hashed or deleted."""
    with FakeRedis("reply", replies={"GET": get_reply}) as server:
        with open_store(server.url, timeout_s=0.5) as store:
            for _ in range(3):
                assert store.get("img") is None
            stats = store.stats()
            assert (stats.remote_errors, stats.remote_bytes_read, stats.remote_corrupt_dropped) == (3, 0, 0)
            assert store.remote is not None and store.remote.breaker.state is BreakerState.OPEN
    assert server.commands["EVALSHA"] + server.commands["EVAL"] == 0


def test_an_error_reply_is_refused_and_leaves_the_circuit_closed(tmp_path: Path) -> None:
    with FakeRedis("reply", replies={"GET": b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"}
                   ) as server:
        with open_store(server.url, timeout_s=0.5) as store:
            for _ in range(3):
                assert store.get("img") is None
            assert store.stats().remote_errors == 3
            assert store.remote is not None and store.remote.breaker.state is BreakerState.CLOSED
    assert server.commands["GET"] == 3  # one each: an error reply is not retried


def test_a_value_sent_a_byte_at_a_time_is_a_hit(redis_server) -> None:
    """A real stored value, replayed by a server that sends it one byte per
    write (every boundary of the header, the value and its \\r\\n)."""
    t = make_tensor(7, rows=2, cols=64)
    with open_store(redis_server.url) as writer:
        assert writer.put("img", t)
        writer.flush()
    (key,) = redis_server.client().keys("ecstore:1:*")
    value = redis_server.client().get(key)
    with FakeRedis("trickle", gap_s=0.0, replies={"GET": b"$%d\r\n%s\r\n" % (len(value), value)}) as server:
        with open_store(server.url) as store:
            assert same_tensor(store.get("img"), t)
            assert store.stats().remote_hits == 1
