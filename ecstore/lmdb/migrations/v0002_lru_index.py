"""Schema 2: an explicit LRU index.

Adds the ``lru`` sub-database, ``u64 BE lru_seq -> key``, so eviction takes the
least recently used entries with one cursor step instead of scanning every
record. Built here from the ``lru_seq`` already kept in each record, so the
eviction order of a schema-1 store carries over unchanged.
"""

import struct

import lmdb

VERSION = 2

_REC_LRU_SEQ = struct.Struct("<BQQQQ")  # version, created, last_access, hits, lru_seq


def upgrade(env: lmdb.Environment, txn: lmdb.Transaction) -> None:
    entries = env.open_db(b"entries", txn=txn, create=False)
    lru = env.open_db(b"lru", txn=txn, create=True)
    with txn.cursor(db=entries) as cur:
        for key, rec in cur:
            seq = _REC_LRU_SEQ.unpack_from(rec, 0)[4]
            txn.put(struct.pack(">Q", seq), bytes(key), db=lru)
