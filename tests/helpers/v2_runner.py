"""vLLM's Model Runner V2 around the worker connector, on the CPU.

Model Runner V2 (``vllm/v1/worker/gpu/``, the GPU default) cannot start on
the CPU build (its config check requires Triton with a CPU backend), so the
connector tests drive its EC path the way ``run_worker_step`` drives the V1
mixin: with vLLM's own V2 pieces, the encoder replaced by given tensors.

Real vLLM code used here (vLLM 0.32's, or 0.33's under ``tools/vllm033.sh``):

* ``vllm.v1.worker.gpu.ec_connector.get_ec_connector`` /
  ``ActiveECConnector``: binds the metadata, ``start_save_caches``,
  ``start_load_caches``, then after the encoder and the gather saves every
  key new in the encoder cache (a set difference, not one call per encoded
  item as V1), asks the worker connector for its stats, builds the worker
  metadata;
* ``vllm.v1.worker.gpu.mm.encoder_cache.EncoderCache``: the runner's
  per-request ``mm_features`` and its ``encoder_outputs`` (the dict the
  connector is given); 0.33: ``update_encoder_inputs`` applies the
  scheduler's ``encoder_input_updates`` (payloads released after use,
  restored for re-encoding);
* ``vllm.v1.worker.gpu.mm.encoder_runner.EncoderRunner``:
  ``prepare_mm_inputs`` (which scheduled items are encoded: those with a
  payload and not already in the encoder cache) and
  ``gather_mm_embeddings`` (raises ``Encoder cache miss``, which stops the
  engine, for a placeholder read this step with no encoder output).

The order of one step is V2's ``execute_model``: finish and free requests,
free the encoder outputs the scheduler freed, add new requests, apply the
encoder-input updates (0.33), then, when tokens are scheduled, the EC
connector's context around "encode" + gather (``prepare_inputs_embeds``);
with no tokens, the connector's ``no_forward``. ``encode_only=True`` is the
encoder-only runner of V2 (``MMEncoderModelRunner``, what an ``ec_producer``
runs): the connector's context around the encoder alone, no gather.

Importing this module imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from vllm.distributed.ec_transfer import ec_transfer_state
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput
from vllm.v1.worker.gpu.ec_connector import ActiveECConnector, get_ec_connector
from vllm.v1.worker.gpu.mm.encoder_cache import EncoderCache
from vllm.v1.worker.gpu.mm.encoder_runner import EncoderRunner


class _NoEncoder:
    """The model slot of ``EncoderRunner``: the tests encode by hand (``encode``)."""

    supports_realtime = False

    def embed_multimodal(self, **kwargs: Any) -> Any:
        raise AssertionError("the test encodes items itself")


class V2Runner:
    """The EC path of one V2 model runner (one worker, one device: the CPU).

    ``encoder_outputs`` is vLLM's encoder cache (mm_hash -> tensor);
    ``gathered`` holds, per step, the multimodal embeddings the gather
    handed to the language model (req_id -> list of tensors)."""

    def __init__(self, vllm_config: Any, worker: ECConnectorBase, *, encode_only: bool = False) -> None:
        self.encoder_cache = EncoderCache()
        self.encoder_outputs = self.encoder_cache.encoder_outputs
        self.encode_only = encode_only
        # vLLM's worker installs its connector process-wide
        # (ensure_ec_transfer_initialized); V2 picks it up when built.
        saved = ec_transfer_state._EC_CONNECTOR_AGENT
        ec_transfer_state._EC_CONNECTOR_AGENT = worker
        try:
            ec = get_ec_connector(vllm_config, self.encoder_cache)
        finally:
            ec_transfer_state._EC_CONNECTOR_AGENT = saved
        assert isinstance(ec, ActiveECConnector)
        self.ec_connector = ec
        self.runner = EncoderRunner(
            model=_NoEncoder(),  # type: ignore[arg-type]
            max_num_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            hidden_size=int(vllm_config.model_config.get_inputs_embeds_size()),
            encoder_cache=self.encoder_cache, dtype=torch.float32, device=torch.device("cpu"))
        self._prefill_len: dict[str, int] = {}
        self.gathered: dict[str, list[torch.Tensor]] = {}

    def step(self, so: SchedulerOutput, encode: Callable[[str], torch.Tensor]) -> ECConnectorOutput | None:
        # finish_requests, free_states, add_requests (model_runner.execute_model)
        for req_id in set(so.finished_req_ids) | set(getattr(so, "preempted_req_ids", None) or ()):
            self.encoder_cache.remove_request(req_id)
            self._prefill_len.pop(req_id, None)
        for mm_hash in so.free_encoder_mm_hashes:
            self.encoder_cache.free_encoder_cache(mm_hash)
        for new in so.scheduled_new_reqs:
            self.encoder_cache.remove_request(new.req_id)
            self.encoder_cache.add_request(new.req_id, new.mm_features)
            self._prefill_len[new.req_id] = len(new.prefill_token_ids or new.prompt_token_ids or ())
        # vLLM 0.33: request-local payload updates (None releases a consumed input)
        for req_id, updates in (getattr(so, "encoder_input_updates", None) or {}).items():
            self.encoder_cache.update_encoder_inputs(req_id, updates)  # type: ignore[attr-defined]
        if so.total_num_scheduled_tokens == 0:
            return self.ec_connector.no_forward(so).ec_connector_output
        scheduled_encoder_inputs = so.scheduled_encoder_inputs  # read before the connector runs, as V2 does
        with self.ec_connector.maybe_get_output(so) as output:
            # model_states.execute_mm_encoder: prepare_mm_inputs decides what runs
            mm_hashes, _ = self.runner.prepare_mm_inputs(scheduled_encoder_inputs)
            self.encoder_outputs.update((h, encode(h)) for h in mm_hashes)
            if not self.encode_only:
                self._gather(so)
        return output

    def _gather(self, so: SchedulerOutput) -> None:
        """``EncoderRunner.gather_mm_embeddings`` over this step's batch."""
        req_ids = list(so.num_scheduled_tokens)
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        n = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        starts = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int32)
        embeds, is_mm = self.runner.gather_mm_embeddings(
            req_ids, int(n.sum()), n, starts,
            np.array([self._prefill_len[r] for r in req_ids], dtype=np.int32),
            np.array([computed[r] for r in req_ids], dtype=np.int32))
        self.gathered = {}
        # The gather's list follows req_ids, then each request's features in order.
        it = iter(embeds)
        for i, req_id in enumerate(req_ids):
            lo, hi = int(starts[i]), int(starts[i] + n[i])
            if is_mm[lo:hi].any():
                self.gathered[req_id] = [next(it) for _ in range(self._items_read(req_id, computed[req_id], int(n[i])))]

    def _items_read(self, req_id: str, start: int, n: int) -> int:
        feats = self.encoder_cache.mm_features.get(req_id, [])
        return sum(1 for f in feats
                   if f.mm_position.offset < start + n and f.mm_position.offset + f.mm_position.length > start)
