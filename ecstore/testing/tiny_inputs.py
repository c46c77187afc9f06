"""Inputs and engine settings for the tiny BLIP-2: images, prompt, vLLM arguments.

Re-exported by :mod:`ecstore.testing.tiny_model`; nothing here builds or loads
the model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def make_image(seed: int, size: int = 224) -> Any:
    """A distinct, deterministic RGB PIL image for ``seed`` (``size`` x ``size``).

    A coarse random colour grid (different for every seed) plus a seed-dependent
    gradient: different seeds give different pixels, hence different vLLM mm_hashes.
    """
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    cells = int(rng.integers(4, 9))
    grid = rng.integers(0, 256, size=(cells, cells, 3), dtype=np.uint8)
    reps = -(-size // cells)
    img = np.kron(grid, np.ones((reps, reps, 1), dtype=np.uint8))[:size, :size]
    yy, xx = np.mgrid[0:size, 0:size]
    angle = (seed % 360) * np.pi / 180.0
    grad = ((np.cos(angle) * xx + np.sin(angle) * yy) % 64).astype(np.int16)
    img = (img.astype(np.int16) + grad[..., None]) % 256
    return Image.fromarray(img.astype(np.uint8)).convert("RGB")


def prompt(question: str = "What is in the image?") -> str:
    """The text prompt for ``LLM.generate`` (vLLM inserts the image tokens itself)."""
    return f"Question: {question} Answer:"


def setup_single_process_env() -> None:
    """Set ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core in this process).

    Must run before the engine is created (safest: before ``import vllm``). Does not
    override a value the caller already set.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def engine_kwargs(
    model_dir: str | os.PathLike[str], *, single_process: bool = True, **overrides: Any
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(**kw)`` that start fast on these CPUs.

    ``single_process=True`` (default) adds ``distributed_executor_backend="uni"``
    (worker in the engine-core process); pair it with ``setup_single_process_env()`` so
    the engine core also runs in the caller's process (~3 s start, < 1 GiB RSS).
    ``overrides`` win over the defaults, e.g. ``ec_transfer_config=...``,
    ``enable_prefix_caching=False``.
    Remember the ``if __name__ == "__main__":`` guard in scripts that start an engine.
    """
    kw: dict[str, Any] = {
        "model": str(Path(model_dir).expanduser().resolve()),
        "dtype": "float32",  # the CPU here is AVX2-only: no bf16
        "enforce_eager": True,
        "max_model_len": 1024,
        "kv_cache_memory_bytes": 64 << 20,
        "limit_mm_per_prompt": {"image": 1},
        "seed": 0,
    }
    if single_process:
        kw["distributed_executor_backend"] = "uni"
    kw.update(overrides)
    return kw


def server_args(model_dir: str | os.PathLike[str]) -> list[str]:
    """CLI flags for ``python -m vllm.entrypoints.openai.api_server`` (same settings).

    Add ``--port``; set ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in the server's env for
    single-process mode.
    """
    return [
        "--model",
        str(Path(model_dir).expanduser().resolve()),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "1024",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--distributed-executor-backend",
        "uni",
        "--limit-mm-per-prompt",
        json.dumps({"image": 1}),
    ]


def greedy_sampling_kwargs(max_tokens: int = 8) -> dict[str, Any]:
    """``SamplingParams(**kw)``: greedy and a fixed length (random weights emit EOS)."""
    return {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
