"""vLLM's real Scheduler plus the worker connector, stepped by hand.

Shared by tests/connector/test_connector_scheduler.py and tests/connector/test_remote_connector.py
(the ``engines`` fixture in conftest.py builds these).
"""

from __future__ import annotations

import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.v1.engine import FinishReason
from vllm.v1.outputs import ModelRunnerOutput, make_empty_encoder_model_runner_output

from ecstore.connector import ECStoreConnector
from helpers import vllm_objects as vo

SHAPE = (vo.EMBEDS_PER_IMAGE, vo.EMBED_WIDTH)


def encoder_output(identifier: str) -> torch.Tensor:
    """Deterministic 'encoder output' per identifier (the test's encoder)."""
    g = torch.Generator().manual_seed(sum(map(ord, identifier)))
    return torch.randn(*SHAPE, generator=g, dtype=torch.float32)


class Engine:
    """vLLM's Scheduler plus the worker connector, stepped by hand.

    ``runner="v1"`` drives the worker as V1's model-runner mixin does
    (``vo.run_worker_step``); ``"v2"`` through Model Runner V2's own EC code
    (``helpers.v2_runner``), with the scheduler as it runs for V2
    (``use_v2_model_runner``: resumed requests are sent as new ones; in
    vLLM 0.33 it also sends ``encoder_input_updates``)."""

    def __init__(self, cfg, runner: str = "v1"):
        self.scheduler = vo.make_scheduler(cfg)
        self.worker = ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.WORKER)
        self.connector = self.scheduler.ec_connector
        assert isinstance(self.connector, ECStoreConnector)
        self.v2 = None
        self.encoder_cache: dict[str, torch.Tensor] = {}  # the model runner's
        if runner == "v2":
            from helpers.v2_runner import V2Runner

            self.scheduler.use_v2_model_runner = True
            self.v2 = V2Runner(cfg, self.worker, encode_only=not self.worker.is_consumer)
            self.encoder_cache = self.v2.encoder_outputs
        self.kv_output = None  # a KVConnectorOutput to report with the next step's output
        self.finished: dict[str, FinishReason] = {}
        self.tokens: dict[str, list[int]] = {}
        self.ec_stats: list[dict] = []

    def step(self):
        out = self.scheduler.schedule()
        if self.v2 is not None:
            ec_out = self.v2.step(out, encoder_output)
        else:
            ec_out = vo.run_worker_step(self.worker, out, self.encoder_cache, encoder_output)
        if self.v2 is not None and self.v2.encode_only:
            # V2's encoder-only runner (MMEncoderModelRunner): no tokens, but
            # unlike V1's it keeps the EC connector output.
            mro = ModelRunnerOutput.with_ec_conn_output(make_empty_encoder_model_runner_output(out), ec_out)
        else:
            mro = vo.runner_output(out, ec_out)
        mro.kv_connector_output, self.kv_output = self.kv_output, None
        eco = self.scheduler.update_from_output(out, mro)
        for outputs in eco.values():
            for o in outputs.outputs:
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.finish_reason
            stats = outputs.scheduler_stats
            if stats is not None and stats.ec_connector_stats:
                self.ec_stats.append(dict(stats.ec_connector_stats))
        self.settle()
        return out

    def settle(self) -> None:
        """Wait until the scheduler side's background verifications (started
        this step, off the scheduler thread) are done: a step is then
        followed by the next as if the verification thread kept pace, and
        a request waiting for one waits exactly one step (no timing in tests)."""
        jobs = self.connector.scheduler_side._verifications
        assert jobs is None or jobs.wait_idle(60), "a background verification did not end"

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
