"""EC connector statistics for vLLM's periodic log line and Prometheus.

Counters are cumulative within a logging interval: hits/misses, loads and
load failures, rejected entries, saves and skips, bytes (``bytes_*``), times
in seconds (``*_seconds``), evictions, and ``remote_*`` with a remote tier.
What each counts: docs/vllm.md#metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, ECConnectorStats

COUNTERS = ("hits", "misses", "loads", "load_failures", "recomputed", "rejected", "saves", "save_skipped",
            "bytes_loaded", "bytes_saved", "load_seconds", "save_seconds", "evictions",
            "commit_seconds", "remote_hits", "remote_misses", "remote_lookup_hits", "remote_errors",
            "remote_bytes_read", "remote_bytes_written", "remote_seconds")

#: RemoteStats field -> connector counter (deltas are reported per step).
REMOTE_COUNTERS = {"hits": "remote_hits", "misses": "remote_misses", "errors": "remote_errors",
                   "bytes_read": "remote_bytes_read", "bytes_written": "remote_bytes_written"}


def remote_deltas(store: Any, seen: dict[str, float]) -> dict[str, float]:
    """Connector counters gained by ``store``'s remote tier since ``seen``
    (updated in place); empty without a remote tier."""
    stats = None if store is None else store.remote_stats()
    if stats is None:
        return {}
    now = stats.as_dict()
    now["seconds"] = now["get_seconds"] + now["put_seconds"]
    out: dict[str, float] = {}
    for field_name, counter in [*REMOTE_COUNTERS.items(), ("seconds", "remote_seconds")]:
        delta = now[field_name] - seen.get(field_name, 0)
        if delta:
            out[counter] = delta
            seen[field_name] = now[field_name]
    return out


@dataclass
class ECStoreConnectorStats(ECConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def add(self, key: str, value: float = 1) -> None:
        self.data[key] = self.data.get(key, 0) + value

    def merge(self, other: dict[str, Any]) -> None:
        for k, v in other.items():
            self.add(k, v)

    def aggregate(self, other: ECConnectorStats) -> ECStoreConnectorStats:
        merged = ECStoreConnectorStats(data=dict(self.data))
        merged.merge(other.data)
        return merged

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        hits, misses = int(d.get("hits", 0)), int(d.get("misses", 0))
        looked = hits + misses
        return {
            "hits": hits,
            "misses": misses,
            "hit_rate": round(hits / looked, 3) if looked else 0.0,
            "loads": int(d.get("loads", 0)),
            "load_failures": int(d.get("load_failures", 0)),
            "recomputed": int(d.get("recomputed", 0)),
            "rejected": int(d.get("rejected", 0)),
            "saves": int(d.get("saves", 0)),
            "save_skipped": int(d.get("save_skipped", 0)),
            "MB_loaded": round(d.get("bytes_loaded", 0) / 1e6, 3),
            "MB_saved": round(d.get("bytes_saved", 0) / 1e6, 3),
            "load_ms": round(d.get("load_seconds", 0) * 1e3, 3),
            "save_ms": round(d.get("save_seconds", 0) * 1e3, 3),
            "evictions": int(d.get("evictions", 0)),
            "commit_ms": round(d.get("commit_seconds", 0) * 1e3, 3),
            # lookups of stored entries answered while the lease file's write lock was busy
            **({"lease_busy": int(d["lease_busy"])} if "lease_busy" in d else {}),
            **({
                "remote_hits": int(d.get("remote_hits", 0)),
                "remote_misses": int(d.get("remote_misses", 0)),
                "remote_lookup_hits": int(d.get("remote_lookup_hits", 0)),
                "remote_errors": int(d.get("remote_errors", 0)),
                "remote_MB_read": round(d.get("remote_bytes_read", 0) / 1e6, 3),
                "remote_MB_written": round(d.get("remote_bytes_written", 0) / 1e6, 3),
                "remote_ms": round(d.get("remote_seconds", 0) * 1e3, 3),
            } if any(k.startswith("remote_") for k in d) else {}),
        }

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def snapshot_and_reset(self) -> ECStoreConnectorStats | None:
        if self.is_empty():
            return None
        out = ECStoreConnectorStats(data=dict(self.data))
        self.reset()
        return out


_PROM = {
    # stats key -> (metric name, documentation)
    "hits": ("vllm:ec_store_hits", "Encoder outputs served from ecstore instead of computed."),
    "misses": ("vllm:ec_store_misses", "Encoder outputs computed because ecstore did not hold them."),
    "loads": ("vllm:ec_store_loads", "Encoder outputs loaded by workers from ecstore."),
    "load_failures": ("vllm:ec_store_load_failures", "Announced loads that failed (request failed)."),
    "saves": ("vllm:ec_store_saves", "Encoder outputs handed to ecstore for storage."),
    "bytes_loaded": ("vllm:ec_store_loaded_bytes", "Bytes of encoder output loaded from ecstore."),
    "bytes_saved": ("vllm:ec_store_saved_bytes", "Bytes of encoder output saved to ecstore."),
    "load_seconds": ("vllm:ec_store_load_seconds", "Seconds workers spent loading from ecstore."),
    "save_seconds": ("vllm:ec_store_save_seconds", "Seconds workers spent in save_caches."),
    "evictions": ("vllm:ec_store_evictions", "Entries evicted from ecstore's tiers."),
    "save_skipped": ("vllm:ec_store_save_skipped", "Saves skipped: the store already held the entry."),
    "commit_seconds": ("vllm:ec_store_commit_seconds",
                       "Seconds encode-only producers waited for their saves to be committed."),
    "remote_hits": ("vllm:ec_store_remote_hits", "Encoder outputs loaded from the remote tier."),
    "remote_misses": ("vllm:ec_store_remote_misses", "Remote-tier reads that found nothing usable."),
    "remote_lookup_hits": ("vllm:ec_store_remote_lookup_hits", "Scheduler lookups answered by the remote tier."),
    "remote_errors": ("vllm:ec_store_remote_errors", "Remote-tier calls that failed (treated as misses)."),
    "remote_bytes_read": ("vllm:ec_store_remote_read_bytes", "Bytes read from the remote tier."),
    "remote_bytes_written": ("vllm:ec_store_remote_written_bytes", "Bytes written to the remote tier."),
    "remote_seconds": ("vllm:ec_store_remote_seconds", "Seconds spent in remote-tier reads and writes."),
}


class ECStorePromMetrics(ECConnectorPromMetrics):
    """Prometheus counters (``vllm:ec_store_*_total``) per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in _PROM.items():
            counter = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._counters[key] = {idx: counter.labels(*values)
                                   for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            v = transfer_stats_data.get(key, 0)
            if v and engine_idx in per_engine:
                per_engine[engine_idx].inc(v)
