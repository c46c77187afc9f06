"""Run the real vLLM engine (tiny BLIP-2) with the ecstore connector once.

    python engine_run.py --model DIR --out result.json [--role ec_both]
        [--extra JSON] [--images 0,1] [--multiprocess] [--no-connector]
        [--encoder-cache-budget N] [--log-stats] [--max-tokens N]
        [--uuids JSON] [--engine-kw JSON] [--embeds]

Every run is a fresh process, as a restart would be. Writes to --out::

    {"tokens": {"<image seed>": [token ids], ...},   # in --images order
     "ec_metrics": {"hits": .., "misses": .., "loads": .., ...},
     "ec_metrics_lines": <number of "EC Transfer metrics" lines logged>,
     "errors": {"<image seed>": "<finish reason>"},  # requests that did not finish normally
     "embeds": {"<image seed>": [[float, ...], ...]}}  # with --embeds

``--embeds`` wraps the model's ``embed_input_ids`` and records, per prompt,
the multimodal embedding that reached the language model (whether computed
or loaded by the connector), as nested lists of floats. The parts shared
with the other engine children are in ``engine_child.py``.
``--uuids '{"3": "u"}'`` sends ``multi_modal_uuids`` for the prompt of image
seed 3; ``--engine-kw`` adds ``LLM(...)`` keyword arguments (e.g.
``{"mm_processor_kwargs": {"do_normalize": false}}``).

``ec_metrics`` sums the integer counters of every ``EC Transfer metrics``
line vLLM's stat logger printed (``--log-stats`` turns stat logging on with a
tiny ``VLLM_LOG_STATS_INTERVAL`` so that every step's stats get logged); the
lines themselves still go to the console as usual.

``--images`` may repeat a seed (``0,1,2,0``); the prompts are generated one
after the other in one engine, in that order. A repeated seed is reported
under ``"<seed>#<n>"`` for its n-th repeat (n >= 1).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# This script's directory is sys.path[0] when it runs: engine_child is a sibling.
from engine_child import add_engine_args, as_floats, greedy_params, image_prompt, record_mm_embeds, start_engine


def main() -> None:
    ap = argparse.ArgumentParser()
    add_engine_args(ap, max_tokens=6)
    ap.add_argument("--out", required=True)
    ap.add_argument("--images", default="0")
    ap.add_argument("--multiprocess", action="store_true")
    ap.add_argument("--no-connector", action="store_true")
    ap.add_argument("--encoder-cache-budget", type=int, default=0,
                    help="vLLM's own encoder cache size in embeddings (0: vLLM's default)")
    ap.add_argument("--log-stats", action="store_true",
                    help="LLM(disable_log_stats=False) and log stats every step")
    ap.add_argument("--uuids", default="{}")
    ap.add_argument("--engine-kw", default="{}")
    ap.add_argument("--embeds", action="store_true")
    a = ap.parse_args()
    overrides: dict = {}
    if a.encoder_cache_budget:
        # vLLM sizes its encoder cache as max(max_num_batched_tokens, largest item).
        overrides["max_num_batched_tokens"] = max(a.encoder_cache_budget, 64)
    overrides.update(json.loads(a.engine_kw))
    llm, capture = start_engine(a.model, role=None if a.no_connector else a.role, extra=a.extra,
                                log_stats=a.log_stats, single_process=not a.multiprocess, **overrides)
    params = greedy_params(a.max_tokens)
    seen_embeds: list = []
    if a.embeds:
        assert not a.multiprocess, "--embeds needs the model in this process"
        llm.apply_model(lambda model: record_mm_embeds(model, seen_embeds, as_floats))
    uuids = json.loads(a.uuids)
    embeds: dict[str, list] = {}
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    seen: dict[int, int] = {}
    for seed in [int(s) for s in a.images.split(",")]:
        n = seen.get(seed, 0)
        seen[seed] = n + 1
        name = str(seed) if n == 0 else f"{seed}#{n}"
        del seen_embeds[:]
        out = llm.generate(image_prompt(seed, uuids.get(str(seed))), params, use_tqdm=False)
        if a.embeds:
            assert len(seen_embeds) == 1, f"expected one image embedding per prompt, got {len(seen_embeds)}"
            embeds[name] = seen_embeds[0]
        completion = out[0].outputs[0]
        tokens[name] = list(completion.token_ids)
        if completion.finish_reason not in ("length", "stop"):
            errors[name] = str(completion.finish_reason)
    if a.log_stats:
        llm.llm_engine.do_log_stats()  # whatever the last interval still holds
    result = {"tokens": tokens, "ec_metrics": capture.totals, "ec_metrics_lines": capture.lines,
              "errors": errors, "embeds": embeds}
    Path(a.out).write_text(json.dumps(result))
    # Shut the engine down (connector shutdown: leases released, store flushed).
    llm.llm_engine.engine_core.shutdown()
    del llm


if __name__ == "__main__":
    main()
