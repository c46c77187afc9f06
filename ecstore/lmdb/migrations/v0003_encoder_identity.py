"""Schema 3: encoder identities (namespaces).

From schema 3 on, entries are written with record version 2, whose
identifier is a stored name ``"<namespace>/<mm identifier>"`` (see
``ecstore.identity``), and their keys hash that name. Adds the ``namespaces``
sub-database, ``namespace (32 hex, ASCII) -> identity description (JSON)``,
which every writer fills in when it opens the store, so tools can say what an
entry's namespace stands for.

Entries already stored (record version 1) are kept as they are: they have no
identity, so they are never served (reads check the record version), and
``ecstore-dump list`` shows them with namespace ``-`` and ``purge --namespace
none`` removes them. They also leave through LRU eviction as usual.
"""

import lmdb

VERSION = 3


def upgrade(env: lmdb.Environment, txn: lmdb.Transaction) -> None:
    env.open_db(b"namespaces", txn=txn, create=True)
