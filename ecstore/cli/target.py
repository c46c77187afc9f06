"""The store a command works on: PATH from the command line or the effective config.

Also the argument helpers shared by the entry commands (positional splitting,
"find this key or fail"). Nothing here writes to the store.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ecstore import maintenance
from ecstore.cli.exitcodes import CLIError
from ecstore.cli.files import PRIVATE_FILE_MODE
from ecstore.cli.format import human_size, printable, warn
from ecstore.config import ECStoreConfig, load_config, normalize_local_disk
from ecstore.errors import ConfigError
from ecstore.lmdb import LMDBTier
from ecstore.maintenance import Row, find_entries


@dataclass
class Target:
    """The store a command works on, and its cap when the config knows it."""

    path: str
    cfg: ECStoreConfig | None
    cap_bytes: int | None
    cap_source: str | None
    #: ``file_mode`` of the config when its ``local_disk`` is this store, else None.
    file_mode: int | None = None

    def cap_json(self, used: int) -> dict[str, Any]:
        """The cap fields of JSON output for ``used`` bytes."""
        return {
            "cap_bytes": self.cap_bytes,
            "cap_source": self.cap_source,
            "cap_used": (used / self.cap_bytes) if self.cap_bytes else None,
        }

    def cap_text(self, used: int) -> str:
        """The cap and fill for ``used`` bytes, as one phrase."""
        if not self.cap_bytes:
            return "cap unknown (max_local_disk_size not configured for this store)"
        return (f"cap {human_size(self.cap_bytes)} (from {self.cap_source}), "
                f"{used / self.cap_bytes * 100:.1f}% used")


def output_mode(target: Target) -> int:
    """Mode of files the tool writes (export): private unless the config of
    this store shares it with a group on purpose (``file_mode``)."""
    return PRIVATE_FILE_MODE if target.file_mode is None else target.file_mode


def load_effective_config(path: str | None, *, show_warnings: bool) -> ECStoreConfig:
    """The effective config (:func:`ecstore.config.load_config`); its warnings go to stderr when ``show_warnings``."""
    if path is not None and not path.strip():
        # Not "no --config": `--config "$UNSET"` must not read $LMCACHE_CONFIG_FILE instead.
        raise CLIError("--config: the path is empty; give a YAML file, or leave --config out "
                       "to use $LMCACHE_CONFIG_FILE")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(path)
    if show_warnings:
        for w in caught:
            warn(str(w.message))
    return cfg


def _same_dir(a: str, b: str) -> bool:
    """Do ``a`` and ``b`` name the same directory?"""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def resolve_target(args: argparse.Namespace) -> Target:
    """PATH from the command line, else ``local_disk`` of the effective config."""
    explicit = getattr(args, "path", None)
    cfg: ECStoreConfig | None = None
    try:
        cfg = load_effective_config(args.config, show_warnings=explicit is None)
    except ConfigError:
        # An explicit PATH does not need the config (only its cap): ignore a
        # broken ambient config, but not one named with --config.
        if explicit is None or args.config is not None:
            raise
    if explicit is not None:
        path = normalize_local_disk(explicit, "command line")
        if not path:
            raise CLIError("empty store path")
    else:
        assert cfg is not None
        if not cfg.local_disk:
            where = cfg.config_file or "no config file (LMCACHE_CONFIG_FILE unset)"
            raise CLIError(f"no store given: pass PATH, or set local_disk (ec_local_disk, "
                           f"LMCACHE_EC_LOCAL_DISK) in the config; config read: {where}")
        path = cfg.local_disk
    cap = src = mode = None
    if cfg is not None and cfg.local_disk and _same_dir(cfg.local_disk, path):
        mode = cfg.file_mode
        if cfg.disk_capacity_bytes:
            cap, src = cfg.disk_capacity_bytes, cfg.source_of("max_local_disk_size")
    return Target(path, cfg, cap, src, mode)


@contextlib.contextmanager
def open_readonly(target: Target) -> Iterator[LMDBTier]:
    """The store of ``target`` opened read-only: :func:`ecstore.maintenance.open_readonly`."""
    with maintenance.open_readonly(target.path, target.cap_bytes, target.file_mode) as tier:
        yield tier


def need_entries(tier: LMDBTier, target: Target, text: str, model: str | None) -> tuple[list[Row], str]:
    """Entries named by ``text`` (key or mm identifier); :class:`CLIError` when there are none."""
    rows, how = find_entries(tier, text, model)
    if not rows:
        extra = f" for model {model!r}" if model else ""
        raise CLIError(f"no entry with key or mm identifier '{printable(text)}'{extra} in {target.path}")
    return rows, how


def split_positionals(args: argparse.Namespace, names: Sequence[str], usage: str) -> None:
    """Map ``args.pos`` onto ``[path] + names``: PATH only when all are given."""
    pos = list(args.pos)
    if len(pos) == len(names) + 1:
        args.path = pos.pop(0)
    elif len(pos) == len(names):
        args.path = None
    else:
        raise CLIError(f"expected {usage}, got {len(pos)} argument(s)")
    for n, v in zip(names, pos):
        setattr(args, n, v)

