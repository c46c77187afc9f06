"""ECStore: the public handle that composes the tiers.

The handle checks arguments and composes; the read path lives in
:mod:`ecstore.store.read_path`, the put path in :mod:`ecstore.store.put_path`,
the background writer in :mod:`ecstore.store.writer`, the counters and
refusal log lines in :mod:`ecstore.store.stats` (flows: docs/architecture.md).
A handle is bound to one (model, dtype); the remote tier's failures are
misses, never errors (docs/remote.md).

Threading: every public method may be called from any thread, concurrently
with the background writer and with ``close`` (see :mod:`ecstore.store.calls`).
Processes: each has its own memory tier and pending map; the LMDB tier is
shared, so an entry committed by one process is visible in every other. A
handle must not be used after ``fork()`` (ForkedStoreError), and a forked
child cannot reopen a directory its parent had open (StoreOpenError).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from ecstore.config import ECStoreConfig
from ecstore.errors import THIS_PROCESS, ECStoreError, StoreFullError, StoreOpenError, check_same_process
from ecstore.format import Record, codec, split_read
from ecstore.identity import EncoderIdentity, library_identity, qualify, split_stored
from ecstore.key import (
    ChunkHasher,
    check_device,
    check_identifier,
    check_identifier_list,
    check_model,
    chunk_hash,
    dtype_name,
    make_key,
)
from ecstore.lmdb import LMDBTier
from ecstore.lmdb.blobfiles import DIRECT_FROM, SPARE_FROM
from ecstore.lmdb.leases import PIN_ABSENT, Pin, PinAnswer
from ecstore.memory import MemoryTier
from ecstore.pool import POOL
from ecstore.store import left_open
from ecstore.store.calls import CallGate
from ecstore.store.put_path import PutPath
from ecstore.store.read_path import ReadPath
from ecstore.store.stats import Counters, StoreStats
from ecstore.store.tiers import Tiers
from ecstore.store.writer import Writer

if TYPE_CHECKING:
    from ecstore.remote.tier import RemoteStats, RemoteTier

#: Upper bound of a typical safetensors header (informational: put sizes each
#: blob exactly with codec.blob_size).
HEADER_ESTIMATE = 1024
#: The writer commits at most this many bytes of blobs per transaction, and
#: at most an eighth of the disk cap (a batch near the cap would have to evict
#: the very entries it just wrote, and fragments the map).
MAX_BATCH_BYTES = 256 << 20

_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True)
class OpenSeams:
    """How a handle opens its tiers beyond what its config says: seams for
    tests, not settings (:mod:`ecstore.testing.stores` opens handles with
    them; ``ECStore(...)`` always uses the defaults).

    ``schema_target``: the LMDB schema a new store is created at and an
    older one migrated to (None: the current one; see
    :class:`~ecstore.lmdb.LMDBTier`). ``map_size_bytes``: the LMDB map size
    (None: max(1.25 x cap, cap + 1 MiB)). ``remote_clock``: the monotonic
    clock (seconds) of the remote tier's circuit breaker and negative cache.
    """

    schema_target: int | None = None
    map_size_bytes: int | None = None
    remote_clock: Callable[[], float] = time.monotonic


DEFAULT_SEAMS = OpenSeams()


def _gated(method: _F) -> _F:
    """A public method of :class:`ECStore` run inside the handle's
    :class:`~ecstore.store.calls.CallGate` (``close`` waits for it; after ``close``
    it raises ECStoreError "store is closed"), in the process that opened
    the handle only (ForkedStoreError)."""
    @functools.wraps(method)
    def call(self: ECStore, *args: Any, **kwargs: Any) -> Any:
        if THIS_PROCESS.pid != self._pid:
            check_same_process(self._pid, repr(self))
        me = self._calls.enter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._calls.leave(me)
    return cast(_F, call)


class ECStore:
    """An encoder-cache store bound to one model and dtype.

    Args:
        config: tiers and sizes (see :class:`ECStoreConfig`).
        model: model name used in keys (``vllm_config.model_config.model``).
        dtype: the encoder output dtype (the model dtype).
        readonly: open the disk tier read-only (tooling): no writes, no LRU
            updates; ``put``/``delete`` raise ECStoreError.
        identity: the encoder identity entries are written and read under
            (see :mod:`ecstore.identity`): an entry of another identity is a
            miss. Default: :func:`~ecstore.identity.library_identity` of
            ``(model, dtype)``, i.e. the caller vouches that they fix the encoder.
        chunk_hasher: override the 64-bit identifier hash (tests force
            collisions with it); must return 16 lower-case hex digits.

    Use as a context manager, or call :meth:`close` (which flushes); a
    handle still open when the interpreter exits is closed then
    (:mod:`ecstore.store.left_open`).
    """

    def __init__(self, config: ECStoreConfig, *, model: str, dtype: torch.dtype,
                 readonly: bool = False, chunk_hasher: ChunkHasher | None = None,
                 identity: EncoderIdentity | None = None) -> None:
        self._open(config, model=model, dtype=dtype, readonly=readonly, chunk_hasher=chunk_hasher,
                   identity=identity, seams=DEFAULT_SEAMS)

    @classmethod
    def _with_seams(cls, seams: OpenSeams, config: ECStoreConfig, *, model: str, dtype: torch.dtype,
                    readonly: bool = False, chunk_hasher: ChunkHasher | None = None,
                    identity: EncoderIdentity | None = None) -> ECStore:
        """A handle opened as ``ECStore(config, ...)`` would be, with ``seams``
        (the internal seam of :mod:`ecstore.testing.stores`; not public API)."""
        store = cls.__new__(cls)
        store._open(config, model=model, dtype=dtype, readonly=readonly, chunk_hasher=chunk_hasher,
                    identity=identity, seams=seams)
        return store

    def _open(self, config: ECStoreConfig, *, model: str, dtype: torch.dtype, readonly: bool,
              chunk_hasher: ChunkHasher | None, identity: EncoderIdentity | None, seams: OpenSeams) -> None:
        """Open the tiers (the body of ``__init__``, with its seams)."""
        if not isinstance(config, ECStoreConfig):
            raise ECStoreError(f"config must be an ECStoreConfig, got {type(config).__name__}")
        self._calls = CallGate()  # the running calls close() waits for
        self._exit_token: int | None = None  # ecstore.store.left_open's, once the tiers are open
        self._pid = os.getpid()
        self.config = config
        self.model = check_model(model)
        self.dtype = dtype
        self.dtype_name = dtype_name(dtype)
        self.readonly = readonly
        self.identity = identity or library_identity(self.model, self.dtype_name)
        #: 32 hex digits; part of every key's hash and of every entry's stored name.
        self.namespace = self.identity.namespace
        self._hash = chunk_hasher or chunk_hash
        self._counters = Counters()
        #: The handle's tiers: the one place they are held (reads, puts,
        #: stats, verify, delete and close all go through it).
        self._tiers = tiers = Tiers(memory=MemoryTier(config.cpu_capacity_bytes) if config.local_cpu else None)
        self._legacy = False
        try:
            self._open_tiers(config, tiers, readonly=readonly, seams=seams)
        except BaseException:  # an open that fails leaves nothing open: no env, no thread
            self.close()
            raise
        if tiers.writer is not None or tiers.remote is not None:  # closed at exit if the caller does not
            background = Tiers(writer=tiers.writer, disk=tiers.disk, remote=tiers.remote)
            self._exit_token = left_open.track(self, background)

    def _open_tiers(self, config: ECStoreConfig, tiers: Tiers, *, readonly: bool, seams: OpenSeams) -> None:
        """Open the disk tier, its writer and the remote tier into ``tiers``
        (``_open``'s part that can fail; ``_open`` closes what it opened)."""
        if config.local_disk:
            tiers.disk = LMDBTier(config.local_disk, config.disk_capacity_bytes, readonly=readonly,
                                  schema_target=seams.schema_target, map_size_bytes=seams.map_size_bytes,
                                  file_mode=config.file_mode, file_blobs_from=config.file_blobs_from_bytes,
                                  split_reads_from=split_read.SPLIT_READ_BYTES if config.split_reads else None,
                                  direct_writes_from=DIRECT_FROM if config.use_odirect else None,
                                  spare_writes_from=SPARE_FROM if config.spare_blob_files else None)
            self._legacy = tiers.disk.record_version == codec.LEGACY_RECORD_VERSION
            if not readonly:
                writer = Writer(tiers.disk, self.model, config.write_queue_bytes,
                                max(1, min(MAX_BATCH_BYTES, config.disk_capacity_bytes // 8)),
                                namespace=(self.namespace, self.identity.canonical()))
                try:
                    writer.start()
                except RuntimeError as e:  # the process is at its thread limit
                    raise StoreOpenError(f"{config.local_disk}: cannot start the store's writer thread ({e})") from e
                tiers.writer = writer  # only a started writer: close() stops and joins it
                if config.pooled_blobs:  # what pending writes held stays faulted for the next burst
                    POOL.keep_at_least(config.write_queue_bytes)
        self._reads = ReadPath(tiers, model=self.model, dtype=self.dtype)
        self._puts = PutPath(tiers, self._reads, self._counters, pooled=config.pooled_blobs)
        if config.remote_url:
            from ecstore.remote import open_remote

            tiers.remote = open_remote(config, model=self.model, dtype=self.dtype, readonly=readonly,
                                       clock=seams.remote_clock)

    # ------------------------------------------------------------------ tiers
    # Read-only views of the tiers, for the handle's own methods and for tests
    # and tools that test a tier; nothing outside ecstore.store uses them
    # (the connector calls the handle's methods).
    @property
    def memory(self) -> MemoryTier | None:
        """This process's memory tier (None: ``local_cpu`` off)."""
        return self._tiers.memory

    @property
    def disk(self) -> LMDBTier | None:
        """The LMDB tier (None: no ``local_disk``)."""
        return self._tiers.disk

    @property
    def remote(self) -> RemoteTier | None:
        """The remote tier (None: no ``remote_url``, or the handle is closed)."""
        return self._tiers.remote

    @property
    def _writer(self) -> Writer | None:
        """The background writer (None: no disk tier, or read-only)."""
        return self._tiers.writer

    # ----------------------------------------------------------------- basics
    def __enter__(self) -> ECStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ECStore(model={self.model!r}, dtype={self.dtype_name}, "
                f"local_disk={self.config.local_disk!r}, local_cpu={self.config.local_cpu})")

    def stored_name(self, mm_hash: str) -> str:
        """What an entry of ``mm_hash`` stores and reads compare:
        ``"<namespace>/<mm_hash>"`` (see :mod:`ecstore.identity`); the bare
        ``mm_hash`` on a store held at schema < 3 (tests of old stores)."""
        if self._legacy:
            return check_identifier(mm_hash)
        return qualify(self.namespace, check_identifier(mm_hash))

    def key(self, mm_hash: str) -> str:
        """The EC key of an mm identifier under this handle's identity:
        ``<model>@1@0@<chunk_hash>@<dtype>``, the chunk hash being that of
        :meth:`stored_name`."""
        return self._key_of(self.stored_name(mm_hash))

    def _key_of(self, name: str) -> str:
        """The EC key of a stored name (see :meth:`key`)."""
        return make_key(self.model, self._hash(name), self.dtype_name)

    # ------------------------------------------------------------------ reads
    @_gated
    def contains(self, mm_hash: str) -> bool:
        """True if ``get(mm_hash)`` would (barring a later eviction) hit.

        Cheap: a dict lookup, or one short LMDB read transaction (~µs).
        Does not count as a hit and does not change LRU order.
        """
        name = self.stored_name(mm_hash)
        return self._reads.contains(self._key_of(name), name)

    @_gated
    def remote_contains(self, mm_hash: str) -> bool:
        """Does the remote tier hold ``mm_hash``? False without one, while it
        is unreachable, or when it said no less than a second ago. Bounded
        by ``remote_timeout_seconds``; never raises for remote failures."""
        return self.remote is not None and self.remote.contains(self.key(mm_hash))

    @_gated
    def get(self, mm_hash: str, device: torch.device | str = "cpu", *,
            wait_for_room: bool = False) -> torch.Tensor | None:
        """The stored tensor on ``device``, or None on a miss.

        A memory-tier hit on the CPU returns the cached tensor itself (no
        copy): treat it as read-only. A disk or remote hit returns a fresh
        tensor that nothing else references (the memory tier and a pending
        LMDB write of a remote hit keep their own copy), so the caller may
        modify it. Corrupt entries are misses. A ``device`` tensors cannot be
        placed on in this process is an InvalidEntryError, nothing counted.

        A remote hit is promoted into LMDB only if the background writer has
        room at once (never waiting behind another process's write lock);
        else the promotion is skipped (``remote_promotions_skipped``).
        ``wait_for_room``: wait for room instead (a thread that may block,
        e.g. the connector's background fetch).
        """
        device = check_device(device)
        name = self.stored_name(mm_hash)
        key = self._key_of(name)
        hit = self._reads.find(key, name, mm_hash, wait_for_room=wait_for_room)
        if hit is None:
            self._counters.miss()
            return None
        t = hit.tensor
        if hit.promoted and device == t.device:
            t = t.clone()  # hand out a copy of our own
        self._counters.hit(hit.tier)
        if self._writer is not None:
            self._writer.touch(key, name)
        if device != t.device:
            t = t.to(device, non_blocking=False)
        return t

    @_gated
    def stored_shape(self, mm_hash: str) -> tuple[int, ...] | None:
        """The shape the disk tier's entry of ``mm_hash`` (under this handle's
        identity) holds, from its record (no blob read); None if there is none,
        or if its record is unreadable (a miss: the entry is dropped, as by
        :meth:`get`). Lets a caller refuse an entry before committing to load it."""
        name = self.stored_name(mm_hash)
        return self._reads.stored_shape(self._key_of(name), name)

    @_gated
    def stored_record(self, mm_hash: str) -> Record | None:
        """The disk tier's record of ``mm_hash``'s entry (under this handle's
        identity: shape, checksum, creation time; no blob read), as
        :meth:`stored_shape` reads it; None likewise."""
        name = self.stored_name(mm_hash)
        return self._reads.stored_record(self._key_of(name), name)

    @_gated
    def verify(self, mm_hash: str) -> bool:
        """Whether the disk tier holds ``mm_hash``'s entry (under this
        handle's identity) and it passes every check a :meth:`get` makes: the
        whole blob is hashed in place (inline) or through a small per-thread
        buffer (blob file), nothing copied out, no memory of the entry's size
        taken. No LRU update, no promotion, not counted as a hit; an entry
        failing a check is logged and dropped, as by :meth:`get`. False
        without a disk tier. The vLLM scheduler verifies before it promises
        an entry that vLLM could not compute instead."""
        name = self.stored_name(mm_hash)
        return self._reads.verify(self._key_of(name), name)

    # ----------------------------------------------------------------- writes
    @_gated
    def put(self, mm_hash: str, tensor: torch.Tensor, *, copy: bool = True, defer_write: bool = False,
            known_absent: bool = False) -> bool:
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

        ``defer_write``: the LMDB write waits for :meth:`start_writes` (or
        ``wait_committed``, ``flush``, ``close``, or a few MiB of deferred
        puts), so that a caller's burst of small puts costs one transaction
        and no thread wake each (the vLLM connector: a step's saves).
        ``known_absent``: the caller found the entry absent moments ago (vLLM
        encoded it because the scheduler's lookup missed): the LMDB tier is
        not asked before the copy; an entry another process committed
        meanwhile is found by the writer, which then stores nothing (True is
        returned all the same; :meth:`puts_found_stored` counts those). So is
        a hash collision with an entry only LMDB holds (True too; the writer
        logs it and keeps the stored entry; this handle's memory tier may
        hold the put's tensor under its own name).
        """
        if self.readonly:
            raise ECStoreError("store is open read-only")
        name = self.stored_name(mm_hash)
        return self._puts.put(mm_hash, name, self._key_of(name), tensor, copy=copy, defer=defer_write,
                              ask_disk=not known_absent)

    def start_writes(self) -> None:
        """Start the LMDB writes of the puts made with ``defer_write``; does
        not block (``wait_committed`` waits for them)."""
        if os.getpid() != self._pid:
            check_same_process(self._pid, repr(self))
        if self._writer is not None:
            self._writer.start_writes()

    def write_lru_soon(self) -> None:
        """Have the background writer record the LRU updates (recency, hit
        counts) of the reads made so far now, in one transaction, instead of
        with the next put or after TOUCH_DELAY_S. Does not block. The vLLM
        connector calls it once per step that loaded entries. Like every call,
        ForkedStoreError in a child forked after the handle opened (it would
        take the parent's writer lock, which the fork may have copied held)."""
        if os.getpid() != self._pid:
            check_same_process(self._pid, repr(self))
        if self._writer is not None:
            self._writer.touches_now()

    @_gated
    def delete(self, mm_hash: str) -> bool:
        """Remove an entry from every tier; True if it was present anywhere
        locally. With a remote tier the shared remote value is deleted too
        (for every node; best effort, not counted in the result)."""
        if self.readonly:
            raise ECStoreError("store is open read-only")
        name = self.stored_name(mm_hash)
        return self._tiers.delete(self._key_of(name), name)

    @_gated
    def flush(self) -> None:
        """Block until every put made so far is committed and synced to disk.

        Raises StoreFullError if some queued writes failed since the last
        flush (disk full...): those entries are not stored; earlier ones are
        intact.
        """
        self._wait_committed(durable=True)  # LMDB commits and blob files synced; remote writes sent or dropped
        if self._writer is None:
            return
        assert self.disk is not None
        self.disk.sync()
        errors = self._writer.take_errors()
        if errors:
            raise StoreFullError(f"{errors.count} write(s) failed since the last flush: {errors.last[-1]}")

    @_gated
    def wait_committed(self) -> None:
        """Block until every put this handle made so far is committed to LMDB.

        After it returns, ``contains``/``get`` in every other process on the
        same ``local_disk`` see those entries (read-your-writes across
        processes), except puts that failed (disk full...), which
        :meth:`flush` reports. Unlike :meth:`flush` it does not wait for
        durability: the cost is the writer's commit of what is queued (each
        commit syncs LMDB's data pages; see ``ecstore.lmdb``); blob files are
        written whole before that commit and ``fdatasync``ed after it
        (``ecstore.store.writer``), which only ``flush`` waits for.

        With a remote tier it also waits until those puts were sent to the
        remote (or dropped: the remote down, slow or its queue full; each
        batch bounded by ``remote_timeout_seconds``, and with a remote that
        stopped answering the whole wait too; never raises), so that other
        nodes see them too. No-op without a disk or remote tier.
        """
        self._wait_committed()

    def _wait_committed(self, durable: bool = False) -> None:
        self._tiers.wait_written(durable)

    def close(self) -> None:
        """Write pending puts and LRU updates, make them durable and release
        the store. Idempotent. A write that fails here (or a blob file that
        could not be made durable) is logged, not raised, and so are those
        since the last :meth:`flush` (one line naming how many): call
        :meth:`flush` first to have such errors raised.

        Thread-safe (see :mod:`ecstore.store.calls`): new calls raise "store is
        closed" from the moment it begins; it waits for the calls already
        running in other threads, then flushes and releases the tiers. Of
        concurrent ``close`` calls exactly one does that; the others wait
        until it is done and return. Called from within a call of this
        handle (a callback), it returns at once and the call that is running
        closes the store when it returns. In a forked child it only marks
        the handle closed (the parent's tiers are not touched)."""
        if os.getpid() != self._pid:
            self._calls.abandon()
            return
        self._calls.close(self._teardown)

    def _teardown(self) -> None:
        """Flush and release the tiers: :meth:`close`, once, with no call running."""
        if self._exit_token is not None:
            left_open.forget(self._exit_token)
        self._tiers.close()

    # ----------------------------------------------------------------- leases
    @_gated
    def lease(self, mm_hashes: list[str], ttl_s: float | None = None) -> None:
        """Pin entries against eviction by any process until :meth:`release`,
        ``ttl_s`` (default ``config.lease_seconds``) or this process's death.
        ``mm_hashes``: a list (a single ``str`` is an InvalidEntryError)."""
        mm_hashes = check_identifier_list(mm_hashes)
        if self.disk is not None and not self.readonly:
            self.disk.lease([self.key(h) for h in mm_hashes],
                            self.config.lease_seconds if ttl_s is None else ttl_s)

    @_gated
    def pin_if_present(self, mm_hash: str, ttl_s: float | None = None) -> bool:
        """Lease ``mm_hash`` and return True if the disk tier holds it; a True
        answer guarantees no process evicts it until :meth:`release` (or the
        lease expires, or this process dies). False: nothing stays leased;
        also while another process holds the lease file's write lock (stopped
        inside a lease write, say): a pin never waits for another process;
        :meth:`pin` tells that case apart. Memory-only stores answer
        :meth:`contains` (nothing to pin)."""
        return self._pin(mm_hash, ttl_s) is Pin.HELD

    @_gated
    def pin(self, mm_hash: str, ttl_s: float | None = None) -> Pin:
        """:meth:`pin_if_present` with a three-way answer: ``Pin.HELD``
        (leased, as its True), ``Pin.ABSENT`` (not held), or ``Pin.BUSY``
        (held by the disk tier, but another process holds the lease file's
        write lock, or did a moment ago: nothing leased; ask again later).
        Memory-only and read-only stores answer HELD or ABSENT from
        :meth:`contains` (nothing to pin)."""
        return self._pin(mm_hash, ttl_s)

    @_gated
    def pin_entry(self, mm_hash: str, ttl_s: float | None = None) -> PinAnswer:
        """:meth:`pin` with the disk tier's record of the entry (its shape,
        checksum and creation time; see :class:`~ecstore.lmdb.leases.PinAnswer`),
        read under the lease: no second read to check what was pinned.
        Memory-only and read-only stores answer from :meth:`contains`, with
        no record."""
        return self._pin_entry(mm_hash, ttl_s)

    @_gated
    def pin_entries(self, mm_hashes: list[str], *, release: list[str] | None = None,
                    ttl_s: float | None = None) -> list[Pin]:
        """:meth:`pin` for each of ``mm_hashes`` (one lease per occurrence),
        after :meth:`release` of ``release``, in one lease-file commit: a
        caller that pins a step's worth of entries pays one. All ``Pin.BUSY``
        (nothing leased, nothing released) while another process holds the
        lease file's write lock. Memory-only and read-only stores answer from
        :meth:`contains`."""
        mm_hashes = check_identifier_list(mm_hashes)
        release = check_identifier_list(release or [])
        names = [self.stored_name(h) for h in mm_hashes]
        if self.disk is None or self.readonly:
            return [Pin.HELD if self._reads.contains(self._key_of(n), n) else Pin.ABSENT for n in names]
        return self.disk.pin_entries([(self._key_of(n), n) for n in names],
                                     self.config.lease_seconds if ttl_s is None else ttl_s,
                                     [self.key(h) for h in release])

    def _pin(self, mm_hash: str, ttl_s: float | None) -> Pin:
        return self._pin_entry(mm_hash, ttl_s).pin

    def _pin_entry(self, mm_hash: str, ttl_s: float | None) -> PinAnswer:
        name = self.stored_name(mm_hash)
        key = self._key_of(name)
        if self.disk is None or self.readonly:
            return PinAnswer(Pin.HELD) if self._reads.contains(key, name) else PIN_ABSENT
        return self.disk.pin_entry(key, name, self.config.lease_seconds if ttl_s is None else ttl_s)

    @_gated
    def release(self, mm_hashes: list[str], *, wait: bool = True) -> bool:
        """Drop one lease of this process on each of ``mm_hashes``. True when
        done; ``wait=False``: False (nothing released) instead of waiting
        while another process holds the lease file's write lock."""
        mm_hashes = check_identifier_list(mm_hashes)
        if self.disk is not None and not self.readonly:
            return self.disk.release([self.key(h) for h in mm_hashes], wait=wait)
        return True

    # ------------------------------------------------- what the connector asks
    @property
    def has_disk_tier(self) -> bool:
        """Whether the handle has a disk tier (``local_disk``; fixed at open)."""
        return self._tiers.disk is not None

    @property
    def has_memory_tier(self) -> bool:
        """Whether the handle has a memory tier (``local_cpu``; fixed at open)."""
        return self._tiers.memory is not None

    @property
    def has_remote_tier(self) -> bool:
        """Whether the handle has a remote tier (``remote_url``): from open
        until :meth:`close` begins releasing the tiers."""
        return self._tiers.remote is not None

    def on_memory_eviction(self, callback: Callable[[str, torch.Tensor], None] | None) -> bool:
        """Have ``callback(mm_hash, tensor)`` called for each entry the memory
        tier evicts to make room (LRU; not for :meth:`delete`), with the
        identifier it was put under and the tensor it held; None: no more
        calls. It runs in the thread whose put or promotion made room, under
        the memory tier's lock: it must be quick and must not call this
        handle. False (nothing registered) without a memory tier."""
        memory = self._tiers.memory
        if memory is None:
            return False
        memory.on_evict = None if callback is None else (
            lambda key, item: callback(split_stored(item.identifier).identifier, item.tensor))
        return True

    @_gated
    def forget_if_lost_from_disk(self, mm_hash: str) -> bool:
        """Whether the disk tier, the file every process on ``local_disk``
        shares, no longer holds ``mm_hash``'s entry (another process evicted
        or deleted it). If so, this process's memory-tier copy is dropped, so
        that a :meth:`put` stores the entry again instead of answering
        "already present". False without a disk tier (nothing is shared) and
        while it holds the entry. One short LMDB read."""
        name = self.stored_name(mm_hash)
        key = self._key_of(name)
        disk, memory = self._tiers.disk, self._tiers.memory
        if disk is None or disk.contains(key, name):
            return False
        if memory is not None:
            memory.delete(key)  # stale copy: put would skip it
        return True

    def disk_evictions(self) -> int:
        """How many entries this handle evicted from the disk tier since it
        opened (to stay under the cap, or to make room in a full map; this
        process only; 0 without a disk tier). A counter read: no I/O, never
        blocks, any thread."""
        disk = self._tiers.disk
        return 0 if disk is None else disk.evictions

    def puts_found_stored(self) -> tuple[int, int]:
        """(puts, tensor bytes) made with ``known_absent`` that the background
        writer found already stored since the handle opened (committed before:
        by another handle, or by this one if it keeps no memory tier; nothing
        was written, though ``put`` answered True). A counter read: no I/O,
        any thread; (0, 0) without a disk tier."""
        if os.getpid() != self._pid:
            check_same_process(self._pid, repr(self))
        w = self._writer
        if w is None:
            return 0, 0
        with w.cv:
            return w.found_stored, w.found_stored_bytes

    @_gated
    def entry_tag(self, mm_hash: str) -> tuple[int, int] | None:
        """(checksum, creation time in ns) of the disk tier's entry of
        ``mm_hash`` from its record (no blob read), or None: no such entry
        (or no disk tier). Entries are never rewritten in place, so an
        unchanged tag means the same blob: what :meth:`verify` found good
        stays good. CorruptEntryError for an unreadable record."""
        disk = self._tiers.disk
        if disk is None:
            return None
        name = self.stored_name(mm_hash)
        rec = disk.record(self._key_of(name))
        return None if rec is None or rec.identifier != name else (rec.checksum, rec.created_ns)

    @_gated
    def namespace_descriptions(self) -> dict[str, bytes]:
        """namespace -> identity description (JSON bytes) of every encoder
        identity registered in the disk tier (its ``namespaces`` table);
        empty without a disk tier. One short LMDB read."""
        disk = self._tiers.disk
        return {} if disk is None else disk.namespace_descriptions()

    @_gated
    def holds_foreign(self, namespace: str, dtype: str, mm_hash: str) -> bool:
        """Whether the disk tier holds ``mm_hash``'s entry as another encoder
        identity of this model wrote it: namespace ``namespace``, dtype name
        ``dtype`` (see :meth:`namespace_descriptions`). It stays a miss here
        (reads see this handle's identity only). One short LMDB read; False
        without a disk tier."""
        disk = self._tiers.disk
        if disk is None:
            return False
        name = qualify(namespace, mm_hash)
        return disk.contains(make_key(self.model, self._hash(name), dtype), name)

    def remote_stats(self) -> RemoteStats | None:
        """The remote tier's counters now (this process; see
        :class:`~ecstore.remote.tier.RemoteStats`), or None without a remote
        tier. No I/O, any thread."""
        remote = self._tiers.remote
        return None if remote is None else remote.stats()

    # ------------------------------------------------------------------ stats
    @_gated
    def stats(self) -> StoreStats:
        """A snapshot of this handle's counters and the tiers' occupancy."""
        return self._counters.snapshot(self._tiers)
