"""Run the real vLLM engine (tiny BLIP-2) with the ecstore connector once.

    python engine_run.py --model DIR --out result.json [--role ec_both]
        [--extra JSON] [--images 0,1] [--multiprocess] [--no-connector]
        [--encoder-cache-budget N] [--log-stats] [--max-tokens N]

Every run is a fresh process, as a restart would be. Writes to --out::

    {"tokens": {"<image seed>": [token ids], ...},   # in --images order
     "ec_metrics": {"hits": .., "misses": .., "loads": .., ...},
     "ec_metrics_lines": <number of "EC Transfer metrics" lines logged>,
     "errors": {"<image seed>": "<finish reason>"}}  # requests that did not finish normally

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
import logging
import os
from pathlib import Path

from ecstore.testing import tiny_model  # noqa: E402

METRICS_PREFIX = "EC Transfer metrics"


class _MetricsCapture(logging.Handler):
    """Sums the counters of vLLM's ``EC Transfer metrics: k=v, ...`` records."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.totals: dict[str, float] = {}
        self.lines = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # never break the engine's logging
            return
        if not msg.startswith(METRICS_PREFIX):
            return
        self.lines += 1
        for part in msg.split(":", 1)[1].split(","):
            key, _, value = part.strip().partition("=")
            if key == "hit_rate":
                continue
            try:
                number = float(value)
            except ValueError:
                continue
            self.totals[key] = self.totals.get(key, 0) + number


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
    ap.add_argument("--log-stats", action="store_true",
                    help="LLM(disable_log_stats=False) and log stats every step")
    ap.add_argument("--max-tokens", type=int, default=6)
    a = ap.parse_args()
    if not a.multiprocess:
        tiny_model.setup_single_process_env()
    if a.log_stats:
        os.environ.setdefault("VLLM_LOG_STATS_INTERVAL", "0.001")
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig

    overrides: dict = {"enable_prefix_caching": False, "disable_log_stats": not a.log_stats}
    if not a.no_connector:
        overrides["ec_transfer_config"] = ECTransferConfig(
            ec_connector="ECStoreConnector", ec_role=a.role, ec_connector_module_path="ecstore.connector",
            ec_connector_extra_config=json.loads(a.extra))
    if a.encoder_cache_budget:
        # vLLM sizes its encoder cache as max(max_num_batched_tokens, largest item).
        overrides["max_num_batched_tokens"] = max(a.encoder_cache_budget, 64)
    llm = LLM(**tiny_model.engine_kwargs(a.model, single_process=not a.multiprocess, **overrides))
    # After LLM(): creating the engine (re)applies vLLM's logging config,
    # which replaces the handlers of the "vllm" logger.
    capture = _MetricsCapture()
    logging.getLogger("vllm").addHandler(capture)
    params = SamplingParams(**tiny_model.greedy_sampling_kwargs(a.max_tokens))
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    seen: dict[int, int] = {}
    for seed in [int(s) for s in a.images.split(",")]:
        n = seen.get(seed, 0)
        seen[seed] = n + 1
        name = str(seed) if n == 0 else f"{seed}#{n}"
        out = llm.generate({"prompt": tiny_model.prompt(), "multi_modal_data": {"image": tiny_model.make_image(seed)}},
                           params, use_tqdm=False)
        completion = out[0].outputs[0]
        tokens[name] = list(completion.token_ids)
        if completion.finish_reason not in ("length", "stop"):
            errors[name] = str(completion.finish_reason)
    if a.log_stats:
        llm.llm_engine.do_log_stats()  # whatever the last interval still holds
    result = {"tokens": tokens, "ec_metrics": capture.totals, "ec_metrics_lines": capture.lines,
              "errors": errors}
    Path(a.out).write_text(json.dumps(result))
    # Shut the engine down (connector shutdown: leases released, store flushed).
    llm.llm_engine.engine_core.shutdown()
    del llm


if __name__ == "__main__":
    main()
