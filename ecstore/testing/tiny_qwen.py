#!/usr/bin/env python3
"""Tiny random-weight Qwen multimodal models that the real vLLM (CPU build) serves offline.

Four models (``qwen2_5_vl``, ``qwen3_vl``, ``qwen2_audio``, ``qwen2_5_omni``),
each built in seconds into a few MB, no download, cached on disk like
:mod:`ecstore.testing.tiny_model` (spec-hash marker, concurrent builds locked
out). Architectures, inputs, encoder output shapes, prompts and media helpers:
docs/testing.md#tiny-models; usage and CLI: docs/testing.md#using-a-tiny-model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ecstore.testing.tiny_build import _read_marker
from ecstore.testing.tiny_inputs import greedy_sampling_kwargs, make_image, setup_single_process_env
from ecstore.testing.tiny_qwen_build import PLACEHOLDERS, build_tiny_qwen
from ecstore.testing.tiny_qwen_inputs import (
    AUDIO_SAMPLE_RATE,
    VIDEO_FPS,
    audio_item,
    engine_kwargs,
    make_audio,
    make_frames,
    make_mp4,
    make_video,
    mp4_data_url,
    prompt,
    video_metadata,
)
from ecstore.testing.tiny_qwen_spec import QWEN_MODELS, QWEN_SPECIAL_TOKENS, qwen_spec, qwen_spec_hash

__all__ = [
    "AUDIO_SAMPLE_RATE",
    "PLACEHOLDERS",
    "QWEN_MODELS",
    "QWEN_SPECIAL_TOKENS",
    "VIDEO_FPS",
    "audio_item",
    "build_tiny_qwen",
    "engine_kwargs",
    "greedy_sampling_kwargs",
    "make_audio",
    "make_frames",
    "make_image",
    "make_mp4",
    "make_video",
    "mp4_data_url",
    "prompt",
    "qwen_spec",
    "qwen_spec_hash",
    "setup_single_process_env",
    "video_metadata",
]


def main(argv: list[str] | None = None) -> int:
    """``python -m ecstore.testing.tiny_qwen NAME OUT_DIR [--seed N] [--force]``: build, print a JSON summary."""
    p = argparse.ArgumentParser(description="Build a tiny random Qwen multimodal model for vLLM tests.")
    p.add_argument("name", choices=QWEN_MODELS)
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    out = build_tiny_qwen(args.name, args.out_dir, seed=args.seed, force=args.force)
    marker = _read_marker(out) or {}
    print(json.dumps({"path": str(out), "model": args.name, "hash": marker.get("hash"),
                      "seconds": round(time.perf_counter() - t0, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
