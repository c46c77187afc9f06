"""remote_url and friends: URL forms, precedence, masking (no server needed)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from ecstore.config import ConfigWarning, ECStoreConfig, describe_config, load_config
from ecstore.errors import ConfigError
from ecstore.remote.breaker import BreakerState, CircuitBreaker
from ecstore.remote.url import mask_secrets, parse_remote_url

SECRET = "hunter2-xyz"


@pytest.mark.parametrize("url, cluster, hosts, db, tls, sock", [
    ("redis://h:7000/3", False, (("h", 7000),), 3, False, None),
    ("redis://h", False, (("h", 6379),), 0, False, None),
    ("rediss://u:p@h:6380/1", False, (("h", 6380),), 1, True, None),
    ("valkey://h:1", False, (("h", 1),), 0, False, None),
    ("redis+cluster://a:1,b:2", True, (("a", 1), ("b", 2)), 0, False, None),
    ("rediss+cluster://u:p@a:1", True, (("a", 1),), 0, True, None),
    ("redis://a:1,b:2,c:3", True, (("a", 1), ("b", 2), ("c", 3)), 0, False, None),
    ("redis://[::1]:7001/0", False, (("::1", 7001),), 0, False, None),
    ("unix:///run/redis.sock?db=4", False, (), 4, False, "/run/redis.sock"),
])
def test_url_forms(url, cluster, hosts, db, tls, sock) -> None:
    t = parse_remote_url(url)
    assert (t.cluster, t.hosts, t.db, t.tls, t.socket_path) == (cluster, hosts, db, tls, sock)


@pytest.mark.parametrize("url, why", [
    ("lm://h:1", "unsupported scheme"),
    ("h:6379", "no scheme"),
    ("redis://", "host is missing"),
    ("redis://h:port", "not a number"),
    ("redis://h:70000", "out of range"),
    ("redis+cluster://a:1,b:2/3", "only database 0"),
    ("redis://h/x", "not a number"),
    ("unix://", "socket path"),
])
def test_bad_urls_are_config_errors_naming_the_problem(url, why) -> None:
    with pytest.raises(ConfigError, match=why):
        ECStoreConfig(remote_url=url)


def test_credentials_from_url_or_key_and_masked_everywhere() -> None:
    t = parse_remote_url(f"redis://alice:{SECRET}@h:1/0")
    assert (t.username, t.password) == ("alice", SECRET)
    assert SECRET not in repr(t) and SECRET not in t.masked
    assert parse_remote_url("redis://h:1", password=SECRET).password == SECRET
    assert parse_remote_url(f"redis://:{SECRET}@h:1", password="other").password == SECRET  # URL wins
    assert mask_secrets(f"rediss://u:{SECRET}@h:1/0") == "rediss://u:***@h:1/0"
    assert mask_secrets(f"unix:///s.sock?db=0&password={SECRET}") == "unix:///s.sock?db=0&password=***"
    assert mask_secrets(f"redis://:{SECRET}@a:1,b:2") == "redis://:***@a:1,b:2"
    with pytest.raises(ConfigError) as info:
        ECStoreConfig(remote_url=f"redis://:{SECRET}@h:notaport")
    assert SECRET not in str(info.value) and "***" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(env={"LMCACHE_EC_REMOTE_URL": f"lm://:{SECRET}@h:1"})
    assert SECRET not in str(info.value)
    cfg = ECStoreConfig(remote_url=f"redis://:{SECRET}@h:1", remote_password=SECRET)
    assert SECRET not in repr(cfg)
    shown = {k: v for k, v, _ in describe_config(cfg)}
    assert shown["remote_url"] == "redis://:***@h:1" and shown["remote_password"] == "***"


def test_precedence_is_that_of_every_ec_key(tmp_path: Path) -> None:
    yaml = tmp_path / "lmcache.yaml"
    yaml.write_text("remote_url: redis://kv-cache:6379/0\n"  # LMCache's KV-cache remote: not ours
                    "ec_remote_url: redis://from-file:1/0\n"
                    "ec_remote_timeout_seconds: 2\n")
    cfg = load_config(yaml, env={})
    assert cfg.remote_url == "redis://from-file:1/0" and cfg.remote_timeout_seconds == 2.0
    assert cfg.source_of("remote_url") == f"{yaml}:2"
    cfg = load_config(yaml, env={"LMCACHE_EC_REMOTE_URL": "redis://from-env:2/0"})
    assert (cfg.remote_url, cfg.source_of("remote_url")) == ("redis://from-env:2/0", "env LMCACHE_EC_REMOTE_URL")
    cfg = load_config(yaml, env={"LMCACHE_EC_REMOTE_URL": "redis://from-env:2/0"},
                      overrides={"remote_url": "redis://override:3/0"})
    assert cfg.remote_url == "redis://override:3/0"
    cfg = load_config(yaml, env={}, overrides={"remote_url": None})
    assert cfg.remote_url is None


def test_base_remote_url_belongs_to_lmcache(tmp_path: Path) -> None:
    yaml = tmp_path / "lmcache.yaml"
    yaml.write_text("remote_url: lm://localhost:65432\n")
    with pytest.warns(ConfigWarning, match="ec_remote_url"):  # a redis:// one is said to be ignored
        cfg = load_config(yaml, env={"LMCACHE_REMOTE_URL": "redis://kv:1/0"})
    assert cfg.remote_url is None and cfg.source_of("remote_url") == "default"


@pytest.mark.parametrize("where", ["file", "env"])
def test_a_base_remote_url_ecstore_speaks_warns_once_naming_ec_remote_url(tmp_path: Path, where: str) -> None:
    """``remote_url: "redis://..."`` (LMCache's KV-cache key) gave no remote
    tier and no word: it stays LMCache's, but a URL of a scheme ecstore
    speaks gets one ConfigWarning naming ec_remote_url, the password masked."""
    yaml = tmp_path / "lmcache.yaml"
    url = f"redis://:{SECRET}@kv:6379/0"
    yaml.write_text(f'remote_url: "{url}"\n' if where == "file" else "chunk_size: 256\n")
    env = {"LMCACHE_REMOTE_URL": url} if where == "env" else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(yaml, env=env)
    assert cfg.remote_url is None
    said = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert len(said) == 1, said
    assert "ec_remote_url" in said[0] and "LMCACHE_EC_REMOTE_URL" in said[0]
    assert (f"{yaml}:1" if where == "file" else "LMCACHE_REMOTE_URL") in said[0]
    assert SECRET not in said[0] and "redis://:***@kv:6379/0" in said[0]


@pytest.mark.parametrize("text, env", [
    ("remote_url: lm://localhost:65432\n", {}),  # LMCache's own remotes: quiet
    ("remote_url: mooncakestore://m:1\n", {}),
    ("remote_url: redis://kv:1/0\nec_remote_url: redis://ec:2/0\n", {}),  # the encoder cache has its own
    ("remote_url: redis://kv:1/0\nec_remote_url: null\n", {}),  # turned off on purpose
    ("remote_url: redis://kv:1/0\n", {"LMCACHE_EC_REMOTE_URL": "redis://ec:2/0"}),
])
def test_a_base_remote_url_is_quiet_when_lmcaches_or_when_ec_remote_url_is_set(tmp_path: Path, text: str,
                                                                               env: dict[str, str]) -> None:
    yaml = tmp_path / "lmcache.yaml"
    yaml.write_text(text)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(yaml, env=env)


def test_timeout_must_be_positive_with_a_remote() -> None:
    with pytest.raises(ConfigError, match="remote_timeout_seconds"):
        ECStoreConfig(remote_url="redis://h:1", remote_timeout_seconds=0)
    assert ECStoreConfig(remote_timeout_seconds=0).remote_url is None


def test_breaker_opens_after_threshold_and_probes_once() -> None:
    now = [0.0]
    b = CircuitBreaker(threshold=2, base_backoff_s=1.0, max_backoff_s=3.0, clock=lambda: now[0])
    assert b.allow() and b.record_failure() is None
    t = b.record_failure()
    assert t is not None and t.after is BreakerState.OPEN and t.backoff_s == 1.0
    assert not b.allow() and b.refusing()
    now[0] = 1.0
    assert b.allow() and not b.allow()  # one probe only
    assert b.record_failure().backoff_s == 2.0
    now[0] = 3.0
    assert b.allow()
    assert b.record_failure().backoff_s == 3.0  # capped
    now[0] = 6.0
    assert b.allow()
    assert b.record_success().after is BreakerState.CLOSED
    assert b.allow() and b.allow()


def test_breaker_replaces_a_probe_that_never_reported() -> None:
    now = [0.0]
    b = CircuitBreaker(threshold=1, base_backoff_s=1.0, max_backoff_s=4.0, clock=lambda: now[0])
    b.record_failure()
    now[0] = 1.0
    assert b.allow()  # a probe whose caller dies without reporting
    now[0] = 4.5
    assert not b.allow()
    now[0] = 5.5
    assert b.allow()  # not stuck half-open forever


def test_missing_redis_package_is_a_clear_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import torch

    from ecstore import ECStore

    monkeypatch.setitem(sys.modules, "redis", None)  # as if `pip install ecstore[redis]` was not run
    with pytest.raises(ConfigError, match=r"pip install 'ecstore\[redis\]'") as info:
        ECStore(ECStoreConfig(remote_url=f"redis://:{SECRET}@h:1"), model="m", dtype=torch.float32)
    assert SECRET not in str(info.value)


def test_tls_query_options_reach_the_cluster_client() -> None:
    from ecstore.remote.backend import _ssl_options

    url = "rediss+cluster://u:p@a:1,b:2?ssl_ca_certs=/etc/ca.pem&ssl_check_hostname=false&other=1"
    assert _ssl_options(url) == {"ssl_ca_certs": "/etc/ca.pem", "ssl_check_hostname": False}


# Passwords holding URL delimiters: each piece is distinctive, so that
# finding one in a message means the password leaked.
PIECES = ("Qz7sec", "Wx8ret", "Vb9pwd")


@pytest.mark.parametrize("userinfo, password", [
    (f"ecuser:{PIECES[0]}@{PIECES[1]}", f"{PIECES[0]}@{PIECES[1]}"),  # '@': the last '@' ends it
    (f"ecuser:{PIECES[0]}:{PIECES[1]}", f"{PIECES[0]}:{PIECES[1]}"),  # ':' after the first
    (f"ecuser:{PIECES[0]}%2F{PIECES[1]}%40{PIECES[2]}%3A", f"{PIECES[0]}/{PIECES[1]}@{PIECES[2]}:"),
    (f":{PIECES[0]}@{PIECES[1]}:{PIECES[2]}", f"{PIECES[0]}@{PIECES[1]}:{PIECES[2]}"),  # no user name
    (f"us@er:{PIECES[0]}", PIECES[0]),  # an '@' in the user name
], ids=["at", "colon", "percent-encoded", "no-user", "at-in-user"])
def test_password_with_url_delimiters_parses_and_is_masked(userinfo: str, password: str) -> None:
    """A password holding '@' or ':' (or any character percent-encoded) is
    the password redis-py uses, and no piece of it is shown: the mask runs
    to the last '@' of the host part (it stopped at the first, showing
    "redis://ecuser:***@tail@host"), in URLs, errors of a bad URL and the
    backend's description (what every log line names)."""
    from ecstore.remote.backend import RedisBackend

    url = f"redis://{userinfo}@127.0.0.1:1/0"
    t = parse_remote_url(url)
    assert t.password == password and t.hosts == (("127.0.0.1", 1),)
    backend = RedisBackend(t, 0.1)
    try:
        for shown in (mask_secrets(url), t.masked, backend.description):
            assert not any(p in shown for p in PIECES), shown
            assert shown.endswith("***@127.0.0.1:1/0")
        assert not any(p in repr(t) for p in PIECES)
    finally:
        backend.close()
    with pytest.raises(ConfigError) as info:
        parse_remote_url(url.replace(":1/0", ":notaport/0"))
    assert not any(p in str(info.value) for p in PIECES), str(info.value)
    assert "notaport" in str(info.value)  # the part after the password still names the problem


@pytest.mark.parametrize("delimiter", ["/", "?", "#"])
def test_password_with_an_unencoded_delimiter_never_shows_in_the_error(delimiter: str) -> None:
    """A password holding '/', '?' or '#' unencoded ends the host part early
    (as in redis-py: the URL is malformed, the password must be
    percent-encoded). The ConfigError masks everything up to the last '@'
    and quotes no piece of the URL ("port 's3cr' is not a number in
    'redis://ecuser:s3cr/et@...'" showed it twice)."""
    for url in (f"redis://ecuser:{PIECES[0]}{delimiter}{PIECES[1]}@ec-redis:6379/0",
                f"redis://:{PIECES[0]}{delimiter}{PIECES[1]}@ec-redis:6379/0",
                f"redis://{PIECES[0]}{delimiter}{PIECES[1]}@ec-redis:6379/0",
                f"rediss+cluster://ecuser:123{delimiter}{PIECES[1]}@a:1,b:2"):
        with pytest.raises(ConfigError) as info:
            ECStoreConfig(remote_url=url)
        assert not any(p in str(info.value) for p in PIECES), str(info.value)
        assert "percent-encode" in str(info.value)
        assert not any(p in mask_secrets(url) for p in PIECES), mask_secrets(url)


@pytest.mark.parametrize("url, why", [
    (f"redis://ecuser:{PIECES[0]}@{PIECES[1]}@h:1/x", "database 'x' is not a number"),
    (f"redis://u:{PIECES[0]}@h:1/x?ssl_ca_certs=/etc/ca@{PIECES[1]}.pem", "database is not a number"),
    (f"ecuser:{PIECES[0]}@h:6379", "no scheme"),
    (f"redis://u:{PIECES[0]}@[::1:6379/0", "Invalid IPv6 URL"),
    (f"lm://u:{PIECES[0]}/{PIECES[1]}@h:1", "unsupported scheme"),
])
def test_every_bad_url_error_is_a_config_error_with_no_piece_of_the_password(url: str, why: str) -> None:
    """Whatever is wrong with a URL holding a password, the error is a
    ConfigError naming the problem and showing no piece of the password
    (a URL with no scheme was shown whole; a bracket left open raised
    urllib's ValueError)."""
    with pytest.raises(ConfigError, match=why) as info:
        ECStoreConfig(remote_url=url)
    assert not any(p in str(info.value) for p in PIECES[:1]), str(info.value)
    if "ssl_ca_certs" not in url:  # an '@' in a query value may end the password: hidden too
        assert not any(p in str(info.value) for p in PIECES), str(info.value)


@pytest.mark.parametrize("query", ["socket_timeout=soon", "health_check_interval=often"])
def test_a_query_option_redis_py_rejects_is_a_config_error(query: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from ecstore import ECStore
    from ecstore.cli import main as dump_main

    url = f"redis://:{SECRET}@127.0.0.1:1/0?{query}"
    with pytest.raises(ConfigError, match=query.split("=")[0]) as info:
        ECStore(ECStoreConfig(remote_url=url), model="m", dtype=torch.float32)
    assert SECRET not in str(info.value)
    assert dump_main(["list", url]) == 2  # one clear error line, no traceback
    err = capsys.readouterr().err
    assert query.split("=")[0] in err and SECRET not in err and "Traceback" not in err


@pytest.mark.parametrize("written", ["0123", "123", "0x1f", "1.50", "true", "2024-01-01"])
def test_password_written_as_a_yaml_number_is_refused_not_rewritten(tmp_path: Path, written: str) -> None:
    """``ec_remote_password: 0123`` was sent as '83' (YAML octal); any
    number, boolean or date is refused with a hint to quote it, and the
    message never shows the value."""
    path = tmp_path / "ec.yaml"
    path.write_text(f"ec_remote_password: {written}\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path), env={})
    msg = str(info.value)
    assert "remote_password" in msg and "quote it" in msg and f"{path}:1" in msg
    assert written not in msg and "83" not in msg
    path.write_text(f"ec_remote_password: '{written}'\n")
    assert load_config(str(path), env={}).remote_password == written
    assert load_config(env={"LMCACHE_EC_REMOTE_PASSWORD": written}).remote_password == written
    with pytest.raises(ConfigError, match="remote_password"):
        load_config(env={}, overrides={"remote_password": 123})


@pytest.mark.parametrize("text, line", [
    (f'chunk_size: 256\nec_remote_url: "redis://ecuser:{SECRET}@cache:6379/0\n', 3),   # unclosed quote
    (f"ec_remote_url: redis://ecuser:{SECRET}@cache:6379/0\n  x: [1\n", 2),           # bad indentation
    (f"ec_remote_url: [redis://ecuser:{SECRET}@cache:6379/0\nb: 1\n", 2),             # unclosed list
    (f"ec_remote_url: redis://ecuser:{SECRET}@cache:6379/0 @ x: y\n", 1),
    (f"ec_remote_url: !<redis://ecuser:{SECRET}@cache:6379/0> x\n", 1),            # the URL as a tag
])
def test_malformed_yaml_error_never_shows_the_url_password(tmp_path: Path, text: str, line: int) -> None:
    """PyYAML's message quotes the offending line (a snippet with a caret):
    the URL password was in the ConfigError. Now: problem, context and marks
    only, masked and bounded."""
    path = tmp_path / "ec.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), env={})
    msg = str(info.value)
    assert SECRET not in msg and "malformed YAML" in msg and f"line {line}" in msg, msg
    assert "^" not in msg and "\n" not in msg and len(msg) < 700


@pytest.mark.parametrize("ttl", [0.0001, 0.0004, 0.00099, 5e-324])
def test_remote_ttl_under_a_millisecond_is_refused(ttl: float) -> None:
    """The remote's expiry is whole milliseconds: a TTL in (0, 0.001) was
    sent as PX 0, which Redis refuses, so every remote write failed."""
    with pytest.raises(ConfigError, match=r"remote_ttl_seconds .*0 or at least 0\.001 s"):
        ECStoreConfig(remote_url="redis://h:1", remote_ttl_seconds=ttl)
    with pytest.raises(ConfigError, match=r"LMCACHE_EC_REMOTE_TTL_SECONDS.*0 or at least 0\.001 s"):
        load_config(env={"LMCACHE_EC_REMOTE_TTL_SECONDS": repr(ttl)})


def test_remote_limits_are_documented_and_enforced() -> None:
    from ecstore.config import settings_table

    rows = {r.name: r for r in settings_table()}
    assert rows["remote_timeout_seconds"].maximum == 86400
    assert rows["remote_ttl_seconds"].maximum == 366 * 86400
    assert rows["max_remote_queue_size"].maximum == 65536
    assert "0.001" in rows["remote_ttl_seconds"].expected
    for ttl in (0.0, 0.001, 366 * 86400.0):
        assert ECStoreConfig(remote_url="redis://h:1", remote_ttl_seconds=ttl).remote_ttl_seconds == ttl
    with pytest.raises(ConfigError, match="at most"):
        ECStoreConfig(remote_url="redis://h:1", remote_ttl_seconds=366 * 86400.0 + 1)
    docs = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    row = next(ln for ln in docs.splitlines() if ln.startswith("| `remote_ttl_seconds`"))
    assert "0.001" in row and "366" in row
    for key, limit in (("remote_timeout_seconds", "86400"), ("max_remote_queue_size", "65536")):
        assert limit in next(ln for ln in docs.splitlines() if ln.startswith(f"| `{key}`"))
