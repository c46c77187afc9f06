"""ECStore: the public handle that composes the tiers.

    ECStore.put ──► memory tier (LRU, bytes)         (caller's thread)
               └──► pending map ──► writer thread ──► LMDB tier (one txn per batch)
    ECStore.get ──► memory tier ─► pending map ─► LMDB tier (promote to memory)

A handle is bound to one (model, dtype). Several handles, threads and
processes may use one ``local_disk`` directory at once.

Threading: every public method may be called from any thread, concurrently
with the background writer. Processes: each process has its own memory tier
and pending map; the LMDB tier is shared, so an entry committed by one
process is visible to ``contains``/``get`` in every other. A handle must not
be used in a child after ``fork()`` (ForkedStoreError), and a forked child
cannot reopen a directory its parent had open (StoreOpenError): processes
that need the store should be started with ``spawn``/``forkserver``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from . import codec
from .config import ECStoreConfig
from .errors import ECStoreError, InvalidEntryError, StoreFullError, check_same_process
from .key import ChunkHasher, check_identifier, check_model, chunk_hash, dtype_name, make_key
from .lmdb_tier import LMDBTier, PutRequest
from .memory import MemoryTier

log = logging.getLogger("ecstore")

#: Upper bound of a typical safetensors header (informational: put sizes each
#: blob exactly with codec.blob_size).
HEADER_ESTIMATE = 1024
#: The writer commits at most this many bytes of blobs per transaction, and
#: at most an eighth of the disk cap (a batch near the cap would have to evict
#: the very entries it just wrote, and fragments the map).
MAX_BATCH_BYTES = 256 << 20
#: LRU updates from reads are written with the next batch of puts, or after
#: this many seconds (or at flush): a burst of hits costs one commit, not one
#: fsync'd commit each.
TOUCH_DELAY_S = 1.0


@dataclass
class StoreStats:
    """Counters of one handle (this process only) plus tier occupancy."""

    hits: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    puts: int = 0
    puts_skipped: int = 0
    puts_refused: int = 0
    write_errors: int = 0
    memory_evictions: int = 0
    disk_evictions: int = 0
    corrupt_dropped: int = 0
    memory_entries: int = 0
    memory_bytes: int = 0
    memory_capacity_bytes: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_capacity_bytes: int = 0
    pending_writes: int = 0
    pending_bytes: int = 0

    @property
    def evictions(self) -> int:
        return self.memory_evictions + self.disk_evictions

    def as_dict(self) -> dict[str, int]:
        d = dict(self.__dict__)
        d["evictions"] = self.evictions
        return d


@dataclass
class _Pending:
    identifier: str
    tensor: torch.Tensor
    nbytes: int
    mm_hash: str
    touch_hits: int = 0
    blob: codec.Blob | None = None  # already encoded (None: the writer encodes)
    order: int = 0  # position among this handle's puts and touches (writer ticket)


class _Writer(threading.Thread):
    """Background LMDB writer: drains puts and LRU touches in batches.

    Bounded by bytes: ``ECStore.put`` blocks while the queued tensor bytes
    would exceed ``max_bytes`` (back-pressure, not unbounded memory).
    """

    def __init__(self, store: "ECStore", max_bytes: int, batch_bytes: int = MAX_BATCH_BYTES) -> None:
        super().__init__(name="ecstore-writer", daemon=True)
        self.store_ref = weakref.ref(store)
        self.max_bytes = max_bytes
        self.batch_bytes = batch_bytes
        self.touch_since = 0.0  # monotonic time of the oldest unwritten LRU touch
        self.drainers = 0  # threads waiting in drain()
        self.cv = threading.Condition()
        self.queue: OrderedDict[str, _Pending] = OrderedDict()  # key -> not yet written
        self.inflight: dict[str, _Pending] = {}  # key -> being written now
        # key -> (identifier, hits, last_access_ns, orders): ``orders`` holds the
        # ticket of the last read of the key between two consecutive puts, so
        # the LMDB tier can replay reads and puts in the order they were made.
        self.touches: dict[str, tuple[str, int, int, tuple[int, ...]]] = {}
        self.ticket = 0  # orders puts and touches as they were made
        self.last_put_ticket = 0
        self.queued_bytes = 0
        self.stopping = False
        self.errors: list[BaseException] = []
        self.busy = False

    def submit(self, key: str, item: _Pending) -> None:
        with self.cv:
            while self.queue and self.queued_bytes + item.nbytes > self.max_bytes and not self.stopping:
                self.cv.wait()
            self.ticket += 1
            item.order = self.last_put_ticket = self.ticket
            self.queue[key] = item
            self.queued_bytes += item.nbytes
            self.cv.notify_all()

    def touch(self, key: str, identifier: str) -> None:
        with self.cv:
            self.ticket += 1
            held, hits, _, orders = self.touches.get(key, (identifier, 0, 0, ()))
            if held != identifier:  # the key changed hands (delete + put of another identifier)
                hits, orders = 0, ()
            if orders and orders[-1] > self.last_put_ticket:
                orders = orders[:-1] + (self.ticket,)  # no put since: only the latest read matters
            else:
                orders = orders + (self.ticket,)
            first = not self.touches
            if first:
                self.touch_since = time.monotonic()
            self.touches[key] = (identifier, hits + 1, time.time_ns(), orders)
            # Touches ride along with the next put batch, or go alone after
            # TOUCH_DELAY_S (each commit is an fsync): wake the writer only for
            # the first one of a burst, so it starts that timer.
            if first:
                self.cv.notify_all()

    def touches_now(self) -> None:
        """Write pending LRU touches without waiting for TOUCH_DELAY_S (does not block)."""
        with self.cv:
            if self.touches:
                self.touch_since = float("-inf")
                self.cv.notify_all()

    def identifier_at(self, key: str) -> str | None:
        with self.cv:
            item = self.queue.get(key) or self.inflight.get(key)
            return None if item is None else item.identifier

    def lookup(self, key: str, identifier: str) -> torch.Tensor | None:
        with self.cv:
            item = self.queue.get(key) or self.inflight.get(key)
            if item is not None and item.identifier == identifier:
                return item.tensor
            return None

    def cancel(self, key: str, identifier: str) -> None:
        """Drop a queued put (and pending LRU touches) of ``identifier`` under
        ``key`` and wait until no write of ``key`` is in flight. A put of
        another identifier under the same key (hash collision) is kept."""
        with self.cv:
            item = self.queue.get(key)
            if item is not None and item.identifier == identifier:
                del self.queue[key]
                self.queued_bytes -= item.nbytes
            touch = self.touches.get(key)
            if touch is not None and touch[0] == identifier:
                del self.touches[key]
            while key in self.inflight:
                self.cv.wait()
            self.cv.notify_all()

    def drain(self) -> None:
        """Block until everything queued before the call has been written."""
        with self.cv:
            self.drainers += 1
            try:
                while self.queue or self.inflight or self.touches or self.busy:
                    self.cv.notify_all()
                    self.cv.wait()
            finally:
                self.drainers -= 1

    def _split_touches(self) -> tuple[dict[str, tuple], dict[str, tuple]]:
        """(reads for this batch, reads to keep): when puts stay queued for a
        later batch, reads made after them wait for that batch too."""
        if not self.queue:
            return self.touches, {}
        cutoff = next(iter(self.queue.values())).order
        now: dict[str, tuple] = {}
        later: dict[str, tuple] = {}
        for key, (identifier, hits, last_ns, orders) in self.touches.items():
            early = tuple(o for o in orders if o < cutoff)
            late = orders[len(early):]
            if early:
                now[key] = (identifier, 0 if late else hits, last_ns, early)
            if late:
                later[key] = (identifier, hits, last_ns, late)
        return now, later

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        self.join()

    def run(self) -> None:
        while True:
            with self.cv:
                while not (self.queue or self.stopping or (self.touches and self.drainers)):
                    if not self.touches:
                        self.cv.wait()
                        continue
                    due = self.touch_since + TOUCH_DELAY_S - time.monotonic()
                    if due <= 0:
                        break
                    self.cv.wait(due)
                if self.stopping and not (self.queue or self.touches):
                    self.cv.notify_all()
                    return
                batch: list[tuple[str, _Pending]] = []
                size = 0
                while self.queue and (not batch or size + next(iter(self.queue.values())).nbytes <= self.batch_bytes):
                    key, item = self.queue.popitem(last=False)
                    batch.append((key, item))
                    size += item.nbytes
                    self.inflight[key] = item
                touches, self.touches = self._split_touches()
                self.busy = True
            store = self.store_ref()
            try:
                if store is not None:
                    store._write(batch, touches)
            except BaseException as e:  # never let the writer die silently
                log.error("ecstore: background write failed: %s", e)
                self.errors.append(e)
            finally:
                with self.cv:
                    for key, item in batch:
                        self.inflight.pop(key, None)
                        self.queued_bytes -= item.nbytes
                    self.busy = False
                    self.cv.notify_all()


class ECStore:
    """An encoder-cache store bound to one model and dtype.

    Args:
        config: tiers and sizes (see :class:`ECStoreConfig`).
        model: model name used in keys (``vllm_config.model_config.model``).
        dtype: the encoder output dtype (the model dtype).
        readonly: open the disk tier read-only (tooling): no writes, no LRU
            updates; ``put``/``delete`` raise ECStoreError.
        chunk_hasher: override the 64-bit identifier hash (tests force
            collisions with it); must return 16 lower-case hex digits.
        _map_size_bytes: test hook, the LMDB map size (see
            :class:`~ecstore.lmdb_tier.LMDBTier`); default max(1.25 x cap, cap + 1 MiB).

    Use as a context manager, or call :meth:`close` (which flushes).
    """

    def __init__(self, config: ECStoreConfig, *, model: str, dtype: torch.dtype,
                 readonly: bool = False, chunk_hasher: ChunkHasher | None = None,
                 _schema_target: int | None = None, _map_size_bytes: int | None = None) -> None:
        if not isinstance(config, ECStoreConfig):
            raise ECStoreError(f"config must be an ECStoreConfig, got {type(config).__name__}")
        self.config = config
        self.model = check_model(model)
        self.dtype = dtype
        self.dtype_name = dtype_name(dtype)
        self.readonly = readonly
        self._hash = chunk_hasher or chunk_hash
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False
        self.memory = MemoryTier(config.cpu_capacity_bytes) if config.local_cpu else None
        self.disk: LMDBTier | None = None
        self._writer: _Writer | None = None
        if config.local_disk:
            self.disk = LMDBTier(config.local_disk, config.disk_capacity_bytes, readonly=readonly,
                                 schema_target=_schema_target, map_size_bytes=_map_size_bytes)
            if not readonly:
                self._writer = _Writer(self, config.write_queue_bytes,
                                       max(1, min(MAX_BATCH_BYTES, config.disk_capacity_bytes // 8)))
                self._writer.start()

    # ----------------------------------------------------------------- basics
    def __enter__(self) -> "ECStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ECStore(model={self.model!r}, dtype={self.dtype_name}, "
                f"local_disk={self.config.local_disk!r}, local_cpu={self.config.local_cpu})")

    def _check(self) -> None:
        check_same_process(self._pid, repr(self))
        if self._closed:
            raise ECStoreError("store is closed")

    def key(self, mm_hash: str) -> str:
        """The EC key of an mm identifier: ``<model>@1@0@<chunk_hash>@<dtype>``."""
        return make_key(self.model, self._hash(check_identifier(mm_hash)), self.dtype_name)

    # ------------------------------------------------------------------ reads
    def _identifier_at(self, key: str) -> str | None:
        """The identifier held under ``key`` by any tier (memory, pending, disk)."""
        for tier in (self.memory, self._writer, self.disk):
            if tier is not None:
                held = tier.identifier_at(key)
                if held is not None:
                    return held
        return None

    def contains(self, mm_hash: str) -> bool:
        """True if ``get(mm_hash)`` would (barring a later eviction) hit.

        Cheap: a dict lookup, or one short LMDB read transaction (~µs).
        Does not count as a hit and does not change LRU order.
        """
        self._check()
        key = self.key(mm_hash)
        if self.memory is not None and self.memory.contains(key, mm_hash):
            return True
        if self._writer is not None and self._writer.lookup(key, mm_hash) is not None:
            return True
        return self.disk is not None and self.disk.contains(key, mm_hash)

    def get(self, mm_hash: str, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """The stored tensor on ``device``, or None on a miss.

        A memory-tier hit on the CPU returns the cached tensor itself (no
        copy): treat it as read-only. A disk hit returns a fresh tensor and
        promotes it to the memory tier. Corrupt entries are misses.
        """
        self._check()
        key = self.key(mm_hash)
        t = None
        tier = "memory"
        if self.memory is not None:
            t = self.memory.get(key, mm_hash)
        if t is None and self._writer is not None:
            t = self._writer.lookup(key, mm_hash)
        if t is None and self.disk is not None:
            tier = "disk"
            t = self.disk.get(key, mm_hash)
            if t is not None and self.memory is not None:
                self.memory.put(key, mm_hash, t, codec.tensor_nbytes(t))
        with self._lock:
            if t is None:
                self._stats.misses += 1
                return None
            self._stats.hits += 1
            if tier == "memory":
                self._stats.memory_hits += 1
            else:
                self._stats.disk_hits += 1
        if self._writer is not None:
            self._writer.touch(key, mm_hash)
        if torch.device(device) != t.device:
            t = t.to(device, non_blocking=False)
        return t

    # ----------------------------------------------------------------- writes
    def put(self, mm_hash: str, tensor: torch.Tensor, *, copy: bool = True) -> bool:
        """Store ``tensor`` under ``mm_hash``.

        Returns True if newly stored, False if already present, or refused
        because it can never fit (larger than every enabled tier; a warning
        is logged). Raises :class:`InvalidEntryError` (store unchanged) for a
        non-tensor, a tensor that is not 2-D, empty, sparse/quantized/meta, or
        whose dtype differs from the handle's.

        The tensor is copied once, from any device and any strides, straight
        into its safetensors blob (the memory tier and the writer share that
        copy), unless ``copy=False`` and it already is a contiguous CPU tensor
        the caller hands over (it must not be modified afterwards; the writer
        encodes it later). The LMDB write happens
        on the background writer; ``flush()`` makes it durable. A later
        ``get``/``contains`` in this process sees the entry immediately.
        """
        self._check()
        if self.readonly:
            raise ECStoreError("store is open read-only")
        key = self.key(mm_hash)
        codec.check_storable(tensor)
        if tensor.dtype != self.dtype:
            raise InvalidEntryError(
                f"tensor dtype {dtype_name(tensor.dtype)} does not match the store's dtype "
                f"{self.dtype_name} (model {self.model!r})"
            )
        nbytes = codec.tensor_nbytes(tensor)
        fits_memory = self.memory is not None and nbytes <= self.memory.capacity_bytes
        # The disk cap counts whole blobs: size them exactly (the header holds
        # the identifier, up to MAX_IDENTIFIER_BYTES, JSON-escaped). Built
        # once here and reused by encode below.
        header = codec.header_bytes(tensor, mm_hash, self.model)
        fits_disk = self.disk is not None and 8 + len(header) + nbytes <= self.disk.capacity_bytes
        if not (fits_memory or fits_disk):
            log.warning("ecstore: refused mm_hash=%s: %d bytes exceed every tier's capacity "
                        "(memory %d, disk %d bytes)", mm_hash, nbytes,
                        self.memory.capacity_bytes if self.memory else 0,
                        self.disk.capacity_bytes if self.disk else 0)
            with self._lock:
                self._stats.puts_refused += 1
            return False
        held = self._identifier_at(key)
        if held == mm_hash:
            with self._lock:
                self._stats.puts_skipped += 1
            return False
        if held is not None:
            log.warning("ecstore: refused mm_hash=%s: its key %s already holds identifier %r "
                        "(64-bit hash collision); the existing entry is kept", mm_hash, key, held)
            with self._lock:
                self._stats.puts_refused += 1
            return False
        blob = None
        if copy or tensor.device.type != "cpu" or not tensor.is_contiguous():
            # The one copy: straight from the caller's tensor (any device or
            # strides) into its safetensors blob. The memory tier and pending
            # write hold a view of the blob's data, and the writer stores the
            # blob as is: no second copy to encode it later.
            blob = codec.encode(tensor, identifier=mm_hash, model=self.model, header=header)
            cpu = codec.blob_tensor(blob, 8 + len(header), tensor.dtype, tuple(tensor.shape))
        else:
            cpu = tensor.detach()  # handed over: encoded by the writer
        stored_in_memory = fits_memory and self.memory is not None and self.memory.put(key, mm_hash, cpu, nbytes)
        with self._lock:
            self._stats.puts += 1
        if self._writer is not None and fits_disk:
            self._writer.submit(key, _Pending(mm_hash, cpu, nbytes, mm_hash, blob=blob))
        elif stored_in_memory:
            log.info("EC put: stored %d bytes for mm_hash=%s", nbytes, mm_hash)
        return True

    def _write(self, batch: list[tuple[str, _Pending]], touches: dict[str, tuple]) -> None:
        """Writer-thread side of put: one LMDB transaction for the batch."""
        assert self.disk is not None
        reqs = [PutRequest(key, it.identifier, self.model, it.tensor, blob=it.blob, order=it.order)
                for key, it in batch]
        try:
            self.disk.write_batch(reqs, touches)
        except ECStoreError as e:  # disk full, map full, schema changed underneath
            log.error("ecstore: %s", e)
        for (key, it), r in zip(batch, reqs):
            if r.result == "stored":
                log.info("EC put: stored %d bytes for mm_hash=%s", it.nbytes, it.mm_hash)
            elif r.result == "collision":
                log.warning("ecstore: not stored mm_hash=%s: key %s holds another identifier "
                            "(64-bit hash collision)", it.mm_hash, key)
            elif r.result == "failed":
                with self._lock:
                    self._stats.write_errors += 1
                assert self._writer is not None
                self._writer.errors.append(r.error or StoreFullError("write failed"))
                log.error("ecstore: could not store mm_hash=%s: %s", it.mm_hash, r.error)

    def write_lru_soon(self) -> None:
        """Have the background writer record the LRU updates (recency, hit
        counts) of the reads made so far now, in one transaction, instead of
        with the next put or after TOUCH_DELAY_S. Does not block. The vLLM
        connector calls it once per step that loaded entries."""
        if self._writer is not None:
            self._writer.touches_now()

    def delete(self, mm_hash: str) -> bool:
        """Remove an entry from every tier; True if it was present anywhere."""
        self._check()
        if self.readonly:
            raise ECStoreError("store is open read-only")
        key = self.key(mm_hash)
        found = False
        if self._writer is not None:
            found = self._writer.lookup(key, mm_hash) is not None
            self._writer.cancel(key, mm_hash)
        if self.memory is not None and self.memory.contains(key, mm_hash):
            found = self.memory.delete(key) or found
        if self.disk is not None and self.disk.contains(key, mm_hash):
            found = self.disk.delete(key) or found
        return found

    def flush(self) -> None:
        """Block until every put made so far is committed and synced to disk.

        Raises StoreFullError if some queued writes failed since the last
        flush (disk full...): those entries are not stored; earlier ones are
        intact.
        """
        self._check()
        if self._writer is None:
            return
        self._writer.drain()
        assert self.disk is not None
        self.disk.sync()
        errors, self._writer.errors = self._writer.errors, []
        if errors:
            raise StoreFullError(f"{len(errors)} write(s) failed since the last flush: {errors[-1]}")

    def wait_committed(self) -> None:
        """Block until every put this handle made so far is committed to LMDB.

        After it returns, ``contains``/``get`` in every other process on the
        same ``local_disk`` see those entries (read-your-writes across
        processes), except puts that failed (disk full...), which
        :meth:`flush` reports. Unlike :meth:`flush` it adds no fsync of its own:
        the cost is the writer's commit of what is queued (each commit syncs
        the data pages; see ``lmdb_tier``). No-op without a disk tier.
        """
        self._check()
        if self._writer is not None:
            self._writer.drain()

    def close(self) -> None:
        """Flush pending writes and release the store. Idempotent."""
        if self._closed or os.getpid() != self._pid:
            self._closed = True
            return
        try:
            if self._writer is not None:
                self._writer.drain()
                self._writer.stop()
                if self.disk is not None:
                    self.disk.sync()
        finally:
            self._closed = True
            if self.disk is not None:
                self.disk.close()

    # ----------------------------------------------------------------- leases
    def lease(self, mm_hashes: list[str], ttl_s: float | None = None) -> None:
        """Pin entries against eviction by any process until :meth:`release`,
        ``ttl_s`` (default ``config.lease_seconds``) or this process's death."""
        self._check()
        if self.disk is not None and not self.readonly:
            self.disk.lease([self.key(h) for h in mm_hashes],
                            self.config.lease_seconds if ttl_s is None else ttl_s)

    def pin_if_present(self, mm_hash: str, ttl_s: float | None = None) -> bool:
        """Lease ``mm_hash`` and return True if the disk tier holds it; a True
        answer guarantees no process evicts it until :meth:`release` (or the
        lease expires, or this process dies). False: nothing stays leased.
        Memory-only stores answer :meth:`contains` (nothing to pin)."""
        self._check()
        if self.disk is None or self.readonly:
            return self.contains(mm_hash)
        return self.disk.pin_if_present(self.key(mm_hash), mm_hash,
                                        self.config.lease_seconds if ttl_s is None else ttl_s)

    def release(self, mm_hashes: list[str]) -> None:
        self._check()
        if self.disk is not None and not self.readonly:
            self.disk.release([self.key(h) for h in mm_hashes])

    # ------------------------------------------------------------------ stats
    def stats(self) -> StoreStats:
        """A snapshot of this handle's counters and the tiers' occupancy."""
        self._check()
        with self._lock:
            s = StoreStats(**self._stats.__dict__)
        if self.memory is not None:
            s.memory_entries = len(self.memory)
            s.memory_bytes = self.memory.used_bytes
            s.memory_capacity_bytes = self.memory.capacity_bytes
            s.memory_evictions = self.memory.evictions
        if self.disk is not None:
            s.disk_entries = self.disk.entry_count()
            s.disk_bytes = self.disk.total_bytes()
            s.disk_capacity_bytes = self.disk.capacity_bytes
            s.disk_evictions = self.disk.evictions
            s.corrupt_dropped = self.disk.corrupt_dropped
        if self._writer is not None:
            with self._writer.cv:
                s.pending_writes = len(self._writer.queue) + len(self._writer.inflight)
                s.pending_bytes = self._writer.queued_bytes
        return s
