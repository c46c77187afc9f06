"""Config values the store cannot use are refused with a short, clear
ConfigError: out-of-range sizes and lease times, NUL bytes, ``file:`` URIs
without ``//``, URI queries/fragments, huge values in messages, LMCache keys
ecstore does not support, YAML numbers where text is meant
(``ec_namespace: 1.10``), bounded messages for huge names,
``min_file_blob_size``'s limit, quotes after whitespace in the environment,
YAML merge keys, sizes of a tier a shared level turned off."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ecstore import ECStore
from ecstore.config import NUMBER_MAX, ConfigWarning, ECStoreConfig, load_config, settings_table
from ecstore.errors import ConfigError

_SCRIPT = Path(sys.executable).parent / "ecstore-dump"
DUMP = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "ecstore.cli"]


@pytest.fixture(autouse=True)
def _no_ambient_config(no_lmcache_env: None) -> None:
    """Only the test configures ecstore."""


def load_error(**kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("key, value", [
    ("max_local_disk_size", 1e300),
    ("max_local_disk_size", 1e12),
    ("max_local_cpu_size", 1e300),
    ("max_write_queue_size", 10**40),
    ("lease_seconds", 1e11),
    ("min_file_blob_size", 1e9),
    ("min_file_blob_size", 65536.5),
])
def test_out_of_range_numbers_are_config_errors(tmp_path: Path, key: str, value: float) -> None:
    msg = load_error(overrides={"local_disk": str(tmp_path / "s"), "max_local_disk_size": 1, key: value})
    assert key in msg and "at most" in msg
    with pytest.raises(ConfigError, match="at most"):
        ECStoreConfig(**{"local_disk": str(tmp_path / "s"), "max_local_disk_size": 1.0, key: value})


def test_largest_allowed_values_open_a_config(tmp_path: Path) -> None:
    from ecstore.config import MAX_LEASE_SECONDS, MAX_SIZE_GIB

    cfg = load_config(env={}, overrides={"local_disk": str(tmp_path / "s"), "max_local_disk_size": MAX_SIZE_GIB,
                                         "lease_seconds": MAX_LEASE_SECONDS})
    assert cfg.disk_capacity_bytes == MAX_SIZE_GIB << 30


def test_config_command_reports_overflowing_size_without_traceback(tmp_path: Path) -> None:
    cfg = tmp_path / "ec.yaml"
    cfg.write_text(f"local_disk: {tmp_path / 's'}\nmax_local_disk_size: 1e300\n")
    r = subprocess.run(DUMP + ["config", "--config", str(cfg)], capture_output=True, text=True,
                       timeout=120, check=False,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("ecstore-dump: error: max_local_disk_size") and len(r.stderr.splitlines()) == 1


def test_nul_byte_in_local_disk(tmp_path: Path) -> None:
    bad = str(tmp_path) + "/a\0b"
    assert "NUL" in load_error(overrides={"local_disk": bad, "max_local_disk_size": 1})
    with pytest.raises(ConfigError, match="NUL"):
        ECStoreConfig(local_disk=bad, max_local_disk_size=1.0)
    assert "NUL" in load_error(path=str(tmp_path / "a\0.yaml"))


def test_file_uri_without_authority(tmp_path: Path) -> None:
    cfg = load_config(env={}, overrides={"local_disk": f"file:{tmp_path}/x", "max_local_disk_size": 1})
    assert cfg.local_disk == f"{tmp_path}/x"
    msg = load_error(overrides={"local_disk": "file:rel/dir", "max_local_disk_size": 1})
    assert "absolute" in msg and "file:rel/dir" in msg
    # A relative plain path with a colon is still a plain path.
    cfg = load_config(env={}, overrides={"local_disk": "cache:v2", "max_local_disk_size": 1})
    assert cfg.local_disk is not None and cfg.local_disk.endswith("/cache:v2")


@pytest.mark.parametrize("suffix", ["?mode=ro", "#frag", "?a=b#c"])
def test_file_uri_query_or_fragment_is_refused(tmp_path: Path, suffix: str) -> None:
    msg = load_error(overrides={"local_disk": f"file://{tmp_path}/x{suffix}", "max_local_disk_size": 1})
    assert "query" in msg or "fragment" in msg
    assert "%3F" in msg and "%23" in msg
    # Percent-encoded, they are part of the path.
    cfg = load_config(env={}, overrides={"local_disk": f"file://{tmp_path}/x%3Fy%23z", "max_local_disk_size": 1})
    assert cfg.local_disk == f"{tmp_path}/x?y#z"


def test_alias_bomb_in_a_bad_value_gives_a_short_message(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 7):  # 10**7 leaves: a 30 MB repr
        prev = f"*a{i - 1}"
        lines.append(f"a{i}: &a{i} [{', '.join([prev] * 10)}]")
    lines.append("ec_max_local_disk_size: *a6")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    msg = load_error(path=str(path))
    assert "ec_max_local_disk_size" in msg and len(msg) < 600


def test_long_value_is_truncated_in_the_message() -> None:
    msg = load_error(overrides={"max_local_disk_size": "9" * 100_000 + "x"})
    assert "max_local_disk_size" in msg and len(msg) < 600


@pytest.mark.parametrize("how", ["override", "env", "yaml"])
def test_unsupported_lmcache_key_is_named_as_such(tmp_path: Path, how: str) -> None:
    if how == "override":
        msg = load_error(overrides={"chunk_size": 256})
    elif how == "env":
        # LMCACHE_EC_<lmcache key> stays LMCache's (its own EC engine reads it): no error.
        assert load_config(env={"LMCACHE_EC_CHUNK_SIZE": "256"}).local_disk is None
        return
    else:
        path = tmp_path / "ec.yaml"
        path.write_text("ec:\n  chunk_size: 256\n")
        assert load_config(path=str(path), env={}).local_disk is None
        return
    assert "did you mean 'chunk_size'" not in msg
    assert "chunk_size" in msg and "LMCache" in msg and "not" in msg


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "ec.yaml"
    path.write_text(text)
    return str(path)


# -------------------------------------------------------------------------- YAML numbers are not text
@pytest.mark.parametrize("text, kind", [
    ("1.10", "number"), ("1.1", "number"), ("0123", "number"), ("0x1f", "number"), ("7", "number"),
    ("on", "boolean"), ("false", "boolean"), ("2024-01-01", "date"), ("[a, b]", "list"), ("{a: 1}", "dict"),
])
def test_namespace_written_as_a_yaml_number_is_refused_not_misread(tmp_path: Path, text: str, kind: str) -> None:
    """``ec_namespace: 1.10`` and ``1.1`` were both the pin '1.1', ``0123`` was
    '83', ``on`` 'True': different weights pins collided. Only text is a pin."""
    msg = load_error(path=write(tmp_path, f"ec_namespace: {text}\n"))
    assert "ec_namespace" in msg and kind in msg and f"{tmp_path}/ec.yaml:1" in msg
    if kind in ("number", "boolean", "date"):
        assert "quote it" in msg
    # Quoted, the text is kept as written; two different pins stay different.
    assert load_config(write(tmp_path, f"ec_namespace: '{text}'\n"), env={}).namespace == text
    with pytest.raises(ConfigError, match="namespace"):
        ECStoreConfig(namespace=1.1)  # type: ignore[arg-type]


def test_namespace_from_env_and_overrides_is_text() -> None:
    assert load_config(env={"LMCACHE_EC_NAMESPACE": "0123"}).namespace == "0123"
    assert load_config(env={}, overrides={"namespace": "1.10"}).namespace == "1.10"
    assert "quote it" in load_error(overrides={"namespace": 1.1})


# -------------------------------------------------------------------------- bounded messages
LONG = "A" * 200_000


@pytest.mark.parametrize("text", [
    f"ec_local_disk: !<{LONG}> 1\n",         # tag name quoted by PyYAML
    f"ec_local_disk: *{LONG}\n",             # undefined alias
    f"ec_local_disk: !!{LONG} 1\n",
    f"? ec_{LONG}\n: 1\n",                  # unknown ec_ key in explicit-key form
    f"ec:\n  ? {LONG}\n  : 1\n",           # unknown key under ec:
    f"? [{', '.join(['x'] * 50_000)}]\n: 1\n",  # a list as a key (warning, then bounded)
    f"a: [1, 2\n{LONG}: x\n",
])
def test_messages_about_huge_yaml_names_are_bounded(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            load_config(path, env={})
            msg = ""
        except ConfigError as exc:
            msg = str(exc)
    assert msg or caught
    for shown in [msg] + [str(w.message) for w in caught]:
        assert len(shown) < 1000, len(shown)


@pytest.mark.parametrize("env, overrides", [
    ({f"LMCACHE_EC_{LONG}": "1"}, {}),
    ({f"LMCACHE_EC_{LONG}\n": "1"}, {}),
    ({}, {f"pd_{LONG}": 1}),                  # an LMCache key (pd_* prefix) ecstore does not support
    ({}, {LONG: 1}),
])
def test_messages_about_huge_variable_or_override_names_are_bounded(env: dict[str, str],
                                                                      overrides: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=env, overrides=overrides)
    assert len(str(info.value)) < 1000 and "AAAA" in str(info.value)


# -------------------------------------------------------------------------- min_file_blob_size, inf, nan
def test_min_file_blob_size_has_the_documented_limit() -> None:
    row = next(r for r in settings_table() if r.name == "min_file_blob_size")
    assert row.maximum == 65536 and row.unit == "MiB"
    msg = load_error(overrides={"min_file_blob_size": 1e9})
    assert "at most 65536 MiB" in msg
    assert load_config(env={"LMCACHE_EC_MIN_FILE_BLOB_SIZE": "65536"}).file_blobs_from_bytes == 65536 << 20


NUMERIC_FIELDS = ["max_local_cpu_size", "max_local_disk_size", "max_write_queue_size", "lease_seconds",
                  "min_file_blob_size", "remote_timeout_seconds", "remote_ttl_seconds", "max_remote_queue_size"]


def test_every_numeric_field_has_a_limit() -> None:
    assert sorted(NUMBER_MAX) == sorted(NUMERIC_FIELDS)


@pytest.mark.parametrize("name", NUMERIC_FIELDS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_infinite_or_nan_numbers_are_config_errors(tmp_path: Path, name: str, value: float) -> None:
    """``min_file_blob_size=inf`` passed ECStoreConfig, then ECStore() raised
    OverflowError (int(inf)); every numeric field refuses inf and NaN."""
    with pytest.raises(ConfigError, match=name):
        ECStoreConfig(**{name: value})
    assert name in load_error(overrides={name: value})
    assert name in load_error(overrides={name: str(value)})


def test_infinite_min_file_blob_size_never_reaches_the_store(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        cfg = ECStoreConfig(local_disk=str(tmp_path / "s"), max_local_disk_size=1.0, min_file_blob_size=math.inf)
        ECStore(cfg, model="m", dtype=torch.float16).close()


# -------------------------------------------------------------------------- env quotes
@pytest.mark.parametrize("raw", [' "/data/ec"', "'/data/ec'  ", '\t"/data/ec"\n'])
def test_env_quotes_inside_whitespace_are_stripped(raw: str) -> None:
    """As LMCache's ``_parse_quoted_string``: strip, then one pair of quotes
    (the quotes were kept: ``<cwd>/"/data/ec"``)."""
    cfg = load_config(env={"LMCACHE_EC_LOCAL_DISK": raw, "LMCACHE_EC_MAX_LOCAL_DISK_SIZE": ' "1" '})
    assert (cfg.local_disk, cfg.max_local_disk_size) == ("/data/ec", 1.0)


def test_env_values_keep_what_the_quotes_hold() -> None:
    cfg = load_config(env={"LMCACHE_EC_REMOTE_PASSWORD": '" pw with spaces "', "LMCACHE_EC_NAMESPACE": " x "})
    assert cfg.remote_password == " pw with spaces "
    assert load_config(env={"LMCACHE_EC_REMOTE_PASSWORD": " unquoted "}).remote_password == " unquoted "


# -------------------------------------------------------------------------- YAML merge keys
@pytest.mark.parametrize("text, expected", [
    ("b: &b {max_local_disk_size: 1}\n<<: *b\nmax_local_disk_size: 2\n", 2.0),
    ("b: &b {max_local_disk_size: 1}\nmax_local_disk_size: 2\n<<: *b\n", 2.0),
    ("b: &b {max_local_disk_size: 1}\n<<: *b\n", 1.0),
    ("b: &b {max_local_disk_size: 1}\nec:\n  <<: *b\n  max_local_disk_size: 5\n", 5.0),
    ("b: &b {ec_max_local_disk_size: 1}\n<<: *b\nec: {max_local_disk_size: 6}\n", None),  # two forms: error
    # Two merged mappings setting one key: whichever yaml.safe_load (LMCache) keeps.
    ("a: &a {ec_max_local_disk_size: 3}\nb: &b {ec_max_local_disk_size: 4}\n<<: [*a, *b]\n", "safe_load"),
])
def test_yaml_merge_key_is_overridden_as_in_yaml(tmp_path: Path, text: str, expected: float | str | None) -> None:
    """A key written in the mapping beats the one merged by ``<<`` (as
    yaml.safe_load, i.e. LMCache, reads it); it was refused as set twice."""
    import yaml

    path = write(tmp_path, f"local_disk: {tmp_path / 's'}\n" + text)
    loaded = yaml.safe_load(Path(path).read_text())
    kept = [v for v in (loaded.get("max_local_disk_size"), loaded.get("ec_max_local_disk_size"),
                        (loaded.get("ec") or {}).get("max_local_disk_size")) if v is not None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)  # the anchors' keys a, b are unknown
        if expected is None:
            with pytest.raises(ConfigError, match="set twice"):
                load_config(path, env={})
            return
        cfg = load_config(path, env={})
    if expected == "safe_load":
        expected = float(loaded["ec_max_local_disk_size"])
    assert cfg.max_local_disk_size == expected and expected in kept


def test_key_written_twice_in_one_mapping_is_still_an_error(tmp_path: Path) -> None:
    msg = load_error(path=write(tmp_path, "max_local_disk_size: 1\nmax_local_disk_size: 2\n"))
    assert "set twice" in msg


# -------------------------------------------------------------------------- sizes of a tier turned off
@pytest.mark.parametrize("text, env, warned", [
    ("local_cpu: false\nec_max_local_cpu_size: 3\n", {}, "local_cpu"),
    ("ec_max_local_cpu_size: 3\n", {"LMCACHE_LOCAL_CPU": "no"}, "LMCACHE_LOCAL_CPU"),
    ("local_disk: null\nec_max_local_disk_size: 3\n", {}, "local_disk"),
    ("local_cpu: false\nec_local_cpu: false\nec_max_local_cpu_size: 3\n", {}, None),  # on purpose
    ("local_cpu: false\nmax_local_cpu_size: 3\n", {}, None),  # the KV cache's own sizes
    ("local_cpu: false\nec_local_cpu: true\nec_max_local_cpu_size: 3\n", {}, None),
])
def test_ec_size_of_a_tier_a_shared_level_turned_off_warns(tmp_path: Path, text: str, env: dict[str, str],
                                                           warned: str | None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(write(tmp_path, text), env=env)
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    if warned is None:
        assert messages == []
    else:
        assert len(messages) == 1 and warned in messages[0] and "unused" in messages[0], messages
