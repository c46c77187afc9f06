"""Compatibility re-exports: the LMDB tier moved to the :mod:`ecstore.lmdb`
package. New code imports from there (``from ecstore.lmdb import LMDBTier,
PutRequest``); this module only keeps imports of branches written before
the move working."""

from .lmdb import LMDBTier as LMDBTier
from .lmdb import PutRequest as PutRequest
from .lmdb.env import _SharedEnv as _SharedEnv
from .lmdb.env import map_size_for as map_size_for
from .lmdb.txn import _SEQ as _SEQ
from .lmdb.txn import _U64 as _U64
from .lmdb.txn import _u64 as _u64
