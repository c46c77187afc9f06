"""Numbered schema migrations of the ecstore LMDB file.

Each ``vNNNN_name.py`` module defines ``VERSION`` (the schema version it
produces) and ``upgrade(env, txn)``, which brings a store at ``VERSION - 1``
to ``VERSION`` inside the given write transaction. ``ecstore.lmdb.schema`` applies
all pending migrations in one transaction when a store is opened, so a crash
mid-upgrade leaves the store exactly as it was.
"""
