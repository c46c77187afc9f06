"""Schema 1: blobs, entry records and store metadata.

Sub-databases (keys are UTF-8 EC keys unless said otherwise):
  blobs    key -> safetensors blob
  entries  key -> packed Record (see ecstore.format.codec)
  meta     b"schema_version" -> ASCII int, b"total_bytes" -> u64 LE (sum of
           blob sizes), b"next_seq" -> u64 LE (next LRU sequence number)
In schema 1 eviction order is only the ``lru_seq`` field of each record.
"""

import struct

import lmdb

VERSION = 1


def upgrade(env: lmdb.Environment, txn: lmdb.Transaction) -> None:
    env.open_db(b"blobs", txn=txn, create=True)
    env.open_db(b"entries", txn=txn, create=True)
    meta = env.open_db(b"meta", txn=txn, create=True)
    txn.put(b"total_bytes", struct.pack("<Q", 0), db=meta)
    txn.put(b"next_seq", struct.pack("<Q", 1), db=meta)
