"""Entries grouped by encoder identity (namespace): the library side of
``ecstore-dump list/show/stats`` columns and ``purge --namespace``.

A namespace is named on the command line by its 32 hex digits or a unique
prefix of at least :data:`MIN_PREFIX` of them, or by ``none`` for entries
written before identities existed (schema < 3; never served).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ecstore.errors import ECStoreError
from ecstore.format import Record

#: The spelling of "written without an identity".
LEGACY = "none"
MIN_PREFIX = 6
_SPEC = re.compile(rf"^[0-9a-f]{{{MIN_PREFIX},32}}$")


@dataclass
class NamespaceSummary:
    """Entries and bytes of one namespace (``namespace`` None: legacy)."""

    namespace: str | None
    entries: int = 0
    bytes: int = 0
    hits: int = 0
    identity: dict[str, Any] | None = field(default=None)

    def as_json(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "entries": self.entries, "bytes": self.bytes,
                "hits": self.hits, "identity": self.identity}


def check_spec(text: str) -> str:
    """Validate a namespace given on the command line: ``none`` or 6..32 hex digits."""
    spec = text.strip().lower()
    if spec == LEGACY or _SPEC.match(spec):
        return spec
    raise ECStoreError(f"namespace {text!r}: expected {LEGACY!r} or {MIN_PREFIX} to 32 hex digits "
                       f"(as 'ecstore-dump list' shows them)")


def matches(rec: Record | None, spec: str) -> bool:
    """Whether ``rec`` belongs to the namespace ``spec`` (see :func:`check_spec`)."""
    if rec is None:
        return False
    ns = rec.namespace
    if spec == LEGACY:
        return ns is None
    return ns is not None and ns.startswith(spec)


def resolve(spec: str, present: Iterable[str | None]) -> None:
    """Raise ECStoreError if a hex prefix ``spec`` names several namespaces of ``present``."""
    if spec == LEGACY:
        return
    hits = {ns for ns in present if ns is not None and ns.startswith(spec)}
    if len(hits) > 1:
        raise ECStoreError(f"namespace prefix {spec!r} is ambiguous: {', '.join(sorted(hits))}")


def identity_of(descriptions: dict[str, bytes], namespace: str | None) -> dict[str, Any] | None:
    """The registered identity description of ``namespace`` (None if unknown)."""
    raw = descriptions.get(namespace) if namespace else None
    if raw is None:
        return None
    try:
        out = json.loads(raw)
    except ValueError:
        return None
    return out if isinstance(out, dict) else None


def summarize(records: Iterable[Record | None], descriptions: dict[str, bytes]) -> list[NamespaceSummary]:
    """One summary per namespace present, largest first; legacy entries as ``None``."""
    by: dict[str | None, NamespaceSummary] = {}
    for rec in records:
        if rec is None:
            continue
        s = by.get(rec.namespace)
        if s is None:
            s = by[rec.namespace] = NamespaceSummary(rec.namespace,
                                                     identity=identity_of(descriptions, rec.namespace))
        s.entries += 1
        s.bytes += rec.blob_size
        s.hits += rec.hits
    return sorted(by.values(), key=lambda s: (-s.bytes, s.namespace or ""))


def short(namespace: str | None) -> str:
    """How tables show a namespace: 12 hex digits, or ``none``."""
    return LEGACY if namespace is None else namespace[:12]


@dataclass(frozen=True)
class SettingDiff:
    """One setting whose value differs between two identity descriptions
    (``path`` dotted, e.g. ``settings.model_config.multimodal_config.mm_processor_kwargs``;
    a value absent on one side is None there)."""

    path: str
    mine: Any
    theirs: Any


def differences(mine: dict[str, Any], theirs: dict[str, Any], *, limit: int = 20) -> list[SettingDiff]:
    """The leaves in which two identity descriptions (``EncoderIdentity.describe``)
    differ, sorted by path; nested dicts (the HF config's sub-configs) are
    compared key by key. At most ``limit`` (the first ones by path)."""
    out: list[SettingDiff] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                walk(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
        elif a != b:
            out.append(SettingDiff(path, a, b))

    walk(mine, theirs, "")
    return out[:limit]
