"""What travels between the scheduler side and the worker side each step.

Both directions are pickled between processes when vLLM runs multi-process,
so these hold only plain values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata, ECConnectorWorkerMetadata


@dataclass(frozen=True)
class LoadSpec:
    """One encoder output the worker must put into vLLM's encoder cache."""

    req_id: str
    identifier: str  # vLLM's mm identifier (mm_hash)
    num_embeds: int  # rows the model expects
    #: columns the model expects: the encoder output width vLLM measured at
    #: start-up (producers), else None (consumer-only: the stored width is used)
    width: int | None
    #: the item's index in the request's mm_features (what vLLM schedules the encoder by)
    index: int = -1
    #: the worker can run the encoder for it in this very step if the load
    #: fails (vLLM holds the inputs its encoder reads: ``features.EncoderInputs``);
    #: else a stand-in + failure
    recomputable: bool = False
    #: the width the stored entry's record gave when the scheduler said yes
    #: (None: not read, e.g. memory-only or a remote yes). A stand-in takes
    #: ``width`` or this: an encoder's output can be wider than the LM's
    #: hidden size (Qwen3-VL's deepstack), and a stand-in of the wrong width
    #: makes the model's split raise
    stored_width: int | None = None
    modality: str = ""  # the item's modality ("image", "video", "audio")


@dataclass
class ECStoreConnectorMetadata(ECConnectorMetadata):
    """Scheduler -> worker, built once per step by ``build_connector_meta``.

    ``acks`` (memory-only mode) lists identifiers the scheduler has removed
    from its index after the worker reported them evicted: only then may the
    worker free them (see ``worker_side``).
    """

    loads: list[LoadSpec] = field(default_factory=list)
    acks: list[str] = field(default_factory=list)
    #: the step's ``SchedulerOutput.scheduled_encoder_inputs`` itself (req_id ->
    #: mm_feature indices the runner encodes this step). Travels in the same
    #: object graph as the SchedulerOutput (in-process, or one pickle to
    #: worker processes), so a worker that cannot load an announced entry adds
    #: the item here and the runner encodes it in this step, before any token
    #: of the request is computed. None when unavailable.
    encoder_inputs: dict[str, list[int]] | None = None
    #: producer-only: identifiers of this step's requests that vLLM does not
    #: encode this step (its own encoder cache may hold them); the worker
    #: stores any it holds that the store lacks (``start_save_caches``).
    publish: list[str] = field(default_factory=list)


@dataclass
class ECStoreWorkerMetadata(ECConnectorWorkerMetadata):
    """Worker -> scheduler, once per step (aggregated across ranks by vLLM).

    ``saved``/``evicted`` feed the scheduler's index in memory-only mode;
    ``loaded``/``failed`` let the scheduler release leases and fail requests
    whose entry could not be loaded; ``cleared`` names identifiers whose
    zero stand-in (put in for a failed load), or whose loaded entry, has
    left vLLM's encoder cache (freed, or the cache was reset);
    ``stats`` carries worker-side counters
    (vLLM's V1 model runner does not collect worker connector stats itself).
    Loads are reported per (request, identifier): each announced load holds
    its own lease, and with async scheduling a later step may announce the
    same entry for another request before this report arrives.
    """

    saved: dict[str, int] = field(default_factory=dict)  # identifier -> tensor bytes
    evicted: list[str] = field(default_factory=list)
    loaded: list[tuple[str, str]] = field(default_factory=list)  # (req_id, identifier)
    failed: list[tuple[str, str, str]] = field(default_factory=list)  # (req_id, identifier, reason)
    #: loads that failed and were encoded in the same step instead (req_id, identifier)
    recomputed: list[tuple[str, str]] = field(default_factory=list)
    cleared: list[str] = field(default_factory=list)  # stand-ins and loaded entries gone from vLLM's encoder cache
    stats: dict[str, float] = field(default_factory=dict)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECStoreWorkerMetadata:
        assert isinstance(other, ECStoreWorkerMetadata)
        stats = dict(self.stats)
        for k, v in other.stats.items():
            stats[k] = stats.get(k, 0) + v
        return ECStoreWorkerMetadata(
            saved={**self.saved, **other.saved},
            evicted=sorted(set(self.evicted) | set(other.evicted)),
            loaded=sorted(set(self.loaded) | set(other.loaded)),
            failed=sorted(set(self.failed) | set(other.failed)),
            recomputed=sorted(set(self.recomputed) | set(other.recomputed)),
            cleared=sorted(set(self.cleared) | set(other.cleared)),
            stats=stats,
        )

    def is_empty(self) -> bool:
        return not (self.saved or self.evicted or self.loaded or self.failed or self.cleared
                    or self.recomputed or self.stats)
