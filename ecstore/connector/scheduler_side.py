"""Scheduler side of the connector: the index, leases and load announcements.

Runs in vLLM's engine-core process (the same process as the worker in
single-process mode). Called from the scheduler thread only.

One index for scheduler and workers
-----------------------------------
* Disk mode: the scheduler opens the same LMDB store as the workers, so
  ``has_cache_item`` is true exactly when a worker can read the entry. Before
  answering yes it pins the entry with a lease (``ECStore.pin_if_present``):
  no process's eviction can remove it until the worker reports it loaded (or
  the request ends, or the lease expires / this process dies).
* Memory-only mode: entries live in the workers' memory, possibly another
  process. The workers report what they saved and evicted in each step's
  worker metadata, and the scheduler keeps a mirror of that index. An entry
  the worker evicts is kept by the worker in a "limbo" until the scheduler
  acknowledges the eviction in a later step's metadata, so an entry announced
  before the scheduler learned of its eviction is still loadable.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from dataclasses import replace
from typing import Any

from ..config import ECStoreConfig
from ..errors import ECStoreError
from ..store import ECStore
from .metadata import ECStoreConnectorMetadata, ECStoreWorkerMetadata, LoadSpec
from .stats import ECStoreConnectorStats

log = logging.getLogger("ecstore")


class SchedulerSide:
    def __init__(self, vllm_config: Any, cfg: ECStoreConfig, *, model: str, dtype: Any,
                 is_producer: bool, is_consumer: bool) -> None:
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.cfg = cfg
        self._vllm_config = vllm_config
        self.store: ECStore | None = None
        if cfg.local_disk:
            # The scheduler only reads and leases: no memory tier of its own.
            self.store = ECStore(replace(cfg, local_cpu=False, sources=dict(cfg.sources)),
                                 model=model, dtype=dtype)
        self.mirror: dict[str, int] = {}  # memory-only: identifier -> bytes held by workers
        self._acks: list[str] = []
        self._step_pins: set[str] = set()  # pinned by has_cache_item this step
        self._loads: list[LoadSpec] = []
        self._inflight: dict[str, set[str]] = defaultdict(set)  # identifier -> req_ids awaiting load
        self._unavailable: set[str] = set()
        self.stats = ECStoreConnectorStats()
        self.pid = os.getpid()

    # -- lookups ------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        if not self.is_consumer:
            return False
        if identifier in self._step_pins or identifier in self._inflight:
            return True  # already pinned for a load
        if self.store is None:
            return identifier in self.mirror
        try:
            if self.store.pin_if_present(identifier):
                self._step_pins.add(identifier)
                return True
        except ECStoreError as e:
            log.warning("ecstore: lookup of %s failed, treated as a miss: %s", identifier, e)
        return False

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        feature = request.mm_features[index]
        identifier = feature.identifier
        if not self.is_consumer:
            return
        if identifier in self._step_pins or identifier in self._inflight or (
                self.store is None and identifier in self.mirror):
            self._loads.append(LoadSpec(request.request_id, identifier,
                                        request.get_num_encoder_embeds(index),
                                        self._width(feature.modality)))
            self._inflight[identifier].add(request.request_id)
            self._step_pins.discard(identifier)
            self.stats.add("hits")
        else:
            self.stats.add("misses")

    def _width(self, modality: str) -> int:
        widths = getattr(self._vllm_config.ec_transfer_config, "mm_encoder_output_widths", None) or {}
        if modality in widths:
            return int(widths[modality])
        return int(self._vllm_config.model_config.get_inputs_embeds_size())

    def build_connector_meta(self, scheduler_output: Any) -> ECStoreConnectorMetadata:
        meta = ECStoreConnectorMetadata(loads=self._loads, acks=self._acks)
        self._loads, self._acks = [], []
        if self._step_pins and self.store is not None:
            # has_cache_item said yes but vLLM did not allocate (e.g. no KV
            # space this step): let go; it will be asked again.
            self._release(list(self._step_pins))
        self._step_pins = set()
        return meta

    # -- feedback from workers ------------------------------------------------
    def update_connector_output(self, output: Any) -> None:
        wm = getattr(output, "ec_connector_worker_meta", None)
        if not isinstance(wm, ECStoreWorkerMetadata):
            return
        for identifier, nbytes in wm.saved.items():
            if self.store is None:
                self.mirror[identifier] = nbytes
        for identifier in wm.evicted:
            if self.mirror.pop(identifier, None) is not None or self.store is None:
                self._acks.append(identifier)
        done = list(wm.loaded)
        for req_id, identifier, reason in wm.failed:
            log.error("ecstore: request %s failed: could not load encoder output %s: %s",
                      req_id, identifier, reason)
            self._unavailable.add(req_id)
            if self.store is None:
                self.mirror.pop(identifier, None)
            done.append(identifier)
        self._finish_loads(done)
        self.stats.merge(wm.stats)

    def _finish_loads(self, identifiers: list[str]) -> None:
        release = []
        for identifier in identifiers:
            reqs = self._inflight.pop(identifier, None)
            if reqs is not None:
                release.extend([identifier] * len(reqs))
        self._release(release)

    def _release(self, identifiers: list[str]) -> None:
        if self.store is not None and identifiers:
            try:
                self.store.release(identifiers)
            except ECStoreError as e:
                log.warning("ecstore: releasing leases failed (they will expire): %s", e)

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        # A request that ends before its load was reported (aborted) must not
        # keep its entries pinned.
        release = []
        for feature in getattr(request, "mm_features", None) or []:
            reqs = self._inflight.get(feature.identifier)
            if reqs and request.request_id in reqs:
                reqs.discard(request.request_id)
                release.append(feature.identifier)
                if not reqs:
                    del self._inflight[feature.identifier]
        self._release(release)
        return False, None

    def get_stats(self) -> ECStoreConnectorStats | None:
        return self.stats.snapshot_and_reset()

    def shutdown(self) -> None:
        if self.store is not None:
            pending = [i for i, reqs in self._inflight.items() for _ in reqs] + list(self._step_pins)
            self._release(pending)
            self.store.close()
