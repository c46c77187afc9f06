"""A put on its way to a tier: the one record of a queued put
(:class:`PendingPut`), what became of it (:class:`PutOutcome`), and the
bookkeeping of a write-behind queue of them (:class:`PutQueue`).

Below the tiers (lmdb, remote) and the store's writer, which all use them:
the writer's queue, the LMDB write batch (a :class:`PendingPut` inside a
:class:`~ecstore.lmdb.batch.BatchPut`, with that tier's results) and the
remote's write queue hold the same record, and both queues keep it in a
:class:`PutQueue`. Plain data; no I/O; no locks of its own.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
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
    the put, instead of the caller's thread paying for that hand-off;
    ``unchecked``: the put did not ask the LMDB tier first
    (``ECStore.put(known_absent=True)``): the writer counts it when it finds
    the entry already stored.

    ``ticket``: its position among its queue's puts and touches, and
    ``since``: the ticket of the oldest put it stands for (it may replace a
    queued one), both set by the queue: a record is in one queue at a time."""

    key: str
    identifier: str
    tensor: torch.Tensor
    blob: codec.Blob | None = None
    mm_hash: str = ""
    prefault: bool = False
    unchecked: bool = False
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


class PutQueue:
    """The bookkeeping both write-behind queues share (the store's writer,
    :class:`~ecstore.store.writer.Writer`, and the remote's
    :class:`~ecstore.remote.writer.WriteQueue`): the puts not yet taken,
    keyed by ``key`` in ticket order (``queued``), the ones taken for the
    batch being written (``taken``), the tensor bytes of both (``bytes``:
    what back-pressure counts) and the ticket counter (``ticket``, the newest
    ticket handed out: a drain waits for everything numbered up to the
    ticket at its call). What differs stays with each owner: how a put waits
    for room (the writer: first come, first admitted, until there is room;
    the remote: a bounded wait, then dropped) and what else a drain waits
    for (the writer: touches and syncs). Not thread-safe: its owner holds
    its one lock around every call."""

    def __init__(self) -> None:
        self.queued: OrderedDict[str, PendingPut] = OrderedDict()  # key -> not yet taken, oldest first
        self.taken: dict[str, PendingPut] = {}  # key -> in the batch being written
        self.bytes = 0  # tensor bytes queued or taken, not yet written
        self.ticket = 0  # the newest ticket handed out

    def next_ticket(self) -> int:
        """A new ticket (puts, and whatever else its owner orders with them)."""
        self.ticket += 1
        return self.ticket

    def room_for(self, nbytes: int, max_bytes: int) -> bool:
        """Whether ``nbytes`` more fit under ``max_bytes``; always when
        nothing is pending (a put larger than ``max_bytes`` waits until
        then, never for ever)."""
        return not self.bytes or self.bytes + nbytes <= max_bytes

    def add(self, item: PendingPut) -> PendingPut | None:
        """Queue ``item`` last under ``item.key`` with the next ticket; a put
        of that key still queued is replaced and returned (``item`` stands
        for it: it takes over its ``since``, so drains that waited for the
        replaced one wait for this one)."""
        item.ticket = item.since = self.next_ticket()
        replaced = self.queued.pop(item.key, None)  # re-queued at the end: queue order is ticket order
        if replaced is not None:
            self.bytes -= replaced.nbytes
            item.since = replaced.since
        self.queued[item.key] = item
        self.bytes += item.nbytes
        return replaced

    def remove(self, key: str) -> PendingPut | None:
        """Forget the queued (not taken) put of ``key``; it, or None."""
        item = self.queued.pop(key, None)
        if item is not None:
            self.bytes -= item.nbytes
        return item

    def get(self, key: str) -> PendingPut | None:
        """The put of ``key`` queued, else taken, else None."""
        return self.queued.get(key) or self.taken.get(key)

    def take(self, max_bytes: int, max_items: int | None = None) -> list[PendingPut]:
        """The next batch, oldest first: at least one put (if any is queued),
        then more while they fit within ``max_bytes`` and ``max_items``;
        they count as taken (and their bytes as pending) until :meth:`done`."""
        batch: list[PendingPut] = []
        size = 0
        while self.queued and (max_items is None or len(batch) < max_items):
            nxt = next(iter(self.queued.values()))
            if batch and size + nxt.nbytes > max_bytes:
                break
            self.queued.popitem(last=False)
            self.taken[nxt.key] = nxt
            batch.append(nxt)
            size += nxt.nbytes
        return batch

    def done(self, batch: list[PendingPut]) -> None:
        """``batch`` (from :meth:`take`) was written, or failed: no longer pending."""
        for item in batch:
            self.taken.pop(item.key, None)
            self.bytes -= item.nbytes

    def oldest(self) -> int | None:
        """The smallest ``since`` of a put queued or taken (None: none)."""
        return min((it.since for it in (*self.queued.values(), *self.taken.values())), default=None)

    def drop_queued(self) -> int:
        """Forget every queued (not taken) put; how many."""
        n = len(self.queued)
        self.bytes -= sum(it.nbytes for it in self.queued.values())
        self.queued.clear()
        return n

    def clear(self) -> int:
        """Forget every put, queued or taken; how many."""
        n = len(self.queued) + len(self.taken)
        self.queued.clear()
        self.taken.clear()
        self.bytes = 0
        return n
