"""The settings of the encoder cache, as data.

* :class:`ECStoreConfig`: the validated, immutable values (defaults are its
  field defaults; sizes in GiB, durations in seconds);
* :data:`KEYS`: one :class:`KeySpec` per setting (type, unit, what is
  expected, parser, doc), the table the loader and ``describe_config`` use;
* :data:`EC_ONLY_KEYS`, :data:`SECRET_KEYS`: policies over those keys;
* the names of the places settings come from (``LMCACHE_CONFIG_FILE``,
  ``ec_`` keys, ``LMCACHE_EC_*``; read by :mod:`.sources`);
* :func:`settings_table`: name, type, unit, default, limit and doc of each;
* :func:`describe_config`: (key, value, source) rows with secrets masked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from ecstore.config.limits import (
    MAX_LEASE_SECONDS,
    MAX_SIZE_GIB,
    MAX_TTL_SECONDS,
    NUMBER_MAX,
    GiB,
    check_size,
    normalize_local_disk,
)
from ecstore.config.parsers import (
    parse_bool,
    parse_file_mode,
    parse_local_disk,
    parse_number,
    parse_remote_url_setting,
    parse_secret,
    parse_text,
)
from ecstore.config.redact import mask_value, short_repr
from ecstore.errors import ConfigError
from ecstore.identity import check_namespace_pin
from ecstore.lmdb.store_files import DEFAULT_FILE_MODE, check_file_mode
from ecstore.remote.url import parse_remote_url

EC_ONLY_KEYS = frozenset({"remote_url", "remote_password", "remote_timeout_seconds",
                          "remote_ttl_seconds", "max_remote_queue_size"})
#: Keys whose values are secrets (masked by describe_config and in messages).
SECRET_KEYS = frozenset({"remote_url", "remote_password"})


@dataclass(frozen=True)
class ECStoreConfig:
    """Validated, immutable encoder-cache settings (one field per key).

    Sizes are GiB (``min_file_blob_size``: MiB), durations seconds; defaults
    are the field defaults. ``sources`` maps each field to where its value
    came from (plus ``"__file__"`` and ``"config_file"`` when a YAML file was
    read). Secrets (``remote_url``, ``remote_password``) are left out of
    ``repr``. What each key means, its limits and accepted forms:
    docs/configuration.md#keys; per-key docs are :data:`KEYS`.
    """

    local_cpu: bool = True
    max_local_cpu_size: float = 5.0
    local_disk: str | None = None
    max_local_disk_size: float = 0.0
    max_write_queue_size: float = 2.0
    lease_seconds: float = 120.0
    file_mode: int = DEFAULT_FILE_MODE
    namespace: str | None = None
    share_client_uuids: bool = False
    pooled_blobs: bool = True
    split_reads: bool = True
    use_odirect: bool = True
    spare_blob_files: bool = True
    min_file_blob_size: float = 0.5
    remote_url: str | None = field(default=None, repr=False)
    remote_password: str | None = field(default=None, repr=False)
    remote_timeout_seconds: float = 0.5
    remote_ttl_seconds: float = 0.0
    max_remote_queue_size: float = 0.25
    # Where each value came from ("default", "path:line", "env VAR", "override KEY").
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        src = lambda k: self.sources.get(k, "ECStoreConfig argument")  # noqa: E731
        for name in ("local_cpu", "share_client_uuids", "pooled_blobs", "split_reads", "use_odirect",
                     "spare_blob_files"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} (from {src(name)}): expected true or false, "
                                  f"got {short_repr(getattr(self, name))}")
        for name in ("max_local_cpu_size", "max_local_disk_size", "max_write_queue_size", "lease_seconds",
                     "min_file_blob_size", "remote_timeout_seconds", "remote_ttl_seconds", "max_remote_queue_size"):
            object.__setattr__(self, name, check_size(name, getattr(self, name), src(name)))
        object.__setattr__(self, "local_disk", normalize_local_disk(self.local_disk, src("local_disk")))
        try:
            check_file_mode(self.file_mode)
        except ValueError as exc:
            raise ConfigError(f"file_mode (from {src('file_mode')}): got {short_repr(self.file_mode)}: {exc}") from None
        try:
            object.__setattr__(self, "namespace", check_namespace_pin(self.namespace))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"namespace (from {src('namespace')}): {e}, got {short_repr(self.namespace)}") from None
        for name in ("remote_url", "remote_password"):
            value = getattr(self, name)
            if isinstance(value, str) and not value.strip():
                object.__setattr__(self, name, None)
            elif value is not None and not isinstance(value, str):
                raise ConfigError(f"{name} (from {src(name)}): expected a string, got a {type(value).__name__}")
        if self.remote_url is not None:
            object.__setattr__(self, "remote_url", self.remote_url.strip())
            parse_remote_url(self.remote_url, src("remote_url"))
            if self.remote_timeout_seconds <= 0:
                raise ConfigError(f"remote_timeout_seconds (from {src('remote_timeout_seconds')}): must be "
                                  f"> 0 s when remote_url is set, got {self.remote_timeout_seconds:g}")
        if self.local_disk is not None and self.max_local_disk_size <= 0:
            raise ConfigError(
                f"max_local_disk_size is {self.max_local_disk_size:g} GiB (from "
                f"{src('max_local_disk_size')}) but local_disk is {self.local_disk!r} (from "
                f"{src('local_disk')}): a disk tier needs max_local_disk_size > 0 GiB. Set "
                f"max_local_disk_size (or ec_max_local_disk_size), or unset local_disk "
                f"(ec_local_disk: null) for a memory-only encoder cache"
            )

    @property
    def cpu_capacity_bytes(self) -> int:
        """Memory-tier bound in bytes (0 when the memory tier is disabled)."""
        return int(self.max_local_cpu_size * GiB) if self.local_cpu else 0

    @property
    def file_blobs_from_bytes(self) -> int:
        """``min_file_blob_size`` in bytes."""
        return int(self.min_file_blob_size * (1 << 20))

    @property
    def disk_capacity_bytes(self) -> int:
        """Disk-tier bound in bytes (0 when there is no disk tier)."""
        return int(self.max_local_disk_size * GiB) if self.local_disk else 0

    @property
    def write_queue_bytes(self) -> int:
        return max(1, int(self.max_write_queue_size * GiB))

    @property
    def remote_queue_bytes(self) -> int:
        return max(1, int(self.max_remote_queue_size * GiB))

    @property
    def config_file(self) -> str | None:
        """Absolute path of the YAML file :func:`load_config` read, or None."""
        return self.sources.get("__file__")

    def source_of(self, key: str) -> str:
        """Where the effective value of ``key`` came from.

        One of ``"default"``, ``"<abs path>:<line>"`` (YAML file),
        ``"env <VARIABLE>"`` or ``"override <key>"``. ``source_of("config_file")``
        tells where the YAML path itself was taken from (``"argument path"``,
        ``"override config_file"``, ``"env LMCACHE_CONFIG_FILE"``).
        """
        return self.sources.get(key, "default")


CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
"""Environment variable naming the LMCache YAML file shared with the KV cache."""

ENV_PREFIX = "LMCACHE_"
EC_ENV_PREFIX = "LMCACHE_EC_"
EC_KEY_PREFIX = "ec_"
EC_SECTION = "ec"
CONFIG_FILE_KEY = "config_file"
"""Key of ``overrides`` (the connector's extra config) naming the YAML file."""


class ConfigWarning(UserWarning):
    """A configuration oddity that is not fatal (e.g. an unknown base key)."""


@dataclass(frozen=True)
class KeySpec:
    """How one ecstore key is documented and parsed.

    ``parse(value, source)`` returns the typed value or raises ValueError
    (its message, if any, is appended to the error; a ConfigError it raises
    itself is passed through unchanged).
    """

    type: str
    unit: str
    expected: str
    parse: Callable[[Any, str], Any]
    doc: str


_SIZE = f"a size in GiB: a finite number >= 0, at most {MAX_SIZE_GIB} (e.g. 16 or 2.5)"

# Policy as data: every key ecstore reads, with its parser. Field names of
# ECStoreConfig; defaults come from the dataclass.
KEYS: dict[str, KeySpec] = {
    "local_cpu": KeySpec(
        "bool", "-", "true or false (also yes/no, on/off, 1/0, in any case)",
        lambda v, _s: parse_bool(v), "keep the in-memory LRU tier"),
    "max_local_cpu_size": KeySpec(
        "float", "GiB", _SIZE, lambda v, _s: parse_number(v, "max_local_cpu_size"),
        "bound of the memory tier"),
    "local_disk": KeySpec(
        "path", "-", "a directory path or file:// URI (null or empty for no disk tier)",
        parse_local_disk, "directory of the persistent (LMDB) tier; none = memory only"),
    "max_local_disk_size": KeySpec(
        "float", "GiB", _SIZE, lambda v, _s: parse_number(v, "max_local_disk_size"),
        "bound of the disk tier; must be > 0 when local_disk is set"),
    "max_write_queue_size": KeySpec(
        "float", "GiB", _SIZE, lambda v, _s: parse_number(v, "max_write_queue_size"),
        "tensors queued for the background disk writer before put() blocks"),
    "lease_seconds": KeySpec(
        "float", "s", f"a duration in seconds: a finite number >= 0, at most {MAX_LEASE_SECONDS:g}",
        lambda v, _s: parse_number(v, "lease_seconds"),
        "how long an entry handed to a loader stays pinned against eviction"),
    "file_mode": KeySpec(
        "octal", "-", "an octal file mode: 0600 (private, default), 0640 or 0660 (shared with the group)",
        lambda v, _s: parse_file_mode(v),
        "mode of the store's files; the directory gets the same bits plus x (0700/0750/0770)"),
    "namespace": KeySpec(
        "str", "-", "a string of at most 200 printable characters (null or empty: automatic)",
        lambda v, _s: check_namespace_pin(parse_text(v)),
        "pin the weights part of the encoder identity (default: fingerprint the weights)"),
    "share_client_uuids": KeySpec(
        "bool", "-", "true or false (also yes/no, on/off, 1/0, in any case)",
        lambda v, _s: parse_bool(v),
        "store and serve items named by client multi_modal_uuids (trusting every client)"),
    "pooled_blobs": KeySpec(
        "bool", "-", "true or false (also yes/no, on/off, 1/0, in any case)",
        lambda v, _s: parse_bool(v),
        "build each put's blob in the pool of already-faulted memory (false: fresh memory, to compare)"),
    "split_reads": KeySpec(
        "bool", "-", "true or false (also yes/no, on/off, 1/0, in any case)",
        lambda v, _s: parse_bool(v),
        "read disk-tier entries of 8 MiB and more on two cores (false: one core, for busy machines)"),
    "use_odirect": KeySpec(
        "bool", "-", "true or false (also yes/no, on/off, 1/0, in any case)",
        lambda v, _s: parse_bool(v),
        "write blob files of 4 MiB and more with O_DIRECT, past the page cache (false: through it)"),
    "spare_blob_files": KeySpec(
        "bool", "-", "true or false (also yes/no, on/off, 1/0, in any case)",
        lambda v, _s: parse_bool(v),
        "copy blobs of 4 MiB and more into a file made ahead in the page cache, visible in about a memcpy "
        "(false: a new file each time)"),
    "min_file_blob_size": KeySpec(
        "float", "MiB", f"a size in MiB: a finite number >= 0, at most {MAX_SIZE_GIB} (e.g. 4 or 0.5)",
        lambda v, _s: parse_number(v, "min_file_blob_size"),
        "blobs of at least this size are kept in files of their own (0: every blob)"),
    "remote_url": KeySpec(
        "url", "-", "redis://host:port/db, rediss://, redis+cluster://h1:p1,h2:p2 or unix:///path",
        lambda v, s: parse_remote_url_setting(v, s),
        "shared remote tier (Redis/Valkey); none = local tiers only (docs/remote.md)"),
    "remote_password": KeySpec(
        "str", "-", "a string (the remote's password; prefer LMCACHE_EC_REMOTE_PASSWORD)",
        lambda v, s: parse_secret(v, s), "password of the remote when remote_url has none"),
    "remote_timeout_seconds": KeySpec(
        "float", "s", f"a duration in seconds: a finite number > 0, at most {MAX_LEASE_SECONDS:g}",
        lambda v, _s: parse_number(v, "remote_timeout_seconds"),
        "bound of each remote call as a whole (connect, command, reply); a slower remote is a miss"),
    "remote_ttl_seconds": KeySpec(
        "float", "s", f"a duration in seconds: 0 (no expiry) or a finite number from 0.001 (1 ms, the "
        f"remote's resolution) to {MAX_TTL_SECONDS:g} (366 days)",
        lambda v, _s: parse_number(v, "remote_ttl_seconds"), "expiry of values written to the remote"),
    "max_remote_queue_size": KeySpec(
        "float", "GiB", _SIZE, lambda v, _s: parse_number(v, "max_remote_queue_size"),
        "tensors queued for the background remote writer"),
}

assert set(KEYS) == {f.name for f in fields(ECStoreConfig)} - {"sources"}


@dataclass(frozen=True)
class SettingInfo:
    """One row of :func:`settings_table`: everything known about a setting."""

    name: str
    type: str
    unit: str
    default: Any
    #: Largest accepted value (numbers only; in ``unit``), else None.
    maximum: float | None
    expected: str
    doc: str


def settings_table() -> list[SettingInfo]:
    """Every setting with its type, unit, default, limit and doc, in :data:`KEYS` order."""
    defaults = {f.name: f.default for f in fields(ECStoreConfig)}
    return [SettingInfo(name, spec.type, spec.unit, defaults[name], NUMBER_MAX.get(name), spec.expected, spec.doc)
            for name, spec in KEYS.items()]



def describe_config(cfg: ECStoreConfig) -> list[tuple[str, Any, str]]:
    """(key, effective value, source) rows, for ``ecstore-dump config``.

    The first row is ``("config_file", <abs path or None>, <where the path was
    named, or "default">)``; then one row per ECStoreConfig field. Secrets
    are masked (:func:`ecstore.config.redact.mask_value`: URL passwords, secret
    keys); ``file_mode`` is shown in octal (``"0600"``).
    """
    rows: list[tuple[str, Any, str]] = [
        (CONFIG_FILE_KEY, cfg.config_file, cfg.source_of(CONFIG_FILE_KEY))
    ]
    for key in KEYS:
        value = getattr(cfg, key)
        if key == "file_mode":
            value = f"{value:04o}"
        rows.append((key, mask_value(key, value), cfg.source_of(key)))
    return rows
