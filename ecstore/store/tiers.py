"""The tiers of an :class:`~ecstore.ECStore` handle: the contract every tier
keeps (:class:`Tier`), and the one object that holds a handle's tiers
(:class:`Tiers`).

A tier maps EC keys (``<model>@1@0@<chunk_hash>@<dtype>``) to one entry
each: the *stored name* it was put under (``"<namespace>/<mm identifier>"``,
see :mod:`ecstore.identity`) and its tensor. Reads name both the key and the
stored name they expect: a key that holds another name (another identity, or
a 64-bit hash collision) is a miss, never the other entry's tensor.

Implementations: :class:`ecstore.memory.MemoryTier` (per process, by
reference), :class:`ecstore.lmdb.tier.LMDBTier` (one file shared by every
process; writes go through :meth:`~ecstore.lmdb.tier.LMDBTier.write_batch`).
The contract tests in :mod:`ecstore.testing.tier_contract` run against both;
how an entry gets *into* a tier differs (a hook of the test class).

:class:`Tiers` is where a handle's set of tiers lives, and the only place:
the handle, its read path, put path and counters' snapshot all get this one
object (a tier added to a handle is added here, and every walk over the
tiers, lookup order included, is a method of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from ecstore.lmdb import LMDBTier
    from ecstore.memory import MemoryTier
    from ecstore.remote.tier import RemoteTier
    from ecstore.store.writer import Writer


@runtime_checkable
class Tier(Protocol):
    """The read and delete side every tier implements.

    All methods are thread-safe; none raises for an absent or foreign entry.
    """

    def contains(self, key: str, identifier: str) -> bool:
        """True if ``key`` holds the entry named ``identifier`` (cheap; no LRU effect)."""
        ...

    def identifier_at(self, key: str) -> str | None:
        """The stored name ``key`` holds, or None if it holds nothing."""
        ...

    def get(self, key: str, identifier: str) -> torch.Tensor | None:
        """The tensor of the entry named ``identifier`` under ``key``, or None
        (absent, another name, or a damaged entry: a miss)."""
        ...

    def delete(self, key: str) -> bool:
        """Remove ``key``'s entry, whatever its name; False if there was none."""
        ...


@dataclass
class Tiers:
    """The tiers of one handle, top to bottom (``None``: disabled).

    ``memory``: this process's LRU of tensors; ``writer``: the background
    writer's pending LMDB writes (read like a tier until committed);
    ``disk``: the LMDB tier shared by every process on the directory;
    ``remote``: the Redis/Valkey tier shared across nodes (set by the handle
    after the local tiers, cleared by :meth:`close`).

    Thread-safe as far as the tiers are (each guards its own state); the
    handle calls :meth:`close` once, with no call running
    (:mod:`ecstore.store.calls`).
    """

    memory: MemoryTier | None = None
    writer: Writer | None = None
    disk: LMDBTier | None = None
    remote: RemoteTier | None = None

    def local(self) -> tuple[Tier, ...]:
        """The local tiers that keep the :class:`Tier` contract, top first
        (memory, LMDB); the pending writes are not one (see :meth:`delete`)."""
        return tuple(t for t in (self.memory, self.disk) if t is not None)

    def identifier_at(self, key: str, *, disk: bool = True) -> str | None:
        """The stored name ``key`` holds in any local tier (memory, pending
        writes, LMDB, in that order), or None; ``disk=False``: without
        asking the LMDB tier."""
        for tier in (self.memory, self.writer, self.disk if disk else None):
            if tier is not None:
                held = tier.identifier_at(key)
                if held is not None:
                    return held
        return None

    def delete(self, key: str, name: str) -> bool:
        """Remove the entry named ``name`` under ``key`` from every tier: a
        pending write is cancelled (waiting for one in flight), the memory and
        LMDB entries removed if they are ``name``'s (another name's entry
        under the key, a hash collision, is kept), and the remote value
        deleted (best effort, every node's; not counted). True if a local
        tier held it."""
        found = False
        if self.writer is not None:
            found = self.writer.lookup(key, name) is not None
            self.writer.cancel(key, name)
        for tier in self.local():
            if tier.contains(key, name):
                found = tier.delete(key) or found
        if self.remote is not None:
            self.remote.delete(key)
        return found

    def wait_written(self, durable: bool = False) -> None:
        """Block until every write handed to the writer so far is committed
        (``durable``: and its blob file synced), and every remote write sent
        or dropped (each batch bounded by ``remote_timeout_seconds``)."""
        if self.writer is not None:
            self.writer.drain(durable)
        if self.remote is not None:
            self.remote.drain()

    def close(self) -> None:
        """Write what is pending and release every tier: the writer drained
        (durably), stopped and its untaken errors logged (not raised), LMDB
        synced; then, whatever happened, the remote closed and cleared, the
        LMDB handle closed and the memory tier emptied (a closed handle holds
        no tensor: pooled ones go back to the pool). Once per handle, with no
        call running."""
        try:
            if self.writer is not None:
                self.writer.drain(durable=True)
                self.writer.stop()
                if self.disk is not None:
                    self.disk.sync()
                self.writer.log_untaken_errors()  # logged, not raised: see ECStore.close
        finally:
            remote, self.remote = self.remote, None
            if remote is not None:
                remote.close()
            if self.disk is not None:
                self.disk.close()
            if self.memory is not None:
                self.memory.clear()
