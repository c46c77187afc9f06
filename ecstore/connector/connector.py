"""``ECStoreConnector``: a thin, role-routed shell over the two sides.

vLLM creates one instance with role SCHEDULER (engine-core process) and one
with role WORKER per worker rank; each delegates to :class:`SchedulerSide` or
:class:`WorkerSide`. Roles from ``ec_role``: ``ec_producer`` saves and never
loads, ``ec_consumer`` loads and never saves, ``ec_both`` does both.

Configuration: ``ec_connector_extra_config`` may name the YAML file
(``config_file``; else ``LMCACHE_CONFIG_FILE``) and any config key, which
overrides every other source (see ``ecstore.config``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from ecstore.config import ECStoreConfig, load_config
from ecstore.connector.logs import ensure_console_logging
from ecstore.connector.metadata import ECStoreConnectorMetadata
from ecstore.connector.scheduler_side import SchedulerSide
from ecstore.connector.stats import ECStoreConnectorStats, ECStorePromMetrics
from ecstore.connector.vllm_identity import encoder_identity, per_process_naming, per_process_warning
from ecstore.connector.worker_side import WorkerSide
from ecstore.errors import ConfigError
from ecstore.remote.url import mask_secrets

if TYPE_CHECKING:
    from vllm.config import ECTransferConfig, VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("ecstore")


def _ec_transfer_config(vllm_config: VllmConfig) -> ECTransferConfig:
    """The engine's ``ec_transfer_config``; ConfigError if it has none (vLLM
    builds an EC connector only from one, so only a hand-made config lacks it)."""
    ec = vllm_config.ec_transfer_config
    if ec is None:
        raise ConfigError("the vLLM config has no ec_transfer_config: the ecstore connector is configured "
                          "through it (--ec-transfer-config '{\"ec_connector\": \"ECStoreConnector\", ...}')")
    return ec


def config_from_vllm(vllm_config: VllmConfig) -> ECStoreConfig:
    """The effective ecstore config for a vLLM engine."""
    extra = dict(_ec_transfer_config(vllm_config).ec_connector_extra_config or {})
    # config_file stays an override: source_of("config_file") is "override config_file".
    return load_config(overrides=extra)


def model_dtype(vllm_config: VllmConfig) -> torch.dtype:
    dtype = vllm_config.model_config.dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype


class ECStoreConnector(ECConnectorBase):
    """vLLM EC connector storing encoder outputs in an ecstore store."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ensure_console_logging()
        self.config = config_from_vllm(vllm_config)
        model = vllm_config.model_config.model
        dtype = model_dtype(vllm_config)
        # Every entry is written and read under this engine's encoder identity
        # (docs/correctness.md): an entry of another identity is a miss.
        self.identity = encoder_identity(vllm_config, str(dtype).removeprefix("torch."), self.config.namespace)
        if per_process_naming(vllm_config) and role == ECConnectorRole.SCHEDULER:
            log.warning(per_process_warning(vllm_config))
        kw: dict[str, Any] = dict(model=model, dtype=dtype, is_producer=self.is_producer, is_consumer=self.is_consumer,
                  identity=self.identity)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == ECConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(vllm_config, self.config, **kw)
        else:
            self.worker_side = WorkerSide(vllm_config, self.config, **kw)
        log.info("ecstore connector: role=%s ec_role=%s model=%s dtype=%s namespace=%s (weights: %s) "
                 "local_disk=%s (%.3g GiB) local_cpu=%s (%.3g GiB) remote=%s", role.name,
                 _ec_transfer_config(vllm_config).ec_role, model, str(dtype).removeprefix("torch."),
                 self.identity.namespace, self.identity.weights.method,
                 self.config.local_disk, self.config.max_local_disk_size, self.config.local_cpu,
                 self.config.max_local_cpu_size,
                 mask_secrets(self.config.remote_url) if self.config.remote_url else None)

    # ---------------------------------------------------------------- worker
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        assert self.worker_side is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, ECStoreConnectorMetadata)
        self.worker_side.start_load_caches(encoder_cache, meta)

    def start_save_caches(self, encoder_cache: dict[str, torch.Tensor] | None = None, **kwargs: Any) -> None:
        if self.worker_side is None or encoder_cache is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, ECStoreConnectorMetadata)
        self.worker_side.start_save_caches(encoder_cache, meta)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        assert self.worker_side is not None
        # Inside the step's connector context (metadata bound: V1 and V2 model
        # runners) the step's end starts the write; outside it (V1's
        # encoder-decoder path), at once.
        self.worker_side.save_caches(encoder_cache, mm_hash, in_step=self._connector_metadata is not None)

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        return None if self.worker_side is None else self.worker_side.build_worker_meta()

    # ------------------------------------------------------------- scheduler
    def has_cache_item(self, identifier: str) -> bool:
        assert self.scheduler_side is not None
        return self.scheduler_side.has_cache_item(identifier)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        assert self.scheduler_side is not None
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.update_connector_output(connector_output)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if self.scheduler_side is None:
            return True
        return self.scheduler_side.ensure_cache_available(request, num_computed_tokens)

    def take_unavailable_requests(self) -> set[str]:
        return set() if self.scheduler_side is None else self.scheduler_side.take_unavailable_requests()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler_side is None:
            return False, None
        return self.scheduler_side.request_finished(request)

    # ------------------------------------------------------------- metrics
    def get_ec_connector_stats(self) -> ECStoreConnectorStats | None:
        # Worker-side counters travel in the worker metadata (vLLM's V1 runner
        # never asks workers for stats), so only the scheduler reports.
        return None if self.scheduler_side is None else self.scheduler_side.get_stats()

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECStoreConnectorStats | None:
        return ECStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> ECStorePromMetrics:
        return ECStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------- lifecycle
    def shutdown(self) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()
        if self.worker_side is not None:
            self.worker_side.shutdown()
