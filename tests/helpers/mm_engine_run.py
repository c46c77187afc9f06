"""Run real vLLM engines (tiny Qwen models, single process) on lists of
multimodal requests and record what reaches the language model.

    python mm_engine_run.py --runs JSON --out result.json

``--runs`` is a list of engine runs, started one after the other in this
process (each shut down before the next starts, so each is a new engine
with an empty vLLM encoder cache; a *restart* needs a new process)::

    {"name": str, "tiny": "qwen2_5_vl", "model": DIR, "requests": [...],
     "extra": {connector extra config} | null (no connector),
     "role": "ec_both", "engine_kw": {LLM kwargs}, "max_tokens": 2}

``requests`` is a list of ``{"name": str, "items": [[modality, seed], ...]}``
(modality ``image``, ``video`` (frames + metadata), ``audio`` or ``mp4``; an
``mp4`` request goes through ``LLM.chat`` as a ``video_url`` data URL, the
others through ``LLM.generate``) with optional ``"mm_processor_kwargs"``
(e.g. ``{"use_audio_in_video": true}``). Requests run one after the other.
Writes ``{run name: {"requests": {request name: ...}, "ec_metrics": {...}}}``
with, per request::

    {"embeds":   [{"shape", "dtype", "xxh3", "sum"}, ...],  # embed_input_ids' multimodal embeddings
     "encoder":  [{"inputs": [kwarg names], "shapes": [[..], ..]}, ...],  # embed_multimodal calls (encoder runs)
     "features": [{"modality", "identifier", "mm_hash", "offset", "length", "data": {key: shape}}, ...],
     "finish":   "length"}

and ``ec_metrics`` the run's summed ``EC Transfer metrics`` counters. ``features``
are the ``MultiModalFeatureSpec`` s of the request as vLLM's scheduler
received it. The shared parts are in ``engine_child.py``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# This script's directory is sys.path[0] when it runs: engine_child is a sibling.
from engine_child import MetricsCapture, greedy_params, xxh3_summary


def _feature_summary(f: Any) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, elem in (f.data or {}).items():
        value = getattr(elem, "data", elem)
        data[key] = list(value.shape) if hasattr(value, "shape") else repr(value)[:80]
    return {"modality": f.modality, "identifier": f.identifier, "mm_hash": f.mm_hash,
            "offset": f.mm_position.offset, "length": f.mm_position.length, "data": data}


def _record_features(sink: list[Any]) -> None:
    """Wrap the scheduler's ``add_request`` (this process) to record each request's features."""
    from vllm.v1.core.sched.scheduler import Scheduler

    inner = Scheduler.add_request

    def add_request(self: Any, request: Any) -> None:
        sink.append([_feature_summary(f) for f in request.mm_features or ()])
        inner(self, request)

    Scheduler.add_request = add_request  # type: ignore[method-assign]


def _record_model(model: Any, embeds: list[Any], encoder: list[Any]) -> bool:
    inner_embed = model.embed_input_ids
    inner_encode = model.embed_multimodal

    def embed_input_ids(input_ids: Any, multimodal_embeddings: Any = None, **kw: Any) -> Any:
        for emb in multimodal_embeddings or ():
            embeds.append(xxh3_summary(emb))
        return inner_embed(input_ids, multimodal_embeddings, **kw)

    def embed_multimodal(**kwargs: Any) -> Any:
        out = inner_encode(**kwargs)
        encoder.append({"inputs": sorted(k for k, v in kwargs.items() if v is not None),
                        "shapes": [list(t.shape) for t in out]})
        return out

    model.embed_input_ids = embed_input_ids
    model.embed_multimodal = embed_multimodal
    return True


def _item(modality: str, seed: int) -> Any:
    from ecstore.testing import tiny_qwen

    if modality == "image":
        return tiny_qwen.make_image(seed, 112)
    if modality == "video":
        return tiny_qwen.make_video(seed)
    if modality == "audio":
        return tiny_qwen.audio_item(seed)
    raise ValueError(f"unknown modality {modality!r}")


def _run_one(llm: Any, tiny: str, req: dict[str, Any], params: Any) -> Any:
    from ecstore.testing import tiny_qwen

    items = req["items"]
    kwargs = req.get("mm_processor_kwargs")
    if items and items[0][0] == "mp4":
        assert len(items) == 1, "an mp4 request carries the clip only"
        content = [{"type": "video_url", "video_url": {"url": tiny_qwen.mp4_data_url(tiny_qwen.make_mp4(items[0][1]))}},
                   {"type": "text", "text": "Describe the video."}]
        return llm.chat([{"role": "user", "content": content}], params, use_tqdm=False,
                        mm_processor_kwargs=kwargs)
    data: dict[str, Any] = {}
    for modality, seed in items:
        assert modality not in data, "one item per modality"
        data[modality] = _item(modality, seed)
    # With use_audio_in_video the video's placeholder stands for its audio too.
    in_video = bool((kwargs or {}).get("use_audio_in_video"))
    placeholders = [m for m, _ in items if not (in_video and m == "audio")]
    prompt: dict[str, Any] = {"prompt": tiny_qwen.prompt(tiny, placeholders), "multi_modal_data": data}
    if kwargs:
        prompt["mm_processor_kwargs"] = kwargs
    return llm.generate(prompt, params, use_tqdm=False)


def _engine_run(run: dict[str, Any], features: list[Any], capture: MetricsCapture) -> dict[str, Any]:
    """One engine: start it, send ``run["requests"]`` in order, shut it down."""
    import gc
    import logging

    from vllm import LLM
    from vllm.config import ECTransferConfig
    from vllm.distributed import cleanup_dist_env_and_memory

    from ecstore.testing import tiny_qwen

    kw: dict[str, Any] = {"enable_prefix_caching": False, "disable_log_stats": False}
    if run.get("extra") is not None:
        kw["ec_transfer_config"] = ECTransferConfig(
            ec_connector="ECStoreConnector", ec_role=run.get("role", "ec_both"),
            ec_connector_module_path="ecstore.connector", ec_connector_extra_config=run["extra"])
    kw.update(run.get("engine_kw", {}))
    print(f"=== engine run {run['name']} ({run['tiny']}) ===", flush=True)
    llm = LLM(**tiny_qwen.engine_kwargs(run["tiny"], run["model"], **kw))
    logging.getLogger("vllm").addHandler(capture)  # after LLM(): it resets vLLM's handlers
    capture.totals.clear()
    embeds: list[Any] = []
    encoder: list[Any] = []
    assert llm.apply_model(lambda model: _record_model(model, embeds, encoder)) == [True]
    params = greedy_params(run.get("max_tokens", 2))
    results: dict[str, Any] = {}
    for req in run["requests"]:
        embeds.clear()
        encoder.clear()
        features.clear()
        out = _run_one(llm, run["tiny"], req, params)
        results[req["name"]] = {"embeds": list(embeds), "encoder": list(encoder),
                                "features": features[0] if features else [],
                                "finish": str(out[0].outputs[0].finish_reason)}
    llm.llm_engine.do_log_stats()
    metrics = dict(capture.totals)
    llm.llm_engine.engine_core.shutdown()  # connector shutdown: store flushed and closed
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    print(f"=== end of engine run {run['name']} ===", flush=True)
    return {"requests": results, "ec_metrics": metrics}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", required=True, help="JSON list of engine runs (see the module docstring)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import os

    from ecstore.testing import tiny_qwen

    tiny_qwen.setup_single_process_env()
    os.environ.setdefault("VLLM_LOG_STATS_INTERVAL", "0.001")
    features: list[Any] = []
    _record_features(features)
    capture = MetricsCapture()
    out = {run["name"]: _engine_run(run, features, capture) for run in json.loads(a.runs)}
    Path(a.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
