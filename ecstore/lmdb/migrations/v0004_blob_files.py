"""Schema 4: large blobs in files of their own.

A ``blobs`` value may now be a pointer to a file in ``blobs/`` (magic, u64 LE
size, ASCII name), and the new ``files`` sub-database maps each such file
name to its EC key. Nothing is rewritten; the version bump makes older
releases refuse the store instead of taking a pointer for a damaged blob.
Format and rationale: docs/format.md (blob files, schema versions).
"""

import lmdb

VERSION = 4


def upgrade(env: lmdb.Environment, txn: lmdb.Transaction) -> None:
    """Inline blobs stay valid: only the (empty) ``files`` index is added."""
    env.open_db(b"files", txn=txn, create=True)
