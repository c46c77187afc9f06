"""A put on its way to a tier: the one record of a queued put
(:class:`PendingPut`) and what became of it (:class:`PutOutcome`).

Below the tiers (lmdb, remote) and the store's writer, which all use them:
the writer's queue, the LMDB write batch (a :class:`PendingPut` inside a
:class:`~ecstore.lmdb.batch.BatchPut`, with that tier's results) and the
remote's write queue hold the same record. Plain data; no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ecstore.format import codec


@dataclass
class PendingPut:
    """One entry waiting for (or in) a tier's write: ``identifier`` (the
    stored name) under ``key``, its ``tensor`` (contiguous, CPU; not modified
    once queued) and ``nbytes``, the tensor's data bytes (what back-pressure
    counts, derived). ``blob``: the safetensors blob when the put already
    encoded it (None: the writer encodes ``tensor``); ``mm_hash``: the
    caller's identifier, for logs; ``prefault``: the blob is a slab of
    :data:`~ecstore.pool.POOL`, and the writer thread asks the pool for a
    spare slab of its size (for the next save of that size) when it takes
    the put, instead of the caller's thread paying for that hand-off.

    ``ticket``: its position among its queue's puts and touches, and
    ``since``: the ticket of the oldest put it stands for (it may replace a
    queued one), both set by the queue: a record is in one queue at a time."""

    key: str
    identifier: str
    tensor: torch.Tensor
    blob: codec.Blob | None = None
    mm_hash: str = ""
    prefault: bool = False
    ticket: int = 0
    since: int = 0
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = codec.tensor_nbytes(self.tensor)


class PutOutcome(enum.Enum):
    """What became of one put; the values are the words the logs use."""

    PENDING = "pending"  # not written yet (or its batch failed before it was)
    STORED = "stored"
    PRESENT = "present"  # the same identifier was already stored
    COLLISION = "collision"  # the key holds another identifier (64-bit hash collision)
    FAILED = "failed"  # not stored: see the error (disk or map full, pinned store...)
