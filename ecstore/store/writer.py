"""The background writer of an :class:`~ecstore.store.ECStore` handle.

:class:`Writer`: one thread per handle commits queued puts
(:class:`~ecstore.format.put.PendingPut`) and touches in one LMDB write
transaction per batch; a sync thread (``ecstore-sync``) ``fdatasync``s blob
files after their commit. :meth:`Writer.drain` waits for everything ticketed
before its call (``durable=True``: until it is durable too); after
:meth:`Writer.stop` puts are refused and everything queued is written first.
Holds the LMDB tier, never the store. Design:
docs/architecture.md#write-behind-queues.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from ecstore.errors import ECStoreError, StoreFullError
from ecstore.format import PendingPut, PutOutcome, PutQueue
from ecstore.lmdb import BatchPut, LMDBTier
from ecstore.lmdb.batch import Touch
from ecstore.pool import POOL

log = logging.getLogger("ecstore")

#: LRU updates from reads are written with the next batch of puts, or after
#: this many seconds (or at flush): a burst of hits costs one commit, not one
#: fsync'd commit each.
TOUCH_DELAY_S = 1.0
#: :meth:`Writer.touches_now` (``write_lru_soon``, once per engine step with
#: loads) writes the pending touches at once, but no sooner than this many
#: seconds after the previous commit of touches: a consumer loading in every
#: step makes at most ~5 LRU commits a second, not one per step, and a step's
#: load does not run beside the commit the previous step asked for
#: (measured: docs/benchmarks.md, "Figures behind constants").
TOUCH_SOON_GAP_S = 0.2
#: Deferred puts (:meth:`Writer.submit` with ``defer``) wait, without waking
#: the writer, until :meth:`Writer.start_writes`, a drain, a put that does
#: not defer, due LRU touches, or until this many tensor bytes are deferred:
#: a step's small saves go in one transaction at the step's end, and a save
#: does not pay for waking a sleeping thread.
DEFER_BYTES = 8 << 20


#: The most recent write errors a writer keeps for ``flush`` and ``close`` to
#: report (the count stays exact): a producer that never flushes (the
#: connector) keeps no more than this many on a disk that stays full.
KEPT_ERRORS = 16


@dataclass(frozen=True)
class WriteErrors:
    """What :meth:`Writer.take_errors` hands on: ``count`` errors recorded
    since the last call, ``last`` the most recent of them (oldest first, at
    most :data:`KEPT_ERRORS`); false when there were none."""

    count: int
    last: list[BaseException]

    def __bool__(self) -> bool:
        return self.count > 0


def _without_frames(error: BaseException) -> BaseException:
    """``error``, and the errors it chains to, without their tracebacks:
    their frames held a failed batch's requests, and so its blobs (a
    finished frame keeps its locals, and its caller's frame through
    ``f_back``). Only the messages are reported (``flush``, ``close``); an
    unforeseen error's traceback is logged when it happens."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += (e.__cause__, e.__context__)  # both: "raise X from A" inside "except B" chains to each
    return error


class SyncJob(NamedTuple):
    """Blob files of one committed batch waiting for their ``fdatasync``:
    ``names`` (in ``blobs/``) and ``since``, the oldest ticket of the puts
    and vouches they stand for (what ``drain(durable=True)`` waits for)."""

    names: list[str]
    since: int


class Writer(threading.Thread):
    """Background LMDB writer: drains puts and LRU touches in batches.

    :meth:`submit` (``ECStore.put``) blocks while unwritten tensor bytes would
    exceed ``max_bytes`` (first come, first served; raises ECStoreError once
    :meth:`stop` began); a transaction commits at most ``batch_bytes`` of blobs
    with the touches made before them. Thread-safe (one condition, ``cv``).
    :attr:`write_errors` / :attr:`sync_errors` count failed puts and blob-file
    syncs, which :meth:`take_errors` hands to ``flush`` and ``close``; a second
    thread (:meth:`_sync_run`, fed :class:`SyncJob`) syncs committed files, and
    :meth:`stop` returns once both threads ended.
    """

    def __init__(self, disk: LMDBTier, model: str, max_bytes: int, batch_bytes: int,
                 namespace: tuple[str, bytes] | None = None) -> None:
        """``namespace``: (namespace, canonical identity JSON bytes) recorded in the
        store's namespaces table with the first batch, so that tools can say
        what a namespace stands for."""
        super().__init__(name="ecstore-writer", daemon=True)
        self.disk = disk
        self.model = model
        self.namespace = namespace
        self.max_bytes = max_bytes
        self.batch_bytes = batch_bytes
        self.touch_since = 0.0  # monotonic time of the oldest unwritten LRU touch
        self.touches_written_at = float("-inf")  # monotonic time touches were last taken for a commit
        self.drainers = 0  # threads waiting in drain()
        self.cv = threading.Condition()
        # puts queued and being written (the batch), their bytes, and the
        # ticket counter that orders puts, touches and vouches as they were made
        self.puts = PutQueue()
        # key -> the reads of it not yet written (see Touch: ``orders`` holds the
        # ticket of the last read of the key between two consecutive puts, so
        # the LMDB tier can replay reads and puts in the order they were made)
        self.touches: dict[str, Touch] = {}
        self.last_put_ticket = 0
        self.deferred_bytes = 0  # tensor bytes of deferred puts queued since the writer was last woken for puts
        # the queued puts are to be written now (a put that did not defer, or
        # a start): deferred puts alone do not end the writer's wait
        self.write_wanted = False
        self.admissions = 0  # puts that came to submit (their turns in line)
        self.in_line: deque[int] = deque()  # turns of the puts in submit, oldest first
        self.stopping = False
        # the most recent errors recorded since take_errors, and how many
        # (see _record_error: guarded by cv)
        self._errors: deque[BaseException] = deque(maxlen=KEPT_ERRORS)
        self._error_count = 0
        self.write_errors = 0  # failed puts since start
        # puts made without asking LMDB first (put(known_absent=True)) that
        # the batch found already stored (nothing written) since start, and
        # their tensor bytes
        self.found_stored = 0
        self.found_stored_bytes = 0
        # blob files of committed entries whose sync after the commit failed
        # since start (those puts were reported stored: not write_errors)
        self.sync_errors = 0
        self.offers_refused = 0  # offers (remote promotions) refused for want of room since start
        self.busy = False
        self.busy_since: int | None = None  # oldest ticket of the touches being written (None: none)
        # oldest ticket of the committed batches whose blob files the sync
        # thread is syncing now (None: none): what drain(durable=True) still
        # waits for, with the jobs still queued for it (sync_jobs)
        self.syncing_since: int | None = None
        self.sync_jobs: deque[SyncJob] = deque()
        # oldest ticket of the vouches taken into the batch being written (None: none)
        self.vouching_since: int | None = None
        self.syncer: threading.Thread | None = None  # the sync thread, once started
        self.sync_stop = False  # the writer thread ended: the sync thread ends once sync_jobs is empty
        # key -> (identifier, ticket): puts skipped because the store already
        # held that entry (:meth:`vouch`), whose blob file the next batch syncs
        self.vouches: dict[str, tuple[str, int]] = {}
        self.progress = 0  # batches finished and puts cancelled: drainers re-check on a change
        self.dead: BaseException | None = None  # what ended the thread early (see _die)

    def submit(self, item: PendingPut, *, defer: bool = False) -> None:
        """Queue ``item`` (under ``item.key``); blocks while the bytes not yet
        written (queued, and the batch being written) plus ``item.nbytes``
        would exceed ``max_bytes`` (back-pressure; an item larger than
        ``max_bytes`` waits until nothing else is pending), and while an
        earlier put waits (puts are admitted in the order they came). Raises
        ECStoreError "store is closed" once :meth:`stop` began (the thread
        might not write it any more): a put that returns was queued before,
        and the thread writes it. ``defer``: it does not wake the writer nor,
        alone, make it write (see :data:`DEFER_BYTES`)."""
        with self.cv:
            if not self.in_line and not self.stopping and self.puts.room_for(item.nbytes, self.max_bytes):
                # Nobody in line and room now (the usual case): admitted at
                # once, as the loop below would, without keeping its turn.
                self.admissions += 1
                self.puts.add(item)
                self.last_put_ticket = item.ticket
                if defer and self.deferred_bytes + item.nbytes < DEFER_BYTES:
                    self.deferred_bytes += item.nbytes
                else:
                    self._want_writes()
                return
            self._want_writes()  # a put waiting for room: deferred ones must not keep the writer asleep
            # First come, first admitted: a put waiting for room holds back
            # every later one, even one that would fit (else a steady stream
            # of small puts from other threads could keep a large one out).
            self.admissions += 1
            turn = self.admissions
            self.in_line.append(turn)
            try:
                while not self.stopping and (self.in_line[0] != turn or
                                             not self.puts.room_for(item.nbytes, self.max_bytes)):
                    self.cv.wait()
            finally:
                self.in_line.remove(turn)  # admitted, refused or interrupted: the next in line goes
                self.cv.notify_all()
            if self.dead is not None:
                raise ECStoreError(f"the store's background writer stopped ({self.dead!r}); reopen the store")
            if self.stopping:
                raise ECStoreError("store is closed")
            # A queued put of the same key (two puts of one key passed the
            # presence check at once) is replaced: flushes waiting for it wait for this one.
            self.puts.add(item)
            self.last_put_ticket = item.ticket
            self._want_writes()  # a put that waited is not deferred: puts in line behind it wait for it

    def start_writes(self) -> None:
        """Wake the writer for the deferred puts queued (see :meth:`submit`).
        Does not block beyond ``cv``."""
        with self.cv:
            if self.puts.queued:
                self._want_writes()

    def _want_writes(self) -> None:
        """Holds ``cv``: have the writer write what is queued, deferred or not."""
        self.deferred_bytes = 0
        self.write_wanted = True
        self.cv.notify_all()

    def offer(self, item: PendingPut) -> bool:
        """Queue ``item`` (under ``item.key``) if that needs no wait: nothing is in
        line in :meth:`submit` and the bytes not yet written leave room for
        it (as :meth:`submit` would admit it at once); else, or once
        :meth:`stop` began, refuse it (False; counted in :attr:`offers_refused`).
        Never blocks beyond ``cv``: for writes a caller may skip (a remote
        hit's promotion into LMDB), which must not wait for another
        process's write lock behind a full queue."""
        with self.cv:
            if self.stopping or self.in_line or item.key in self.puts.queued or \
                    not self.puts.room_for(item.nbytes, self.max_bytes):
                self.offers_refused += 1
                return False
            self.puts.add(item)
            self.last_put_ticket = item.ticket
            self._want_writes()
            return True

    def add_error(self, error: BaseException) -> None:
        """Record a failed write (any thread); :meth:`take_errors` hands it on."""
        with self.cv:
            self._record_error(error)

    def _record_error(self, error: BaseException) -> None:
        """Record ``error`` (``cv`` held) without its frames' locals."""
        self._errors.append(_without_frames(error))
        self._error_count += 1

    def take_errors(self) -> WriteErrors:
        """The write errors recorded since the last call, atomically (each
        is counted by exactly one call)."""
        with self.cv:
            taken = WriteErrors(self._error_count, list(self._errors))
            self._errors.clear()
            self._error_count = 0
        return taken

    def vouch(self, key: str, identifier: str) -> None:
        """A put of ``identifier`` under ``key`` skipped because the store
        already holds it: ``drain(durable=True)`` (``flush``) vouches for it
        too, so the next batch syncs that entry's blob file (another handle
        may have committed it visible-first and not synced it yet; the
        ``fdatasync`` of a clean file costs next to nothing). Does not block;
        ignored once :meth:`stop` began."""
        with self.cv:
            if self.stopping:
                return
            ticket = self.puts.next_ticket()
            held = self.vouches.get(key)
            self.vouches[key] = (identifier, ticket if held is None or held[0] != identifier else held[1])

    def log_untaken_errors(self) -> None:
        """``close``: log, in one line, the errors recorded since the last
        :meth:`take_errors` (``flush``), which nobody will raise now (each
        was also logged when it happened); takes them."""
        errors = self.take_errors()
        if errors:
            log.error("ecstore: closing %s: %d write error(s) since the last flush() were not raised "
                      "(call flush() before close() to have them raised); the last: %s",
                      self.disk.path, errors.count, errors.last[-1])

    def touch(self, key: str, identifier: str) -> None:
        with self.cv:
            ticket = self.puts.next_ticket()
            held = self.touches.get(key)
            if held is None or held.identifier != identifier:  # none, or the key changed hands
                held = Touch(identifier, 0, 0, (), ticket, ())  # (delete + put of another identifier)
            hits, orders, since, counts = held.hits, held.orders, held.since, held.counts
            if orders and orders[-1] > self.last_put_ticket:
                # No put since: only the latest read's position matters.
                orders = orders[:-1] + (ticket,)
                counts = counts[:-1] + (counts[-1] + 1,)
            else:
                orders = orders + (ticket,)
                counts = counts + (1,)
            first = not self.touches
            if first:
                self.touch_since = time.monotonic()
            self.touches[key] = Touch(identifier, hits + 1, time.time_ns(), orders, since, counts)
            # Touches ride along with the next put batch, or go alone after
            # TOUCH_DELAY_S (each commit is an fsync): wake the writer only for
            # the first one of a burst, so it starts that timer.
            if first:
                self.cv.notify_all()

    def touches_now(self) -> None:
        """Write pending LRU touches without waiting for TOUCH_DELAY_S: now,
        or :data:`TOUCH_SOON_GAP_S` after the previous commit of touches if
        that is later. Does not block."""
        with self.cv:
            if self.touches:
                soon = self.touches_written_at + TOUCH_SOON_GAP_S - TOUCH_DELAY_S
                if soon < self.touch_since:
                    self.touch_since = soon
                    self.cv.notify_all()

    def touches_due(self) -> float | None:
        """When (``time.monotonic()``) the pending touches will be written
        if no put or flush takes them earlier; None if there are none."""
        with self.cv:
            return self.touch_since + TOUCH_DELAY_S if self.touches else None

    def identifier_at(self, key: str) -> str | None:
        with self.cv:
            item = self.puts.get(key)
            return None if item is None else item.identifier

    def lookup(self, key: str, identifier: str) -> torch.Tensor | None:
        with self.cv:
            item = self.puts.get(key)
            if item is not None and item.identifier == identifier:
                return item.tensor
            return None

    def cancel(self, key: str, identifier: str) -> None:
        """Drop a queued put (and pending LRU touches) of ``identifier`` under
        ``key`` and wait until no write of ``key`` is in flight. A put of
        another identifier under the same key (hash collision) is kept."""
        with self.cv:
            item = self.puts.queued.get(key)
            if item is not None and item.identifier == identifier:
                self.puts.remove(key)
            touch = self.touches.get(key)
            if touch is not None and touch.identifier == identifier:
                del self.touches[key]
            while key in self.puts.taken:
                self.cv.wait()
            self.progress += 1
            self.cv.notify_all()

    def drain(self, durable: bool = False) -> None:
        """Block until every put submitted and every touch recorded before the
        call has been written (committed, or failed: see :meth:`take_errors`);
        ``durable``: and its blob files synced (see the module doc).
        Puts and reads made after the call do not hold it up: each batch takes
        the oldest queued puts, so the writer reaches the last earlier one
        after a bounded number of batches; while a drainer waits, the writer
        also writes pending touches at once."""
        with self.cv:
            target = self.puts.ticket
            self.drainers += 1  # while one waits, deferred puts are written too
            self.cv.notify_all()  # the writer writes pending touches now
            try:
                seen = -1
                while True:
                    if seen != self.progress:  # only a finished batch or a cancel can settle ours
                        seen = self.progress
                        oldest = self._oldest_pending(durable)
                        if oldest is None or oldest > target:
                            return
                    self.cv.wait()
            finally:
                self.drainers -= 1

    def _oldest_pending(self, durable: bool = False) -> int | None:
        """The smallest ticket of a put or touch not yet written (queued or
        in the batch being written; ``durable``: or whose blob files are
        being synced), None when there is none. Holds ``cv``."""
        oldest = self.puts.oldest()
        tickets = [] if oldest is None else [oldest]
        tickets += [t.since for t in self.touches.values()]
        if self.busy_since is not None:
            tickets.append(self.busy_since)
        if durable and self.syncing_since is not None:
            tickets.append(self.syncing_since)
        if durable and self.vouching_since is not None:
            tickets.append(self.vouching_since)
        if durable:
            tickets += [job.since for job in self.sync_jobs]
            tickets += [since for _, since in self.vouches.values()]
        return min(tickets, default=None)

    def _split_touches(self) -> tuple[dict[str, Touch], dict[str, Touch]]:
        """(reads for this batch, reads to keep): when puts stay queued for a
        later batch, reads made after them wait for that batch too."""
        if not self.puts.queued:
            return self.touches, {}
        cutoff = next(iter(self.puts.queued.values())).ticket
        now: dict[str, Touch] = {}
        later: dict[str, Touch] = {}
        for key, t in self.touches.items():
            early = tuple(o for o in t.orders if o < cutoff)
            late = t.orders[len(early):]
            if not late:
                now[key] = t
                continue
            # Each part with its own reads' hits (reads sharing an order have no
            # put between them, so none straddles the cutoff). The reads kept
            # for later were all made after the put at ``cutoff``: that ticket
            # bounds them from below, so a drain that began before that put
            # does not wait for them, and one after it does.
            late_hits = sum(t.counts[len(early):])
            if early:
                now[key] = replace(t, hits=t.hits - late_hits, orders=early, counts=t.counts[:len(early)])
            later[key] = replace(t, hits=late_hits, orders=late, since=cutoff if early else t.since,
                                 counts=t.counts[len(early):])
        return now, later

    def stop(self) -> None:
        """Refuse further puts (:meth:`submit` raises), write everything
        queued and every pending touch, and end the thread (joined)."""
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        self.join()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # a defect or an exhausted process: fail every waiter, hang none  # noqa: BLE001
            self._die(e)
        finally:
            self._end_syncs()

    def _end_syncs(self) -> None:
        """Writer thread, ending: let the sync thread finish the jobs queued
        and end, and wait for it (``stop`` returns with every committed blob
        file synced, or its failure recorded)."""
        with self.cv:
            self.sync_stop = True
            syncer = self.syncer
            self.cv.notify_all()
        if syncer is not None:
            syncer.join()

    def _die(self, error: BaseException) -> None:
        """The thread is ending on ``error``: every put not yet written fails
        with it (:meth:`take_errors` hands it to ``flush``), pending touches
        are dropped, and :meth:`submit` raises from now on; drainers,
        cancellers and back-pressured puts wake up instead of waiting for a
        thread that is gone."""
        log.error("ecstore: the background writer stopped: %r", error)
        with self.cv:
            self.dead = error
            self.stopping = True
            lost = self.puts.clear()
            if lost:
                self._record_error(ECStoreError(f"{lost} put(s) not written: the background writer "
                                                f"stopped ({error!r})"))
                self.write_errors += lost
            self.touches.clear()
            self.vouches.clear()
            self.busy = False
            self.busy_since = None
            self.vouching_since = None
            # sync_jobs/syncing_since stay: the sync thread still syncs them
            self.progress += 1
            self.cv.notify_all()

    def _run(self) -> None:
        while True:
            with self.cv:
                # Deferred puts alone do not end the wait, even when another
                # thread's notify (the sync thread's) wakes it: a wanted write
                # or a drainer does.
                while not ((self.puts.queued and (self.write_wanted or self.drainers)) or self.stopping
                           or ((self.touches or self.vouches) and self.drainers)):
                    if not self.touches:
                        self.cv.wait()
                        continue
                    due = self.touch_since + TOUCH_DELAY_S - time.monotonic()
                    if due <= 0:
                        break
                    self.cv.wait(due)
                if self.stopping and not (self.puts.queued or self.touches or self.vouches):
                    self.cv.notify_all()
                    return
                batch = self.puts.take(self.batch_bytes)
                self.deferred_bytes = 0
                self.write_wanted = bool(self.puts.queued)  # what a wanted batch left is wanted too
                touches, self.touches = self._split_touches()
                if touches:
                    self.touches_written_at = time.monotonic()
                vouches, self.vouches = self.vouches, {}
                vouched_since = min((since for _, since in vouches.values()), default=None)
                self.vouching_since = vouched_since  # until their sync job is queued
                self.busy = True
                self.busy_since = min((t.since for t in touches.values()), default=None)
            self._prefault_after(batch)
            to_sync: list[str] = []
            try:
                to_sync = self._write(batch, touches, vouches)
            except BaseException as e:  # never let the writer die silently  # noqa: BLE001
                log.error("ecstore: background write failed: %s", e, exc_info=not isinstance(e, ECStoreError))
                self.add_error(e)
            finally:
                inline = False
                with self.cv:  # committed: visible to every process (wait_committed returns)
                    self.puts.done(batch)
                    self.busy = False
                    self.busy_since = None
                    if to_sync:  # in the same critical section: a durable drain never misses them
                        since = min([item.since for item in batch]
                                    + ([] if vouched_since is None else [vouched_since]))
                        self.sync_jobs.append(SyncJob(to_sync, since))
                        inline = not self._syncer_running()
                    # Before a drainer wakes: the written puts' blobs return to the
                    # pool now, not when the next batch is taken (the next saves reuse them).
                    batch.clear()
                    self.vouching_since = None
                    self.progress += 1
                    self.cv.notify_all()
            if inline:  # no sync thread could be started: sync here, before the next batch
                self._sync_next()
            if not self.puts.queued:  # idle: ready a spare blob file for the next large save
                self.disk.prepare_spare()

    @staticmethod
    def _prefault_after(batch: list[PendingPut]) -> None:
        """Writer thread, before the commit (``flush`` returns after it): ask
        the pool for a spare slab for each pooled blob's next save."""
        try:
            for item in batch:
                if item.prefault and item.blob is not None:
                    t = item.tensor
                    POOL.prefault_soon(len(item.blob), (len(item.blob) - item.nbytes, t.dtype, tuple(t.shape)))
        except Exception as e:  # only an optimisation (e.g. no thread can be started): write anyway  # noqa: BLE001
            log.warning("ecstore: could not ready memory for the next save: %r", e)

    def _syncer_running(self) -> bool:
        """Holds ``cv``: whether the sync thread runs (started now if not
        yet); False if no thread can be started (then the writer syncs)."""
        if self.syncer is None:
            syncer = threading.Thread(target=self._sync_run, name="ecstore-sync", daemon=True)
            try:
                syncer.start()
            except RuntimeError as e:  # "can't start new thread": sync on the writer thread
                log.warning("ecstore: no thread to sync blob files on (%s): the writer syncs them", e)
                return False
            self.syncer = syncer
        return True

    def _sync_run(self) -> None:
        """The sync thread: sync the jobs the writer queued, all waiting ones
        together, until the writer thread ended and none is left."""
        while self._sync_next(wait=True):
            pass

    def _sync_next(self, wait: bool = False) -> bool:
        """Take every queued :class:`SyncJob` and sync their files in one
        :meth:`_sync_files`; ``wait``: first wait for a job while the writer
        runs. False when there was none to take."""
        with self.cv:
            while wait and not self.sync_jobs and not self.sync_stop:
                self.cv.wait()
            if not self.sync_jobs:
                return False
            jobs = list(self.sync_jobs)
            self.sync_jobs.clear()
            self.syncing_since = min(job.since for job in jobs)
        self._sync_files(list(dict.fromkeys(name for job in jobs for name in job.names)))
        return True

    def _sync_files(self, names: list[str]) -> None:
        """Sync thread: make committed batches' blob files durable, then
        let ``drain(durable=True)`` (``flush``) go on. A failure counts in
        :attr:`sync_errors` (not :attr:`write_errors`: those puts were
        committed and reported stored) and is an error ``flush`` raises:
        those entries stay visible, and a read checks them as it checks
        every entry. Any other exception is recorded the same way (never a
        sync thread that ends with drainers waiting for it)."""
        try:
            self.disk.sync_files(names)
        except BaseException as e:  # ECStoreError from the OS; anything else: a defect, recorded  # noqa: BLE001
            log.error("ecstore: %d committed blob file(s) could not be made durable: %s", len(names), e)
            with self.cv:
                self.sync_errors += len(names)
                self._record_error(StoreFullError(
                    f"{len(names)} committed blob file(s) not made durable (the entries stay readable "
                    f"until a power loss; a torn file is a miss): {e}"))
        finally:
            with self.cv:
                self.syncing_since = None
                self.progress += 1
                self.cv.notify_all()

    def _write(self, batch: list[PendingPut], touches: dict[str, Touch],
               vouches: dict[str, tuple[str, int]] | None = None) -> list[str]:
        """Writer thread: one LMDB transaction for ``batch`` and ``touches``;
        returns the blob files still to be synced: those of the stored puts,
        and those of the entries found present or ``vouches`` (puts skipped:
        see :meth:`vouch`) point to (another handle may have committed one
        visible-first and not synced its file yet: ``flush`` vouches for it
        too; the ``fdatasync`` of a clean file costs next to nothing)."""
        namespace = self.namespace
        if batch and namespace is not None:
            try:
                self.disk.register_namespace(*namespace)
                self.namespace = None
            except ECStoreError as e:
                log.warning("ecstore: could not record the encoder identity of namespace %s: %s",
                            namespace[0], e)
        reqs = [BatchPut(it, self.model) for it in batch]
        try:
            if reqs or touches:  # not for vouches alone: a commit of nothing still costs an fsync
                self.disk.write_batch(reqs, dict(touches), sync_files=False)
        except ECStoreError as e:  # disk full, map full, schema changed underneath
            log.error("ecstore: %s", e)
        for r in reqs:
            self._report(r)
        names = [r.ref.name for r in reqs if r.ref is not None and r.outcome is PutOutcome.STORED]
        names += [r.present_file for r in reqs if r.outcome is PutOutcome.PRESENT and r.present_file is not None]
        for key, (identifier, _) in (vouches or {}).items():
            try:
                name = self.disk.file_of(key, identifier)
            except ECStoreError as e:  # cannot tell which file: not vouched for
                log.error("ecstore: cannot find the blob file of %s to make it durable: %s", identifier, e)
                with self.cv:
                    self.sync_errors += 1
                    self._record_error(StoreFullError(f"blob file of {identifier} not made durable: {e}"))
                continue
            if name is not None:
                names.append(name)
        return list(dict.fromkeys(names))

    def _report(self, res: BatchPut) -> None:
        """Log what became of one put of a batch (``EC put:`` lines) and
        record a failure; a put the batch left PENDING (it raised before
        reaching it) failed."""
        put, mm_hash = res.put, res.put.mm_hash or res.put.identifier
        outcome = PutOutcome.FAILED if res.outcome is PutOutcome.PENDING else res.outcome
        if outcome is PutOutcome.STORED:
            log.info("EC put: stored %d bytes for mm_hash=%s", put.nbytes, mm_hash)
        elif outcome is PutOutcome.PRESENT and put.unchecked:
            with self.cv:
                self.found_stored += 1
                self.found_stored_bytes += put.nbytes
        elif outcome is PutOutcome.COLLISION:
            log.warning("ecstore: not stored mm_hash=%s: key %s holds another identifier "
                        "(64-bit hash collision)", mm_hash, put.key)
        elif outcome is PutOutcome.FAILED:
            log.error("ecstore: could not store mm_hash=%s: %s", mm_hash, res.error)
            with self.cv:
                self.write_errors += 1
                self._record_error(res.error or StoreFullError("write failed"))
