"""Real vLLM objects for the connector tests (no engine, no mocks).

* :func:`vllm_config` - a real ``VllmConfig`` for a tiny model directory
  (BLIP-2, or a tiny Qwen from ``ecstore.testing.tiny_qwen``) with the
  ecstore connector in a given ``ec_role`` (built through
  ``EngineArgs.create_engine_config``, as ``vllm.LLM`` does);
* :func:`processed_request` - a request as vLLM's input processor builds it
  (the renderer and the model's multimodal processor, as ``LLM.generate``),
  from real items: pixels, or an EPD consumer's metadata-only item
  (:func:`request_from_prompt`: the same from any prompt dict, e.g. an
  encoder-decoder model's);
* :func:`make_request` - a request whose prompt holds one image placeholder
  per identifier, each item's ``MultiModalFeatureSpec`` copied from one vLLM
  really built for the model (:func:`feature_template`: ``data``, modality
  and placeholder length as processed; only identifier and offset set here):
  a full item (pixel values) or a metadata-only one (``image_grid_thw``
  only: what vLLM builds for an EPD consumer's ``{"image":
  {"image_grid_thw": ...}}``; BLIP-2 cannot be sent such items, so those
  come from the tiny Qwen2.5-VL);
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

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ecstore.testing import tiny_model, tiny_qwen  # noqa: E402
from ecstore.testing.tiny_build import _read_marker  # noqa: E402

tiny_model.setup_single_process_env()

from vllm.config import ECTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec  # noqa: E402
from vllm.renderers.inputs.preprocess import parse_model_prompt  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine.input_processor import InputProcessor  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ECConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import sanity_check_mm_encoder_outputs  # noqa: E402

#: The tiny models (``ecstore.testing``) the doubles come from, by name.
BLIP2 = "blip2"
QWEN2_5_VL = "qwen2_5_vl"
#: Where vLLM builds metadata-only items: a model whose parser declares the
#: image's placeholder metadata (BLIP-2 declares none: it takes pixels only).
METADATA_MODEL = QWEN2_5_VL
#: The tiny BLIP-2's image placeholder token id and embeddings per image.
IMAGE_TOKEN_ID = tiny_model.SPECIAL_TOKENS.index(tiny_model.IMAGE_TOKEN)
EMBEDS_PER_IMAGE = tiny_model.NUM_QUERY_TOKENS
#: Width of one embedding (OPT hidden size): what the worker must load.
EMBED_WIDTH = tiny_model.LIGHT_SPEC["text"]["hidden_size"]
#: The patch grid of the metadata-only Qwen2.5-VL image (t, h, w patches;
#: 2x2 merge): 8 * 16 / 4 = 32 embeddings, as many as a BLIP-2 image.
METADATA_GRID = (1, 8, 16)
#: What vLLM's engine core measures at start-up on producer instances
#: (measure_encoder_output_widths; consumer-only instances have none), per
#: tiny model: Qwen3-VL's deepstack output is 3 x 128 wide.
PRODUCER_WIDTHS = {BLIP2: {"image": EMBED_WIDTH}, QWEN2_5_VL: {"image": 128, "video": 128},
                   "qwen3_vl": {"image": 384, "video": 384}}

_REPO = Path(__file__).resolve().parents[2]
_CONFIGS: dict[tuple, VllmConfig] = {}


def model_dir(name: str) -> Path:
    """The tiny model ``name``'s directory (built once into .cache/, as the
    session fixtures of conftest.py build it)."""
    if name == BLIP2:
        return tiny_model.build_tiny_blip2(_REPO / ".cache" / "tiny_blip2")
    return tiny_qwen.build_tiny_qwen(name, _REPO / ".cache" / f"tiny_{name}")


def model_name(directory: str | Path) -> str:
    """Which tiny model ``directory`` holds (its build marker)."""
    marker = _read_marker(Path(directory)) or {}
    return str(marker.get("model") or BLIP2)


def _engine_kwargs(directory: str | Path, **overrides: Any) -> dict[str, Any]:
    name = model_name(directory)
    if name == BLIP2:
        return tiny_model.engine_kwargs(directory, **overrides)
    return tiny_qwen.engine_kwargs(name, directory, **overrides)


def _ec_config(role: str) -> ECTransferConfig:
    return ECTransferConfig(ec_connector="ECStoreConnector", ec_role=role,
                            ec_connector_module_path="ecstore.connector", ec_connector_extra_config={})


def vllm_config(model_dir: str | Path, role: str, extra: Mapping[str, Any],
                **engine_overrides: Any) -> VllmConfig:
    """A real VllmConfig with ``ECStoreConnector`` as ``role``.

    Building one costs ~2 s (HF config, processor), so one config per
    (model, role, engine overrides) is built and reused; each call gives it
    ``extra`` as the connector's ``ec_connector_extra_config`` (read when a
    connector is created, so create the connectors right after this call).
    ``engine_overrides`` are ``EngineArgs`` fields, e.g.
    ``max_num_batched_tokens=64`` (vLLM's encoder cache then holds 64
    embeddings: two tiny BLIP-2 images; the tiny Qwen2.5-VL's largest item,
    a video, makes it 112).
    """
    key = (str(model_dir), role, repr(sorted(engine_overrides.items())))
    cfg = _CONFIGS.get(key)
    if cfg is None:
        kw = _engine_kwargs(model_dir, enable_prefix_caching=False, ec_transfer_config=_ec_config(role),
                            **engine_overrides)
        cfg = EngineArgs(**kw).create_engine_config()
        if cfg.ec_transfer_config.is_ec_producer:
            cfg.ec_transfer_config.mm_encoder_output_widths = dict(PRODUCER_WIDTHS[model_name(model_dir)])
        _CONFIGS[key] = cfg
    cfg.ec_transfer_config.ec_connector_extra_config = dict(extra)
    return cfg


@functools.cache
def _input_processor(name: str) -> InputProcessor:
    """vLLM's input processor for tiny model ``name`` on an ``ec_consumer``
    config (which accepts metadata-only items; full items are processed
    alike on every role). Its config is not one :func:`vllm_config` hands out."""
    kw = _engine_kwargs(model_dir(name), ec_transfer_config=_ec_config("ec_consumer"))
    return InputProcessor(EngineArgs(**kw).create_engine_config())


def processed_request(name: str, req_id: str, mm_data: Mapping[str, Any], *,
                      uuids: Mapping[str, Sequence[str]] | None = None, max_tokens: int = 3,
                      mm_processor_kwargs: Mapping[str, Any] | None = None) -> Request:
    """The ``Request`` vLLM's engine core gets for a prompt of tiny model
    ``name`` with ``mm_data`` (one item per modality, in the order given),
    built by vLLM's renderer and input processor as ``LLM.generate`` does
    (``uuids``: the client's ``multi_modal_uuids``; ``mm_processor_kwargs``:
    the request's own processor settings)."""
    ip = _input_processor(name)
    modalities = list(mm_data)
    text = tiny_model.prompt() if name == BLIP2 else tiny_qwen.prompt(name, modalities)
    prompt: dict[str, Any] = {"prompt": text, "multi_modal_data": dict(mm_data)}
    if uuids is not None:
        prompt["multi_modal_uuids"] = {m: list(u) for m, u in uuids.items()}
    if mm_processor_kwargs is not None:
        prompt["mm_processor_kwargs"] = dict(mm_processor_kwargs)
    return request_from_prompt(ip, req_id, prompt, max_tokens=max_tokens)


def request_from_prompt(ip: InputProcessor, req_id: str, prompt: Mapping[str, Any], *,
                        max_tokens: int = 3) -> Request:
    """The ``Request`` vLLM's engine core gets for ``prompt`` (a prompt dict as
    ``LLM.generate`` takes it), rendered and processed by ``ip`` (greedy)."""
    renderer = ip.renderer
    (engine_input,) = renderer.render_cmpl([parse_model_prompt(ip.model_config, dict(prompt))],
                                          renderer.default_cmpl_tok_params)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ecr = ip.process_inputs(req_id, engine_input, params, ("generate",))
    return Request.from_engine_core_request(ecr, block_hasher=None)


@functools.cache
def feature_template(name: str, inputs: bool) -> tuple[MultiModalFeatureSpec, int]:
    """One image's feature as vLLM builds it for tiny model ``name``, and its
    placeholder token id. ``inputs``: a full item (from pixels); else a
    metadata-only item, as an EPD consumer sends it (``{"image":
    {"image_grid_thw": ...}}`` plus a uuid, no pixels), of
    :data:`METADATA_GRID`. A Qwen full item is a 224 x 112 image allowed
    that many pixels (the request's ``max_pixels``): the same grid, so both
    kinds take :data:`EMBEDS_PER_IMAGE` tokens, as a BLIP-2 image does."""
    if inputs and name == BLIP2:
        req = processed_request(name, "template", {"image": tiny_model.make_image(1)})
    elif inputs:
        _, h, w = METADATA_GRID
        image = tiny_qwen.make_image(1, 14 * w).resize((14 * w, 14 * h))
        size = {"longest_edge": 14 * 14 * h * w, "shortest_edge": 56 * 56}  # pixels
        req = processed_request(name, "template", {"image": image}, mm_processor_kwargs={"size": size})
    elif name == BLIP2:
        raise ValueError("vLLM builds no metadata-only item for BLIP-2 (its parser declares no "
                         f"placeholder metadata): use {METADATA_MODEL}")
    else:
        req = processed_request(name, "template", {"image": {"image_grid_thw": torch.tensor([METADATA_GRID])}},
                                uuids={"image": ["template"]})
    (feature,) = req.mm_features
    return feature, int(req.prompt_token_ids[feature.mm_position.offset])


def make_request(req_id: str, identifiers: Sequence[str], *, max_tokens: int = 3,
                 text_tokens: Sequence[int] = (10, 11, 12), inputs: bool = True,
                 model: str | None = None, rows: Mapping[str, int] | None = None) -> Request:
    """A request with one image per identifier, then ``text_tokens``; each
    image's feature is vLLM's own (:func:`feature_template`) under the
    given identifier. ``inputs``: vLLM holds the processed pixels (it can
    encode the item); False: a metadata-only item (an EPD consumer's
    pre-computed embedding input without its tensor), which only the
    connector can provide. ``model``: the tiny model the features come from
    (default: BLIP-2 for full items, :data:`METADATA_MODEL` for
    metadata-only ones; use a config of the same model). Each image takes
    :data:`EMBEDS_PER_IMAGE` tokens with the defaults; ``rows`` gives some
    identifiers another number (an image of another size under the same
    identifier: a client uuid reused; only for metadata-only items, whose
    placeholder alone says how many)."""
    name = model or (BLIP2 if inputs else METADATA_MODEL)
    template, token = feature_template(name, inputs)
    assert not (rows and inputs), "processed inputs fix an item's size"
    prompt: list[int] = []
    features = []
    for ident in identifiers:
        n = (rows or {}).get(ident, template.mm_position.length)
        features.append(replace(template, identifier=ident, mm_hash=ident,
                                mm_position=replace(template.mm_position, offset=len(prompt), length=n)))
        prompt += [token] * n
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
                feature = features[req_id][i]
                if feature.data is None:
                    continue  # as vLLM's runner: nothing to encode (then an encoder cache miss below)
                # vLLM's runner hands feature.data to the model's embed_multimodal,
                # which encodes nothing for an item without encoder inputs (only
                # placeholder metadata); its sanity check then stops the engine.
                outputs = [encode(feature.identifier)] if _encodable(worker, feature) else []
                sanity_check_mm_encoder_outputs(outputs, expected_num_items=1)
                encoder_cache[feature.identifier] = outputs[0]
                worker.save_caches(encoder_cache=encoder_cache, mm_hash=feature.identifier)
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


def _encodable(worker: ECConnectorBase, feature: MultiModalFeatureSpec) -> bool:
    """Whether the model would encode ``feature``: its data holds a field
    besides the placeholder metadata the model declares (vLLM's own
    resolver; the rule of vLLM's CPU EC connector for "local input")."""
    metadata = _metadata_resolver(worker._vllm_config.model_config).fields_for(feature.modality)
    data = feature.data or {}
    return any(elem.data is not None for key, elem in data.items() if key not in metadata)


_RESOLVERS: dict[str, PlaceholderMetadataResolver] = {}


def _metadata_resolver(model_config: Any) -> PlaceholderMetadataResolver:
    model = str(model_config.model)
    if model not in _RESOLVERS:
        _RESOLVERS[model] = PlaceholderMetadataResolver(model_config)
    return _RESOLVERS[model]


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
