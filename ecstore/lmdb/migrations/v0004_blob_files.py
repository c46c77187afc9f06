"""Schema 4: large blobs in files of their own.

From schema 4 on, a value of the ``blobs`` sub-database is either the
safetensors blob itself (as before) or a pointer to a file in the store's
``blobs/`` directory holding it: 8 magic bytes that no blob starts with,
the file's size (u64 LE) and its name (ASCII). Writers keep blobs of at
least ``min_file_blob_size`` (default 512 KiB) in files: one copy into the page
cache and an ``fdatasync`` instead of LMDB's copy into freshly faulted
memory plus its ``pwrite`` (see ``ecstore.lmdb.blobfiles``). The new
``files`` sub-database, ``file name (ASCII) -> EC key``, lists every blob
file a committed entry points to (written and removed in the entry's
transaction), so finding the files a crash left behind reads that small
index instead of every blob. Records, the
LRU index, the byte accounting (a file's bytes count like an inline blob's)
and every existing entry are unchanged, so nothing is rewritten; the version
bump makes older ecstore releases refuse the store instead of taking a
pointer for a damaged blob.
"""

import lmdb

VERSION = 4


def upgrade(env: lmdb.Environment, txn: lmdb.Transaction) -> None:
    """Inline blobs stay valid: only the (empty) ``files`` index is added."""
    env.open_db(b"files", txn=txn, create=True)
