"""What the scheduler side checks before it promises vLLM an encoder output.

vLLM learns of a failed load only after the step's tokens were processed, so
for items vLLM could not encode again (no processed inputs, or tensor
parallelism) the scheduler verifies the entry before its yes (see
``SchedulerSide.ensure_cache_available``). :class:`VerifiedEntries` remembers
the entries it verified, so that a popular entry is read once per scheduler
process, not at every request. :class:`RemoteFetches` brings such an entry
that only the remote tier holds into the local disk tier, verified, on a
thread of its own: the scheduler defers the request meanwhile (it never waits
for the network or for another process's write lock). Both are thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from ecstore.errors import ECStoreError
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


class Fetch:
    """States of :class:`RemoteFetches` (plain strings, for logs)."""

    RUNNING = "running"
    LOCAL = "local"  # committed to the local disk tier and verified there
    REMOTE_ONLY = "remote-only"  # verified, but the local tier did not take it (too large, key taken)
    FAILED = "failed"  # the remote lost it, it failed its checks, or the fetch failed


class RemoteFetches:
    """Remote entries fetched into the local disk tier on one background
    thread (started at the first fetch; daemon). :meth:`start` queues a
    fetch (no-op while one runs); :meth:`state` says how it went. A fetch
    gets the entry through the store (remote value verified, promoted to the
    local tier), waits for that commit, and verifies the local entry. Its
    result is kept until :meth:`forget` (bounded: :data:`FETCH_RESULTS`).
    ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(self, store: ECStore, verified: VerifiedEntries,
                 clock: Any = time.monotonic) -> None:
        self.store = store
        self.verified = verified
        self.clock = clock
        self._cv = threading.Condition()
        self._todo: deque[str] = deque()
        # identifier -> (state, when the fetch ended (clock); 0 while running)
        self._states: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._thread: threading.Thread | None = None
        self._closed = False

    def state(self, identifier: str) -> str | None:
        with self._cv:
            entry = self._states.get(identifier)
            return None if entry is None else entry[0]

    def pending(self, identifier: str) -> bool:
        """Whether a request waiting for ``identifier`` should wait another
        step: its fetch is running, or has just (within
        :data:`FETCH_RETRY_S`) brought it into the local store, which the
        next lookup pins (a fetch may end before its starter looks)."""
        with self._cv:
            state, ended = self._states.get(identifier, (None, 0.0))
            return state == Fetch.RUNNING or (state == Fetch.LOCAL and self.clock() - ended < FETCH_RETRY_S)

    def start(self, identifier: str) -> None:
        """Fetch ``identifier`` unless a fetch of it is running, found it
        remote-only (the local tier would not take it), or ended less than
        :data:`FETCH_RETRY_S` ago (failed, or its entry left the local tier
        again): never fetched again at every step for one request."""
        with self._cv:
            state, ended = self._states.get(identifier, (None, 0.0))
            if self._closed or state in (Fetch.RUNNING, Fetch.REMOTE_ONLY) or (
                    state is not None and self.clock() - ended < FETCH_RETRY_S):
                return
            self._states[identifier] = (Fetch.RUNNING, 0.0)
            self._states.move_to_end(identifier)
            self._todo.append(identifier)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ecstore-fetch", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def forget(self, identifier: str) -> None:
        with self._cv:
            entry = self._states.get(identifier)
            if entry is not None and entry[0] != Fetch.RUNNING:
                del self._states[identifier]

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no fetch is queued or running (at most ``timeout_s``
        seconds); whether that happened."""
        with self._cv:
            return self._cv.wait_for(
                lambda: not self._todo and all(st != Fetch.RUNNING for st, _ in self._states.values()),
                timeout_s)

    def close(self) -> None:
        """Stop the thread after the fetch it is in (bounded by the store's
        remote timeout and its commit); queued fetches are dropped."""
        with self._cv:
            self._closed = True
            for identifier in self._todo:
                self._states.pop(identifier, None)  # dropped, never fetched
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
            outcome = self._fetch(identifier)
            with self._cv:
                self._states[identifier] = (outcome, self.clock())
                self._cv.notify_all()
                while len(self._states) > FETCH_RESULTS:
                    oldest = next(iter(self._states))
                    if self._states[oldest][0] == Fetch.RUNNING:
                        break
                    del self._states[oldest]

    def _fetch(self, identifier: str) -> str:
        try:
            if self.store.get(identifier, wait_for_room=True) is None:  # verified; promoted (queued)
                return Fetch.FAILED
            self.store.wait_committed()
            if self.verified.check(identifier):
                return Fetch.LOCAL
            log.warning("ecstore: the remote entry %s could not be kept in the local store (larger than it, "
                        "or its key holds another entry): loaded from the remote unpinned", identifier)
            return Fetch.REMOTE_ONLY
        except ECStoreError as e:
            log.warning("ecstore: fetching %s from the remote failed, treated as a miss: %s", identifier, e)
            return Fetch.FAILED
        except Exception as e:  # noqa: BLE001  (a defect must not stop later fetches)
            log.error("ecstore: fetching %s from the remote failed: %r", identifier, e)
            return Fetch.FAILED
