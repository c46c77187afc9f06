"""Remote-tier URLs: parsing, validation and credential masking.

Accepted forms (LMCache's ``remote_url`` style)::

    redis://[user[:password]@]host[:port][/db]        one server
    rediss://...                                       the same over TLS
    redis+cluster://[user[:password]@]h1:p1[,h2:p2...] a Redis / Valkey cluster (seed nodes)
    rediss+cluster://...                               a cluster over TLS
    redis://h1:p1,h2:p2                                a comma-separated seed list: a cluster
    unix:///path/to/redis.sock[?db=N]                  a local socket

``valkey://`` / ``valkeys://`` are accepted as spellings of ``redis://`` /
``rediss://``. The port defaults to 6379, the database to 0 (a cluster has
only database 0). A password given in the URL wins over the ``remote_password``
key (normally set with ``LMCACHE_EC_REMOTE_PASSWORD``).

Nothing here logs: :func:`mask_url` is what every message uses to show a URL.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

from ..errors import ConfigError

DEFAULT_PORT = 6379

_SCHEMES = {
    "redis": (False, False), "valkey": (False, False),
    "rediss": (True, False), "valkeys": (True, False),
    "redis+cluster": (False, True), "valkey+cluster": (False, True),
    "rediss+cluster": (True, True), "valkeys+cluster": (True, True),
    "unix": (False, False),
}

_USERINFO = re.compile(r"(?P<head>://[^@/]*?:)(?P<secret>[^@/]*)(?P<at>@)")
_QUERY_SECRET = re.compile(r"(?P<head>[?&](?:password|pass|auth)=)(?P<secret>[^&#]*)", re.IGNORECASE)


def mask_url(url: object) -> str:
    """``url`` with any password replaced by ``***`` (safe to log or print).

    Works on malformed text too: whatever sits between ``://user:`` and ``@``
    and any ``password=`` query value is masked.
    """
    text = str(url)
    text = _USERINFO.sub(lambda m: f"{m['head']}***{m['at']}", text)
    return _QUERY_SECRET.sub(lambda m: f"{m['head']}***", text)


def redact(text: str, *secrets: str | None) -> str:
    """``text`` with every non-empty secret replaced by ``***`` (for error
    messages a client library built from a URL or password)."""
    for s in secrets:
        if s:
            text = text.replace(s, "***")
    return mask_url(text)


def supported_scheme(url: object) -> bool:
    """True when ``url`` is a string naming one of the remote schemes above."""
    if not isinstance(url, str) or "://" not in url:
        return False
    return url.split("://", 1)[0].strip().lower() in _SCHEMES


@dataclass(frozen=True)
class RemoteTarget:
    """A parsed remote URL.

    ``hosts`` holds (host, port) pairs: one for a single server, the seed
    nodes for a cluster, none for a unix socket (``socket_path``).
    """

    url: str = field(repr=False)
    tls: bool
    cluster: bool
    hosts: tuple[tuple[str, int], ...]
    socket_path: str | None
    db: int
    username: str | None
    password: str | None = field(repr=False)

    @property
    def masked(self) -> str:
        return mask_url(self.url)


def _bad(url: str, source: str, why: str) -> ConfigError:
    return ConfigError(
        f"remote_url (from {source}): {why} in {mask_url(url)!r}; expected redis://host:port/db, "
        f"rediss://..., redis+cluster://h1:p1,h2:p2, or unix:///path/to/socket")


def _host_port(text: str, url: str, source: str) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise _bad(url, source, "a host is missing")
    try:
        port = int(port_text) if port_text else DEFAULT_PORT
    except ValueError:
        raise _bad(url, source, f"port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise _bad(url, source, f"port {port} is out of range")
    return host, port


def parse_remote_url(url: object, source: str = "ECStoreConfig argument",
                     password: str | None = None) -> RemoteTarget:
    """Parse and validate ``url``; ``password`` is used when the URL has none.

    Raises ConfigError (with the URL masked) for anything malformed.
    """
    if not isinstance(url, str):
        raise ConfigError(f"remote_url (from {source}): expected a redis:// URL, got a "
                          f"{type(url).__name__}")
    text = url.strip()
    if "://" not in text:
        raise _bad(text, source, "no scheme")
    scheme = text.split("://", 1)[0].lower()
    if scheme not in _SCHEMES:
        raise _bad(text, source, f"unsupported scheme {scheme!r}")
    tls, cluster = _SCHEMES[scheme]
    parts = urlsplit("x://" + text.split("://", 1)[1])  # keep the comma-separated netloc intact
    query = parse_qs(parts.query)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username = pw = None
    if userinfo:
        user, sep, secret = userinfo.partition(":")
        username = unquote(user) or None
        pw = unquote(secret) if sep else None
    if pw is None and query.get("password"):
        pw = query["password"][0]
    pw = pw or password or None
    db_text = query.get("db", [""])[0]
    if scheme == "unix":
        path = unquote(parts.path)
        if not path:
            raise _bad(text, source, "a socket path is missing")
        hosts: tuple[tuple[str, int], ...] = ()
        socket_path: str | None = path
    else:
        if not hostlist:
            raise _bad(text, source, "a host is missing")
        hosts = tuple(_host_port(h, text, source) for h in hostlist.split(","))
        socket_path = None
        cluster = cluster or len(hosts) > 1
        path = parts.path.strip("/")
        if path:
            db_text = path
    try:
        db = int(db_text) if db_text else 0
    except ValueError:
        raise _bad(text, source, f"database {db_text!r} is not a number") from None
    if db < 0:
        raise _bad(text, source, f"database {db} is negative")
    if cluster and db != 0:
        raise _bad(text, source, "a cluster has only database 0")
    return RemoteTarget(text, tls, cluster, hosts, socket_path, db, username, pw)
