"""A put on its way to a tier: what became of it (:class:`PutOutcome`).

Below the tiers (lmdb, remote) and the store's writer, which all use it.
Plain data; no I/O.
"""

from __future__ import annotations

import enum


class PutOutcome(enum.Enum):
    """What became of one put; the values are the words the logs use."""

    PENDING = "pending"  # not written yet (or its batch failed before it was)
    STORED = "stored"
    PRESENT = "present"  # the same identifier was already stored
    COLLISION = "collision"  # the key holds another identifier (64-bit hash collision)
    FAILED = "failed"  # not stored: see the error (disk or map full, pinned store...)
