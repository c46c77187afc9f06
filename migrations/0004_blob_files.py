"""Schema 4: large blobs in files of their own.

From schema 4 on, a value of the ``blobs`` sub-database is either the
safetensors blob itself (as before) or a pointer to a file in the store's
``blobs/`` directory holding it: 8 magic bytes that no blob starts with,
the file's size (u64 LE) and its name (ASCII). Writers keep blobs of at
least ``min_file_blob_size`` (default 512 KiB) in files: one copy into the page
cache and an ``fdatasync`` instead of LMDB's copy into freshly faulted
memory plus its ``pwrite`` (see ``ecstore.lmdb.blobfiles``). Records, the
LRU index, the byte accounting (a file's bytes count like an inline blob's)
and every existing entry are unchanged, so nothing is rewritten; the version
bump makes older ecstore releases refuse the store instead of taking a
pointer for a damaged blob.
"""

VERSION = 4


def upgrade(env, txn) -> None:
    """Nothing to convert: inline blobs stay valid."""
