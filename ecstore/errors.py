"""Exceptions raised by ecstore.

Every error ecstore raises on purpose derives from :class:`ECStoreError`, so a
caller (the vLLM connector, for one) can catch the whole family in one place.
"""

from __future__ import annotations

import os


class ECStoreError(Exception):
    """Base class of every error ecstore raises deliberately."""


class ConfigError(ECStoreError, ValueError):
    """A configuration value is missing, malformed or out of range.

    The message names the key, where the value came from (file and line,
    environment variable, or programmatic override) and what was expected.
    """


class InvalidEntryError(ECStoreError, ValueError):
    """A tensor or identifier that the store refuses to hold.

    Raised before anything is written: the store is unchanged.
    """


class SchemaError(ECStoreError):
    """The on-disk store has a schema this version cannot open safely."""


class StoreOpenError(ECStoreError):
    """The ``local_disk`` location cannot be opened as an ecstore store
    (not a store, truncated or garbage data file, permissions...)."""


class StoreFullError(ECStoreError):
    """The persistent tier cannot make room for an entry (disk full, map full
    with nothing left to evict). Earlier entries are intact."""


class CorruptEntryError(ECStoreError):
    """A stored entry (its record, its blob, or a remote value) failed the
    entry check: checksum, header, or disagreement with its key or record.

    Reads never raise it: a corrupt entry is a miss (and is dropped). It is
    raised by the checking functions themselves (``ecstore.format.blob_check.check_entry``,
    ``unpack_record``...) for callers and tools that inspect entries."""


class ForkedStoreError(ECStoreError):
    """A store handle opened in one process was used in a forked child.

    LMDB environments must never be shared across ``fork()``. A forked child
    cannot reopen a directory its parent had open either (StoreOpenError):
    give processes that need the store their own start (``spawn`` or
    ``forkserver``), or open the store in the parent only after forking."""


def check_same_process(opened_pid: int, what: str) -> None:
    """Raise ForkedStoreError if ``what`` (opened in ``opened_pid``) is used in
    another process, i.e. a child forked after it was opened."""
    if os.getpid() != opened_pid:
        raise ForkedStoreError(
            f"{what} was opened in process {opened_pid} and used in forked child {os.getpid()}; "
            f"open stores in the child process itself (a forked child cannot reopen a directory its "
            f"parent had open: start such processes with spawn/forkserver)"
        )


class _ThisProcess:
    """This process's id as an attribute (``THIS_PROCESS.pid``): the hot
    path's fork checks read it instead of calling ``os.getpid()`` (a system
    call each, several per lookup). An ``os.register_at_fork`` hook sets it
    in a forked child before the child runs any other code of its own
    (registered at import, ahead of ecstore's other fork hooks); a fork
    that runs no Python fork hooks (a C extension's bare ``fork()`` without
    ``PyOS_AfterFork_Child``) is not seen. Read from any thread."""

    __slots__ = ("pid",)

    def __init__(self) -> None:
        self.pid = os.getpid()

    def _after_fork_in_child(self) -> None:
        self.pid = os.getpid()


#: See :class:`_ThisProcess`.
THIS_PROCESS = _ThisProcess()
os.register_at_fork(after_in_child=THIS_PROCESS._after_fork_in_child)
