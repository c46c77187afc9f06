"""Encoder-cache configuration.

:class:`ECStoreConfig` is the validated, immutable set of values an
:class:`ecstore.ECStore` is opened with. Sizes are in GiB (2**30 bytes), as in
LMCache's YAML; the ``*_bytes`` properties give them in bytes.

:func:`load_config` (below) builds one from LMCache-style YAML, environment
variables and overrides, remembering where every value came from
(:attr:`ECStoreConfig.sources`, :meth:`ECStoreConfig.source_of`,
:func:`describe_config`).
"""

from __future__ import annotations

import difflib
import math
import os
import re
import stat
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import unquote, urlparse

import yaml

from .errors import ConfigError
from .redact import mask_value, short_repr
from .store_files import DEFAULT_FILE_MODE, check_file_mode
from .identity import check_namespace_pin
from .remote.url import mask_url, parse_remote_url

GiB = 1 << 30

#: Largest size any ``max_*_size`` key accepts, in GiB (64 TiB): LMDB maps
#: 1.25x the disk cap into the address space (x86-64 user space is 128 TiB).
MAX_SIZE_GIB = 64 * 1024
#: Longest lease, in seconds (one day): a lease pins an entry against
#: eviction until released; one that outlived its loader must expire.
MAX_LEASE_SECONDS = 86400.0

_FILE_SCHEME = re.compile(r"^file:", re.IGNORECASE)


def normalize_local_disk(value: Any, source: str = "ECStoreConfig argument") -> str | None:
    """Turn a ``local_disk`` value into an absolute directory path, or None.

    Accepts a plain path (relative paths resolve against the current working
    directory) or a ``file://`` URI. ``None`` or an empty string means no disk
    tier. Any other URI scheme raises :class:`ConfigError`.
    """
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ConfigError(
            f"local_disk (from {source}): expected a path or file:// URI, got {short_repr(value)}"
        )
    text = value.strip()
    if not text:
        return None
    shown = short_repr(value)
    if "://" in text or _FILE_SCHEME.match(text):
        parsed = urlparse(text)
        if parsed.scheme.lower() != "file":
            raise ConfigError(
                f"local_disk (from {source}): unsupported URI scheme {short_repr(parsed.scheme)} "
                f"in {shown}; expected a plain path or a file:// URI"
            )
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(
                f"local_disk (from {source}): file:// URI {shown} names host "
                f"{short_repr(parsed.netloc.rpartition('@')[2])}; only local paths are supported"
            )
        if parsed.query or parsed.fragment or "?" in text or "#" in text:
            raise ConfigError(
                f"local_disk (from {source}): file URI {shown} has a query ('?') or fragment ('#'), "
                f"which a directory cannot use; if they are part of the directory name, write them "
                f"percent-encoded (%3F for '?', %23 for '#') or give a plain path"
            )
        text = unquote(parsed.path)
        if not text:
            raise ConfigError(f"local_disk (from {source}): file URI {shown} has no path")
        if not text.startswith("/"):
            raise ConfigError(
                f"local_disk (from {source}): file URI {shown} needs an absolute path "
                f"(file:///abs/dir or file:/abs/dir); give a relative directory as a plain path"
            )
    if "\0" in text:
        raise ConfigError(f"local_disk (from {source}): the path {shown} contains a NUL byte")
    return os.path.abspath(os.path.expanduser(text))


# What each numeric field holds, for error messages, and its largest value.
_NUMBER_KINDS = {
    "max_local_cpu_size": "a size in GiB",
    "max_local_disk_size": "a size in GiB",
    "max_write_queue_size": "a size in GiB",
    "lease_seconds": "a duration in seconds",
    "remote_timeout_seconds": "a duration in seconds",
    "remote_ttl_seconds": "a duration in seconds",
    "max_remote_queue_size": "a size in GiB",
}
_NUMBER_MAX = {
    "max_local_cpu_size": float(MAX_SIZE_GIB),
    "max_local_disk_size": float(MAX_SIZE_GIB),
    "max_write_queue_size": float(MAX_SIZE_GIB),
    "lease_seconds": MAX_LEASE_SECONDS,
    "remote_timeout_seconds": MAX_LEASE_SECONDS,
    "remote_ttl_seconds": 366 * 86400.0,
    "max_remote_queue_size": float(MAX_SIZE_GIB),
}


def _too_big(name: str, number: float) -> str | None:
    """Why ``number`` is out of range for ``name``, or None."""
    top = _NUMBER_MAX.get(name)
    if top is not None and number > top:
        unit = "GiB" if "size" in name else "s"
        return f"at most {top:g} {unit}"
    return None


#: Keys read only from ecstore's own levels (ec_<key>, ec: {<key>}, LMCACHE_EC_<KEY>,
#: overrides): a base ``remote_url`` / ``LMCACHE_REMOTE_URL`` is LMCache's KV-cache remote.
EC_ONLY_KEYS = frozenset({"remote_url", "remote_password", "remote_timeout_seconds",
                          "remote_ttl_seconds", "max_remote_queue_size"})
#: Keys whose values are secrets (masked by describe_config and in messages).
SECRET_KEYS = frozenset({"remote_url", "remote_password"})


def _check_size(name: str, value: Any, source: str) -> float:
    kind = _NUMBER_KINDS.get(name, "a number")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} (from {source}): expected {kind} (a number >= 0), got {short_repr(value)}")
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    if math.isnan(v) or v < 0:
        raise ConfigError(f"{name} (from {source}): expected {kind} (a finite number >= 0), "
                          f"got {short_repr(value)}")
    limit = _too_big(name, v)
    if limit is not None:
        raise ConfigError(f"{name} (from {source}): expected {kind}, {limit}; got {short_repr(value)}")
    return v


@dataclass(frozen=True)
class ECStoreConfig:
    """Validated encoder-cache settings.

    Attributes:
        local_cpu: keep an in-memory (per-process) LRU tier above the disk tier.
        max_local_cpu_size: bound of the memory tier, GiB of tensor data.
        local_disk: directory of the LMDB store (absolute path after
            normalisation; ``file://`` URIs accepted), or None for memory only.
            There is no implicit default location.
        max_local_disk_size: bound of the disk tier, GiB of stored blobs. Must
            be > 0 when ``local_disk`` is set.
        max_write_queue_size: GiB of tensors waiting for the background LMDB
            writer before ``put`` blocks (back-pressure instead of unbounded
            memory).
        lease_seconds: how long an entry announced to a loader stays pinned
            against eviction if the loader never releases it.
        file_mode: mode of the store's files (directory: the same bits plus
            x): 0600 private (default), 0640/0660 to share the store with
            the directory's group on purpose. See docs/security.md.
        namespace: pins the weights part of the encoder identity (see
            ecstore.identity): None fingerprints the weights automatically;
            a string (at most 200 printable characters) replaces that
            fingerprint and the revision, e.g. to share entries between
            copies of one checkpoint or to mark a change the fingerprint
            cannot see. Change it whenever the weights change.
        share_client_uuids: store and serve items whose identifier is not a
            content hash (a client's ``multi_modal_uuids`` entry, used verbatim
            by vLLM). Default false: such items are neither stored nor looked
            up, since any client could name another image by the same uuid.
            Set it true where every client of the store is trusted (e.g. an
            encoder-disaggregated deployment whose proxy assigns the uuids).
        remote_url: the shared remote tier (Redis/Valkey, see
            docs/remote.md), or None. May hold a password: never logged
            (``repr`` leaves it out; :func:`describe_config` masks it).
        remote_password: password of the remote when the URL has none
            (normally ``LMCACHE_EC_REMOTE_PASSWORD``).
        remote_timeout_seconds: bound of connecting and of each socket
            read/write to the remote; also how long ``put`` waits for room
            in a full remote write queue before dropping that write.
        remote_ttl_seconds: expiry of values written to the remote (0: none;
            the server's ``maxmemory`` policy bounds it).
        max_remote_queue_size: GiB of tensors waiting for the background
            remote writer.
        sources: where each value came from (see :func:`load_config`): one
            entry per field when built by :func:`load_config`, plus
            ``"__file__"`` (absolute path of the YAML file read) and
            ``"config_file"`` (where that path was taken from) when a file
            was read.
    """

    local_cpu: bool = True
    max_local_cpu_size: float = 5.0
    local_disk: str | None = None
    max_local_disk_size: float = 0.0
    max_write_queue_size: float = 1.0
    lease_seconds: float = 120.0
    file_mode: int = DEFAULT_FILE_MODE
    namespace: str | None = None
    share_client_uuids: bool = False
    remote_url: str | None = field(default=None, repr=False)
    remote_password: str | None = field(default=None, repr=False)
    remote_timeout_seconds: float = 0.5
    remote_ttl_seconds: float = 0.0
    max_remote_queue_size: float = 0.25
    # Where each value came from ("default", "path:line", "env VAR", "override KEY").
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        src = lambda k: self.sources.get(k, "ECStoreConfig argument")  # noqa: E731
        if not isinstance(self.share_client_uuids, bool):
            raise ConfigError(f"share_client_uuids (from {src('share_client_uuids')}): expected true or "
                              f"false, got {short_repr(self.share_client_uuids)}")
        if not isinstance(self.local_cpu, bool):
            raise ConfigError(
                f"local_cpu (from {src('local_cpu')}): expected true or false, got {short_repr(self.local_cpu)}"
            )
        for name in ("max_local_cpu_size", "max_local_disk_size", "max_write_queue_size", "lease_seconds",
                     "remote_timeout_seconds", "remote_ttl_seconds", "max_remote_queue_size"):
            object.__setattr__(self, name, _check_size(name, getattr(self, name), src(name)))
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


# ---------------------------------------------------------------------------
# Loading: defaults < YAML base keys < LMCACHE_<KEY> < YAML ec_<key>/ec: <key>
#          < LMCACHE_EC_<KEY> < overrides
# ---------------------------------------------------------------------------

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


_TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
_FALSE_WORDS = frozenset({"false", "0", "no", "off"})


def _parse_bool(value: Any) -> bool:
    """A boolean: YAML true/false, the ints 1/0, or one of the strings
    true/false, 1/0, yes/no, on/off in any case. Anything else is ValueError."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    raise ValueError


def _parse_number(value: Any, name: str = "") -> float:
    """A finite number >= 0: an int, a float or a numeric string ("2.5"),
    at most the limit of key ``name`` (see ``_NUMBER_MAX``).

    Booleans, NaN, infinities, negatives, numbers over the limit and other
    strings are ValueError (the limit named in its message)."""
    if isinstance(value, str):
        try:
            value = float(value.strip()[:400])
        except ValueError:
            raise ValueError from None  # "lots"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError
    try:
        number = float(value)
    except OverflowError:
        raise ValueError from None
    if math.isnan(number) or number < 0:
        raise ValueError
    limit = _too_big(name, number)
    if limit is not None:
        raise ValueError(limit)
    if math.isinf(number):
        raise ValueError
    return number


def _parse_file_mode(value: Any) -> int:
    """An octal mode: a YAML octal int (``0660``, which YAML reads as 432)
    or a string ``"0660"`` / ``"660"`` / ``"0o660"``. A decimal int such as
    660 (YAML without the leading 0) is refused, not misread."""
    if isinstance(value, str):
        text = value.strip().lower().removeprefix("0o")
        if not text or any(c not in "01234567" for c in text):
            raise ValueError
        return check_file_mode(int(text, 8))
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError
    if value in (600, 640, 660):
        raise ValueError(f"{value} is decimal here: write 0{value} (YAML octal) or quote it as '0{value}'")
    return check_file_mode(value)


def _parse_local_disk(value: Any, source: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError
    if "," in value:
        raise ValueError(
            "ecstore needs a single directory; LMCache's comma-separated multi-disk "
            "form is not supported here, give the encoder cache its own ec_local_disk"
        )
    return normalize_local_disk(value, source)


def _parse_remote_url(value: Any, source: str) -> str | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        raise ConfigError(f"remote_url (from {source}): expected a redis:// URL, got a {type(value).__name__}")
    parse_remote_url(value, source)  # ConfigError with the URL masked
    return value.strip()


def _parse_secret(value: Any, source: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise ConfigError(f"remote_password (from {source}): expected a string, got a {type(value).__name__}")
    return str(value) or None


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
        lambda v, _s: _parse_bool(v), "keep the in-memory LRU tier"),
    "max_local_cpu_size": KeySpec(
        "float", "GiB", _SIZE, lambda v, _s: _parse_number(v, "max_local_cpu_size"),
        "bound of the memory tier"),
    "local_disk": KeySpec(
        "path", "-", "a directory path or file:// URI (null or empty for no disk tier)",
        _parse_local_disk, "directory of the persistent (LMDB) tier; none = memory only"),
    "max_local_disk_size": KeySpec(
        "float", "GiB", _SIZE, lambda v, _s: _parse_number(v, "max_local_disk_size"),
        "bound of the disk tier; must be > 0 when local_disk is set"),
    "max_write_queue_size": KeySpec(
        "float", "GiB", _SIZE, lambda v, _s: _parse_number(v, "max_write_queue_size"),
        "tensors queued for the background disk writer before put() blocks"),
    "lease_seconds": KeySpec(
        "float", "s", f"a duration in seconds: a finite number >= 0, at most {MAX_LEASE_SECONDS:g}",
        lambda v, _s: _parse_number(v, "lease_seconds"),
        "how long an entry handed to a loader stays pinned against eviction"),
    "file_mode": KeySpec(
        "octal", "-", "an octal file mode: 0600 (private, default), 0640 or 0660 (shared with the group)",
        lambda v, _s: _parse_file_mode(v),
        "mode of the store's files; the directory gets the same bits plus x (0700/0750/0770)"),
    "namespace": KeySpec(
        "str", "-", "a string of at most 200 printable characters (null or empty: automatic)",
        lambda v, _s: check_namespace_pin(v if v is None or isinstance(v, str) else str(v)),
        "pin the weights part of the encoder identity (default: fingerprint the weights)"),
    "share_client_uuids": KeySpec(
        "bool", "-", "true or false (also yes/no, on/off, 1/0, in any case)",
        lambda v, _s: _parse_bool(v),
        "store and serve items named by client multi_modal_uuids (trusting every client)"),
    "remote_url": KeySpec(
        "url", "-", "redis://host:port/db, rediss://, redis+cluster://h1:p1,h2:p2 or unix:///path",
        lambda v, s: _parse_remote_url(v, s),
        "shared remote tier (Redis/Valkey); none = local tiers only (docs/remote.md)"),
    "remote_password": KeySpec(
        "str", "-", "a string (the remote's password; prefer LMCACHE_EC_REMOTE_PASSWORD)",
        lambda v, s: _parse_secret(v, s), "password of the remote when remote_url has none"),
    "remote_timeout_seconds": KeySpec(
        "float", "s", "a duration in seconds: a finite number > 0",
        lambda v, _s: _parse_number(v, "remote_timeout_seconds"),
        "bound of each remote connect/read/write; a slower remote is a miss"),
    "remote_ttl_seconds": KeySpec(
        "float", "s", "a duration in seconds: a finite number >= 0 (0: no expiry)",
        lambda v, _s: _parse_number(v, "remote_ttl_seconds"), "expiry of values written to the remote"),
    "max_remote_queue_size": KeySpec(
        "float", "GiB", _SIZE, lambda v, _s: _parse_number(v, "max_remote_queue_size"),
        "tensors queued for the background remote writer"),
}

assert set(KEYS) == {f.name for f in fields(ECStoreConfig)} - {"sources"}

# Keys LMCache defines for its KV cache (current names, aliases and legacy
# names). They may appear in the shared YAML, bare or ec_-prefixed (LMCache's
# own EC engine reads ec_<key>), and are ignored without a warning.
LMCACHE_KEYS: frozenset[str] = frozenset("""
    chunk_size local_cpu max_local_cpu_size local_cpu_use_hugepages reserve_local_cpu_size
    local_disk local_disk_path_sharding max_local_disk_size max_local_cache_size local_device
    remote_url remote_serde remote_config_url app_id use_layerwise save_decode_cache
    save_unfull_chunk pre_caching_hash_algorithm pipelined_backend backend
    enable_blending blend_recompute_ratio blend_recompute_ratios blend_thresholds
    blend_check_layers blend_min_tokens blend_special_str blend_separator
    blend_add_special_in_precomp retrieve_locations store_location
    enable_p2p p2p_host p2p_init_ports p2p_lookup_ports lookup_url distributed_url
    mp_host mp_port enable_controller controller_url controller_pull_url controller_reply_url
    lmcache_instance_id lmcache_worker_port lmcache_worker_ports lmcache_worker_ids
    lmcache_worker_heartbeat_delay_time lmcache_worker_heartbeat_time
    enable_pd enable_xpyd pd_role pd_buffer_size pd_buffer_device pd_peer_host
    pd_peer_init_port pd_peer_alloc_port pd_peer_query_port pd_proxy_host pd_proxy_port
    transfer_channel enable_nixl nixl_role nixl_backends nixl_buffer_size nixl_buffer_device
    nixl_receiver_host nixl_receiver_port nixl_enable_gc nixl_peer_host nixl_peer_port
    nixl_peer_init_port nixl_peer_alloc_port nixl_proxy_host nixl_proxy_port
    gds_path gds_path_sharding gds_buffer_size gds_backend use_gds cufile_buffer_size weka_path
    maru_path maru_pool_size audit_actual_remote_url extra_config blocking_timeout_secs
    external_lookup_client py_enable_gc cache_policy cost_aware_half_life_seconds
    cost_aware_ewma_alpha numa_mode enable_async_loading internal_api_server_enabled
    internal_api_server_host internal_api_server_port_start
    internal_api_server_include_index_list internal_api_server_socket_path_prefix
    priority_limit plugin_locations runtime_plugin_locations external_backends storage_plugins
    remote_storage_plugins lookup_timeout_ms min_retrieve_tokens hit_miss_ratio
    lookup_server_worker_ids enable_scheduler_bypass_lookup script_allowed_imports
    enable_lazy_memory_allocator lazy_memory_initial_ratio lazy_memory_expand_trigger_ratio
    lazy_memory_step_ratio lazy_memory_safe_size enable_chunk_statistics enable_kv_events
    use_gpu_connector_v3 pin_timeout_sec pin_check_interval_sec enable_hidden_state_cache
    max_hidden_state_cpu_size hidden_state_layers hidden_states_retrieve_mode
""".split())

# Whole families of LMCache keys (new ones appear with each release).
LMCACHE_KEY_PREFIXES: tuple[str, ...] = (
    "pd_", "nixl_", "p2p_", "blend_", "gds_", "lmcache_worker_", "internal_api_server_",
    "lazy_memory_", "chunk_statistics_", "controller_", "lookup_",
)


def _is_lmcache_key(key: str) -> bool:
    return key in LMCACHE_KEYS or key.startswith(LMCACHE_KEY_PREFIXES)


def _closest(key: str, spelled: Callable[[str], str]) -> str:
    """Message tail "; did you mean 'X'?" naming the valid key nearest ``key``
    (ecstore's keys first, then LMCache's), spelled by ``spelled`` in the
    caller's form (``ec_x``, ``ec.x``, ``LMCACHE_EC_X``); the list of
    ecstore's keys when nothing is close."""
    for candidates in (KEYS, sorted(LMCACHE_KEYS)):
        match = difflib.get_close_matches(key, [c for c in candidates if c != key], n=1, cutoff=0.6)
        if match:
            return f"; did you mean {spelled(match[0])!r}?"
    return f"; ecstore's keys are: {', '.join(spelled(k) for k in KEYS)}"


@dataclass(frozen=True)
class _Setting:
    """One raw value as found in one source."""

    value: Any
    source: str  # "default", "/abs/ec.yaml:5", "env VAR", "override key"
    spelled: str  # the key as the user wrote it, for messages


# Precedence, lowest first (built-in defaults sit below all of them).
_LEVELS = ("file", "env", "ec_file", "ec_env", "override")
# Levels addressed to LMCache as well as ecstore: only their effective value is
# validated, so a shadowed value LMCache accepts but ecstore would not (e.g. a
# comma-separated local_disk) does not break the encoder cache.
_SHARED_LEVELS = frozenset({"file", "env"})


def _parse(key: str, setting: _Setting) -> Any:
    spec = KEYS[key]
    try:
        return spec.parse(setting.value, setting.source)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        detail = str(exc) if isinstance(exc, ValueError) and exc.args else ""
        raise ConfigError(
            f"{setting.spelled} (from {setting.source}): expected {spec.expected}, "
            f"got {short_repr(setting.value)}" + (f" ({short_repr(detail)[1:-1]})" if detail else "")
        ) from None


def _put(layer: dict[str, _Setting], key: str, setting: _Setting) -> None:
    previous = layer.get(key)
    if previous is not None:
        raise ConfigError(
            f"{key} is set twice for the same level: {previous.spelled} (from "
            f"{previous.source}) and {setting.spelled} (from {setting.source}); keep one"
        )
    layer[key] = setting


#: Largest config file read, in bytes (a YAML config is a few KiB).
MAX_CONFIG_BYTES = 1 << 20


def _read_bounded(path: str, what: str) -> bytes:
    """The bytes of a regular file (or a pipe, e.g. ``<(...)``), at most
    MAX_CONFIG_BYTES; a device, socket or directory is refused without
    reading it (``/dev/zero`` would never end)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{what} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"{what} cannot be read: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError(f"{what} is a directory, not a YAML file")
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            raise ConfigError(f"{what} is not a regular file (a device or socket); give a YAML file")
        os.set_blocking(fd, True)
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError(f"{what} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{what} is larger than {MAX_CONFIG_BYTES >> 20} MiB; a config file is a few "
                          f"lines of YAML")
    return b"".join(chunks)


def _read_yaml(path: str, origin: str) -> list[tuple[Any, Any, int, list[tuple[Any, Any, int]] | None]]:
    """Top-level entries of the YAML mapping in ``path`` as (key, value, line, ec).

    ``ec`` is the (key, value, line) list of a nested ``ec:`` mapping (value
    None), else None. Lines are 1-based. An empty file yields no entries.
    ``origin`` (where the path was named) goes into file-level errors.
    """
    what = f"config file {path} (from {origin})"
    data = _read_bounded(path, what)

    loader: yaml.SafeLoader | None = None
    try:
        loader = yaml.SafeLoader(data)  # ReaderError for bytes that are not UTF-8/16
        loader.name = path  # marks in YAML's messages then name the file
        root = loader.get_single_node()
        if root is None or (isinstance(root, yaml.ScalarNode) and loader.construct_object(root) is None):
            return []  # empty file, comments only, or a lone "---"
        if not isinstance(root, yaml.MappingNode):
            kind = "a list" if isinstance(root, yaml.SequenceNode) else "a single value"
            raise ConfigError(
                f"{what}: the top level must be a mapping of keys to values, got {kind} "
                f"at line {root.start_mark.line + 1}"
            )

        def pairs(node: yaml.MappingNode) -> list[tuple[Any, yaml.Node, int]]:
            loader.flatten_mapping(node)  # resolve "<<" merge keys
            out = []
            for key_node, value_node in node.value:
                key = loader.construct_object(key_node, deep=True)
                if not isinstance(key, (str, int, float, bool)) and key is not None:
                    key = repr(key)  # a list or mapping used as a key
                out.append((key, value_node, key_node.start_mark.line + 1))
            return out

        entries: list[tuple[Any, Any, int, list[tuple[Any, Any, int]] | None]] = []
        for key, value_node, line in pairs(root):
            if key == EC_SECTION and isinstance(value_node, yaml.MappingNode):
                nested = [(k, loader.construct_object(v, deep=True), ln) for k, v, ln in pairs(value_node)]
                entries.append((key, None, line, nested))
                continue
            value = loader.construct_object(value_node, deep=True)
            if key == EC_SECTION:
                if value is not None:
                    raise ConfigError(
                        f"{EC_SECTION} (from {path}:{line}): expected a mapping of ecstore "
                        f"keys (e.g. 'ec: {{max_local_disk_size: 64}}'), got {short_repr(value)}"
                    )
                entries.append((key, None, line, []))
            else:
                entries.append((key, value, line, None))
        return entries
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{what}: malformed YAML{where}: {exc}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _collect_file(path: str, origin: str, layers: dict[str, dict[str, _Setting]]) -> None:
    for key, value, line, nested in _read_yaml(path, origin):
        src = f"{path}:{line}"
        if key == EC_SECTION:
            for sub, sub_value, sub_line in nested or []:
                sub_src = f"{path}:{sub_line}"
                if isinstance(sub, str) and sub in KEYS:
                    _put(layers["ec_file"], sub, _Setting(sub_value, sub_src, f"ec.{sub}"))
                elif not (isinstance(sub, str) and _is_lmcache_key(sub)):
                    raise ConfigError(
                        f"unknown key {EC_SECTION}.{sub} (from {sub_src})"
                        + _closest(str(sub), lambda k: f"{EC_SECTION}.{k}")
                    )
        elif isinstance(key, str) and key.startswith(EC_KEY_PREFIX):
            name = key[len(EC_KEY_PREFIX):]
            if name in KEYS:
                _put(layers["ec_file"], name, _Setting(value, src, key))
            elif not _is_lmcache_key(name):
                raise ConfigError(
                    f"unknown key {key} (from {src})"
                    + _closest(name, lambda k: f"{EC_KEY_PREFIX}{k}")
                )
        elif isinstance(key, str) and key in KEYS:
            _put(layers["file"], key, _Setting(value, src, key))
        elif not (isinstance(key, str) and _is_lmcache_key(key)):
            hint = _closest(str(key), str)
            if hint.startswith("; ecstore's keys"):
                hint = ""
            warnings.warn(
                f"{src}: ignoring unknown key {short_repr(key)} (neither an ecstore nor a known "
                f"LMCache key){hint}",
                ConfigWarning,
                stacklevel=3,
            )


def _unquote(text: str) -> str:
    """Strip one pair of matching surrounding quotes, as LMCache does for env values."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _collect_env(env: Mapping[str, str], layers: dict[str, dict[str, _Setting]]) -> None:
    for var in sorted(env):
        if var.startswith(EC_ENV_PREFIX):
            name = var[len(EC_ENV_PREFIX):].lower()
            if name in KEYS:
                _put(layers["ec_env"], name, _Setting(_unquote(env[var]), f"env {var}", name))
            elif not _is_lmcache_key(name):
                raise ConfigError(
                    f"unknown key {name} (from env {var})"
                    + _closest(name, lambda k: f"{EC_ENV_PREFIX}{k.upper()}")
                )
        elif var.startswith(ENV_PREFIX):
            # Other LMCACHE_* variables belong to LMCache: never an error here.
            name = var[len(ENV_PREFIX):].lower()
            if name in KEYS and var == f"{ENV_PREFIX}{name.upper()}":
                _put(layers["env"], name, _Setting(_unquote(env[var]), f"env {var}", name))


def _collect_overrides(overrides: Mapping[Any, Any], layers: dict[str, dict[str, _Setting]]) -> None:
    for key, value in overrides.items():
        if key == CONFIG_FILE_KEY:
            continue
        if isinstance(key, str) and key in KEYS:
            layers["override"][key] = _Setting(value, f"override {key}", key)
            continue
        if isinstance(key, str) and key.startswith(EC_KEY_PREFIX) and key[len(EC_KEY_PREFIX):] in KEYS:
            hint = f"; overrides take bare key names: did you mean {key[len(EC_KEY_PREFIX):]!r}?"
        elif isinstance(key, str) and _is_lmcache_key(key):
            raise ConfigError(
                f"{key!r} (from override {key}) is an LMCache setting that ecstore does not support; "
                f"ecstore's keys are: {', '.join(KEYS)}")
        else:
            hint = _closest(str(key), str)
        raise ConfigError(f"unknown key {short_repr(key)} (from override {short_repr(key)}){hint}")


def _choose_file(
    path: str | os.PathLike[str] | None, env: Mapping[str, str], overrides: Mapping[Any, Any]
) -> tuple[str, str] | None:
    """(absolute path, where it was named) of the YAML file to read, or None."""
    candidates: Iterable[tuple[Any, str]] = (
        (path, "argument path"),
        (overrides.get(CONFIG_FILE_KEY), f"override {CONFIG_FILE_KEY}"),
        (env.get(CONFIG_FILE_ENV), f"env {CONFIG_FILE_ENV}"),
    )
    for value, origin in candidates:
        if value is None:
            continue
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str):
            raise ConfigError(f"config file (from {origin}): expected a path, got {short_repr(value)}")
        if "\0" in value:
            raise ConfigError(f"config file (from {origin}): the path {short_repr(value)} contains a NUL byte")
        if value.strip():
            return os.path.abspath(os.path.expanduser(value.strip())), origin
    return None


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ECStoreConfig:
    """Build the encoder-cache config from LMCache's YAML, env and overrides.

    Precedence, lowest to highest: built-in defaults < base keys of the YAML
    file < ``LMCACHE_<KEY>`` < ``ec_<key>`` / ``ec: {<key>: ...}`` in the
    YAML < ``LMCACHE_EC_<KEY>`` < ``overrides``.

    Args:
        path: YAML file to read. If None, ``overrides["config_file"]`` is used,
            else ``env["LMCACHE_CONFIG_FILE"]``, else no file is read. The
            file is never written.
        env: environment to read (default ``os.environ``).
        overrides: programmatic values (the vLLM connector's
            ``ec_connector_extra_config``): ecstore key names, plus an optional
            ``config_file``.

    Returns:
        An :class:`ECStoreConfig` whose ``sources`` names, for every field, the
        place its value came from.

    Raises:
        ConfigError: unreadable/malformed file, unknown ec key or
            ``LMCACHE_EC_*`` variable or override key, or a bad value.

    Warns:
        ConfigWarning: a base YAML key that neither ecstore nor LMCache knows.
    """
    env = os.environ if env is None else env
    overrides = {} if overrides is None else overrides
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"overrides: expected a mapping of ecstore keys, got {short_repr(overrides)}")

    layers: dict[str, dict[str, _Setting]] = {level: {} for level in _LEVELS}
    extra_sources: dict[str, str] = {}
    chosen = _choose_file(path, env, overrides)
    if chosen is not None:
        file_path, origin = chosen
        _collect_file(file_path, origin, layers)
        extra_sources = {"__file__": file_path, CONFIG_FILE_KEY: origin}
    _collect_env(env, layers)
    _collect_overrides(overrides, layers)

    # Values addressed to ecstore only are all validated (fail fast); shared
    # base values only when they are the effective ones.
    for level in _LEVELS:
        if level not in _SHARED_LEVELS:
            for key, own in layers[level].items():
                _parse(key, own)

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key in KEYS:
        for level in reversed(_LEVELS):
            setting = layers[level].get(key)
            if setting is not None and level in _SHARED_LEVELS and key in EC_ONLY_KEYS:
                continue  # LMCache's own remote_url (its KV cache's remote) is not ours
            if setting is not None:
                values[key] = _parse(key, setting)
                sources[key] = setting.source
                break
        else:
            sources[key] = "default"
    sources.update(extra_sources)
    return ECStoreConfig(**values, sources=sources)


def describe_config(cfg: ECStoreConfig) -> list[tuple[str, Any, str]]:
    """(key, effective value, source) rows, for ``ecstore-dump config``.

    The first row is ``("config_file", <abs path or None>, <where the path was
    named, or "default">)``; then one row per ECStoreConfig field. Secrets
    are masked (:func:`ecstore.redact.mask_value`: URL passwords, secret
    keys); ``file_mode`` is shown in octal (``"0600"``).
    """
    rows: list[tuple[str, Any, str]] = [
        (CONFIG_FILE_KEY, cfg.config_file, cfg.source_of(CONFIG_FILE_KEY))
    ]
    for key in KEYS:
        value = getattr(cfg, key)
        if key == "file_mode":
            value = f"{value:04o}"
        rows.append((key, _shown(key, value), cfg.source_of(key)))
    return rows


def _shown(key: str, value: Any) -> Any:
    """A value as it may be printed: passwords masked."""
    if key == "remote_password" and value:
        return "***"
    if key == "remote_url" and value:
        return mask_url(value)
    return mask_value(key, value)
