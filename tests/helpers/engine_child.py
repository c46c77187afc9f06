"""What the engine child scripts share (tests only): their common arguments,
starting the tiny BLIP-2 engine with or without the ecstore connector,
summing vLLM's ``EC Transfer metrics`` lines, the image prompts, and recording
the multimodal embeddings that reach the language model.

Used by ``engine_run.py``, ``embeds_engine_run.py`` and ``epd_engine.py``
(siblings: a script's directory is ``sys.path[0]`` when it runs, so they
``import engine_child``). Each of them is one process running one engine;
nothing here is thread-safe beyond what vLLM's logging gives the handler.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from ecstore.testing import tiny_model

METRICS_PREFIX = "EC Transfer metrics"


class MetricsCapture(logging.Handler):
    """Sums the counters of vLLM's ``EC Transfer metrics: k=v, ...`` records
    (``hit_rate`` left out) into :attr:`totals`; :attr:`lines` counts them.
    The lines themselves still reach the console through vLLM's handlers."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.totals: dict[str, float] = {}
        self.lines = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # never break the engine's logging  # noqa: BLE001
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


def add_engine_args(ap: argparse.ArgumentParser, *, role: str | None = "ec_both", max_tokens: int = 4) -> None:
    """The arguments every child takes: ``--model DIR`` (the tiny model),
    ``--role`` (the connector's ec_role; default ``role``), ``--extra JSON``
    (its ``ec_connector_extra_config``) and ``--max-tokens N`` (greedy
    tokens per request; default ``max_tokens``)."""
    ap.add_argument("--model", required=True)
    ap.add_argument("--role", default=role)
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--max-tokens", type=int, default=max_tokens)


def start_engine(model_dir: str, *, role: str | None, extra: str, log_stats: bool = True,
                 single_process: bool = True, **overrides: Any) -> tuple[Any, MetricsCapture]:
    """Start ``vllm.LLM`` on the tiny model and attach a :class:`MetricsCapture`.

    ``role`` None: no connector; else the ecstore connector with that ec_role
    and ``extra`` (a JSON object) as its extra config. ``single_process``:
    engine core and worker in this process (needed to wrap the model with
    ``LLM.apply_model``). ``log_stats``: vLLM's stat logging on, every step.
    Prefix caching is off; ``overrides`` are further ``LLM`` keyword arguments.
    Returns (llm, capture)."""
    if single_process:
        tiny_model.setup_single_process_env()
    if log_stats:
        os.environ.setdefault("VLLM_LOG_STATS_INTERVAL", "0.001")
    from vllm import LLM
    from vllm.config import ECTransferConfig

    kw: dict[str, Any] = {"enable_prefix_caching": False, "disable_log_stats": not log_stats}
    if role is not None:
        kw["ec_transfer_config"] = ECTransferConfig(
            ec_connector="ECStoreConnector", ec_role=role, ec_connector_module_path="ecstore.connector",
            ec_connector_extra_config=json.loads(extra))
    kw.update(overrides)
    llm = LLM(**tiny_model.engine_kwargs(model_dir, single_process=single_process, **kw))
    # After LLM(): creating the engine (re)applies vLLM's logging config,
    # which replaces the handlers of the "vllm" logger.
    capture = MetricsCapture()
    logging.getLogger("vllm").addHandler(capture)
    return llm, capture


def greedy_params(max_tokens: int) -> Any:
    """Greedy ``SamplingParams`` of a fixed length."""
    from vllm import SamplingParams

    return SamplingParams(**tiny_model.greedy_sampling_kwargs(max_tokens))


def image_prompt(seed: int, uuid: str | None = None) -> dict[str, Any]:
    """The prompt of image ``seed`` (with ``multi_modal_uuids`` if ``uuid``)."""
    prompt: dict[str, Any] = {"prompt": tiny_model.prompt(),
                              "multi_modal_data": {"image": tiny_model.make_image(seed)}}
    if uuid is not None:
        prompt["multi_modal_uuids"] = {"image": [uuid]}
    return prompt


def record_mm_embeds(model: Any, sink: list[Any], summary: Callable[[Any], Any]) -> bool:
    """Wrap ``model.embed_input_ids`` to append ``summary(embedding)`` to
    ``sink`` for every multimodal embedding it receives (what reaches the
    language model, computed or loaded by the connector). Returns True (for
    ``LLM.apply_model``; runs where the model is: this process)."""
    inner = model.embed_input_ids

    def embed_input_ids(input_ids: Any, multimodal_embeddings: Any = None, **kw: Any) -> Any:
        for emb in multimodal_embeddings or ():
            sink.append(summary(emb))
        return inner(input_ids, multimodal_embeddings, **kw)

    model.embed_input_ids = embed_input_ids
    return True


def count_and_record(model: Any, encoded: list[int], sink: list[Any]) -> bool:
    """Count the items the model's encoders run for into ``encoded[0]`` (its
    ``embed_multimodal`` is wrapped) and record what reaches its language model
    into ``sink`` (:func:`record_mm_embeds` with :func:`sha256_summary`). For
    ``llm.apply_model`` in a single-process engine (the worker is this process)."""
    embed_multimodal = model.embed_multimodal

    def counting_embed_multimodal(*args: Any, **kwargs: Any) -> Any:
        out = embed_multimodal(*args, **kwargs)
        encoded[0] += len(out) if out is not None else 0
        return out

    model.embed_multimodal = counting_embed_multimodal
    return record_mm_embeds(model, sink, sha256_summary)


def as_floats(t: Any) -> list[list[float]]:
    """The embedding itself, as nested lists of floats."""
    return t.detach().float().cpu().tolist()


def xxh3_summary(t: Any) -> dict[str, Any]:
    """Shape, dtype, xxh3-64 of the bytes (at the embedding's own dtype) and float64 sum."""
    import torch
    import xxhash

    c = t.detach().to("cpu").contiguous()
    return {"shape": list(c.shape), "dtype": str(c.dtype).removeprefix("torch."),
            "xxh3": xxhash.xxh3_64_intdigest(c.view(torch.uint8).numpy().tobytes()),
            "sum": float(c.double().sum())}


def sha256_summary(t: Any) -> list[Any]:
    """[float64 sum, float64 sum of abs, sha256 hex of the float32 bytes]."""
    import torch

    f = t.detach().to("cpu", torch.float32).contiguous()
    return [float(f.double().sum()), float(f.double().abs().sum()), hashlib.sha256(f.numpy().tobytes()).hexdigest()]
