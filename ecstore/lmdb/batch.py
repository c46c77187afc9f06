"""The records of a write batch (:meth:`ecstore.lmdb.tier.LMDBTier.write_batch`):
:class:`PutRequest` (one entry to store, and its result) and the order in
which a batch's puts and touches are applied (:func:`in_call_order`).
Plain data; no I/O; thread-safe as long as one batch is used by one thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ecstore.format import codec
from ecstore.lmdb.blobfiles import FileRef


@dataclass
class PutRequest:
    """One entry for :meth:`LMDBTier.write_batch <ecstore.lmdb.tier.LMDBTier.write_batch>`."""

    key: str
    identifier: str
    model: str
    tensor: torch.Tensor  # contiguous, CPU
    blob: codec.Blob | None = None
    result: str = "pending"  # "stored" | "present" | "collision" | "failed"
    error: BaseException | None = None
    #: Position of this put among the puts and touches of a batch (see
    #: :meth:`LMDBTier.write_batch`); None: in list order, before all touches.
    order: int | None = None
    #: The file holding the blob, once written (blobs of at least the tier's
    #: ``file_blobs_from`` bytes); None: the blob goes into LMDB itself.
    ref: FileRef | None = None
    #: Result "present": the blob file of the entry already stored (None: an
    #: inline blob). Another handle may have committed it with
    #: ``sync_files=False`` and not synced it yet: a caller that vouches for
    #: this put's durability syncs that file too (``LMDBTier.sync_files``).
    present_file: str | None = None

    @property
    def encoded(self) -> codec.Blob:
        """``blob``, once :meth:`LMDBTier.write_batch` has set it (it encodes
        every request without one before anything else)."""
        assert self.blob is not None, "PutRequest.blob is set by write_batch before it is used"
        return self.blob


@dataclass(frozen=True)
class PutOp:
    """Apply ``todo[index]`` of the batch."""

    index: int


@dataclass(frozen=True)
class TouchOp:
    """Touch ``key`` if it still holds ``identifier``: add ``hits``, raise
    its last access to ``last_ns`` (ns since the epoch)."""

    key: str
    identifier: str
    hits: int
    last_ns: int


BatchOp = PutOp | TouchOp


def in_call_order(todo: list[PutRequest], touches: dict[str, tuple]) -> list[BatchOp]:
    """The batch's operations in the order they were made.

    ``touches`` maps key -> ``(identifier, hits, last_access_ns[, orders])``.
    When every put has an ``order`` and every touch a non-empty tuple of
    ``orders`` (the positions at which the key was read), puts and touches
    are interleaved by those positions, so an entry read before a put is
    already most recently used when that put evicts; a key read at several
    positions gets one touch per position, its hits counted on the last.
    Otherwise: the puts in list order, then the touches."""
    ordered = (all(p.order is not None for p in todo)
               and all(len(t) > 3 and t[3] for t in touches.values()))
    if not ordered:
        return ([PutOp(i) for i in range(len(todo))]
                + [TouchOp(key, t[0], t[1], t[2]) for key, t in touches.items()])
    ops: list[tuple[int, BatchOp]] = []
    for i, p in enumerate(todo):
        assert p.order is not None  # every put has one: `ordered`
        ops.append((p.order, PutOp(i)))
    for key, (identifier, hits, last_ns, orders, *_) in touches.items():
        orders = sorted(orders)
        for o in orders[:-1]:
            ops.append((o, TouchOp(key, identifier, 0, 0)))
        ops.append((orders[-1], TouchOp(key, identifier, hits, last_ns)))
    ops.sort(key=lambda op: op[0])
    return [op for _, op in ops]
