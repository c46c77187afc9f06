"""Store handles opened with test seams (:class:`ecstore.store.handle.OpenSeams`).

What tests need to open a handle differently -- an older schema, a small
LMDB map, a fake clock for the remote tier -- is not part of
:class:`~ecstore.ECStore`'s signature: these factories open a handle exactly
as ``ECStore(config, **kwargs)`` would (``kwargs``: ``model``, ``dtype``,
``readonly``, ``chunk_hasher``, ``identity``), through the handle's internal
seam, with one seam set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ecstore.config import ECStoreConfig
from ecstore.store import ECStore
from ecstore.store.handle import OpenSeams


def open_store_with_seams(config: ECStoreConfig, seams: OpenSeams, **kwargs: Any) -> ECStore:
    """``ECStore(config, **kwargs)`` opened with ``seams``."""
    return ECStore._with_seams(seams, config, **kwargs)


def open_store_at_schema(config: ECStoreConfig, schema_target: int | None, **kwargs: Any) -> ECStore:
    """A handle whose LMDB tier is created at (or an older store migrated
    to) schema ``schema_target`` instead of the current one (None: the
    current one), to test old stores and migrations."""
    return open_store_with_seams(config, OpenSeams(schema_target=schema_target), **kwargs)


def open_store_with_map_size(config: ECStoreConfig, map_size_bytes: int, **kwargs: Any) -> ECStore:
    """A handle whose LMDB map is ``map_size_bytes`` (smaller than the cap:
    a full map without filling a disk)."""
    return open_store_with_seams(config, OpenSeams(map_size_bytes=map_size_bytes), **kwargs)


def open_store_with_remote_clock(config: ECStoreConfig, clock: Callable[[], float] | None,
                                 **kwargs: Any) -> ECStore:
    """A handle whose remote tier's circuit breaker and negative cache read
    ``clock`` (monotonic seconds; None: the real one)."""
    return open_store_with_seams(config, OpenSeams() if clock is None else OpenSeams(remote_clock=clock),
                                 **kwargs)
