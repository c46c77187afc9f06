"""vLLM's real Scheduler plus the worker connector, stepped by hand.

Shared by tests/test_connector_scheduler.py and tests/test_remote_connector.py
(the ``engines`` fixture in conftest.py builds these).
"""

from __future__ import annotations

import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.v1.engine import FinishReason

from ecstore.connector import ECStoreConnector
from helpers import vllm_objects as vo

SHAPE = (vo.EMBEDS_PER_IMAGE, vo.EMBED_WIDTH)


def encoder_output(identifier: str) -> torch.Tensor:
    """Deterministic 'encoder output' per identifier (the test's encoder)."""
    g = torch.Generator().manual_seed(sum(map(ord, identifier)))
    return torch.randn(*SHAPE, generator=g, dtype=torch.float32)


class Engine:
    """vLLM's Scheduler plus the worker connector, stepped by hand."""

    def __init__(self, cfg):
        self.scheduler = vo.make_scheduler(cfg)
        self.worker = ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.WORKER)
        self.connector = self.scheduler.ec_connector
        assert isinstance(self.connector, ECStoreConnector)
        self.encoder_cache: dict[str, torch.Tensor] = {}  # the model runner's
        self.finished: dict[str, FinishReason] = {}
        self.tokens: dict[str, list[int]] = {}
        self.ec_stats: list[dict] = []

    def step(self):
        out = self.scheduler.schedule()
        ec_out = vo.run_worker_step(self.worker, out, self.encoder_cache, encoder_output)
        eco = self.scheduler.update_from_output(out, vo.runner_output(out, ec_out))
        for outputs in eco.values():
            for o in outputs.outputs:
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.finish_reason
            stats = outputs.scheduler_stats
            if stats is not None and stats.ec_connector_stats:
                self.ec_stats.append(dict(stats.ec_connector_stats))
        return out

    def run(self, max_steps: int = 50) -> list:
        outs = []
        while self.scheduler.has_requests():
            assert len(outs) < max_steps, "requests never finished"
            outs.append(self.step())
        return outs

    def totals(self) -> dict[str, float]:
        tot: dict[str, float] = {}
        for d in self.ec_stats:
            for k, v in d.items():
                tot[k] = tot.get(k, 0) + v
        return tot

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()
