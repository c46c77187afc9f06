"""Run the real vLLM engine (tiny BLIP-2) with the ecstore connector once.

    python engine_run.py --model DIR --out result.json [--role ec_both]
        [--extra JSON] [--images 0,1] [--multiprocess] [--no-connector]

Writes {"tokens": {image_seed: [ids]}, "stats": {...}} to --out. Used by the
integration tests: every run is a fresh process, as a restart would be.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import tiny_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--role", default="ec_both")
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--images", default="0")
    ap.add_argument("--multiprocess", action="store_true")
    ap.add_argument("--no-connector", action="store_true")
    ap.add_argument("--encoder-cache-budget", type=int, default=0,
                    help="vLLM's own encoder cache size in embeddings (0: vLLM's default)")
    ap.add_argument("--max-tokens", type=int, default=6)
    a = ap.parse_args()
    if not a.multiprocess:
        tiny_model.setup_single_process_env()
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig

    overrides: dict = {"enable_prefix_caching": False}
    if not a.no_connector:
        overrides["ec_transfer_config"] = ECTransferConfig(
            ec_connector="ECStoreConnector", ec_role=a.role, ec_connector_module_path="ecstore.connector",
            ec_connector_extra_config=json.loads(a.extra))
    if a.encoder_cache_budget:
        overrides["max_num_batched_tokens"] = max(a.encoder_cache_budget, 64)
    llm = LLM(**tiny_model.engine_kwargs(a.model, single_process=not a.multiprocess, **overrides))
    params = SamplingParams(**tiny_model.greedy_sampling_kwargs(a.max_tokens))
    tokens = {}
    for seed in [int(s) for s in a.images.split(",")]:
        out = llm.generate({"prompt": tiny_model.prompt(), "multi_modal_data": {"image": tiny_model.make_image(seed)}},
                           params, use_tqdm=False)
        tokens[seed] = list(out[0].outputs[0].token_ids)
    result = {"tokens": tokens}
    Path(a.out).write_text(json.dumps(result))
    del llm


if __name__ == "__main__":
    main()
