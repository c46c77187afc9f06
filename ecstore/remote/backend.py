"""The remote key-value protocol the remote tier needs, and its Redis/Valkey
implementation (``redis`` from PyPI: ``pip install ecstore[redis]``).

A backend only moves bytes: framing, verification, the circuit breaker and
statistics live in :mod:`ecstore.remote.tier`. Backend methods raise
:class:`RemoteUnavailable` when the server cannot be reached in time (the
breaker counts those) and :class:`RemoteRefused` when it answered with an
error (e.g. ``OOM command not allowed`` under ``maxmemory`` + ``noeviction``).

Threading: one backend is shared by the caller threads and the tier's
writer thread; redis-py's clients are thread-safe (a connection pool).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from ecstore.errors import ConfigError, ECStoreError
from ecstore.remote.deadline import deadline, deadline_class
from ecstore.remote.reply import BadReply, read_bulk
from ecstore.remote.url import RemoteTarget, mask_secrets

log = logging.getLogger("ecstore")

#: Prefix of every key ecstore writes (the rest is the entry's EC key).
KEY_PREFIX = "ecstore:1:"

_DELETE_IF_UNCHANGED = """
if redis.call('STRLEN', KEYS[1]) == tonumber(ARGV[1]) and
   redis.sha1hex(redis.call('GET', KEYS[1])) == ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


_SSL_OPTIONS: dict[str, Callable[[str], Any]] = {
    "ssl_ca_certs": str, "ssl_certfile": str, "ssl_keyfile": str, "ssl_cert_reqs": str,
    "ssl_check_hostname": lambda v: v.lower() in ("1", "true", "yes", "on")}


def _ssl_options(url: str) -> dict[str, Any]:
    """TLS options given as query arguments (``?ssl_ca_certs=...``), for the
    cluster client (``Redis.from_url`` reads them itself)."""
    query = parse_qs(urlsplit(url).query)
    return {k: conv(query[k][-1]) for k, conv in _SSL_OPTIONS.items() if k in query}


def _pack_set(key: str, parts: Sequence[Any], px: int | None) -> list[Any]:
    """RESP of ``SET key <parts joined> NX [PX px]`` as buffers (the parts are not copied)."""
    views = [memoryview(p).cast("B") for p in parts]
    tail = [b"NX"] + ([b"PX", str(px).encode()] if px is not None else [])
    k = key.encode()
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(tail), len(k), k, sum(len(v) for v in views))
    end = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in tail)
    return [head, *views, end]


def _parse_error(text: str) -> Exception:
    """The exception redis-py raises for the error reply ``text`` (e.g.
    ``AuthenticationError`` for ``NOAUTH ...``, else ``ResponseError``)."""
    from redis._parsers.base import BaseParser

    return BaseParser.parse_error(text)


def _cluster_client(target: RemoteTarget, common: dict[str, Any]) -> Any:
    """A RedisCluster over the seed nodes of ``target`` whose node connections
    are :func:`~ecstore.remote.deadline.deadline_class` ones.

    RedisCluster takes a connection class only when given a ``url`` (it then
    builds each node's pool from its keyword arguments): the first seed is
    given as a plain ``redis://host:port`` URL, the others as startup nodes,
    and TLS as the connection class (with the ``ssl_*`` query options).
    It connects to the seeds when constructed (raising if none answers),
    which is why it is built at the first call: an unreachable cluster is then
    a failed call (a miss), not an error at start-up. One cluster-level retry
    (after a topology refresh), within the caller's deadline.
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    base = redis.SSLConnection if target.tls else redis.Connection
    (host, port), *others = target.hosts
    seed = f"redis://[{host}]:{port}" if ":" in host else f"redis://{host}:{port}"
    return RedisCluster(url=seed, startup_nodes=[ClusterNode(h, p) for h, p in others],
                        retry=Retry(NoBackoff(), 1), connection_class=deadline_class(base),
                        **common, **(_ssl_options(target.url) if target.tls else {}))


class RemoteUnavailable(ECStoreError):
    """The remote server could not be reached or did not answer in time."""


class RemoteRefused(ECStoreError):
    """The remote server answered with an error (full, wrong type, auth...)."""


class RemoteBadReply(RemoteUnavailable):
    """The server answered with a reply the command never has (an integer or
    an array to ``GET``): not a server ecstore can use, counted like one that
    cannot be reached (the breaker records a failure)."""


class RemoteBackend(Protocol):
    """Byte-level operations on one remote store (keys are ``str``)."""

    description: str  # for messages: the URL with its password masked

    def get(self, key: str) -> bytes | memoryview | None: ...

    def exists(self, key: str) -> bool: ...

    def exists_many(self, keys: Sequence[str]) -> list[bool]: ...

    def set_many(self, items: Sequence[tuple[str, Sequence[Any]]], ttl_s: float) -> list[bool]:
        """Store values whose keys are absent (SET NX), in one round trip;
        each value is given as buffers to concatenate (sent without copying
        where the client allows). True per item that was written."""
        ...

    def delete(self, key: str) -> None: ...

    def delete_if_unchanged(self, key: str, value: bytes | memoryview) -> bool:
        """Delete ``key`` only if it still holds exactly ``value``."""
        ...

    def close(self) -> None: ...


class RedisBackend:
    """:class:`RemoteBackend` over redis-py (a single server, a unix socket,
    or a cluster).

    ``timeout_s`` bounds each call as a whole (seconds, plus the time its
    bytes take at :data:`~ecstore.remote.deadline.MIN_RATE_BYTES_PER_S`):
    connecting, sending and reading the whole reply, redirects and retries
    included (see :mod:`ecstore.remote.deadline`). redis-py's own retries are off but one
    immediate reconnect after a connection error (a pooled connection the
    server closed, e.g. after a restart), never after a timeout, and within
    the same deadline.
    """

    def __init__(self, target: RemoteTarget, timeout_s: float) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ConfigError(
                f"remote_url is {target.masked!r} but the 'redis' package is not installed: "
                f"pip install 'ecstore[redis]'") from None
        self._redis = redis
        self.description = target.masked
        self.timeout_s = timeout_s
        self._secrets = (target.password,)
        common: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                                  "username": target.username, "password": target.password}
        self.is_cluster = target.cluster
        self._zero_copy_get = not target.cluster  # GET replies read in place (ecstore.remote.reply)
        self._client: Any = None
        self._delete_script: Any = None
        self._connect_lock = threading.Lock()
        if target.cluster:
            self._make_client: Callable[[], Any] = lambda: _cluster_client(target, common)
        else:
            url = target.url
            for alias, real in (("valkeys://", "rediss://"), ("valkey://", "redis://")):
                if url.lower().startswith(alias):
                    url = real + url[len(alias):]
            # Retries only after a connection error (a stale pooled
            # connection), never after a timeout.
            retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
            try:
                # The URL picks the connection class (TLS, unix socket); its
                # query arguments (ssl_ca_certs=...) are redis-py's.
                base = redis.connection.parse_url(url).get("connection_class", redis.Connection)
                self._make_client = lambda: redis.Redis.from_url(
                    url, retry=retry, connection_class=deadline_class(base), **common)
                _ = self.client  # connects lazily
            except (ValueError, TypeError) as e:  # a query option redis-py rejects: ?socket_timeout=soon
                raise ConfigError(f"remote_url {target.masked!r}: {mask_secrets(str(e), *self._secrets)}") from None

    @property
    def client(self) -> Any:
        """The redis-py client, built at the first use (a cluster client
        connects when built: raises the client's error if it cannot)."""
        client = self._client
        if client is None:
            with self._connect_lock:
                if self._client is None:
                    made = self._make_client()
                    self._delete_script = made.register_script(_DELETE_IF_UNCHANGED)
                    self._client = made
                client = self._client
        return client

    def _call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (which reaches the client through :attr:`client`) within
        ``timeout_s`` from now (or an enclosing, sooner deadline), its failures
        as RemoteUnavailable / RemoteRefused."""
        try:
            with deadline(self.timeout_s):
                return fn()
        except RemoteBadReply:
            raise
        except Exception as e:  # noqa: BLE001  (cluster topology errors, malformed replies...)
            raise self.error_of(e) from None

    def error_of(self, e: Exception) -> ECStoreError:
        """The ECStoreError a failure of the client stands for, its message
        naming the server (password masked): RemoteUnavailable (unreachable,
        timed out, cluster or reply trouble) or RemoteRefused (the server
        answered with an error). For callers that use :attr:`client`
        directly (``ecstore.remote.inspect``)."""
        r = self._redis
        text = mask_secrets(str(e), *self._secrets)
        if isinstance(e, (r.ConnectionError, r.TimeoutError, r.exceptions.ClusterError, OSError)):
            return RemoteUnavailable(f"{self.description}: {text}")
        if isinstance(e, r.RedisError):  # the server answered with an error
            return RemoteRefused(f"{self.description}: {text}")
        return RemoteUnavailable(f"{self.description}: {type(e).__name__}: {text}")

    def get(self, key: str) -> bytes | memoryview | None:
        """The value under ``key`` (None: absent). A reply that is not a bulk
        string raises :class:`RemoteBadReply` at once: nothing is built from
        what it holds (``bytes(8000000000)`` from a 14-byte integer reply).

        On a single server (every URL but a cluster's) the reply is read by
        :func:`ecstore.remote.reply.read_bulk` straight into reused memory (a
        memoryview of it); from a cluster (redirects) by redis-py."""
        if self._zero_copy_get:
            return self._call(lambda: self._get_zero_copy(KEY_PREFIX + key))
        value = self._call(lambda: self.client.get(KEY_PREFIX + key))
        if value is None or isinstance(value, bytes):
            return value
        if isinstance(value, (bytearray, memoryview)):
            return bytes(value)
        raise RemoteBadReply(f"{self.description}: GET answered with {type(value).__name__} reply, "
                             f"not a string")

    def _get_zero_copy(self, key: str) -> memoryview | None:
        """``GET key`` on one pooled connection, its reply read in place
        (:func:`~ecstore.remote.reply.read_bulk`). One reconnect if the
        pooled connection was stale (a connection error, never a timeout);
        a connection whose reply was not read whole is dropped."""
        r = self._redis
        pool = self.client.connection_pool
        k = key.encode()
        command = b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k)
        for attempt in (0, 1):
            conn = pool.get_connection()
            try:
                conn.send_packed_command([command], check_health=False)
                try:
                    return read_bulk(conn._sock, _parse_error, r.ConnectionError)
                except BadReply as e:
                    raise RemoteBadReply(f"{self.description}: GET answered with {e}") from None
                except TimeoutError:  # socket.timeout: redis-py's name for it
                    raise r.TimeoutError("Timeout reading from socket") from None
                except OSError as e:
                    raise r.ConnectionError(f"Error while reading from the socket: {e}") from None
            except r.ConnectionError:
                conn.disconnect()
                if attempt:
                    raise
            except BaseException:
                conn.disconnect()  # part of the reply may be unread: never reuse it
                raise
            finally:
                pool.release(conn)
        raise AssertionError("unreachable")

    def exists(self, key: str) -> bool:
        return bool(self._call(lambda: self.client.exists(KEY_PREFIX + key)))

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        def run() -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(KEY_PREFIX + k)
            return [bool(x) for x in pipe.execute()]
        return self._call(run) if keys else []

    def set_many(self, items: Sequence[tuple[str, Sequence[Any]]], ttl_s: float) -> list[bool]:
        px = int(ttl_s * 1000) if ttl_s > 0 else None
        if not items:
            return []
        if not self.is_cluster:
            return self._call(lambda: self._set_many_zero_copy(items, px))

        def run() -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            for k, parts in items:
                pipe.set(KEY_PREFIX + k, b"".join(parts), nx=True, px=px)
            return [bool(x) for x in pipe.execute()]
        return self._call(run)

    def _set_many_zero_copy(self, items: Sequence[tuple[str, Sequence[Any]]], px: int | None) -> list[bool]:
        """Pipelined SET NX on one pooled connection, each value's buffers
        written to the socket as they are (no concatenated copy of a 100+ MB
        value). One reconnect if the pooled connection was stale."""
        pool = self.client.connection_pool
        for attempt in (0, 1):
            conn = pool.get_connection()
            try:
                for key, parts in items:
                    conn.send_packed_command(_pack_set(KEY_PREFIX + key, parts, px), check_health=False)
                return [bool(conn.read_response()) for _ in items]
            except self._redis.ConnectionError:
                conn.disconnect()
                if attempt:
                    raise
            except BaseException:
                conn.disconnect()  # responses may be left unread: never reuse it
                raise
            finally:
                pool.release(conn)
        raise AssertionError("unreachable")

    def delete(self, key: str) -> None:
        self._call(lambda: self.client.delete(KEY_PREFIX + key))

    def delete_if_unchanged(self, key: str, value: bytes | memoryview) -> bool:
        digest = hashlib.sha1(value).hexdigest()
        def run() -> Any:
            _ = self.client  # builds the client and its script
            return self._delete_script(keys=[KEY_PREFIX + key], args=[len(value), digest])
        return bool(self._call(run))

    def close(self) -> None:
        if self._client is None:
            return
        try:
            self._client.close()
        except Exception as e:  # noqa: BLE001  (closing a client of a dead server)
            log.debug("ecstore: closing the remote client: %s", mask_secrets(str(e), *self._secrets))
