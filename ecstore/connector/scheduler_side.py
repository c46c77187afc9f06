"""Scheduler side of the connector: the index, leases and load announcements.

Runs in vLLM's engine-core process (the same process as the worker in
single-process mode). Called from the scheduler thread only; never waits on
another process's long write (remote fetches run on ``ecstore-fetch``).

A load is announced exactly for the items ``has_cache_item`` said yes to, and
each such load from a disk store holds a lease until the worker reports it (or
the request ends, or the lease expires): taken at the lookup for items vLLM
could not encode again, else with the step's other lease writes at its end
(one commit), before the load reaches the worker. Entries of another encoder identity
are misses. The flows (disk and memory-only modes, producers, the remote
tier, items vLLM cannot encode again) are in docs/architecture.md.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ecstore.config import ECStoreConfig
from ecstore.connector.availability import (
    Fetch,
    RemoteFetches,
    Verifications,
    VerifiedEntries,
    placeholder_computed,
)
from ecstore.connector.features import EncoderInputs
from ecstore.connector.foreign import ForeignNamespaces
from ecstore.connector.metadata import ECStoreConnectorMetadata, ECStoreWorkerMetadata, LoadSpec
from ecstore.connector.shared_stats import SharedCounters, record_path
from ecstore.connector.stats import ECStoreConnectorStats, remote_deltas
from ecstore.connector.vllm_identity import CLIENT_UUID_WARNING, kept_out
from ecstore.errors import ECStoreError
from ecstore.format import Record
from ecstore.identity import EncoderIdentity
from ecstore.lmdb.leases import Pin, PinAnswer
from ecstore.store import ECStore

log = logging.getLogger("ecstore")


@dataclass
class _LoadsInFlight:
    """One identifier's loads announced and not yet reported, and the
    requests that read them (the loading ones, and those vLLM serves the same
    allocation): a failed load fails them all."""

    loads: int = 0
    readers: set[str] = field(default_factory=set)


class SchedulerSide:
    def __init__(self, vllm_config: Any, cfg: ECStoreConfig, *, model: str, dtype: Any,
                 is_producer: bool, is_consumer: bool, identity: EncoderIdentity | None = None) -> None:
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.cfg = cfg
        self._vllm_config = vllm_config
        self.store: ECStore | None = None
        self.memory_only = not cfg.local_disk
        if cfg.local_disk or cfg.remote_url:
            # The scheduler reads, leases and (fetching remote entries vLLM
            # could not encode) writes entries: no memory tier of its own.
            self.store = ECStore(replace(cfg, local_cpu=False, sources=dict(cfg.sources)),
                                 model=model, dtype=dtype, identity=identity)
        self.mirror: dict[str, int] = {}  # memory-only: identifier -> bytes held by workers
        self._acks: list[str] = []
        # has_cache_item said yes this step: identifier -> whether that yes
        # holds a lease of ours (a local disk hit) or not (memory-only mirror,
        # remote tier). Only pinned yeses are ever released: a release drops
        # "one lease of this process", which could otherwise be another load's.
        self._step_hits: dict[str, bool] = {}
        self._release_later: list[str] = []  # leases a busy lease file kept us from releasing
        self._producer_hits: set[str] = set()  # producer-only: yes this step (nothing pinned)
        # this step: items ensure_cache_available found vLLM can encode (the
        # request being scheduled); their yeses are leased at the step's end,
        # and only if allocated (_pin_later, then _alloc_pins: (identifier, req_id))
        self._deferrable: set[str] = set()
        self._pin_later: set[str] = set()
        self._alloc_pins: list[tuple[str, str]] = []
        self._producer_allocated: set[str] = set()  # producer-only: allocated this step
        self._req_items: dict[str, list[str]] = {}  # producer-only: req_id -> its item identifiers
        # Producer-only (encode-only) instances: vLLM drops the worker
        # metadata, so worker counters come through a shared record.
        self._shared: SharedCounters | None = None
        if is_producer and not is_consumer:
            try:
                self._shared = SharedCounters(record_path(vllm_config))
            except OSError as e:
                log.warning("ecstore: worker counters will not be reported (stats record: %s)", e)
        self._loads: list[LoadSpec] = []
        # identifier -> req_ids whose announced load holds a lease on it
        self._inflight: dict[str, set[str]] = defaultdict(set)
        self._unavailable: set[str] = set()
        # Identifiers whose load failed while vLLM's encoder cache may still
        # hold the worker's zero stand-in (see ensure_cache_available).
        self._poisoned: set[str] = set()
        self._failed_reqs: set[str] = set()  # already failed and logged
        # identifier -> rows the request being scheduled expects (set by
        # ensure_cache_available, which vLLM calls for a request right before
        # it asks has_cache_item for that request's items)
        self._expected_rows: dict[str, int] = {}
        # vLLM encodes an item again after a failed load only with a single
        # rank (tensor parallelism: the ranks would disagree) and processed
        # inputs: items without that are verified before a yes (see
        # ensure_cache_available).
        self._can_recompute = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1) == 1
        self._inputs = EncoderInputs(vllm_config.model_config)  # "processed inputs": what the encoder reads
        self._verify_first: set[str] = set()  # this step: verify before a yes
        self._verified = VerifiedEntries(self.store) if self.store is not None else None
        # ... verified off this thread (the request waits a step meanwhile).
        self._verifications = Verifications(self._verified) if self._verified is not None else None
        # Stored entries whose latest lookup started (or found running) their
        # verification: a miss, but ensure_cache_available defers, not fails.
        self._verifying: set[str] = set()
        self._step_verified: set[str] = set()  # this step: yeses that passed that check
        # Stored entries whose latest lookup met a busy lease write lock
        # (Pin.BUSY): a miss, but ensure_cache_available defers, not fails.
        self._lease_busy: set[str] = set()
        # this step: the stored width of each local yes (its record, read by
        # _fits): a stand-in's width on an instance where vLLM measured none
        self._step_widths: dict[str, int] = {}
        # Remote-only entries of such items: fetched into the local store
        # (verified, then pinned like any local entry) off this thread.
        self._fetches = RemoteFetches(self.store, self._verified) if (
            self.store is not None and self._verified is not None and self.store.has_remote_tier
            and self.store.has_disk_tier) else None
        self._vllm_holds: set[str] = set()  # allocated in vLLM's encoder cache, not freed since
        # this step: items vLLM cannot encode that ensure_cache_available let
        # through because vLLM's encoder cache held them (no lookup). vLLM
        # asks has_cache_item for one only once it evicted it, in this very
        # pass, to make room for another item (see _evicted_in_the_pass).
        self._passed_as_held: set[str] = set()
        self._loads_in_flight: dict[str, _LoadsInFlight] = {}
        # vLLM runs no EC connector load for encoder-decoder models (their
        # model runners skip the connector's context): a yes would skip the
        # encoder and leave the decoder without encoder outputs.
        self._encoder_decoder = bool(getattr(vllm_config.model_config, "is_encoder_decoder", False))
        if self._encoder_decoder:
            log.warning("ecstore: %s is an encoder-decoder model; vLLM loads no encoder output through an "
                        "EC connector for such models, so ecstore looks nothing up for it (its encoder "
                        "always runs)", getattr(vllm_config.model_config, "model", "the model"))
        self._foreign = ForeignNamespaces(self.store) if (
            is_consumer and self.store is not None and self.store.has_disk_tier) else None
        # vLLM 0.33 with Model Runner V2: (req_id -> mm_feature indices) whose
        # processed inputs the worker released (encoder_input_updates), and
        # this step's loads of items with inputs (see _restore_inputs).
        self._released: dict[str, set[int]] = {}
        self._step_load_inputs: list[tuple[str, int, Any]] = []
        self._rejected_logged: set[str] = set()
        self._uuid_warned = False
        self.stats = ECStoreConnectorStats()
        self._remote_seen: dict[str, float] = {}
        self.pid = os.getpid()

    # -- lookups ------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        if self._encoder_decoder:
            return False  # nothing would be loaded (see __init__)
        self._vllm_holds.discard(identifier)  # vLLM asks only for an item its encoder cache does not hold
        if identifier in self._passed_as_held:
            return self._evicted_in_the_pass(identifier)
        if identifier in self._step_hits:  # (consumers only; never a kept-out identifier)
            # Already answered yes this step (and pinned, if local): asked
            # again by vLLM right after ensure_cache_available's lookup, or
            # for a request that was not allocated after all: the pin is
            # still ours to hand on; unless this request needs a verified
            # yes and that one was not (then asked again below).
            if identifier not in self._verify_first or identifier in self._step_verified:
                return True
            self._pin_later.discard(identifier)
            if self._step_hits.pop(identifier):
                self._release([identifier])
        elif self._kept_out(identifier):
            return False
        if not self.is_consumer:
            return self._producer_has(identifier)
        pinned = busy = deferred = False
        self._lease_busy.discard(identifier)
        self._verifying.discard(identifier)
        if self.memory_only or self.store is None:
            found = local = identifier in self.mirror
        else:
            # One lease per yes that gets allocated: every request waiting
            # for this entry holds its own pin (see _finish_loads).
            found = local = held = False
            verified = self._verified if identifier in self._verify_first else None
            try:
                unverified = verified is not None and not verified.known(identifier)
                handed = None if unverified else self._handed_pin(identifier)
                if unverified:
                    # Never verified here: not pinned, and no blob is read on
                    # this thread. The entry is verified in the background and
                    # the request waits a step (see ensure_cache_available).
                    rec = self.store.stored_record(identifier)
                    local = rec is not None
                    if rec is not None:
                        self._start_verification(identifier, rec)
                elif handed is None and verified is None and identifier in self._deferrable:
                    # vLLM can encode it in the step should the entry be gone
                    # by then: leased at the step's end if allocated, with the
                    # step's other leases (one commit; see _commit_step_leases).
                    rec = self.store.stored_record(identifier)
                    local = rec is not None
                    found = deferred = local and self._fits(identifier, rec, pinned=False)
                else:
                    answer = handed or self.store.pin_entry(identifier)
                    local = held = answer.pin is Pin.HELD
                    if answer.pin is Pin.BUSY:  # stored, but not pinnable now: a miss this time
                        busy = True
                        self._lease_busy.add(identifier)
                        self.stats.add("lease_busy")
                    found = pinned = local and self._fits(identifier, answer.record)
                    held = False  # released by _fits unless it fits (then pinned)
                    if found and verified is not None:
                        if verified.known(identifier, answer.record):
                            self._step_verified.add(identifier)
                            if self._fetches is not None:
                                self._fetches.forget(identifier)  # a fetch that brought it here is done
                        else:  # another entry under the identifier since: verified again first
                            self._release([identifier])
                            found = pinned = False
                            self._start_verification(identifier, answer.record)
            except ECStoreError as e:
                log.warning("ecstore: lookup of %s failed, treated as a miss: %s", identifier, e)
                if held or pinned:  # pinned, then found unusable: the pin must not outlive the answer
                    self._release([identifier])
                found = pinned = local = deferred = False
        # The remote only when no local tier holds the item (a local entry
        # refused as a misfit is not looked up again there).
        if not local and not busy and self.store is not None and self.store.has_remote_tier:
            try:
                found = self.store.remote_contains(identifier)  # bounded; no remote failure raises
            except ECStoreError as e:  # an identifier no key can be made of (share_client_uuids)
                log.warning("ecstore: remote lookup of %.200s failed, treated as a miss: %s", identifier, e)
                found = False
            if found and identifier in self._verify_first and self._fetches is not None:
                # Not promised unpinned: fetched into the local store first
                # (ensure_cache_available defers its request meanwhile, and
                # fails it if the fetch failed, or its entry is gone again).
                if self._fetches.state(identifier) == Fetch.REMOTE_ONLY:  # the local store cannot take it
                    self._step_verified.add(identifier)
                else:
                    self._fetches.start(identifier)  # unless one runs, or failed under a second ago
                    found = False
            if found:
                self.stats.add("remote_lookup_hits")
        if found:
            self._step_hits[identifier] = pinned  # a remote yes holds no lease
            if deferred:
                self._pin_later.add(identifier)
        elif self._foreign is not None and not local:
            self._foreign.on_miss(identifier)  # held under another identity? logged once
        return found

    def _evicted_in_the_pass(self, identifier: str) -> bool:
        """``has_cache_item`` for an item vLLM cannot encode that its encoder
        cache held when ``ensure_cache_available`` passed the request, and
        that it evicted since, in this scheduling pass, to make room for
        another item: a no would have vLLM encode an item it holds no inputs
        for (the model runner raises: the engine stops). The store is asked
        first (a verified, pinned yes as for any lookup); failing that, yes
        with nothing pinned: vLLM keeps the worker's tensor of an entry it
        evicts and allocates again in the same pass (``get_freed_mm_hashes``)
        and the worker serves it if its rows fit; where the worker holds none
        that fits (vLLM's encoder cache was reset since, a client uuid reused
        for another size), the load fails there and fails the request."""
        self._passed_as_held.discard(identifier)
        if self.has_cache_item(identifier):
            return True
        self._step_hits[identifier] = False
        return True

    def _kept_out(self, identifier: str) -> bool:
        """Per-process names and (unless shared) client uuids are never looked up."""
        why = kept_out(identifier, self.cfg.share_client_uuids)
        if why == "client-uuid" and not self._uuid_warned:
            self._uuid_warned = True
            log.warning(CLIENT_UUID_WARNING.format(identifier=identifier))
        return why is not None

    def _handed_pin(self, identifier: str) -> PinAnswer | None:
        """The pin the verification thread took on ``identifier``'s entry
        once verified (ours now), if it holds one: no read, no lease write."""
        record = self._verifications.take(identifier) if self._verifications is not None else None
        return None if record is None else PinAnswer(Pin.HELD, record)

    def _start_verification(self, identifier: str, record: Record | None) -> None:
        """Verify ``identifier``'s entry (of ``record``) on the verification
        thread, unless that runs, or ended on this very entry under a second
        ago; if it runs now, or has just passed (between our lookup and now:
        the next lookup is a yes), the request waits (``_verifying``)."""
        tag = None if record is None else (record.checksum, record.created_ns)
        if self._verifications is not None and self._verifications.start(identifier, tag, now=False):
            self._verifying.add(identifier)  # the thread starts when the step ends (build_connector_meta)

    def _fits(self, identifier: str, record: Record | None = None, *, pinned: bool = True) -> bool:
        """Whether the entry's shape fits what the request expects (rows, and
        the encoder width where vLLM measured it). A misfit (e.g. a client
        uuid reused for an image of another size) is a miss: the pin (if
        ``pinned``) is let go and vLLM runs the encoder; nothing is loaded. So
        is an entry gone since the pin (its record unreadable: dropped;
        deleted), without counting as a misfit."""
        assert self.store is not None
        shape = record.shape if record is not None else self.store.stored_shape(identifier)
        if shape is None:
            # Pinned, so not evicted: its record was unreadable (dropped by
            # stored_shape, a miss) or another process deleted it.
            if pinned:
                self._release([identifier])
            return False
        rows = self._expected_rows.get(identifier)
        widths = set(self._widths().values())
        ok = len(shape) == 2 and (rows is None or shape[0] == rows) \
            and (not widths or shape[1] in widths)
        if not ok:
            if pinned:
                self._release([identifier])
            self.stats.add("rejected")
            if identifier not in self._rejected_logged:
                self._rejected_logged.add(identifier)
                log.warning("ecstore: entry %s has shape %s but the request expects %s rows%s: "
                            "not loaded, the encoder runs instead", identifier, shape, rows,
                            f" of width {sorted(widths)}" if widths else "")
        else:
            self._step_widths[identifier] = int(shape[1])
        return ok

    def _producer_has(self, identifier: str) -> bool:
        """A producer-only instance (vLLM runs it encode-only) answers from the
        store too: a yes makes vLLM skip its encoder for the item, and there
        is nothing to load (vLLM calls no load on producers; no lease is
        taken). Memory-only: its workers' reports never reach this side
        (vLLM drops an encode-only instance's worker metadata), so no."""
        if self.store is None:
            return False
        try:
            found = self.store.contains(identifier)
        except ECStoreError as e:
            log.warning("ecstore: lookup of %s failed, treated as a miss: %s", identifier, e)
            return False
        if found:
            self._producer_hits.add(identifier)
        return found

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        feature = request.mm_features[index]
        identifier = feature.identifier
        if not self.is_consumer:
            # Announces nothing; counts what the store spared the encoder.
            self._producer_allocated.add(identifier)
            if identifier in self._producer_hits:
                self._producer_hits.discard(identifier)
                self.stats.add("hits")
            else:
                self.stats.add("misses")
            return
        self._vllm_holds.add(identifier)
        # Announce a load exactly when has_cache_item said yes: then vLLM
        # did not schedule the encoder for it. Anything else is computed.
        if identifier in self._step_hits:
            pinned = self._step_hits.pop(identifier)
            recomputable = self._inputs.at_hand(feature)
            flight = self._loads_in_flight.setdefault(identifier, _LoadsInFlight())
            flight.loads += 1
            flight.readers.add(request.request_id)
            self._loads.append(LoadSpec(request.request_id, identifier,
                                        request.get_num_encoder_embeds(index),
                                        self._width(feature.modality), index=index,
                                        recomputable=recomputable,
                                        stored_width=self._step_widths.get(identifier),
                                        modality=feature.modality))
            if recomputable:
                self._step_load_inputs.append((request.request_id, index, feature.data))
            if pinned:  # its report (or the request's end) releases the lease
                self._inflight[identifier].add(request.request_id)
            elif identifier in self._pin_later:  # leased at the step's end (then as if pinned)
                self._pin_later.discard(identifier)
                self._alloc_pins.append((identifier, request.request_id))
            self.stats.add("hits")
        else:
            self.stats.add("misses")

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        """Fail requests that would read a stand-in from vLLM's encoder cache.

        When a load fails, the worker puts a zero stand-in under the
        identifier (else the step crashes) and the loading request is failed.
        vLLM's encoder cache keeps that entry (unreferenced, reusable) until
        it needs the space, and serves it to any later request with the same
        identifier without asking the connector: such a request is failed
        too (retryable) instead of silently using zeros. Once vLLM frees the
        entry (``free_encoder_mm_hashes``; or the worker reports the stand-in
        ``cleared``, e.g. after ``reset_encoder_cache``), the item is looked
        up and computed afresh. Only items the request still has to read
        count: one whose placeholder lies wholly within the first
        ``num_computed_tokens`` tokens (in its KV cache already: a decoding
        request, or a prefix-cache hit) is never read again.
        """
        features = getattr(request, "mm_features", None) or []
        self._expected_rows = {}
        for i, feature in enumerate(features):
            try:
                self._expected_rows[feature.identifier] = int(request.get_num_encoder_embeds(i))
            except Exception:  # an older Request without it: rows are checked by the worker  # noqa: BLE001
                pass
        if not self.is_consumer or self._encoder_decoder:
            return True
        self._deferrable = set()
        pending = [f for f in features if not placeholder_computed(f, num_computed_tokens)]
        for feature in pending:
            if feature.identifier in self._poisoned:
                return self._fail(request, f"vLLM's encoder cache holds a stand-in for {feature.identifier}, "
                                           "whose load failed; retry once vLLM has evicted it")
            flight = self._loads_in_flight.get(feature.identifier)
            if flight is not None:  # reads that load (vLLM serves it the same allocation)
                flight.readers.add(request.request_id)
        # A failed load is reported to vLLM only after the step's tokens were
        # processed (a request ending in that step would end normally, on the
        # stand-in), so items vLLM could not encode again are verified before
        # a yes; an item vLLM holds no inputs for must be available, or the
        # request is failed now, before any token (vLLM would find it missing
        # from its encoder cache and stop the engine).
        # The check reads the whole entry: it runs on the verification thread,
        # never here; the request waits (False: vLLM asks again next step)
        # until it is done, as for a remote fetch.
        deferred = False
        for feature in pending:
            has_inputs = self._inputs.at_hand(feature)
            if self._can_recompute and has_inputs:
                self._deferrable.add(feature.identifier)
                continue
            identifier = feature.identifier
            self._verify_first.add(identifier)
            if identifier in self._vllm_holds:
                if not has_inputs:
                    self._passed_as_held.add(identifier)
                continue
            if self.has_cache_item(identifier):
                continue
            if identifier in self._verifying:
                deferred = True  # stored, being verified off this thread: asked again next step
                continue
            if has_inputs:
                continue  # tensor parallelism: vLLM encodes it
            if self._fetches is not None and self._fetches.pending(identifier):
                deferred = True  # being fetched from the remote (or just fetched): asked again next step
                continue
            if identifier in self._lease_busy:
                deferred = True  # stored, but the lease file was busy: asked again next step
                continue
            return self._fail(request, f"the encoder output {identifier} is not available "
                                       "(not stored, or failed its checks) and vLLM holds no inputs "
                                       "to compute it")
        return not deferred

    def _fail(self, request: Any, why: str) -> bool:
        """Have vLLM fail ``request`` (retryable; logged once); False."""
        if request.request_id not in self._failed_reqs:
            log.error("ecstore: request %s failed: %s", request.request_id, why)
            self._failed_reqs.add(request.request_id)
        self._unavailable.add(request.request_id)
        return False

    def _width(self, modality: str) -> int | None:
        # vLLM measures encoder output widths at start-up on producer
        # instances only. A consumer-only instance does not know it (it can
        # differ from the LM hidden size, e.g. Qwen3-VL's deepstack outputs),
        # so the worker then checks rows and dtype and trusts the stored width.
        widths = self._widths()
        return int(widths[modality]) if modality in widths else None

    def _widths(self) -> dict[str, int]:
        return getattr(self._vllm_config.ec_transfer_config, "mm_encoder_output_widths", None) or {}

    def build_connector_meta(self, scheduler_output: Any) -> ECStoreConnectorMetadata:
        meta = ECStoreConnectorMetadata(loads=self._loads, acks=self._acks,
                                        encoder_inputs=getattr(scheduler_output, "scheduled_encoder_inputs", None),
                                        publish=self._to_publish(scheduler_output))
        self._loads, self._acks = [], []
        self._restore_inputs(scheduler_output)
        # has_cache_item said yes but vLLM did not allocate (e.g. no KV space
        # this step): let go of the pins; it will be asked again. Likewise
        # the pins the verification thread took that no lookup came for.
        release = [i for i, pinned in self._step_hits.items() if pinned]
        if self._verifications is not None:
            release += self._verifications.unclaimed()
        self._commit_step_leases(release)
        self._step_hits = {}
        self._pin_later.clear()
        self._deferrable = set()
        self._producer_hits.clear()
        self._verify_first.clear()
        self._passed_as_held.clear()
        self._step_verified.clear()
        self._step_widths.clear()
        if self._verifications is not None:
            self._verifications.kick()  # this step's verifications, now that its scheduling is done
        freed = getattr(scheduler_output, "free_encoder_mm_hashes", None) or ()
        self._vllm_holds.difference_update(freed)
        if self._poisoned:
            self._unpoison(freed)
        return meta

    def _commit_step_leases(self, release: list[str]) -> None:
        """The step's lease writes in one lease-file commit, before its loads
        reach the workers: one lease per allocated yes that was not pinned at
        its lookup (``_alloc_pins``: items vLLM can encode in the step) and
        the releases ``release`` (with those a busy lease file kept back).
        Such a load whose entry is gone by now (evicted or deleted since the
        lookup), or whose lease the busy lease file refused, goes ahead
        unpinned: the worker reads what is there (checked as always) or has
        vLLM encode the item in the step (``recomputed``)."""
        pins, self._alloc_pins = self._alloc_pins, []
        if not pins or self.store is None:
            self._release(release)
            return
        release = self._release_later + release
        self._release_later = []
        try:
            answers = self.store.pin_entries([i for i, _ in pins], release=release)
        except ECStoreError as e:
            log.warning("ecstore: leasing this step's loads failed (they go ahead unpinned): %s", e)
            self._release(release)  # (dropped if that fails too: the leases expire)
            return
        if answers and answers[0] is Pin.BUSY:  # nothing leased, nothing released
            self._release_later = release
            self.stats.add("lease_busy", len(pins))
            return
        for (identifier, req_id), answer in zip(pins, answers):
            if answer is Pin.HELD:  # its report (or the request's end) releases the lease
                self._inflight[identifier].add(req_id)

    def _restore_inputs(self, scheduler_output: Any) -> None:
        """vLLM 0.33, Model Runner V2: the scheduler has the worker release an
        item's processed inputs once its placeholder is computed (``None`` in
        ``encoder_input_updates``), and sends them again only for items it
        schedules for encoding. A request that rewinds (e.g. KV blocks that
        failed to load are recomputed) can be announced a load of a released
        item: should that load fail, the worker has it encoded in the step,
        which V2 cannot do without inputs ("Encoder cache miss" stops the
        engine). Such a load therefore sends the inputs back with it. No-op
        where the field is absent (vLLM 0.32) or always empty (V1)."""
        loads, self._step_load_inputs = self._step_load_inputs, []
        updates = getattr(scheduler_output, "encoder_input_updates", None)
        if not isinstance(updates, dict):
            return
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            self._released.pop(new.req_id, None)  # (re)installed with its inputs
        for req_id, changes in updates.items():
            released = self._released.setdefault(req_id, set())
            for index, data in changes.items():
                if data is None:
                    released.add(index)
                else:
                    released.discard(index)
        for req_id, index, data in loads:
            if index in self._released.get(req_id, ()):
                updates.setdefault(req_id, {})[index] = data
                self._released[req_id].discard(index)

    def _to_publish(self, scheduler_output: Any) -> list[str]:
        """Producer-only, disk store: the items of this step's requests that
        vLLM neither encodes nor asked about this step (served from its own
        encoder cache, e.g. an image it encoded for an earlier request). The
        worker stores those the store lost meanwhile (evicted), so a request's
        items are in the store when its output leaves, as if computed now."""
        allocated, self._producer_allocated = self._producer_allocated, set()
        if self.is_consumer or self.store is None:
            return []
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            self._req_items[new.req_id] = [f.identifier for f in getattr(new, "mm_features", None) or ()]
        # Every request scheduled this step (a long prompt may take several
        # steps): items vLLM encodes later are not in its cache yet, and the
        # worker skips those the store holds (one read each).
        out: list[str] = []
        for req_id in getattr(scheduler_output, "num_scheduled_tokens", None) or ():
            for ident in self._req_items.get(req_id, ()):
                if ident not in allocated and ident not in out \
                        and kept_out(ident, self.cfg.share_client_uuids) is None:
                    out.append(ident)
        return out

    def _unpoison(self, identifiers: Iterable[str]) -> None:
        self._poisoned.difference_update(identifiers)
        if not self._poisoned:
            self._failed_reqs.clear()

    # -- feedback from workers ------------------------------------------------
    def update_connector_output(self, output: Any) -> None:
        wm = getattr(output, "ec_connector_worker_meta", None)
        if not isinstance(wm, ECStoreWorkerMetadata):
            return
        for identifier, nbytes in wm.saved.items():
            if self.memory_only:
                self.mirror[identifier] = nbytes
        for identifier in wm.evicted:
            if self.mirror.pop(identifier, None) is not None or self.memory_only:
                self._acks.append(identifier)
        done = list(wm.loaded) + list(wm.recomputed)
        for req_id, identifier, reason in wm.failed:
            log.error("ecstore: request %s failed: could not load encoder output %s: %s",
                      req_id, identifier, reason)
            self._unavailable.add(req_id)
            self._failed_reqs.add(req_id)
            self._poisoned.add(identifier)
            flight = self._loads_in_flight.get(identifier)
            for reader in flight.readers if flight is not None else ():  # served the same stand-in
                if reader not in self._failed_reqs:
                    log.error("ecstore: request %s failed: it read the failed load of %s", reader, identifier)
                    self._unavailable.add(reader)
                    self._failed_reqs.add(reader)
            if self.memory_only:
                self.mirror.pop(identifier, None)
            done.append((req_id, identifier))
        self._loads_reported(done)
        for identifier in wm.cleared:
            # Gone from vLLM's encoder cache (freed, or the cache was reset):
            # a stand-in, or an entry a worker loaded.
            self._unpoison([identifier])
            self._vllm_holds.discard(identifier)
        self._finish_loads(done)
        self.stats.merge(wm.stats)

    def _loads_reported(self, done: list[tuple[str, str]]) -> None:
        """The worker reported these (request, identifier) loads: once no load
        of an identifier is in flight, its readers are forgotten."""
        for _, identifier in done:
            flight = self._loads_in_flight.get(identifier)
            if flight is not None:
                flight.loads -= 1
                if flight.loads <= 0:
                    del self._loads_in_flight[identifier]

    def _finish_loads(self, done: list[tuple[str, str]]) -> None:
        """Release the lease each reported (request, identifier) load held."""
        release = []
        for req_id, identifier in done:
            reqs = self._inflight.get(identifier)
            if reqs and req_id in reqs:
                reqs.discard(req_id)
                release.append(identifier)
                if not reqs:
                    del self._inflight[identifier]
        self._release(release)

    def _release(self, identifiers: list[str], *, wait: bool = False) -> None:
        """Release one lease on each of ``identifiers`` (and on those an
        earlier call could not release). The scheduler's step never waits
        for another process's lease write: while one holds the lease file's
        write lock they are kept for the next call (every step makes one);
        ``wait`` (shutdown) waits instead."""
        identifiers = self._release_later + identifiers
        self._release_later = []
        if self.store is not None and identifiers:
            try:
                if not self.store.release(identifiers, wait=wait):
                    self._release_later = identifiers
            except ECStoreError as e:
                log.warning("ecstore: releasing leases failed (they will expire): %s", e)

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        # A request that ends before its load was reported (aborted) must not
        # keep its entries pinned.
        self._failed_reqs.discard(request.request_id)
        for flight in self._loads_in_flight.values():
            flight.readers.discard(request.request_id)
        self._req_items.pop(request.request_id, None)
        self._released.pop(request.request_id, None)
        self._finish_loads([(request.request_id, f.identifier)
                            for f in getattr(request, "mm_features", None) or []])
        return False, None

    def get_stats(self) -> ECStoreConnectorStats | None:
        if self._shared is not None:
            self.stats.merge(self._shared.take_delta())
        errors = remote_deltas(self.store, self._remote_seen).get("remote_errors")
        if errors:
            self.stats.add("remote_errors", errors)
        return self.stats.snapshot_and_reset()

    def shutdown(self) -> None:
        handed: list[str] = []
        if self._verifications is not None:
            self._verifications.close()
            handed = self._verifications.unclaimed(every=True)
        if self._fetches is not None:
            self._fetches.close()
        if self._shared is not None:
            self._shared.close(remove=True)
            self._shared = None
        if self.store is not None:
            pending = [i for i, reqs in self._inflight.items() for _ in reqs] + \
                [i for i, pinned in self._step_hits.items() if pinned] + handed
            self._release(pending, wait=True)
            self.store.close()
