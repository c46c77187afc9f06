"""Run the real vLLM engine (tiny BLIP-2, single process) once and record the
multimodal embeddings that reach the language model.

    python embeds_engine_run.py --model DIR --out result.json --images 0,1
        [--extra JSON] [--role ec_both] [--no-connector]

The model's ``embed_input_ids`` is wrapped (through ``LLM.apply_model``):
every call that carries multimodal embeddings records, per embedding, its
shape, dtype and an xxh3-64 of its bytes, plus its float64 sum. Writes::

    {"embeds": {"<image seed>": [{"shape": [32, 128], "dtype": "float32",
                                  "xxh3": int, "sum": float}, ...]},
     "ec_metrics": {...}, "errors": {...}}

(same ``ec_metrics`` as engine_run.py). Images are generated one after the
other, so each seed's list holds the embeddings of its own prefill.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from engine_run import _MetricsCapture  # same folder

from ecstore.testing import tiny_model

RECORDS: list[dict[str, Any]] = []


def _wrap(model: Any) -> bool:
    import torch
    import xxhash

    inner = model.embed_input_ids

    def embed_input_ids(input_ids: Any, multimodal_embeddings: Any = None, **kw: Any) -> Any:
        for emb in multimodal_embeddings or ():
            t = emb.detach().to("cpu").contiguous()
            RECORDS.append({"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                            "xxh3": xxhash.xxh3_64_intdigest(t.view(torch.uint8).numpy().tobytes()),
                            "sum": float(t.double().sum())})
        return inner(input_ids, multimodal_embeddings, **kw)

    model.embed_input_ids = embed_input_ids
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--role", default="ec_both")
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--images", default="0")
    ap.add_argument("--no-connector", action="store_true")
    a = ap.parse_args()
    tiny_model.setup_single_process_env()  # apply_model's closure then runs in this process
    import os

    os.environ.setdefault("VLLM_LOG_STATS_INTERVAL", "0.001")
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig

    overrides: dict = {"enable_prefix_caching": False, "disable_log_stats": False}
    if not a.no_connector:
        overrides["ec_transfer_config"] = ECTransferConfig(
            ec_connector="ECStoreConnector", ec_role=a.role, ec_connector_module_path="ecstore.connector",
            ec_connector_extra_config=json.loads(a.extra))
    llm = LLM(**tiny_model.engine_kwargs(a.model, single_process=True, **overrides))
    assert llm.apply_model(_wrap) == [True]
    capture = _MetricsCapture()
    logging.getLogger("vllm").addHandler(capture)
    params = SamplingParams(**tiny_model.greedy_sampling_kwargs(4))
    embeds: dict[str, list] = {}
    errors: dict[str, str] = {}
    for seed in [int(s) for s in a.images.split(",")]:
        RECORDS.clear()
        out = llm.generate({"prompt": tiny_model.prompt(), "multi_modal_data": {"image": tiny_model.make_image(seed)}},
                           params, use_tqdm=False)
        embeds[str(seed)] = list(RECORDS)
        if out[0].outputs[0].finish_reason not in ("length", "stop"):
            errors[str(seed)] = str(out[0].outputs[0].finish_reason)
    llm.llm_engine.do_log_stats()
    Path(a.out).write_text(json.dumps({"embeds": embeds, "ec_metrics": capture.totals, "errors": errors}))
    llm.llm_engine.engine_core.shutdown()  # connector shutdown: store flushed, remote queue sent
    del llm


if __name__ == "__main__":
    main()
