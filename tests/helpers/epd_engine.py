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
counts the items of every ``embed_multimodal`` call (the vision tower). The
parts shared with the other engine children are in ``engine_child.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

# This script's directory is sys.path[0] when it runs: engine_child is a sibling.
from engine_child import add_engine_args, count_and_record, greedy_params, image_prompt, start_engine

#: Summaries of the multimodal embeddings of the current request (cleared before each).
_EMBEDS: list[Any] = []
#: Items the vision tower ran for during the current command (one-element box, reset per command).
_ENCODED = [0]


def _instrument(model: Any) -> bool:
    return count_and_record(model, _ENCODED, _EMBEDS)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_engine_args(ap, role=None)
    a = ap.parse_args()
    # Protocol on the original stdout; everything else (vLLM, ecstore) to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    llm, capture = start_engine(a.model, role=a.role, extra=a.extra)
    assert all(llm.apply_model(_instrument))
    params = greedy_params(a.max_tokens)
    print(json.dumps({"ready": True}), file=proto)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        capture.totals = {}
        _ENCODED[0] = 0
        tokens: dict[str, list[int]] = {}
        embeds: dict[str, list] = {}
        for seed in cmd["images"]:
            _EMBEDS.clear()
            out = llm.generate(image_prompt(seed), params, use_tqdm=False)
            tokens[str(seed)] = list(out[0].outputs[0].token_ids)
            if _EMBEDS:
                embeds[str(seed)] = _EMBEDS[0]
        llm.llm_engine.do_log_stats()
        print(json.dumps({"tokens": tokens, "embeds": embeds, "encoded": _ENCODED[0],
                          "metrics": capture.totals}), file=proto)
    llm.llm_engine.engine_core.shutdown()
    print(json.dumps({"exited": True}), file=proto)


if __name__ == "__main__":
    main()
