"""Limits of ecstore's settings and the checks that enforce them.

Sizes are in GiB (2**30 bytes), durations in seconds. :data:`NUMBER_MAX` is
the policy table of upper bounds; :func:`check_size` is what
:class:`~ecstore.config.ECStoreConfig` runs on every numeric field and
:func:`normalize_local_disk` what it runs on ``local_disk``. Pure functions,
thread-safe.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any
from urllib.parse import unquote, urlparse

from ecstore.config.redact import short_repr
from ecstore.errors import ConfigError
from ecstore.lmdb.tier import MAX_LEASE_SECONDS  # the lease file's bound

GiB = 1 << 30

#: Largest size any ``max_*_size`` key accepts, in GiB (64 TiB): LMDB maps
#: 1.25x the disk cap into the address space (x86-64 user space is 128 TiB).
MAX_SIZE_GIB = 64 * 1024
#: Longest expiry of values written to the remote, in seconds (366 days).
MAX_TTL_SECONDS = 366 * 86400.0

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
NUMBER_KINDS = {
    "max_local_cpu_size": "a size in GiB",
    "max_local_disk_size": "a size in GiB",
    "max_write_queue_size": "a size in GiB",
    "lease_seconds": "a duration in seconds",
    "min_file_blob_size": "a size in MiB",
    "remote_timeout_seconds": "a duration in seconds",
    "remote_ttl_seconds": "a duration in seconds",
    "max_remote_queue_size": "a size in GiB",
}
NUMBER_MAX = {
    "max_local_cpu_size": float(MAX_SIZE_GIB),
    "max_local_disk_size": float(MAX_SIZE_GIB),
    "max_write_queue_size": float(MAX_SIZE_GIB),
    "lease_seconds": MAX_LEASE_SECONDS,
    "min_file_blob_size": float(MAX_SIZE_GIB),  # MiB
    "remote_timeout_seconds": MAX_LEASE_SECONDS,
    "remote_ttl_seconds": MAX_TTL_SECONDS,
    "max_remote_queue_size": float(MAX_SIZE_GIB),
}
#: Smallest value other than 0, where a smaller positive one cannot work: the
#: remote's expiry is sent in whole milliseconds (``PX``), and a TTL under
#: 1 ms would be ``PX 0``, which Redis refuses (every write would fail).
NUMBER_MIN_POSITIVE = {
    "remote_ttl_seconds": 0.001,
}


def unit_of(name: str) -> str:
    """The unit of numeric field ``name`` in messages: GiB, MiB or s."""
    if name == "min_file_blob_size":
        return "MiB"
    return "GiB" if "size" in name else "s"


def too_big(name: str, number: float) -> str | None:
    """Why ``number`` is out of range for ``name`` (over its limit, or a
    positive value under its smallest usable one), or None."""
    top = NUMBER_MAX.get(name)
    if top is not None and number > top:
        return f"at most {top:g} {unit_of(name)}"
    low = NUMBER_MIN_POSITIVE.get(name)
    if low is not None and 0 < number < low:
        return f"0 or at least {low:g} {unit_of(name)}"
    return None


def check_size(name: str, value: Any, source: str) -> float:
    """``value`` of the numeric field ``name`` as a float within its limit
    (:data:`NUMBER_MAX`); :class:`ConfigError` naming ``source`` otherwise."""
    kind = NUMBER_KINDS.get(name, "a number")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} (from {source}): expected {kind} (a number >= 0), got {short_repr(value)}")
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    if math.isnan(v) or math.isinf(v) or v < 0:
        raise ConfigError(f"{name} (from {source}): expected {kind} (a finite number >= 0), "
                          f"got {short_repr(value)}")
    limit = too_big(name, v)
    if limit is not None:
        raise ConfigError(f"{name} (from {source}): expected {kind}, {limit}; got {short_repr(value)}")
    return v
