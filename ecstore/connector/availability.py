"""What the scheduler side checks before it promises vLLM an encoder output.

vLLM learns of a failed load only after the step's tokens were processed, so
for items vLLM could not encode again (no processed inputs, or tensor
parallelism) the scheduler verifies the entry before its yes (see
``SchedulerSide.ensure_cache_available``). :class:`VerifiedEntries` remembers
the entries it verified, so that a popular entry is read once per scheduler
process, not at every request. The scheduler thread never reads a blob:
:class:`Verifications` verifies (and pins for the next lookup) on a thread
of its own while the request waits a step, and :class:`RemoteFetches`
brings such an entry that only the remote tier holds into the local disk
tier, verified, on another (the scheduler never waits for a blob read, the
network or another process's write lock). All are thread-safe."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from ecstore.errors import ECStoreError
from ecstore.format import Record
from ecstore.lmdb.leases import Pin
from ecstore.store import ECStore

log = logging.getLogger("ecstore")

#: Entries the scheduler remembers as verified.
VERIFIED_MEMO_ENTRIES = 4096
#: Finished fetches remembered until the scheduler asks (the oldest go first).
FETCH_RESULTS = 4096
#: A fetch that failed (or whose entry left the local store again) is not
#: started again for this many seconds: the requests waiting for it fail
#: (items without inputs) or are encoded, instead of fetching again at every
#: step; later ones try again.
FETCH_RETRY_S = 1.0


def placeholder_computed(feature: Any, num_computed_tokens: int) -> bool:
    """Whether ``feature``'s placeholder lies wholly within the first
    ``num_computed_tokens`` tokens of its request (in its KV cache: never
    read again). False when vLLM gives no position."""
    pos = getattr(feature, "mm_position", None)
    try:
        return pos is not None and int(pos.offset) + int(pos.length) <= int(num_computed_tokens)
    except (TypeError, ValueError, AttributeError):
        return False


class VerifiedEntries:
    """Entries of a store's disk tier that passed :meth:`ECStore.verify`,
    each remembered by its record's (checksum, creation time): entries are
    never rewritten in place, so a record with the same tag holds the same,
    verified blob; a new entry under the identifier is verified again.
    Bounded (:data:`VERIFIED_MEMO_ENTRIES`, least recently used first out)."""

    def __init__(self, store: ECStore, limit: int = VERIFIED_MEMO_ENTRIES) -> None:
        self.store = store
        self.limit = limit
        self._tags: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._lock = threading.Lock()  # the scheduler thread and the fetch thread

    def known(self, identifier: str, record: Record | None = None) -> bool:
        """Whether ``identifier`` passed :meth:`check` (no read: a dict
        lookup); with its current ``record`` (read by the caller), whether
        that very entry did (same checksum and creation time)."""
        with self._lock:
            tag = self._tags.get(identifier)
            if tag is None or (record is not None and tag != (record.checksum, record.created_ns)):
                return False
            self._tags.move_to_end(identifier)
            return True

    def check(self, identifier: str) -> bool:
        """Whether ``identifier``'s disk-tier entry passes every check a load
        makes: the whole blob is read the first time (about a disk hit's
        cost), a record read (µs) after. A failing entry is dropped by
        :meth:`ECStore.verify` (logged). Raises ECStoreError (treat as a miss)."""
        if not self.store.has_disk_tier:
            return False
        tag = self.store.entry_tag(identifier)
        with self._lock:
            if tag is not None and self._tags.get(identifier) == tag:
                self._tags.move_to_end(identifier)
                return True
            self._tags.pop(identifier, None)
        if tag is None or not self.store.verify(identifier):
            return False
        with self._lock:
            self._tags[identifier] = tag
            while len(self._tags) > self.limit:
                self._tags.popitem(last=False)
        return True


@dataclass(frozen=True, slots=True)
class _Job:
    """What :class:`_BackgroundJobs` knows of the latest job on an identifier."""

    state: str  # RUNNING, or the job's outcome
    ended: float = 0.0  # when it ended (the jobs' clock, seconds); 0.0 while running
    tag: object = None  # what it was about (e.g. the entry's checksum and creation time)


_NO_JOB = _Job("")


class _BackgroundJobs:
    """Jobs on one identifier each, run one at a time on a background thread
    (started at the first job; daemon), so that the scheduler thread never
    waits for them: :meth:`start` queues one (no-op while one of it runs,
    and for :data:`FETCH_RETRY_S` after one of it ended on the same ``tag``:
    what the job was about, e.g. the entry's record), :meth:`state`
    says how it went (the outcome, a plain string, kept until :meth:`forget`;
    bounded: :data:`FETCH_RESULTS`). Subclasses give :meth:`_work` (the job:
    its outcome), the outcome that asks a request to wait another moment
    (``_ready``), the one a job that raised ends with (``_failed``; an
    ECStoreError is logged as a miss, anything else as a defect, and later
    jobs go on), what a job does for those logs (``_doing``, with ``%s`` for
    the identifier) and the thread's name. ``clock``: monotonic seconds
    (tests pass their own). Thread-safe."""

    RUNNING = "running"
    _ready = ""
    _failed = "failed"
    _doing = "the background job on %s"
    _name = "ecstore-jobs"

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self._cv = threading.Condition()
        self._todo: deque[str] = deque()
        self._states: OrderedDict[str, _Job] = OrderedDict()  # identifier -> its latest job
        self._thread: threading.Thread | None = None
        self._closed = False

    def state(self, identifier: str) -> str | None:
        with self._cv:
            job = self._states.get(identifier)
            return None if job is None else job.state

    def pending(self, identifier: str) -> bool:
        """Whether a request waiting for ``identifier`` should wait another
        step: its job is running, or has just (within :data:`FETCH_RETRY_S`)
        ended with the outcome that makes the next lookup a yes (a job may
        end before its starter looks)."""
        with self._cv:
            job = self._states.get(identifier, _NO_JOB)
            return job.state == self.RUNNING or (
                job.state == self._ready and self.clock() - job.ended < FETCH_RETRY_S)

    def _refused(self, state: str, ended: float) -> bool:
        """Whether a job on the same tag must not start now, given the last one's outcome."""
        return self.clock() - ended < FETCH_RETRY_S

    def start(self, identifier: str, tag: object = None, *, now: bool = True) -> bool:
        """Queue a job on ``identifier`` unless one runs, or one on the same
        ``tag`` ended less than :data:`FETCH_RETRY_S` ago (never again at
        every step for one request). Whether a request should wait for it:
        one runs now, or that one ended with the outcome that makes the next
        lookup a yes (it may end between a lookup and this call).
        ``now=False``: queued, but the thread is only woken by :meth:`kick`
        (the scheduler's step ends first: the thread does not compete with it)."""
        with self._cv:
            job = self._states.get(identifier)
            if self._closed or (job is not None and job.state == self.RUNNING):
                return job is not None and job.state == self.RUNNING
            if job is not None and tag == job.tag and self._refused(job.state, job.ended):
                return job.state == self._ready
            self._states[identifier] = _Job(self.RUNNING, tag=tag)
            self._states.move_to_end(identifier)
            self._todo.append(identifier)
            if now:
                self._wake()
            return True

    def kick(self) -> None:
        """Wake the thread for the jobs queued with ``now=False``."""
        with self._cv:
            if self._todo and not self._closed:
                self._wake()

    def _wake(self) -> None:  # under self._cv
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._cv.notify_all()

    def forget(self, identifier: str) -> None:
        with self._cv:
            job = self._states.get(identifier)
            if job is not None and job.state != self.RUNNING:
                del self._states[identifier]

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no job is queued or running (at most ``timeout_s``
        seconds); whether that happened."""
        with self._cv:
            return self._cv.wait_for(
                lambda: not self._todo and all(job.state != self.RUNNING for job in self._states.values()),
                timeout_s)

    def close(self) -> None:
        """Stop the thread after the job it is in; queued jobs are dropped."""
        with self._cv:
            self._closed = True
            for identifier in self._todo:
                self._states.pop(identifier, None)  # dropped, never run
            self._todo.clear()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._todo and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                identifier = self._todo.popleft()
            try:
                outcome = self._work(identifier)
            except ECStoreError as e:
                log.warning("ecstore: " + self._doing + " failed, treated as a miss: %s", identifier, e)
                outcome = self._failed
            except Exception as e:  # noqa: BLE001  (a defect must not stop later jobs)
                log.error("ecstore: " + self._doing + " failed: %r", identifier, e)
                outcome = self._failed
            with self._cv:
                tag = self._states.get(identifier, _NO_JOB).tag
                self._states[identifier] = _Job(outcome, self.clock(), tag)
                self._cv.notify_all()
                while len(self._states) > FETCH_RESULTS:
                    oldest = next(iter(self._states))
                    if self._states[oldest].state == self.RUNNING:
                        break
                    del self._states[oldest]

    def _work(self, identifier: str) -> str:
        """The job on ``identifier``: its outcome (may raise: see the class)."""
        raise NotImplementedError


class Verify:
    """Outcomes of :class:`Verifications` (plain strings, for logs)."""

    RUNNING = _BackgroundJobs.RUNNING
    PASSED = "passed"  # remembered by VerifiedEntries (and pinned for it): the next lookup says yes
    FAILED = "failed"  # gone, failed its checks (dropped, logged) or could not be read


@dataclass(frozen=True, slots=True)
class _HandedPin:
    """A lease :class:`Verifications` took on an entry it verified, for the scheduler."""

    record: Record  # the entry's record, read under the lease (matches what was verified)
    step: int  # the scheduler's step (Verifications.unclaimed calls) it was taken in


class Verifications(_BackgroundJobs):
    """Entries verified (:meth:`VerifiedEntries.check`: the whole blob read)
    on a background thread of their own, so that the scheduler thread reads
    no blob: the scheduler answers "not yet" for an entry it must verify
    first and the request waits a step (``ensure_cache_available``), as for
    a remote fetch; a failing entry is dropped and a miss. A verified entry
    is pinned here too (one lease of this process, as the scheduler's own
    lookup takes) and handed to the next lookup (:meth:`take`): the yes
    then costs the scheduler thread no LMDB read and no lease write (with
    the CPU caches cold after the blob's read, those took most of the
    item's scheduler time). A pin no lookup took by the end of the step
    after the one it was taken in goes back (:meth:`unclaimed`: the
    scheduler releases it); a later lookup pins as usual."""

    _ready = Verify.PASSED
    _failed = Verify.FAILED
    _doing = "verifying %s"
    _name = "ecstore-verify"

    def __init__(self, verified: VerifiedEntries, clock: Any = time.monotonic) -> None:
        super().__init__(clock)
        self.verified = verified
        self._pins: dict[str, _HandedPin] = {}  # identifier -> the lease taken for its next lookup
        self._step = 0  # how many times unclaimed() was called: the scheduler's steps

    def _work(self, identifier: str) -> str:
        if not self.verified.check(identifier):
            return Verify.FAILED
        try:
            self._hand_over(identifier)
        except ECStoreError as e:  # the entry passed: the lookup pins it (or meets the same error) itself
            log.debug("ecstore: pinning the verified entry %s for the scheduler failed: %s", identifier, e)
        return Verify.PASSED

    def _hand_over(self, identifier: str) -> None:
        """Pin ``identifier``'s verified entry for its next lookup (see the class)."""
        store = self.verified.store
        answer = store.pin_entry(identifier)  # never waits long: Pin.BUSY instead
        if answer.pin is not Pin.HELD:
            return  # not pinnable now (gone since, or the lease file busy): pinned by the lookup
        replaced: _HandedPin | None = None
        kept = answer.record is not None and self.verified.known(identifier, answer.record)
        if kept:
            assert answer.record is not None
            with self._cv:
                kept = not self._closed
                if kept:
                    replaced = self._pins.pop(identifier, None)
                    self._pins[identifier] = _HandedPin(answer.record, self._step)
        if not kept or replaced is not None:  # another entry under it since, or closing: not handed over
            store.release([identifier], wait=False)  # refused while the lease file is busy: it expires

    def take(self, identifier: str) -> Record | None:
        """The record of the entry of ``identifier`` this thread verified and
        pinned for the caller, who now owns that lease (to release as any
        pin of its lookup); None if there is none. A dict lookup."""
        with self._cv:
            pin = self._pins.pop(identifier, None)
        return None if pin is None else pin.record

    def unclaimed(self, *, every: bool = False) -> list[str]:
        """Once per scheduler step (at its end): the identifiers whose handed
        pins were taken before the step that ends and not claimed by
        :meth:`take` during it (e.g. the request waiting for it was not
        asked again): the caller releases one lease on each. ``every``: all
        of them (at shutdown, after :meth:`close`)."""
        step, self._step = self._step, self._step + 1  # written by the scheduler thread only
        if not self._pins:  # the common step: no lock taken (a pin handed over meanwhile waits a step)
            return []
        with self._cv:
            out = [i for i, pin in self._pins.items() if every or pin.step < step]
            for identifier in out:
                del self._pins[identifier]
        return out


class Fetch:
    """States of :class:`RemoteFetches` (plain strings, for logs)."""

    RUNNING = _BackgroundJobs.RUNNING
    LOCAL = "local"  # committed to the local disk tier and verified there
    REMOTE_ONLY = "remote-only"  # verified, but the local tier did not take it (too large, key taken)
    FAILED = "failed"  # the remote lost it, it failed its checks, or the fetch failed


class RemoteFetches(_BackgroundJobs):
    """Remote entries fetched into the local disk tier on one background
    thread (see :class:`_BackgroundJobs`). A fetch gets the entry through the
    store (remote value verified, promoted to the local tier), waits for that
    commit, and verifies the local entry. A fetch that found the entry
    remote-only (the local tier would not take it) is never started again."""

    _ready = Fetch.LOCAL
    _failed = Fetch.FAILED
    _doing = "fetching %s from the remote"
    _name = "ecstore-fetch"

    def __init__(self, store: ECStore, verified: VerifiedEntries,
                 clock: Any = time.monotonic) -> None:
        super().__init__(clock)
        self.store = store
        self.verified = verified

    def _refused(self, state: str, ended: float) -> bool:
        return state == Fetch.REMOTE_ONLY or super()._refused(state, ended)

    def _work(self, identifier: str) -> str:
        if self.store.get(identifier, wait_for_room=True) is None:  # verified; promoted (queued)
            return Fetch.FAILED
        self.store.wait_committed()
        if self.verified.check(identifier):
            return Fetch.LOCAL
        log.warning("ecstore: the remote entry %s could not be kept in the local store (larger than it, "
                    "or its key holds another entry): loaded from the remote unpinned", identifier)
        return Fetch.REMOTE_ONLY
