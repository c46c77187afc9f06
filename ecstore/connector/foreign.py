"""Tell, once, why a consumer misses entries another instance stored.

Entries are shared only between instances of the same encoder identity
(``ecstore.identity``). An EPD pair configured differently (an encoder
instance started with a setting its PD instance lacks) writes and reads under
two namespaces: every item the producer stored is a miss on the consumer, and
the encoder runs again (or, for an item vLLM holds no inputs for, the request
fails). :class:`ForeignNamespaces` notices it: on a consumer's miss it looks
the item up under every other namespace the store's ``namespaces`` table
registers for the same model, and the first time it is found under one it
logs (once per such namespace) which settings differ, from both identity
descriptions.

Cost per miss until told: one read of the small ``namespaces`` table and one
key lookup per other namespace of the model (microseconds each). Scheduler
thread only.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import namespaces
from ..errors import ECStoreError
from ..identity import qualify
from ..key import make_key

log = logging.getLogger("ecstore")

#: Longest rendering of one differing value in the log line.
_VALUE_CHARS = 120


class ForeignNamespaces:
    """Checks a consumer's misses against the other identities of its model."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._mine = store.identity.describe()
        self._told: set[str] = set()

    def on_miss(self, identifier: str) -> str | None:
        """After a local miss of ``identifier``: the namespace that holds it
        under another identity of this model, logged the first time (None if
        none does). Never raises."""
        disk = self._store.disk
        if disk is None:
            return None
        try:
            descriptions = disk.namespace_descriptions()
            for ns in sorted(descriptions):
                if ns == self._store.namespace:
                    continue
                theirs = namespaces.identity_of(descriptions, ns)
                if theirs is None or theirs.get("model") != self._mine["model"]:
                    continue
                name = qualify(ns, identifier)
                key = make_key(self._store.model, self._store._hash(name), str(theirs.get("dtype")))
                if disk.contains(key, name):
                    if ns not in self._told:
                        self._told.add(ns)
                        self._log(identifier, ns, theirs)
                    return ns
        except (ECStoreError, ValueError, TypeError) as e:  # a damaged table: nothing to tell
            log.debug("ecstore: could not compare with other namespaces: %s", e)
        return None

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
