"""Run the real vLLM engine (tiny BLIP-2, single process) once and record the
multimodal embeddings that reach the language model.

    python embeds_engine_run.py --model DIR --out result.json --images 0,1
        [--extra JSON] [--role ec_both] [--no-connector] [--max-tokens 4]

The model's ``embed_input_ids`` is wrapped (through ``LLM.apply_model``):
every call that carries multimodal embeddings records, per embedding, its
shape, dtype and an xxh3-64 of its bytes, plus its float64 sum. Writes::

    {"embeds": {"<image seed>": [{"shape": [32, 128], "dtype": "float32",
                                  "xxh3": int, "sum": float}, ...]},
     "ec_metrics": {...}, "errors": {...}}

(same ``ec_metrics`` as engine_run.py). Images are generated one after the
other, so each seed's list holds the embeddings of its own prefill. The parts
shared with the other engine children are in ``engine_child.py``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# This script's directory is sys.path[0] when it runs: engine_child is a sibling.
from engine_child import add_engine_args, greedy_params, image_prompt, record_mm_embeds, start_engine, xxh3_summary


def main() -> None:
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    ap.add_argument("--out", required=True)
    ap.add_argument("--images", default="0")
    ap.add_argument("--no-connector", action="store_true")
    a = ap.parse_args()
    # Single process: apply_model's closure then runs in this process.
    llm, capture = start_engine(a.model, role=None if a.no_connector else a.role, extra=a.extra)
    records: list[dict[str, Any]] = []
    assert llm.apply_model(lambda model: record_mm_embeds(model, records, xxh3_summary)) == [True]
    params = greedy_params(a.max_tokens)
    embeds: dict[str, list] = {}
    errors: dict[str, str] = {}
    for seed in [int(s) for s in a.images.split(",")]:
        records.clear()
        out = llm.generate(image_prompt(seed), params, use_tqdm=False)
        embeds[str(seed)] = list(records)
        if out[0].outputs[0].finish_reason not in ("length", "stop"):
            errors[str(seed)] = str(out[0].outputs[0].finish_reason)
    llm.llm_engine.do_log_stats()
    Path(a.out).write_text(json.dumps({"embeds": embeds, "ec_metrics": capture.totals, "errors": errors}))
    llm.llm_engine.engine_core.shutdown()  # connector shutdown: store flushed, remote queue sent
    del llm


if __name__ == "__main__":
    main()
