"""Worker side of the connector: loads into and saves from vLLM's encoder cache.

Runs in each worker process, called from the model-runner thread.
``start_load_caches`` puts every announced entry into ``encoder_cache``; one
that cannot be loaded is encoded in the same step (``recomputed``), or, where
that is impossible, gets a zero stand-in and its request is failed.
``save_caches`` copies the output off the device once and hands it to the
store. On encode-only producers ``build_worker_meta`` returns only once the
step's saves are committed (visible to every process). The flows are in
docs/architecture.md.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import time
from typing import Any

import torch

from ecstore.config import ECStoreConfig
from ecstore.connector.metadata import ECStoreConnectorMetadata, ECStoreWorkerMetadata, LoadSpec
from ecstore.connector.shared_stats import SharedCounters, record_path
from ecstore.connector.stats import remote_deltas
from ecstore.connector.vllm_identity import kept_out
from ecstore.errors import ECStoreError
from ecstore.format import tensor_nbytes
from ecstore.identity import EncoderIdentity
from ecstore.store import ECStore

log = logging.getLogger("ecstore")
#: An encode-only producer hands saves of this many bytes and more to the
#: store instead of copying them (:meth:`WorkerSide._lends`): where the
#: store writes the blob file from a spare (``ecstore.lmdb.blobfiles.SPARE_FROM``).
LEND_FROM = 4 << 20


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # distributed state not initialised (single process)  # noqa: BLE001
        return 0


class WorkerSide:
    def __init__(self, vllm_config: Any, cfg: ECStoreConfig, *, model: str, dtype: torch.dtype,
                 is_producer: bool, is_consumer: bool, identity: EncoderIdentity | None = None) -> None:
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.dtype = dtype
        self.device = torch.device(vllm_config.device_config.device)
        if is_producer and not is_consumer and cfg.local_disk is not None and cfg.local_cpu:
            # An encode-only producer never reads its store: a memory tier
            # would only keep every saved blob (and its pooled slab) alive, so
            # each save copied into fresh memory. Without it a blob's slab
            # returns to the pool once written, for the next save.
            cfg = dataclasses.replace(cfg, local_cpu=False,
                                      sources={**cfg.sources, "local_cpu": "encode-only producer (not read here)"})
            log.info("ecstore: encode-only producer: no memory tier (nothing reads it in this instance); "
                     "each blob is held until written to %s", cfg.local_disk)
        self.store = ECStore(cfg, model=model, dtype=dtype, identity=identity)
        self.share_client_uuids = cfg.share_client_uuids
        # A failed load is encoded in the same step instead (see start_load_caches),
        # unless a tensor-parallel encoder would need every rank to join in.
        self._can_recompute = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1) == 1
        # Encoder output width per modality, as last loaded here: a
        # stand-in's width when neither vLLM (producers only) nor the entry's
        # record told it (see _standin_width).
        self._seen_widths: dict[str, int] = {}
        self._lm_width = int(vllm_config.model_config.get_inputs_embeds_size())
        self.memory_only = cfg.local_disk is None
        self._limbo: dict[str, torch.Tensor] = {}  # memory-only: evicted, not yet acked
        if self.memory_only:
            self.store.on_memory_eviction(self._on_evict)
        self._saved: dict[str, int] = {}
        self._evicted: list[str] = []
        self._loaded: list[tuple[str, str]] = []  # (req_id, identifier)
        self._failed: list[tuple[str, str, str]] = []
        self._recomputed: list[tuple[str, str]] = []
        # Zero stand-ins this worker put into vLLM's encoder cache, and those
        # seen gone from it since the last report (vLLM freed or reset them).
        self._standins: dict[str, torch.Tensor] = {}
        self._cleared: list[str] = []
        self._in_cache: set[str] = set()  # loaded into vLLM's encoder cache by this worker
        self._stats: dict[str, float] = {}
        self._rank: int | None = None
        self._disk_evictions_seen = 0
        # Saves counted in save_caches that the writer then found already
        # stored (another process's, committed between the scheduler's lookup
        # and the write): (puts, bytes) seen so far, and what is still to be
        # taken off the saves reported (see _settle_saves).
        self._found_seen = (0, 0)
        self._uncounted = [0, 0]
        # Encode-only producer: commit each step's saves before its output
        # leaves the engine, and report counters through the shared record.
        self.encode_only = is_producer and not is_consumer
        self._uncommitted = False  # a save of this step is not committed yet
        self._shared: SharedCounters | None = None
        self._record_path = record_path(vllm_config) if self.encode_only else None
        self._remote_seen: dict[str, float] = {}
        atexit.register(self.shutdown)

    def _count(self, key: str, value: float = 1) -> None:
        self._stats[key] = self._stats.get(key, 0) + value

    def _on_evict(self, identifier: str, tensor: torch.Tensor) -> None:
        # Called under the memory tier's lock: just park it. Only a consumer
        # can have a load of it announced; a producer's scheduler side never
        # acks (nor does vLLM deliver an encode-only instance's reports), so
        # parking there would keep every evicted tensor forever.
        if self.is_consumer:
            self._limbo[identifier] = tensor
        self._evicted.append(identifier)
        self._count("evictions")

    # -- loading ------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], meta: ECStoreConnectorMetadata) -> None:
        for identifier in meta.acks:
            self._limbo.pop(identifier, None)
        for identifier, standin in list(self._standins.items()):
            if encoder_cache.get(identifier) is not standin:
                del self._standins[identifier]
                self._cleared.append(identifier)
        # Entries loaded into vLLM's encoder cache that are gone from it
        # (freed, or the cache was reset: vLLM reports no free then): the
        # scheduler side stops counting on vLLM holding them.
        gone = [i for i in self._in_cache if i not in encoder_cache]
        for identifier in gone:
            self._in_cache.discard(identifier)
            self._cleared.append(identifier)
        if not meta.loads or not self.is_consumer:
            return  # a producer never loads (its scheduler side announces nothing)
        t0 = time.perf_counter()
        for spec in meta.loads:
            held = encoder_cache.get(spec.identifier)
            if held is not None and held is not self._standins.get(spec.identifier) \
                    and int(held.shape[0]) == spec.num_embeds:  # another size: a uuid reused, not this item
                self._loaded.append((spec.req_id, spec.identifier))
                continue
            tensor, reason = None, "not in the store (evicted, or dropped as corrupt: see above)"
            read_width: int | None = None  # the width of what was read, if anything
            try:
                tensor = self.store.get(spec.identifier, device=self.device)
            except ECStoreError as e:
                reason = str(e)
            if tensor is None and spec.identifier in self._limbo:
                tensor = self._limbo[spec.identifier].to(self.device)
            if tensor is not None:
                read_width = int(tensor.shape[-1])
                width = spec.width if spec.width is not None else read_width
                expect = (spec.num_embeds, width)
                if tuple(tensor.shape) != expect or tensor.dtype != self.dtype:
                    reason = (f"stored shape {tuple(tensor.shape)} {tensor.dtype} does not match "
                              f"the model's {expect} {self.dtype}")
                    tensor = None
            if tensor is None and self._recompute(spec, meta):
                log.warning("ecstore: could not load encoder output %s for request %s (%s): "
                            "computing it in this step instead", spec.identifier, spec.req_id, reason)
                self._recomputed.append((spec.req_id, spec.identifier))
                self._count("load_failures")
                self._count("recomputed")
                continue
            if tensor is None:
                self._failed.append((spec.req_id, spec.identifier, reason))
                self._count("load_failures")
                # Keep the step alive; the request is failed by the scheduler.
                width = self._standin_width(spec, read_width)
                standin = torch.zeros(spec.num_embeds, width, dtype=self.dtype, device=self.device)
                encoder_cache[spec.identifier] = self._standins[spec.identifier] = standin
                continue
            encoder_cache[spec.identifier] = tensor
            if spec.modality:
                self._seen_widths[spec.modality] = int(tensor.shape[-1])
            self._in_cache.add(spec.identifier)
            self._standins.pop(spec.identifier, None)
            self._loaded.append((spec.req_id, spec.identifier))
            self._count("loads")
            self._count("bytes_loaded", tensor_nbytes(tensor))
        self._count("load_seconds", time.perf_counter() - t0)
        self.store.write_lru_soon()  # this step's hits: one LRU commit, off the step

    def _standin_width(self, spec: LoadSpec, read_width: int | None) -> int:
        """The width of a stand-in for ``spec``'s failed load: what the model
        reads there is the encoder's output, which can be wider than the LM's
        hidden size (Qwen3-VL's deepstack packs several layers on the last
        dimension; a stand-in of the LM's width makes the model's split raise).
        In order: the width vLLM measured (producers), the stored entry's
        record (read by the scheduler before its yes), what was read here, the
        width of the last entry of that modality this worker loaded.
        Only when none is known (a remote-only entry lost before its first
        load, on a consumer that never saw that modality) the LM's hidden size,
        logged."""
        for width in (spec.width, spec.stored_width, read_width, self._seen_widths.get(spec.modality)):
            if width is not None:
                return int(width)
        log.warning("ecstore: the encoder output width of %s is unknown here: its stand-in takes the "
                    "language model's hidden size (%d)", spec.identifier, self._lm_width)
        return self._lm_width

    def _recompute(self, spec: LoadSpec, meta: ECStoreConnectorMetadata) -> bool:
        """Have vLLM's runner encode ``spec``'s item in this step (it runs the
        encoder right after this call, over ``scheduled_encoder_inputs``)."""
        if not (self._can_recompute and spec.recomputable and spec.index >= 0
                and meta.encoder_inputs is not None):
            return False
        indices = meta.encoder_inputs.setdefault(spec.req_id, [])
        if spec.index not in indices:
            indices.append(spec.index)
        return True

    # -- saving -------------------------------------------------------------
    def start_save_caches(self, encoder_cache: dict[str, torch.Tensor], meta: ECStoreConnectorMetadata) -> None:
        """Before the step's encoder runs (producers): store the items vLLM
        serves from its own encoder cache this step (``meta.publish``) that
        the store no longer holds, so they are committed by the step's end
        like the ones it computes. vLLM passes ``encoder_cache`` for exactly
        this; ``save_caches`` never fires for such items."""
        if not self.is_producer or not meta.publish:
            return
        for identifier in meta.publish:
            if encoder_cache.get(identifier) is None:
                continue  # computed later in this step (then saved) or not ours
            try:
                if not self._lost_from_disk(identifier):
                    continue
            except ECStoreError as e:
                log.warning("ecstore: lookup of %s failed, not re-publishing it: %s", identifier, e)
                continue
            self.save_caches(encoder_cache, identifier, in_step=True)

    def _lost_from_disk(self, identifier: str) -> bool:
        """Whether the shared file no longer holds ``identifier`` (another
        process evicted or deleted it); if so, this process's memory-tier
        copy is dropped, so that a put stores it again instead of answering
        "already held". False without a disk tier (memory only). What counts
        for other processes is the shared file."""
        return self.store.forget_if_lost_from_disk(identifier)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, *, in_step: bool = False) -> None:
        """Store vLLM's encoder output ``mm_hash`` (producers). ``in_step``:
        called inside the step's connector context, whose end
        (:meth:`build_worker_meta`) starts the write; otherwise it starts
        at once."""
        if not self.is_producer:
            return
        if self._rank is None:
            self._rank = _tp_rank()
        if self._rank != 0 and not self.memory_only:
            return  # rank 0 writes the shared entry; the others do no I/O
        if kept_out(mm_hash, self.share_client_uuids):
            return  # a per-process counter or a client uuid: never stored (warned by the scheduler)
        tensor = encoder_cache.get(mm_hash)
        if tensor is None:
            return
        t0 = time.perf_counter()
        try:
            # put() skips an entry this process holds (False) before copying
            # anything; otherwise one copy, straight off the device (or out of
            # the batch's output, which the tensor is a view of) into the
            # entry's safetensors blob, or none: an encode-only producer lends
            # a large CPU tensor (see _lends). vLLM encoded it because the
            # scheduler's lookup missed: the shared file is not asked again
            # (the writer finds an entry another process stored since), and
            # in a step the write starts at its end (build_worker_meta),
            # with the step's other saves.
            copy = not self._lends(tensor)
            stored = self.store.put(mm_hash, tensor, copy=copy, defer_write=in_step, known_absent=True)
            if not stored and self._lost_from_disk(mm_hash):
                # Held only in this process's memory tier: vLLM computed it
                # again because the shared file lost it. Store it again, or
                # other processes would keep missing it.
                stored = self.store.put(mm_hash, tensor, copy=copy, defer_write=in_step, known_absent=True)
        except ECStoreError as e:
            log.warning("ecstore: not saving mm_hash=%s: %s", mm_hash, e)
            return
        if stored:
            self._uncommitted = self._uncommitted or self.encode_only
            self._saved[mm_hash] = nbytes = tensor_nbytes(tensor)
            self._count("saves")
            self._count("bytes_saved", nbytes)
        else:
            self._count("save_skipped")
        self._count("save_seconds", time.perf_counter() - t0)

    def _lends(self, tensor: torch.Tensor) -> bool:
        """Whether a save hands vLLM's tensor to the store (``put(copy=False)``)
        instead of copying it: an encode-only producer's large CPU tensor,
        with only the disk tier. Its step waits until the entry is committed
        (:meth:`_commit_step_saves`), and vLLM does not write into an encoder
        output, so the writer can write the blob file from the tensor's own
        bytes (into a ready spare file: no copy of the entry at all; else
        the writer copies it). Nothing else keeps it: no memory tier, no
        remote queue that could outlive the step."""
        st = self.store
        return (self.encode_only and st.has_disk_tier and not st.has_memory_tier and not st.has_remote_tier
                and tensor.device.type == "cpu" and tensor.is_contiguous()
                and tensor_nbytes(tensor) >= LEND_FROM)

    # -- reporting ------------------------------------------------------------
    def _commit_step_saves(self) -> None:
        """Encode-only producers: block until this step's saves are committed
        (visible to other processes). Only the commit is waited for; a failed
        write is logged by the store and the entry is simply absent."""
        self._uncommitted = False
        t0 = time.perf_counter()
        try:
            self.store.wait_committed()
        except ECStoreError as e:
            log.warning("ecstore: waiting for this step's saves to be committed failed: %s", e)
        self._count("commit_seconds", time.perf_counter() - t0)

    def _publish_counters(self) -> None:
        """Encode-only producers: add this step's counters to the shared record
        (opened at the first step: the scheduler side has created it by then)."""
        if self._rank is None:
            self._rank = _tp_rank()
        if self._rank == 0:
            if self._shared is None and self._record_path is not None:
                try:
                    self._shared = SharedCounters(self._record_path)
                except OSError as e:
                    log.warning("ecstore: worker counters will not be reported (stats record: %s)", e)
                    self._record_path = None
            if self._shared is not None and self._stats:
                self._shared.add(self._stats)
        self._stats = {}

    def _settle_saves(self) -> None:
        """Saves the writer found already stored since the last report count
        as ``save_skipped``, not as ``saves``/``bytes_saved``. An encode-only
        producer's are settled in the step's own report (it waited for the
        commit); another producer's may come a step later, and are then
        taken off that step's saves (never below zero: a remainder waits
        for the next step with saves)."""
        count, nbytes = self.store.puts_found_stored()
        seen_count, seen_bytes = self._found_seen
        if count != seen_count:
            self._found_seen = (count, nbytes)
            self._count("save_skipped", count - seen_count)
            self._uncounted[0] += count - seen_count
            self._uncounted[1] += nbytes - seen_bytes
        if not (self._uncounted[0] or self._uncounted[1]):
            return
        for i, key in enumerate(("saves", "bytes_saved")):
            take = min(self._uncounted[i], int(self._stats.get(key, 0)))
            if take:
                self._stats[key] -= take
                self._uncounted[i] -= take

    def build_worker_meta(self) -> ECStoreWorkerMetadata | None:
        if self._saved:
            self.store.start_writes()  # the step's saves, deferred by save_caches
        if self._uncommitted:
            self._commit_step_saves()
        self._settle_saves()
        if self.store.has_disk_tier:
            evictions = self.store.disk_evictions()
            if evictions > self._disk_evictions_seen:
                self._count("evictions", evictions - self._disk_evictions_seen)
                self._disk_evictions_seen = evictions
        for key, delta in remote_deltas(self.store, self._remote_seen).items():
            self._count(key, delta)
        if self.encode_only:
            self._publish_counters()  # vLLM would drop them with the metadata
        wm = ECStoreWorkerMetadata(saved=self._saved, evicted=self._evicted, loaded=self._loaded,
                                   failed=self._failed, cleared=self._cleared, stats=self._stats,
                                   recomputed=self._recomputed)
        self._saved, self._evicted, self._loaded, self._failed, self._stats = {}, [], [], [], {}
        self._recomputed = []
        self._cleared = []
        return None if wm.is_empty() else wm

    def shutdown(self) -> None:
        atexit.unregister(self.shutdown)  # registered at init: it held this object (and its store) until exit
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        try:
            self.store.close()
        except Exception as e:  # never raise during interpreter/engine teardown  # noqa: BLE001
            log.warning("ecstore: error while closing the store: %s", e)
