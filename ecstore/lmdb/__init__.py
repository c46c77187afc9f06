"""The persistent tier: one LMDB environment in the ``local_disk`` directory.

This package is ecstore's only I/O seam: every byte that reaches or leaves
the disk goes through :class:`~ecstore.lmdb.tier.LMDBTier`. One job per
module:

* :mod:`~ecstore.lmdb.env`: the per-process environment registry, map
  sizing, the data-file and lease-file checks.
* :mod:`~ecstore.lmdb.txngate`: how a transaction begins, and
  ``MDB_MAP_RESIZED`` handling (a map another process grew).
* :mod:`~ecstore.lmdb.leases`: the lease table (``leases.mdb``) and its
  eviction-marker (tombstone) protocol.
* :mod:`~ecstore.lmdb.txn`: :class:`~ecstore.lmdb.txn.WriteTxn`, the write
  transaction: insert / remove / touch / evict; it alone keeps
  ``total_bytes`` and the LRU sequence counter.
* :mod:`~ecstore.lmdb.full`: what a write does when the map is full.
* :mod:`~ecstore.lmdb.blobfiles`: blobs of at least ``min_file_blob_size``
  as files of their own in ``blobs/`` (pointers in the ``blobs``
  sub-database), writer tokens and the sweep of a crash's leftovers.
* :mod:`~ecstore.lmdb.handle`: an open handle (schema check, sub-database
  handles, how transactions are begun); :mod:`~ecstore.lmdb.reads`: reads;
  :mod:`~ecstore.lmdb.batch`: write-batch records;
  :mod:`~ecstore.lmdb.tier`: :class:`~ecstore.lmdb.tier.LMDBTier` (write
  batches, deletes, leases, eviction at open).

Guarantees: a blob, its record and its LRU row are written and removed in
one write transaction with ``total_bytes``; any number of processes may open
one directory, every method is thread-safe, and an environment is never
used across ``fork()`` (ForkedStoreError). The layout and the design notes
(map size, readers, durability) are in docs/architecture.md.
"""

from ecstore.lmdb.batch import BatchPut
from ecstore.lmdb.env import MiB, map_size_for
from ecstore.lmdb.full import MAPFULL_PATIENCE_S, MAPFULL_STUCK_RETRIES
from ecstore.lmdb.tier import LMDBTier

__all__ = ["LMDBTier", "BatchPut", "map_size_for", "MiB", "MAPFULL_PATIENCE_S", "MAPFULL_STUCK_RETRIES"]
