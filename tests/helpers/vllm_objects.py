"""Real vLLM objects for the connector tests (no engine, no mocks).

* :func:`vllm_config` - a real ``VllmConfig`` for the tiny BLIP-2 directory
  with the ecstore connector in a given ``ec_role`` (built through
  ``EngineArgs.create_engine_config``, as ``vllm.LLM`` does);
* :func:`make_request` - a real ``vllm.v1.request.Request`` whose prompt
  holds one 32-token image placeholder per identifier, with
  ``MultiModalFeatureSpec``/``PlaceholderRange`` as vLLM's input processor
  builds them (``data=None``: the scheduler never looks at pixel data);
* :func:`make_scheduler` - vLLM's real ``Scheduler`` with a minimal
  ``KVCacheConfig`` (one full-attention group), as ``EngineCore`` builds it;
* :func:`runner_output` - the ``ModelRunnerOutput`` a model runner returns
  for a step (sampled tokens + the EC connector output);
* :func:`run_worker_step` - what vLLM's model runner does with the worker
  connector around a step (``ECConnectorModelRunnerMixin``), with the
  encoder replaced by given tensors.

Importing this module imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ecstore.testing import tiny_model  # noqa: E402

tiny_model.setup_single_process_env()

from vllm.config import ECTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ECConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

#: The tiny BLIP-2's image placeholder token id and embeddings per image.
IMAGE_TOKEN_ID = tiny_model.SPECIAL_TOKENS.index(tiny_model.IMAGE_TOKEN)
EMBEDS_PER_IMAGE = tiny_model.NUM_QUERY_TOKENS
#: Width of one embedding (OPT hidden size): what the worker must load.
EMBED_WIDTH = tiny_model.LIGHT_SPEC["text"]["hidden_size"]

_CONFIGS: dict[tuple, VllmConfig] = {}


def vllm_config(model_dir: str | Path, role: str, extra: Mapping[str, Any],
                **engine_overrides: Any) -> VllmConfig:
    """A real VllmConfig with ``ECStoreConnector`` as ``role``.

    Building one costs ~2 s (HF config, processor), so one config per
    (model, role, engine overrides) is built and reused; each call gives it
    ``extra`` as the connector's ``ec_connector_extra_config`` (read when a
    connector is created, so create the connectors right after this call).
    ``engine_overrides`` are ``EngineArgs`` fields, e.g.
    ``max_num_batched_tokens=64`` (vLLM's encoder cache then holds 64
    embeddings: two tiny BLIP-2 images).
    """
    key = (str(model_dir), role, tuple(sorted(engine_overrides.items())))
    cfg = _CONFIGS.get(key)
    if cfg is None:
        kw = tiny_model.engine_kwargs(
            model_dir,
            enable_prefix_caching=False,
            ec_transfer_config=ECTransferConfig(
                ec_connector="ECStoreConnector", ec_role=role,
                ec_connector_module_path="ecstore.connector", ec_connector_extra_config={}),
            **engine_overrides,
        )
        cfg = EngineArgs(**kw).create_engine_config()
        if cfg.ec_transfer_config.is_ec_producer:
            # What vLLM's engine core measures at start-up on producer
            # instances (measure_encoder_output_widths); consumer-only
            # instances have none.
            cfg.ec_transfer_config.mm_encoder_output_widths = {"image": EMBED_WIDTH}
        _CONFIGS[key] = cfg
    cfg.ec_transfer_config.ec_connector_extra_config = dict(extra)
    return cfg


def make_request(req_id: str, identifiers: Sequence[str], *, max_tokens: int = 3,
                 text_tokens: Sequence[int] = (10, 11, 12), inputs: bool = True) -> Request:
    """A request with one image per identifier, then ``text_tokens``.
    ``inputs``: vLLM holds processed inputs for each image (it can encode
    it); False: a metadata-only item (an EPD consumer's pre-computed
    embedding input without its tensor), which only the connector can
    provide."""
    prompt: list[int] = []
    features = []
    for ident in identifiers:
        features.append(MultiModalFeatureSpec(
            data=MultiModalKwargsItem({}) if inputs else None, modality="image", identifier=ident, mm_hash=ident,
            mm_position=PlaceholderRange(offset=len(prompt), length=EMBEDS_PER_IMAGE)))
        prompt += [IMAGE_TOKEN_ID] * EMBEDS_PER_IMAGE
    prompt += list(text_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(req_id, prompt, params, None, mm_features=features)


def make_scheduler(cfg: VllmConfig, *, num_blocks: int = 64, log_stats: bool = True) -> Scheduler:
    """vLLM's real Scheduler for ``cfg`` (creates the SCHEDULER connector)."""
    block_size = cfg.cache_config.block_size
    cfg.cache_config.num_gpu_blocks = num_blocks
    text = cfg.model_config.hf_text_config
    head_size = text.hidden_size // text.num_attention_heads
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(
            [f"layers.{i}.attn" for i in range(text.num_hidden_layers)],
            FullAttentionSpec(block_size=block_size, num_kv_heads=text.num_attention_heads,
                              head_size=head_size, dtype=torch.float32))],
    )
    return Scheduler(vllm_config=cfg, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(cfg),
                     block_size=block_size, log_stats=log_stats)


def run_worker_step(worker: ECConnectorBase, scheduler_output: SchedulerOutput,
                    encoder_cache: dict[str, torch.Tensor],
                    encode: Callable[[str], torch.Tensor]) -> ECConnectorOutput:
    """One step of a model runner around ``worker``, the way
    ``ECConnectorModelRunnerMixin`` drives it: free what the scheduler
    freed, bind the metadata, load (consumer roles), "encode" every
    scheduled encoder input with ``encode(mm_hash)``, save each new output,
    collect the worker metadata, clear the metadata. Checks that every
    placeholder the step reads (overlapping the tokens it computes, as
    vLLM's ``_gather_mm_embeddings``) is in ``encoder_cache`` afterwards
    (the model runner raises "Encoder cache miss" otherwise)."""
    for mm_hash in scheduler_output.free_encoder_mm_hashes:
        encoder_cache.pop(mm_hash, None)
    output = ECConnectorOutput()
    worker.bind_connector_metadata(scheduler_output.ec_connector_metadata)
    if worker.is_producer:
        worker.start_save_caches(encoder_cache=encoder_cache)
    if worker.is_consumer:
        worker.start_load_caches(encoder_cache)
    features = _features_by_request(scheduler_output)
    try:
        for req_id, input_ids in scheduler_output.scheduled_encoder_inputs.items():
            for i in input_ids:
                if features[req_id][i].data is None:
                    continue  # as vLLM's runner: nothing to encode (then an encoder cache miss below)
                mm_hash = features[req_id][i].identifier
                encoder_cache[mm_hash] = encode(mm_hash)
                worker.save_caches(encoder_cache=encoder_cache, mm_hash=mm_hash)
        computed = _num_computed_tokens(scheduler_output)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            start = computed.get(req_id, 0)
            for feature in features.get(req_id, []):
                pos = feature.mm_position
                if pos.offset >= start + n or pos.offset + pos.length <= start:
                    continue  # not read this step (computed before, or later)
                if feature.identifier not in encoder_cache:
                    raise AssertionError(f"Encoder cache miss for {feature.identifier}")
    finally:
        output.finished_sending, output.finished_recving = worker.get_finished(
            scheduler_output.finished_req_ids)
        output.ec_connector_worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
    return output


def _num_computed_tokens(scheduler_output: SchedulerOutput) -> dict[str, int]:
    """Each scheduled request's tokens computed before this step."""
    out = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    out.update(zip(cached.req_ids, cached.num_computed_tokens))
    return out


_SEEN_FEATURES: dict[str, list[MultiModalFeatureSpec]] = {}


def _features_by_request(scheduler_output: SchedulerOutput) -> dict[str, list[MultiModalFeatureSpec]]:
    # New requests carry their mm_features once; later steps only name them.
    for new in scheduler_output.scheduled_new_reqs:
        _SEEN_FEATURES[new.req_id] = list(new.mm_features)
    return {rid: _SEEN_FEATURES.get(rid, []) for rid in scheduler_output.num_scheduled_tokens}


def runner_output(scheduler_output: SchedulerOutput, ec_output: ECConnectorOutput | None,
                  token: int = 7) -> ModelRunnerOutput:
    """The model runner's output for a step: one sampled token per scheduled
    request (the tests' prompts are scheduled whole, in one step)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = [[token] for _ in req_ids]
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=sampled, ec_connector_output=ec_output)
