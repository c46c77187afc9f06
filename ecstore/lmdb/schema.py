"""Schema versioning: find the store's version and apply :mod:`ecstore.lmdb.migrations`.

The schema version lives in the ``meta`` sub-database under
``b"schema_version"``. ``ensure_schema`` opens or upgrades a store:

* empty environment  -> every migration, in one write transaction;
* older version      -> the pending migrations, in one write transaction
                        (version re-read inside it, so two processes opening
                        at once upgrade exactly once);
* newer version      -> SchemaError naming both versions; nothing written;
* no ``meta`` at all -> StoreOpenError (an LMDB file that is not ecstore's).
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from functools import lru_cache
from types import ModuleType

import lmdb

from ecstore.errors import SchemaError, StoreOpenError
from ecstore.lmdb import migrations as migrations_pkg

_NAME = re.compile(r"^v(\d{4})_\w+$")

#: ``begin(write=...)``: a transaction as a context manager (committed at the
#: end of the block). LMDBTier passes its own, which handles MDB_MAP_RESIZED.
Begin = Callable[..., ContextManager[lmdb.Transaction]]


def _plain_begin(env: lmdb.Environment) -> Begin:
    @contextlib.contextmanager
    def begin(write: bool = False) -> Iterator[lmdb.Transaction]:
        with env.begin(write=write) as txn:
            yield txn
    return begin


@lru_cache(maxsize=1)
def migrations() -> tuple[ModuleType, ...]:
    """All migrations (the modules ``vNNNN_name`` of :mod:`ecstore.lmdb.migrations`),
    ordered by version; versions must be 1..N without gaps."""
    names = sorted(m.name for m in pkgutil.iter_modules(migrations_pkg.__path__) if _NAME.match(m.name))
    mods = [importlib.import_module(f"{migrations_pkg.__name__}.{n}") for n in names]
    for i, m in enumerate(mods, 1):
        if m.VERSION != i:
            raise SchemaError(f"migration {m.__name__} has VERSION {m.VERSION}, expected {i}")
    return tuple(mods)


def current_version() -> int:
    """The schema version this ecstore writes."""
    return len(migrations())


def read_version(env: lmdb.Environment, begin: Begin | None = None) -> int | None:
    """Schema version of an open environment; None for an empty one."""
    with (begin or _plain_begin(env))(write=False) as txn:
        if txn.get(b"meta") is None:  # named DBs are keys of the main DB
            if _main_is_empty(txn):
                return None
            raise StoreOpenError("not an ecstore store: the LMDB file has no 'meta' database")
        # With a transaction: a bare open_db() takes the write lock holding
        # the GIL, and deadlocks against a writer thread of this process.
        meta = env.open_db(b"meta", txn=txn, create=False)
        raw = txn.get(b"schema_version", db=meta)
    if raw is None:
        raise StoreOpenError("not an ecstore store: no schema_version in 'meta'")
    text = bytes(raw)
    if not (text.isdigit() and text.isascii()) or int(text) < 1:
        # Never re-run migrations over a store with data: they would reset
        # total_bytes and the LRU sequence.
        raise StoreOpenError(
            f"damaged: its meta record schema_version is {text[:40]!r} (a store has version 1 or "
            f"more); move the store away or restore a copy")
    return int(text)


def _main_is_empty(txn: lmdb.Transaction) -> bool:
    with txn.cursor() as cur:
        return not cur.first()


def ensure_schema(env: lmdb.Environment, *, readonly: bool, path: str, target: int | None = None,
                  begin: Begin | None = None) -> int:
    """Bring ``env`` to ``target`` (default: current) and return its version.

    ``begin`` opens its transactions (default: plain ``env.begin``); the
    caller holds whatever lock its write transactions need."""
    target = current_version() if target is None else target
    begin = begin or _plain_begin(env)
    try:
        version = read_version(env, begin)
    except StoreOpenError as e:
        raise StoreOpenError(f"{path} is {e}") from None  # say which directory
    if version is not None and version > current_version():
        raise SchemaError(
            f"store at {path} has schema version {version}, newer than this ecstore "
            f"supports ({current_version()}); upgrade ecstore. The store was not modified."
        )
    if version is not None and version >= target:
        check_meta(env, path, begin)
        return version
    if readonly and version is None:
        raise SchemaError(
            f"store at {path} is empty: no ecstore schema yet (another process may be creating it at this "
            f"moment: try again; or one died before writing it: open it read-write once)")
    if readonly:
        raise SchemaError(
            f"store at {path} has schema version {version}, older than {target}; "
            f"open it once read-write to upgrade it (read-only access does not migrate)"
        )
    with begin(write=True) as txn:
        meta = env.open_db(b"meta", txn=txn, create=True)
        raw = txn.get(b"schema_version", db=meta)
        version = int(raw) if raw is not None else 0
        for mig in migrations()[version:target]:
            mig.upgrade(env, txn)
            txn.put(b"schema_version", str(mig.VERSION).encode(), db=meta)
    check_meta(env, path, begin)
    return max(version, target)


#: Meta records every schema keeps as u64 little-endian counters.
_U64_META = (b"total_bytes", b"next_seq")


def check_meta(env: lmdb.Environment, path: str, begin: Begin | None = None) -> None:
    """StoreOpenError unless ``total_bytes`` and ``next_seq`` are 8-byte
    counters (a tampered or damaged meta record would break every write)."""
    with (begin or _plain_begin(env))() as txn:
        meta = env.open_db(b"meta", txn=txn, create=False)
        for name in _U64_META:
            raw = txn.get(name, db=meta)
            if raw is None or len(raw) != 8:
                found = "missing" if raw is None else f"{len(raw)} bytes"
                raise StoreOpenError(
                    f"store at {path} is damaged: its meta record {name.decode()} is {found} (expected an "
                    f"8-byte counter); move the store away or restore a copy")
