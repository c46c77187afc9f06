"""The put path of an :class:`~ecstore.store.ECStore` handle: checks
(storable, dtype, fits a tier, not held), one copy into the blob, then the
memory tier (a view of the blob's data), the writer queue (back-pressure by
bytes) and the remote tier's writer, if configured.

:class:`PutPath` works on the handle's :class:`~ecstore.store.tiers.Tiers` (the
object the reads use; no reference to the handle). Thread-safe as
far as the tiers are; ``put`` may block in the writer's back-pressure.
"""

from __future__ import annotations

import logging

import torch

from ecstore.errors import InvalidEntryError
from ecstore.format import PendingPut, codec
from ecstore.key import dtype_name
from ecstore.pool import POOL
from ecstore.store.read_path import ReadPath
from ecstore.store.stats import Counters
from ecstore.store.tiers import Tiers

log = logging.getLogger("ecstore")

class PutPath:
    """Admits, encodes and hands out one put to every tier (see module doc).

    ``pooled``: build each blob in :data:`ecstore.pool.POOL` (memory faulted
    in before, reused once nothing references an earlier blob) instead of
    fresh ``torch.empty`` memory, whose page faults cost more than the copy
    (the ``pooled_blobs`` setting, on by default).
    """

    def __init__(self, tiers: Tiers, reads: ReadPath, counters: Counters, *, pooled: bool = True) -> None:
        self.tiers = tiers
        self.reads = reads
        self.counters = counters
        self.pooled = pooled

    def put(self, mm_hash: str, name: str, key: str, tensor: torch.Tensor, *, copy: bool,
            defer: bool = False, ask_disk: bool = True) -> bool:
        """:meth:`ECStore.put` for stored name ``name`` under ``key``: True if
        newly stored; False if already held, or refused (too large for every
        tier, or a hash collision: logged and counted). Raises
        :class:`InvalidEntryError` (nothing changed) for a tensor that cannot
        be stored or whose dtype is not the handle's. ``defer``: the writer
        is not woken for it (:meth:`Writer.submit`); ``ask_disk=False``: the
        LMDB tier is not asked whether it holds the entry (the writer finds
        out, and stores nothing then)."""
        r = self.reads
        memory, disk, writer, remote = self.tiers.memory, self.tiers.disk, self.tiers.writer, self.tiers.remote
        codec.check_storable(tensor)
        dtype, shape = tensor.dtype, tensor.shape
        if dtype != r.dtype:
            raise InvalidEntryError(
                f"tensor dtype {dtype_name(dtype)} does not match the store's dtype "
                f"{dtype_name(r.dtype)} (model {r.model!r})"
            )
        nbytes = shape[0] * shape[1] * dtype.itemsize  # 2-D (check_storable)
        fits_memory = memory is not None and nbytes <= memory.capacity_bytes
        # The disk cap counts whole blobs: size them exactly (the header holds
        # the identifier, up to MAX_IDENTIFIER_BYTES, JSON-escaped). Built
        # once here and reused by encode below.
        head = codec.blob_head(shape, dtype, name, r.model)
        fits_disk = disk is not None and len(head) + nbytes <= disk.capacity_bytes
        if not (fits_memory or fits_disk or remote is not None):
            self.counters.refused_too_large(mm_hash, nbytes, memory.capacity_bytes if memory else 0,
                                            disk.capacity_bytes if disk else 0)
            return False
        held = r.identifier_at(key) if ask_disk else self.tiers.identifier_at(key, disk=False)
        if held == name:
            self.counters.put_skipped()
            if writer is not None:  # flush() vouches for it: its blob file is synced too
                writer.vouch(key, name)
            return False
        if held is not None:
            self.counters.refused_collision(mm_hash, key, held)
            return False
        blob = None
        if copy or tensor.device.type != "cpu" or not tensor.is_contiguous():
            # The one copy: straight from the caller's tensor (any device or
            # strides) into its safetensors blob. The memory tier and pending
            # write hold a view of the blob's data, and the writer stores the
            # blob as is: no second copy to encode it later.
            blob, cpu = codec.encode_view(tensor, identifier=name, model=r.model, head=head,
                                          pool=POOL if self.pooled else None)
        else:
            cpu = tensor.detach()  # handed over: encoded by the writer
        stored_in_memory = fits_memory and memory is not None and memory.put(key, name, cpu, nbytes)
        self.counters.put()
        # A spare faulted slab for the next save of this size: asked for by the
        # writer thread when it takes the put (off this thread), else here.
        prefault = blob is not None and self.pooled
        if writer is not None and fits_disk:
            writer.submit(PendingPut(key, name, cpu, blob=blob, mm_hash=mm_hash, prefault=prefault,
                                     unchecked=not ask_disk), defer=defer)
            prefault = False
        elif stored_in_memory:
            log.info("EC put: stored %d bytes for mm_hash=%s", nbytes, mm_hash)
        if remote is not None:
            remote.submit(key, name, cpu, blob)
        if prefault:
            POOL.prefault_soon(len(blob), (len(blob) - nbytes, dtype, tuple(shape)))  # type: ignore[arg-type]
        return True
