"""A long-lived real vLLM engine (tiny BLIP-2) for the E -> PD tests, driven
by JSON lines.

    python epd_engine.py --model DIR [--role ec_producer|ec_consumer|ec_both] [--extra JSON]

No ``--role``: no connector (the single-instance baseline). One process, the
engine runs in it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``uni`` executor),
with vLLM's stat logging on every step. vLLM's console output goes to stderr;
stdout carries only this protocol: ``{"ready": true}`` once the engine is up,
then one answer per command line read from stdin:

    {"op": "generate", "images": [seed, ...]}
        one request per image, one after the other (greedy, a few tokens) ->
        {"tokens": {seed: [ids]},
         "embeds": {seed: [sum, abs_sum, sha256 of the float32 bytes]},
         "encoded": <items the vision tower ran for during the command>,
         "metrics": {counter: total of the "EC Transfer metrics" lines}}
    {"op": "exit"}  -> shuts the engine down and exits 0

``embeds`` are what reached the language model: the model's
``embed_input_ids`` is wrapped and records each multimodal embedding it is
given (an encode-only producer runs no language model: none). ``encoded``
counts the items of every ``embed_multimodal`` call (the vision tower).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
from typing import Any

from ecstore.testing import tiny_model

# This script's directory is sys.path[0] when it runs: engine_run is a sibling.
from engine_run import _MetricsCapture

_RECORD: dict[str, Any] = {"embeds": [], "encoded": 0}


def _instrument(model: Any) -> bool:
    """Wrap the model's vision tower and input embedding (runs in the worker,
    which is this process)."""
    import torch

    embed_input_ids = model.embed_input_ids
    embed_multimodal = model.embed_multimodal

    def counting_embed_multimodal(*args: Any, **kwargs: Any) -> Any:
        out = embed_multimodal(*args, **kwargs)
        _RECORD["encoded"] += len(out) if out is not None else 0
        return out

    def recording_embed_input_ids(input_ids: Any, multimodal_embeddings: Any = None, **kwargs: Any) -> Any:
        for t in multimodal_embeddings or ():
            f = t.detach().to("cpu", torch.float32).contiguous()
            _RECORD["embeds"].append([float(f.double().sum()), float(f.double().abs().sum()),
                                      hashlib.sha256(f.numpy().tobytes()).hexdigest()])
        return embed_input_ids(input_ids, multimodal_embeddings, **kwargs)

    model.embed_multimodal = counting_embed_multimodal
    model.embed_input_ids = recording_embed_input_ids
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--role", default=None)
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--max-tokens", type=int, default=4)
    a = ap.parse_args()
    # Protocol on the original stdout; everything else (vLLM, ecstore) to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    tiny_model.setup_single_process_env()
    os.environ.setdefault("VLLM_LOG_STATS_INTERVAL", "0.001")
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig

    overrides: dict[str, Any] = {"enable_prefix_caching": False, "disable_log_stats": False}
    if a.role:
        overrides["ec_transfer_config"] = ECTransferConfig(
            ec_connector="ECStoreConnector", ec_role=a.role, ec_connector_module_path="ecstore.connector",
            ec_connector_extra_config=json.loads(a.extra))
    llm = LLM(**tiny_model.engine_kwargs(a.model, **overrides))
    assert all(llm.apply_model(_instrument))
    capture = _MetricsCapture()
    logging.getLogger("vllm").addHandler(capture)
    params = SamplingParams(**tiny_model.greedy_sampling_kwargs(a.max_tokens))
    print(json.dumps({"ready": True}), file=proto)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        capture.totals = {}
        _RECORD["encoded"] = 0
        tokens: dict[str, list[int]] = {}
        embeds: dict[str, list] = {}
        for seed in cmd["images"]:
            _RECORD["embeds"] = []
            out = llm.generate({"prompt": tiny_model.prompt(),
                                "multi_modal_data": {"image": tiny_model.make_image(seed)}},
                               params, use_tqdm=False)
            tokens[str(seed)] = list(out[0].outputs[0].token_ids)
            if _RECORD["embeds"]:
                embeds[str(seed)] = _RECORD["embeds"][0]
        llm.llm_engine.do_log_stats()
        print(json.dumps({"tokens": tokens, "embeds": embeds, "encoded": _RECORD["encoded"],
                          "metrics": capture.totals}), file=proto)
    llm.llm_engine.engine_core.shutdown()
    print(json.dumps({"exited": True}), file=proto)


if __name__ == "__main__":
    main()
