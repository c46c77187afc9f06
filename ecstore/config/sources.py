"""Loading the config: YAML file, ``LMCACHE_CONFIG_FILE``, ``ec_`` keys,
``LMCACHE_*`` / ``LMCACHE_EC_*`` environment and overrides, merged by level
with the provenance of every value.

Precedence, lowest first: defaults < YAML base keys < ``LMCACHE_<KEY>`` <
YAML ``ec_<key>`` / ``ec: {<key>}`` < ``LMCACHE_EC_<KEY>`` < overrides.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ecstore.config.lmcache_keys import LMCACHE_KEYS, is_lmcache_key
from ecstore.config.redact import short_repr
from ecstore.config.settings import (
    CONFIG_FILE_ENV,
    CONFIG_FILE_KEY,
    EC_ENV_PREFIX,
    EC_KEY_PREFIX,
    EC_ONLY_KEYS,
    EC_SECTION,
    ENV_PREFIX,
    KEYS,
    ConfigWarning,
    ECStoreConfig,
)
from ecstore.config.yaml_file import read_yaml
from ecstore.errors import ConfigError

#: Longest key or variable name quoted as written in a message; longer or
#: unprintable ones are shown through :func:`short_repr`.
_MAX_NAME = 100


def _name(text: Any) -> str:
    """A key or variable name as it may appear in a message: as written when
    short and printable, else bounded (and quoted) by :func:`short_repr`."""
    if isinstance(text, str) and len(text) <= _MAX_NAME and text.isprintable():
        return text
    return short_repr(text, _MAX_NAME)


def _closest(key: str, spelled: Callable[[str], str]) -> str:
    """Message tail "; did you mean 'X'?" naming the valid key nearest ``key``
    (ecstore's keys first, then LMCache's), spelled by ``spelled`` in the
    caller's form (``ec_x``, ``ec.x``, ``LMCACHE_EC_X``); the list of
    ecstore's keys when nothing is close (or ``key`` is too long to be a typo)."""
    for candidates in (KEYS, sorted(LMCACHE_KEYS)) if len(key) <= _MAX_NAME else ():
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
    """The typed value of one raw setting; :class:`ConfigError` naming where it came from."""
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
    """Add ``setting`` to one level; a key set twice within a level is an error."""
    previous = layer.get(key)
    if previous is not None:
        raise ConfigError(
            f"{key} is set twice for the same level: {previous.spelled} (from "
            f"{previous.source}) and {setting.spelled} (from {setting.source}); keep one"
        )
    layer[key] = setting


def _collect_file(path: str, origin: str, layers: dict[str, dict[str, _Setting]]) -> None:
    """The YAML file's ecstore keys into the ``file`` and ``ec_file`` levels."""
    for key, value, line, nested in read_yaml(path, origin):
        src = f"{path}:{line}"
        if key == EC_SECTION:
            for sub, sub_value, sub_line in nested or []:
                sub_src = f"{path}:{sub_line}"
                if isinstance(sub, str) and sub in KEYS:
                    _put(layers["ec_file"], sub, _Setting(sub_value, sub_src, f"ec.{sub}"))
                elif not (isinstance(sub, str) and is_lmcache_key(sub)):
                    raise ConfigError(
                        f"unknown key {_name(f'{EC_SECTION}.{sub}')} (from {sub_src})"
                        + _closest(str(sub), lambda k: f"{EC_SECTION}.{k}")
                    )
        elif isinstance(key, str) and key.startswith(EC_KEY_PREFIX):
            name = key[len(EC_KEY_PREFIX):]
            if name in KEYS:
                _put(layers["ec_file"], name, _Setting(value, src, key))
            elif not is_lmcache_key(name):
                raise ConfigError(
                    f"unknown key {_name(key)} (from {src})"
                    + _closest(name, lambda k: f"{EC_KEY_PREFIX}{k}")
                )
        elif isinstance(key, str) and key in KEYS:
            _put(layers["file"], key, _Setting(value, src, key))
        elif not (isinstance(key, str) and is_lmcache_key(key)):
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
    """Strip one pair of matching surrounding quotes, as LMCache's
    ``_parse_quoted_string`` does for env values: whitespace around the quotes
    goes with them (``' "/data/ec"'`` is ``/data/ec``); what is inside the
    quotes is kept as written. An unquoted value is returned unchanged."""
    stripped = text.strip()
    if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
        return stripped[1:-1]
    return text


def _collect_env(env: Mapping[str, str], layers: dict[str, dict[str, _Setting]]) -> None:
    """``LMCACHE_<KEY>`` and ``LMCACHE_EC_<KEY>`` variables into the ``env`` and ``ec_env`` levels."""
    for var in sorted(env):
        if var.startswith(EC_ENV_PREFIX):
            name = var[len(EC_ENV_PREFIX):].lower()
            if name in KEYS:
                _put(layers["ec_env"], name, _Setting(_unquote(env[var]), f"env {var}", name))
            elif not is_lmcache_key(name):
                raise ConfigError(
                    f"unknown key {_name(name)} (from env {_name(var)})"
                    + _closest(name, lambda k: f"{EC_ENV_PREFIX}{k.upper()}")
                )
        elif var.startswith(ENV_PREFIX):
            # Other LMCACHE_* variables belong to LMCache: never an error here.
            name = var[len(ENV_PREFIX):].lower()
            if name in KEYS and var == f"{ENV_PREFIX}{name.upper()}":
                _put(layers["env"], name, _Setting(_unquote(env[var]), f"env {var}", name))


def _collect_overrides(overrides: Mapping[Any, Any], layers: dict[str, dict[str, _Setting]]) -> None:
    """Programmatic overrides into the ``override`` level (bare key names only)."""
    for key, value in overrides.items():
        if key == CONFIG_FILE_KEY:
            continue
        if isinstance(key, str) and key in KEYS:
            layers["override"][key] = _Setting(value, f"override {key}", key)
            continue
        if isinstance(key, str) and key.startswith(EC_KEY_PREFIX) and key[len(EC_KEY_PREFIX):] in KEYS:
            hint = f"; overrides take bare key names: did you mean {key[len(EC_KEY_PREFIX):]!r}?"
        elif isinstance(key, str) and is_lmcache_key(key):
            raise ConfigError(
                f"{short_repr(key, _MAX_NAME)} (from override {_name(key)}) is an LMCache setting that "
                f"ecstore does not support; ecstore's keys are: {', '.join(KEYS)}")
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
        if not value.strip() and origin == "argument path":
            # An explicit "" is a mistake (an unset shell variable), not "use $LMCACHE_CONFIG_FILE".
            raise ConfigError(f"config file (from {origin}): the path is empty; give a YAML file, "
                              f"or None to fall back to {CONFIG_FILE_KEY} / ${CONFIG_FILE_ENV}")
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

    Precedence, lowest to highest: defaults < base YAML keys < ``LMCACHE_<KEY>``
    < ``ec_<key>`` / ``ec: {<key>: ...}`` < ``LMCACHE_EC_<KEY>`` < ``overrides``.
    The YAML is ``path``, else ``overrides["config_file"]``, else
    ``env["LMCACHE_CONFIG_FILE"]`` (``env`` defaults to ``os.environ``); it is
    never written. The result's ``sources`` names where each value came from.
    Raises ConfigError (bad file, unknown ec key, bad value); warns
    ConfigWarning (unknown base key, a base redis ``remote_url``). Details:
    docs/configuration.md#where-values-come-from-lowest-to-highest-precedence.
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
    effective: dict[str, tuple[str, _Setting]] = {}
    for key in KEYS:
        for level in reversed(_LEVELS):
            setting = layers[level].get(key)
            if setting is not None and level in _SHARED_LEVELS and key in EC_ONLY_KEYS:
                continue  # LMCache's own remote_url (its KV cache's remote) is not ours
            if setting is not None:
                values[key] = _parse(key, setting)
                sources[key] = setting.source
                effective[key] = (level, setting)
                break
        else:
            sources[key] = "default"
    sources.update(extra_sources)
    cfg = ECStoreConfig(**values, sources=sources)
    _warn_unused_sizes(cfg, effective)
    if "remote_url" not in effective:
        _warn_base_remote_url(layers)
    return cfg


def _warn_base_remote_url(layers: Mapping[str, Mapping[str, _Setting]]) -> None:
    """One ConfigWarning when the shared ``remote_url`` (LMCache's KV-cache
    remote: never the encoder cache's) names a server ecstore could use
    (``redis://``...) and no ``ec_remote_url`` is set, naming the key that
    turns the shared tier on. LMCache's own schemes (``lm://``...) stay quiet."""
    from ecstore.remote.url import mask_secrets, supported_scheme

    for level in reversed(_LEVELS):
        setting = layers[level].get("remote_url")
        if level in _SHARED_LEVELS and setting is not None:
            if supported_scheme(setting.value):
                warnings.warn(
                    f"{setting.spelled} {short_repr(mask_secrets(setting.value))} (from {setting.source}) is "
                    f"LMCache's KV-cache remote: the encoder cache does not use it and has no remote tier; "
                    f"to share encoder outputs through a Redis/Valkey server, set ec_remote_url "
                    f"(or LMCACHE_EC_REMOTE_URL)",
                    ConfigWarning,
                    stacklevel=3,
                )
            return


# A size the encoder cache is given on its own levels, and the tier it sizes.
_GATED_SIZES = (("max_local_cpu_size", "local_cpu", "ec_local_cpu: true"),
                ("max_local_disk_size", "local_disk", "ec_local_disk: /some/dir"))


def _warn_unused_sizes(cfg: ECStoreConfig, effective: Mapping[str, tuple[str, _Setting]]) -> None:
    """ConfigWarning when a size addressed to the encoder cache only
    (``ec_max_local_cpu_size``...) sizes a tier a shared level (the KV
    cache's ``local_cpu: false``, ``local_disk: null``) turned off."""
    for size_key, tier_key, fix in _GATED_SIZES:
        size = effective.get(size_key)
        tier = effective.get(tier_key)
        if (size is None or tier is None or size[0] in _SHARED_LEVELS or tier[0] not in _SHARED_LEVELS
                or getattr(cfg, tier_key)):
            continue
        warnings.warn(
            f"{size[1].spelled} (from {size[1].source}) sizes the encoder cache's {tier_key} tier, but "
            f"{tier[1].spelled} (from {tier[1].source}, shared with LMCache's KV cache) turns that tier "
            f"off, so the size is unused; set it for the encoder cache (e.g. {fix}) or drop the size",
            ConfigWarning,
            stacklevel=3,
        )
