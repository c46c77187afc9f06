"""The read path of an :class:`~ecstore.store.ECStore` handle: memory tier,
pending writes, LMDB tier (a hit promoted to memory), then the remote tier (a
hit promoted to memory and LMDB).

:class:`ReadPath` reads the tiers of one handle (its
:class:`~ecstore.store.tiers.Tiers`, not the handle) and answers
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
from ecstore.format import PendingPut, Record, codec
from ecstore.store.stats import HitTier

if TYPE_CHECKING:
    from ecstore.store.tiers import Tiers


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

    ``tiers``: the handle's tiers (the object itself: its remote is set after
    construction, the handle opens it last, and cleared at close).
    ``model``/``dtype``: what an LMDB entry must claim to be served (else a
    miss, see :func:`blob_check.check_entry`).
    """

    def __init__(self, tiers: Tiers, *, model: str, dtype: torch.dtype) -> None:
        self.tiers = tiers
        self.model = model
        self.dtype = dtype

    def identifier_at(self, key: str) -> str | None:
        """The identifier held under ``key`` by any local tier (memory,
        pending, disk), or None."""
        return self.tiers.identifier_at(key)

    def contains(self, key: str, name: str) -> bool:
        """Would :meth:`find` hit? A dict lookup, or one short LMDB read
        transaction (µs), or (remote tier) a bounded remote query. No LRU
        change, no counting."""
        memory, writer, disk, remote = self.tiers.memory, self.tiers.writer, self.tiers.disk, self.tiers.remote
        if memory is not None and memory.contains(key, name):
            return True
        if writer is not None and writer.lookup(key, name) is not None:
            return True
        if disk is not None and disk.contains(key, name):
            return True
        return remote is not None and remote.contains(key)

    def find(self, key: str, name: str, mm_hash: str, *, wait_for_room: bool = False) -> Hit | None:
        """The tensor stored under ``key`` for stored name ``name``, or None.

        A memory or pending hit is the tier's own tensor; an LMDB hit is a
        fresh CPU tensor (checked entry; promoted into the memory tier when it
        fits); a remote hit is verified and promoted into memory and, in the
        background, LMDB: queued only if the writer has room at once (else
        skipped and counted, see :meth:`Writer.offer`), or, with
        ``wait_for_room``, once it has. Corrupt entries are misses.
        """
        memory, writer, disk, remote = self.tiers.memory, self.tiers.writer, self.tiers.disk, self.tiers.remote
        if memory is not None:
            t = memory.get(key, name)
            if t is not None:
                return Hit(t, HitTier.MEMORY, False)
        if writer is not None:
            t = writer.lookup(key, name)
            if t is not None:
                return Hit(t, HitTier.MEMORY, False)
        if disk is not None:
            t = disk.get(key, name, model=self.model, dtype=self.dtype)
            if t is not None:
                promoted = memory is not None and memory.put(key, name, t, codec.tensor_nbytes(t))
                return Hit(t, HitTier.DISK, promoted)
        if remote is not None:
            entry = remote.get(key, name)
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
        memory, writer, disk = self.tiers.memory, self.tiers.writer, self.tiers.disk
        nbytes = codec.tensor_nbytes(t)
        held = False
        if memory is not None and nbytes <= memory.capacity_bytes:
            held = memory.put(key, name, t, nbytes)
        if writer is not None and disk is not None and len(blob) <= disk.capacity_bytes \
                and self.identifier_at(key) in (None, name):
            item = PendingPut(key, name, t, blob=np.frombuffer(blob, dtype=np.uint8), mm_hash=mm_hash)
            if wait_for_room:
                writer.submit(item)
                held = True
            else:
                held = writer.offer(item) or held
        return held

    def stored_shape(self, key: str, name: str) -> tuple[int, ...] | None:
        """The shape of :meth:`stored_record`'s record, if any."""
        rec = self.stored_record(key, name)
        return None if rec is None else rec.shape

    def stored_record(self, key: str, name: str) -> Record | None:
        """The LMDB tier's record under ``key`` (no blob read), if it is
        ``name``'s; else None. An unreadable record is a miss: logged and
        removed, like a corrupt entry met by :meth:`find`."""
        disk = self.tiers.disk
        if disk is None:
            return None
        try:
            rec = disk.record(key)
        except CorruptEntryError as e:  # a miss, dropped as get drops it
            disk.drop_corrupt(key, e)
            return None
        if rec is None or rec.identifier != name or rec.version != disk.record_version:
            return None
        return rec

    def verify(self, key: str, name: str) -> bool:
        """Whether the LMDB tier holds ``name``'s entry under ``key`` and it
        passes every check :meth:`find` makes (the whole blob read, its
        checksum compared, nothing copied out); no promotion. A failing entry
        is dropped, as by :meth:`find`. False without an LMDB tier."""
        disk = self.tiers.disk
        return disk is not None and disk.verify(key, name, model=self.model, dtype=self.dtype)
