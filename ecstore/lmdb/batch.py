"""The records of a write batch (:meth:`ecstore.lmdb.tier.LMDBTier.write_batch`):
:class:`BatchPut` (one put to store, and its result), :class:`Touch` (the
LRU update of one key) and the order in which a batch's puts and touches are
applied (:func:`in_call_order`).
Plain data; no I/O; thread-safe as long as one batch is used by one thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from ecstore.format import PendingPut, PutOutcome, codec
from ecstore.lmdb.blobfiles import FileRef


@dataclass
class BatchPut:
    """One put of a :meth:`LMDBTier.write_batch <ecstore.lmdb.tier.LMDBTier.write_batch>`:
    the queued ``put`` (its ``ticket`` is its position among the batch's puts
    and touches, see :func:`in_call_order`), the ``model`` its blob header
    names when the tier encodes it, and what became of it, set by the tier."""

    put: PendingPut
    model: str
    outcome: PutOutcome = PutOutcome.PENDING  # set by write_batch (never PENDING once it returned or raised)
    error: BaseException | None = None
    #: The file holding the blob, once written (blobs of at least the tier's
    #: ``file_blobs_from`` bytes); None: the blob goes into LMDB itself.
    ref: FileRef | None = None
    #: Outcome PRESENT: the blob file of the entry already stored (None: an
    #: inline blob). Another handle may have committed it with
    #: ``sync_files=False`` and not synced it yet: a caller that vouches for
    #: this put's durability syncs that file too (``LMDBTier.sync_files``).
    present_file: str | None = None
    #: The entry was stored when the batch began (``write_batch`` read it
    #: before writing blob files): no file is written for it unless the
    #: transaction finds it gone.
    seen_stored: bool = False
    #: The blob's checksum, computed as its file was written (None: not yet).
    checksum: int | None = None
    #: The blob head (``codec.blob_head``) of a put that came without a blob
    #: (a handed-over tensor), set by the tier. While ``put.blob`` stays None
    #: the tier writes the file from it and the tensor's own bytes (a spare
    #: file ready) instead of encoding the tensor first.
    head: bytes | None = None

    @property
    def encoded(self) -> codec.Blob:
        """``put.blob``, once :meth:`LMDBTier.write_batch` has set it (it
        encodes every put without one, except those written from ``head``)."""
        assert self.put.blob is not None, "BatchPut.put.blob is set by write_batch before it is used"
        return self.put.blob

    @property
    def size(self) -> int:
        """The blob's size in bytes, encoded or not."""
        if self.put.blob is not None:
            return len(self.put.blob)
        assert self.head is not None, "BatchPut.head or put.blob is set by write_batch before it is used"
        return len(self.head) + self.put.nbytes


@dataclass(frozen=True)
class Touch:
    """The LRU update of one key made by reads not yet written: the
    identifier read, the hits to add, the newest read time (ns since the
    epoch), and ``orders``: the tickets of the reads between two puts (at
    least one), so the batch replays reads and puts in the order they were
    made (:func:`in_call_order`). ``since``: a ticket no later than the
    oldest read counted in ``hits`` (what the writer's ``drain`` waits for).
    ``counts``: the reads behind each of ``orders`` (reads with no put
    between them share one order), so that a split keeps each part's hits."""

    identifier: str
    hits: int
    last_access_ns: int
    orders: tuple[int, ...]
    since: int = 0
    counts: tuple[int, ...] = ()


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


def in_call_order(todo: list[BatchPut], touches: dict[str, Touch]) -> list[BatchOp]:
    """The batch's operations in the order they were made: puts and touches
    interleaved by their positions (each put's ticket, each touch's
    ``orders``: the positions at which the key was read), so an entry read
    before a put is already most recently used when that put evicts; a key
    read at several positions gets one touch per position, its hits counted
    on the last. Operations at one position keep their list order (puts
    first)."""
    ops: list[tuple[int, BatchOp]] = [(p.put.ticket, PutOp(i)) for i, p in enumerate(todo)]
    for key, t in touches.items():
        assert t.orders, f"touch of {key} without the position of its reads"
        orders = sorted(t.orders)
        for o in orders[:-1]:
            ops.append((o, TouchOp(key, t.identifier, 0, 0)))
        ops.append((orders[-1], TouchOp(key, t.identifier, t.hits, t.last_access_ns)))
    ops.sort(key=lambda op: op[0])
    return [op for _, op in ops]
