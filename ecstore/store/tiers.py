"""The contract every tier of an :class:`~ecstore.ECStore` keeps.

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
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


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
