"""Tell, once, why a consumer misses entries another instance stored.

:class:`ForeignNamespaces`: on a consumer's miss it looks the item up under the
model's other namespaces in the store's ``namespaces`` table and, the first
time it is found under one, logs which settings differ (once per namespace).
Cost per miss: one key lookup per namespace not yet reported; the table is
reread at most every :data:`REFRESH_SECONDS`. Scheduler thread only. Why:
docs/correctness.md (section 5), docs/disaggregation.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ecstore.errors import ECStoreError
from ecstore.maintenance import namespaces

log = logging.getLogger("ecstore")

#: Longest rendering of one differing value in the log line.
_VALUE_CHARS = 120
#: Seconds between two reads of the ``namespaces`` table (a namespace
#: registered meanwhile is looked at from the next read on).
REFRESH_SECONDS = 5.0


@dataclass(frozen=True)
class _Other:
    """Another registered identity of this model: where its entries are."""

    namespace: str
    dtype: str
    description: dict[str, Any]


class ForeignNamespaces:
    """Checks a consumer's misses against the other identities of its model.

    ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(self, store: Any, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._mine = store.identity.describe()
        self._clock = clock
        self._told: set[str] = set()
        self._raw: dict[str, bytes] | None = None  # the table as last read
        self._others: list[_Other] = []  # parsed from it, sorted by namespace
        self._read_at = 0.0

    def on_miss(self, identifier: str) -> str | None:
        """After a local miss of ``identifier``: the namespace that holds it
        under another identity of this model, the first time one does (then
        logged, and that namespace not looked at again); None otherwise.
        Never raises."""
        if not self._store.has_disk_tier:
            return None
        try:
            for other in self._candidates():
                if other.namespace in self._told:
                    continue
                if self._store.holds_foreign(other.namespace, other.dtype, identifier):
                    self._told.add(other.namespace)
                    self._log(identifier, other.namespace, other.description)
                    return other.namespace
        except (ECStoreError, ValueError, TypeError) as e:  # a damaged table: nothing to tell
            log.debug("ecstore: could not compare with other namespaces: %s", e)
        return None

    def _candidates(self) -> list[_Other]:
        """The other identities of this model, from the table read at most
        every REFRESH_SECONDS and parsed only when it changed."""
        now = self._clock()
        if self._raw is not None and now - self._read_at < REFRESH_SECONDS:
            return self._others
        self._read_at = now
        try:
            raw = self._store.namespace_descriptions()
        except ECStoreError:
            if self._raw is None:
                self._raw = {}  # unreadable: tried again after REFRESH_SECONDS, not on every miss
            raise
        if raw != self._raw:
            self._raw = raw
            self._others = self._parse(raw)
        return self._others

    def _parse(self, raw: dict[str, bytes]) -> list[_Other]:
        out: list[_Other] = []
        for ns in sorted(raw):
            if ns == self._store.namespace or ns in self._told:
                continue
            theirs = namespaces.identity_of(raw, ns)
            if theirs is not None and theirs.get("model") == self._mine["model"]:
                out.append(_Other(ns, str(theirs.get("dtype")), theirs))
        return out

    def _log(self, identifier: str, ns: str, theirs: dict[str, Any]) -> None:
        diffs = namespaces.differences(self._mine, theirs)
        listed = "; ".join(f"{d.path}: {_short(d.mine)} here, {_short(d.theirs)} there" for d in diffs)
        log.warning(
            "ecstore: encoder output %s is stored under another encoder identity of this model "
            "(namespace %s, written by an instance configured differently), not under this one "
            "(%s): the two instances do not share entries. Settings that differ: %s. Start both with "
            "the same encoder settings (docs/disaggregation.md); this is logged once per namespace.",
            identifier, namespaces.short(ns), namespaces.short(self._store.namespace), listed or "none found")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _VALUE_CHARS else text[:_VALUE_CHARS - 3] + "..."
