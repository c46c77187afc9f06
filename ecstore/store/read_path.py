"""The read path of an :class:`~ecstore.store.ECStore` handle.

    find ──► memory tier ─► pending writes ─► LMDB tier ─(hit)─► promote to memory
                                                        └(miss)─► remote tier ─► promote to memory + LMDB

:class:`ReadPath` holds the tiers of one handle (not the handle) and answers
in stored names and keys; the handle checks its arguments, counts the result
and records the LRU touch. Every method is thread-safe as far as the tiers
are (they are: each guards its own state); a tier may be ``None`` (disabled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ecstore.errors import CorruptEntryError
from ecstore.format import codec
from ecstore.format.record import Record
from ecstore.store.stats import HitTier
from ecstore.store.writer import PendingPut

if TYPE_CHECKING:
    from ecstore.lmdb import LMDBTier
    from ecstore.memory import MemoryTier
    from ecstore.remote.tier import RemoteTier
    from ecstore.store.writer import Writer


@dataclass(frozen=True)
class Hit:
    """A tensor found by :meth:`ReadPath.find`: the tier that served it, and
    whether a tier now holds this very tensor (``promoted``: the memory tier,
    or a pending LMDB write of a remote hit; the caller must then hand out a
    copy, not the tier's tensor)."""

    tensor: torch.Tensor
    tier: HitTier
    promoted: bool


class ReadPath:
    """memory -> pending writes -> LMDB -> remote, with promotion upwards.

    ``model``/``dtype``: what an LMDB entry must claim to be served (else a
    miss, see :func:`blob_check.check_entry`). ``remote`` may be set after
    construction (the handle opens it last) and cleared at close.
    """

    def __init__(self, *, memory: MemoryTier | None, writer: Writer | None, disk: LMDBTier | None,
                 model: str, dtype: torch.dtype) -> None:
        self.memory = memory
        self.writer = writer
        self.disk = disk
        self.remote: RemoteTier | None = None
        self.model = model
        self.dtype = dtype

    def identifier_at(self, key: str) -> str | None:
        """The identifier held under ``key`` by any local tier (memory,
        pending, disk), or None."""
        for tier in (self.memory, self.writer, self.disk):
            if tier is not None:
                held = tier.identifier_at(key)
                if held is not None:
                    return held
        return None

    def contains(self, key: str, name: str) -> bool:
        """Would :meth:`find` hit? A dict lookup, or one short LMDB read
        transaction (µs), or (remote tier) a bounded remote query. No LRU
        change, no counting."""
        if self.memory is not None and self.memory.contains(key, name):
            return True
        if self.writer is not None and self.writer.lookup(key, name) is not None:
            return True
        if self.disk is not None and self.disk.contains(key, name):
            return True
        return self.remote is not None and self.remote.contains(key)

    def find(self, key: str, name: str, mm_hash: str, *, wait_for_room: bool = False) -> Hit | None:
        """The tensor stored under ``key`` for stored name ``name``, or None.

        A memory or pending hit is the tier's own tensor; an LMDB hit is a
        fresh CPU tensor (checked entry; promoted into the memory tier when it
        fits); a remote hit is verified and promoted into memory and, in the
        background, LMDB: queued only if the writer has room at once (else
        skipped and counted, see :meth:`Writer.offer`), or, with
        ``wait_for_room``, once it has. Corrupt entries are misses.
        """
        if self.memory is not None:
            t = self.memory.get(key, name)
            if t is not None:
                return Hit(t, HitTier.MEMORY, False)
        if self.writer is not None:
            t = self.writer.lookup(key, name)
            if t is not None:
                return Hit(t, HitTier.MEMORY, False)
        if self.disk is not None:
            t = self.disk.get(key, name, model=self.model, dtype=self.dtype)
            if t is not None:
                promoted = self.memory is not None and self.memory.put(key, name, t, codec.tensor_nbytes(t))
                return Hit(t, HitTier.DISK, promoted)
        if self.remote is not None:
            entry = self.remote.get(key, name)
            if entry is not None:
                return Hit(entry.tensor, HitTier.REMOTE, self._promote(
                    key, name, mm_hash, entry.tensor, entry.blob, wait_for_room))
        return None

    def _promote(self, key: str, name: str, mm_hash: str, t: torch.Tensor, blob: memoryview,
                 wait_for_room: bool) -> bool:
        """A verified remote entry (stored name ``name``) into the memory tier
        and (background) LMDB, its blob stored as is; not written back to the
        remote. The LMDB write is offered to the writer (skipped when its
        queue is full: another process holding the write lock must not make
        a read wait), or submitted (``wait_for_room``). True if a tier now
        holds ``t`` (the memory tier, or the
        pending LMDB write, whose blob ``t`` views): the caller must then
        hand out a copy, or a change to it would be committed to LMDB under
        a fresh checksum."""
        nbytes = codec.tensor_nbytes(t)
        held = False
        if self.memory is not None and nbytes <= self.memory.capacity_bytes:
            held = self.memory.put(key, name, t, nbytes)
        if self.writer is not None and self.disk is not None and len(blob) <= self.disk.capacity_bytes \
                and self.identifier_at(key) in (None, name):
            item = PendingPut(name, t, nbytes, blob=np.frombuffer(blob, dtype=np.uint8), mm_hash=mm_hash)
            if wait_for_room:
                self.writer.submit(key, item)
                held = True
            else:
                held = self.writer.offer(key, item) or held
        return held

    def stored_shape(self, key: str, name: str) -> tuple[int, ...] | None:
        """The shape of :meth:`stored_record`'s record, if any."""
        rec = self.stored_record(key, name)
        return None if rec is None else rec.shape

    def stored_record(self, key: str, name: str) -> Record | None:
        """The LMDB tier's record under ``key`` (no blob read), if it is
        ``name``'s; else None. An unreadable record is a miss: logged and
        removed, like a corrupt entry met by :meth:`find`."""
        if self.disk is None:
            return None
        try:
            rec = self.disk.record(key)
        except CorruptEntryError as e:  # a miss, dropped as get drops it
            self.disk.drop_corrupt(key, e)
            return None
        if rec is None or rec.identifier != name or rec.version != self.disk.record_version:
            return None
        return rec
