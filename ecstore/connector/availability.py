"""What the scheduler side checks before it promises vLLM an encoder output.

vLLM learns of a failed load only after the step's tokens were processed, so
for items vLLM could not encode again (no processed inputs, or tensor
parallelism) the scheduler verifies the entry before its yes (see
``SchedulerSide.ensure_cache_available``). :class:`VerifiedEntries` remembers
the entries it verified, so that a popular entry is read once per scheduler
process, not at every request. Scheduler thread only (not thread-safe).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ..store import ECStore

#: Entries the scheduler remembers as verified.
VERIFIED_MEMO_ENTRIES = 4096


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

    def check(self, identifier: str) -> bool:
        """Whether ``identifier``'s disk-tier entry passes every check a load
        makes: the whole blob is read the first time (about a disk hit's
        cost), a record read (µs) after. A failing entry is dropped by
        :meth:`ECStore.verify` (logged). Raises ECStoreError (treat as a miss)."""
        disk = self.store.disk
        if disk is None:
            return False
        rec = disk.record(self.store.key(identifier))
        tag = None if rec is None else (rec.checksum, rec.created_ns)
        if tag is not None and self._tags.get(identifier) == tag:
            self._tags.move_to_end(identifier)
            return True
        self._tags.pop(identifier, None)
        if tag is None or not self.store.verify(identifier):
            return False
        self._tags[identifier] = tag
        while len(self._tags) > self.limit:
            self._tags.popitem(last=False)
        return True
