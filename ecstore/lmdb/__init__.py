"""The persistent tier: one LMDB environment in the ``local_disk`` directory.

This package is ecstore's only I/O seam: every byte that reaches or leaves
the disk goes through :class:`~ecstore.lmdb.tier.LMDBTier`. Guarantees: a
blob, its record and its LRU row are written and removed in one write
transaction with ``total_bytes``; any number of processes may open one
directory, every method is thread-safe, and an environment is never used
across ``fork()`` (ForkedStoreError). Its modules, the layout and the design
notes: docs/architecture.md#the-lmdb-tier.
"""

from ecstore.lmdb.batch import BatchPut
from ecstore.lmdb.env import MiB, map_size_for
from ecstore.lmdb.full import MAPFULL_PATIENCE_S, MAPFULL_STUCK_RETRIES
from ecstore.lmdb.tier import LMDBTier

__all__ = ["LMDBTier", "BatchPut", "map_size_for", "MiB", "MAPFULL_PATIENCE_S", "MAPFULL_STUCK_RETRIES"]
