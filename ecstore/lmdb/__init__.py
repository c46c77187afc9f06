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

Layout (see :mod:`ecstore.lmdb.migrations`): sub-databases ``blobs`` (key -> safetensors
blob, or a pointer to the file holding it), ``entries`` (key -> packed Record), ``lru`` (u64 BE seq -> key) and
``meta`` (schema version, total bytes, next LRU sequence number). A blob, its
record and its LRU position are always written and removed in the same write
transaction, and ``total_bytes`` is updated in that transaction too, so the
accounting can never drift from the entries. A blob file is written whole
(into the page cache) before the transaction that points to it commits,
``fdatasync``ed right after that commit (before ``flush`` returns: visible
first, durable next, :mod:`ecstore.store.writer`), and deleted only after the one
that removed its entry did. A power loss between that commit and the sync
can tear the file: its read is a checked miss, never garbage.

Leases (pins against eviction while a loader is about to read an entry) live
in a second, tiny LMDB file, ``leases.mdb``, opened without fsync: they are
ephemeral, and keeping them apart means a scheduler taking a lease never
waits behind a writer committing a 100 MB blob.

Design notes
------------
* Map size. LMDB files never shrink and can only grow up to the map size, so
  the map size is what actually bounds the file. We use
  ``max(1.25 * cap, cap + 1 MiB)``. When fragmentation makes a commit hit the map
  limit (``MapFullError``), we evict extra least-recently-used entries in a
  separate transaction (pages freed by a committed transaction become
  reusable) and retry: a full map costs hit ratio, never a crash. Other
  writers committing meanwhile keep the write retrying (up to a deadline);
  it gives up only when nobody makes progress (:mod:`~ecstore.lmdb.full`).
* Readers. Read transactions are opened per call and closed before
  returning, so no reader pins old pages across calls; ``reader_check()``
  clears slots of dead processes at open and whenever the map fills.
* Durability. Blob files are written whole before their entries commit and
  ``fdatasync``ed (and ``blobs/`` ``fsync``ed) right after that commit, before
  ``flush`` returns (the store directory is ``fsync``ed once per handle
  before its first commit pointing into ``blobs/``). The environment is opened with
  ``metasync=False``: one fsync per commit; the newest commit can be lost on power failure (not on a
  process crash), integrity is preserved. ``sync()`` forces it to disk.
* Processes and threads. Any number of processes may open the same directory
  (LMDB serialises writers with a lock in ``lock.mdb``). Within a process
  one environment per directory is shared by all handles (LMDB forbids
  opening the same file twice in a process); every method is thread-safe.
  An environment must never be used across ``fork()``: the child gets
  ForkedStoreError. A forked child cannot open the same directory either
  while the parent had it open (py-lmdb refuses a second environment on the
  same files, and closing the inherited one may hang): StoreOpenError says
  so; use processes started with ``spawn``/``forkserver`` for that.
"""

from ecstore.lmdb.batch import PutRequest
from ecstore.lmdb.env import MiB, map_size_for
from ecstore.lmdb.full import MAPFULL_PATIENCE_S, MAPFULL_STUCK_RETRIES
from ecstore.lmdb.tier import LMDBTier

__all__ = ["LMDBTier", "PutRequest", "map_size_for", "MiB", "MAPFULL_PATIENCE_S", "MAPFULL_STUCK_RETRIES"]
