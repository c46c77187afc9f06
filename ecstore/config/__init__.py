"""Encoder-cache configuration.

:class:`ECStoreConfig` is the validated, immutable set of values an
:class:`ecstore.ECStore` is opened with. Sizes are in GiB (2**30 bytes), as in
LMCache's YAML; the ``*_bytes`` properties give them in bytes.

:func:`load_config` builds one from LMCache-style YAML, environment
variables and overrides, remembering where every value came from
(:attr:`ECStoreConfig.sources`, :meth:`ECStoreConfig.source_of`,
:func:`describe_config`).

Modules: :mod:`.settings` (the dataclass and the table of settings as data),
:mod:`.limits` (upper bounds, size and path checks), :mod:`.parsers` (value
parsers), :mod:`.sources` (merging file, environment and overrides with
provenance), :mod:`.yaml_file` (bounded YAML reading with line numbers),
:mod:`.lmcache_keys` (LMCache's own keys, ignored quietly).
"""

from __future__ import annotations

from ecstore.config.limits import (
    MAX_LEASE_SECONDS,
    MAX_SIZE_GIB,
    NUMBER_KINDS,
    NUMBER_MAX,
    GiB,
    check_size,
    normalize_local_disk,
)
from ecstore.config.lmcache_keys import LMCACHE_KEY_PREFIXES, LMCACHE_KEYS
from ecstore.config.settings import (
    CONFIG_FILE_ENV,
    CONFIG_FILE_KEY,
    EC_ENV_PREFIX,
    EC_KEY_PREFIX,
    EC_ONLY_KEYS,
    EC_SECTION,
    ENV_PREFIX,
    KEYS,
    SECRET_KEYS,
    ConfigWarning,
    ECStoreConfig,
    KeySpec,
    SettingInfo,
    describe_config,
    settings_table,
)
from ecstore.config.sources import load_config
from ecstore.config.yaml_file import MAX_CONFIG_BYTES

__all__ = [
    "CONFIG_FILE_ENV", "CONFIG_FILE_KEY", "EC_ENV_PREFIX", "EC_KEY_PREFIX", "EC_ONLY_KEYS", "EC_SECTION",
    "ENV_PREFIX", "GiB", "KEYS", "LMCACHE_KEYS", "LMCACHE_KEY_PREFIXES", "MAX_CONFIG_BYTES", "MAX_LEASE_SECONDS",
    "MAX_SIZE_GIB", "NUMBER_KINDS", "NUMBER_MAX", "SECRET_KEYS", "ConfigWarning", "ECStoreConfig", "KeySpec",
    "SettingInfo", "check_size", "describe_config", "load_config", "normalize_local_disk", "settings_table",
]
