"""Remote-tier URLs: parsing, validation and credential masking.

:func:`parse_remote_url` accepts LMCache's ``remote_url`` forms
(``redis://``, ``rediss://``, ``redis+cluster://``, a seed list,
``unix://``; ``valkey`` spellings; port 6379, db 0 by default); a password in
the URL wins over ``remote_password``. Forms and percent-encoding:
docs/remote.md#url-forms and docs/remote.md#credentials. Nothing here logs.
:func:`mask_secrets` is ecstore's one secret masker: every message, log line
and tool output that may hold a URL, a config value or a client error goes
through it (this module is the lowest layer that needs it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

from ecstore.errors import ConfigError

DEFAULT_PORT = 6379

_SCHEMES = {
    "redis": (False, False), "valkey": (False, False),
    "rediss": (True, False), "valkeys": (True, False),
    "redis+cluster": (False, True), "valkey+cluster": (False, True),
    "rediss+cluster": (True, True), "valkeys+cluster": (True, True),
    "unix": (False, False),
}

#: ``://user:`` then the password, up to the *last* ``@`` before the host
#: part ends (at ``/``, ``?``, ``#`` or a line end). The user name holds no
#: ``:``; either may hold ``@`` (the password wins the extra ones).
_USERINFO = re.compile(r"(?P<head>://[^:/?#\r\n]*:)(?P<secret>[^/?#\r\n]*)(?P<at>@)")
_QUERY_SECRET = re.compile(r"(?P<head>[?&](?:password|pass|auth)=)(?P<secret>[^&\s]*)", re.IGNORECASE)
#: What a secret is replaced with.
MASK = "***"
#: Words naming a secret, in a query parameter or a config key (``ecstore.config.redact``).
SECRET_WORDS = r"(?:pass(?:word|wd|phrase)?|pwd|secret|token|api[_-]?key|access[_-]?key|auth|credentials?)"
_SECRET_PARAM = re.compile(rf"(?i)(?P<head>[?&;]{SECRET_WORDS}=)(?P<value>[^&#;\s]*)")


def mask_secrets(text: object, *secrets: str | None) -> str:
    """``text`` (``str()`` of any object) safe to log or print, every secret
    replaced by ``***``: each non-empty one of ``secrets`` (what a client
    library built from a URL or password may echo); in every URL, whatever
    sits between ``://user:`` and the last ``@`` of the host part (a lone URL
    with an ``@`` where none can be, the host part having ended early inside
    a password, :func:`_misplaced_at`, is masked up to its last ``@``); and
    the value of secret-looking query parameters (``password``, ``token``,
    ``secret``, ``api_key``, ``auth``...). Pure, thread-safe.
    """
    text = str(text)
    for s in secrets:
        if s:
            text = text.replace(s, MASK)
    if "://" not in text and "=" not in text:
        return text
    text = _mask_raw(text) if _malformed_userinfo(text) else _mask_urls(text)
    return _SECRET_PARAM.sub(lambda m: f"{m['head']}{MASK}", text)


def _mask_urls(text: str) -> str:
    """URL passwords (:data:`_USERINFO`) and ``password=`` query values masked."""
    text = _USERINFO.sub(lambda m: f"{m['head']}{MASK}{m['at']}", text)
    return _QUERY_SECRET.sub(lambda m: f"{m['head']}{MASK}", text)


def _malformed_userinfo(text: str) -> bool:
    """Is ``text`` one URL (no white space) with an ``@`` where none can be?"""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() == "unix" or any(c.isspace() for c in text):
        return False
    try:
        return _misplaced_at(urlsplit("x://" + rest))
    except ValueError:
        return "@" in rest[_host_part_end(rest):]


def _host_part_end(rest: str) -> int:
    """Where the host part of ``rest`` (a URL after ``://``) ends: its first
    ``/``, ``?`` or ``#`` (as for urlsplit and redis-py)."""
    return min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))


def _at_after_host(url: str) -> bool:
    """Does an ``@`` follow the host part of ``url``? Then the host part may
    have ended inside a password (an unencoded ``/``, ``?`` or ``#``), and
    any piece of the URL may be a piece of it. (A unix socket's path may
    hold ``@``; it has no host part.)"""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.strip().lower() == "unix":
        return False
    return "@" in rest[_host_part_end(rest):]


def _mask_raw(url: str) -> str:
    """``url`` masked for an error about it: as :func:`_mask_urls`, and when
    an ``@`` follows the host part (:func:`_at_after_host`) everything from
    the password (or from the start, if no user name ends before the host
    part) to the *last* ``@`` of the URL is hidden; in text with no scheme,
    all before its last ``@``."""
    if "://" not in url and "@" in url:
        return _mask_urls(MASK + "@" + url.rpartition("@")[2])
    if not _at_after_host(url):
        return _mask_urls(url)
    scheme, _, rest = url.partition("://")
    at = rest.rfind("@")
    colon = rest.find(":", 0, _host_part_end(rest))
    user = rest[:colon + 1] if 0 <= colon < at else ""
    return _mask_urls(f"{scheme}://{user}{MASK}@{rest[at + 1:]}")


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
        return mask_secrets(self.url)


def _bad(url: str, source: str, why: str, *values: object) -> ConfigError:
    """The ConfigError for ``url``: ``why`` (``{}`` marks where each of
    ``values``, pieces of the URL, is quoted) and the URL masked. Where an
    ``@`` follows the host part, any piece may be part of a password: the
    URL is masked up to its last ``@`` and no piece is quoted."""
    if values:
        hide = _at_after_host(url) or "://" not in url
        why = why.format(*("" if hide else f" {v!r}" for v in values))
    return ConfigError(
        f"remote_url (from {source}): {why} in {_mask_raw(url)!r}; expected redis://host:port/db, "
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
        raise _bad(url, source, "port{} is not a number", port_text) from None
    if not 0 < port < 65536:
        raise _bad(url, source, "port{} is out of range", port)
    return host, port


def _misplaced_at(parts: SplitResult) -> bool:
    """An ``@`` where a redis URL can hold none: in the path (only ``/db``),
    the fragment, or a query field without ``=`` (where the host part ended
    early inside a password holding ``/``, ``?`` or ``#``)."""
    fields = parts.query.split("&")
    return "@" in parts.path or "@" in parts.fragment or any("@" in f and "=" not in f for f in fields)


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
        raise _bad(text, source, "unsupported scheme{}", scheme)
    tls, cluster = _SCHEMES[scheme]
    try:
        parts = urlsplit("x://" + text.split("://", 1)[1])  # keep the comma-separated netloc intact
        query = parse_qs(parts.query)
    except ValueError as e:  # "Invalid IPv6 URL"...
        raise _bad(text, source, f"{e}") from None
    if scheme != "unix" and _misplaced_at(parts):
        raise _bad(text, source, "an '@' after the host part (percent-encode a '/', '?' or '#' in the "
                   "user name or password: %2F, %3F, %23)")
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
        raise _bad(text, source, "database{} is not a number", db_text) from None
    if db < 0:
        raise _bad(text, source, "database{} is negative", db)
    if cluster and db != 0:
        raise _bad(text, source, "a cluster has only database 0")
    return RemoteTarget(text, tls, cluster, hosts, socket_path, db, username, pw)
