#!/usr/bin/env python3
"""Tiny random-weight Qwen multimodal models that the real vLLM (CPU build) serves offline.

Four models, each built in seconds into a directory of a few MB (no download,
cached on disk like :mod:`ecstore.testing.tiny_model`'s BLIP-2: a marker holds
a spec hash, concurrent builds are locked out):

============  ====================================  =====================  ==================
name          architecture                          inputs                 encoder output
============  ====================================  =====================  ==================
qwen2_5_vl    Qwen2_5_VLForConditionalGeneration    image, video (frames,  [tokens, 128]
                                                    mp4)
qwen3_vl      Qwen3VLForConditionalGeneration       image, video           [tokens, 384]
              (deepstack: 2 extra levels)                                  (wider than the LM)
qwen2_audio   Qwen2AudioForConditionalGeneration    audio                  [frames, 128]
qwen2_5_omni  Qwen2_5OmniModel (the thinker)        image, video, audio,   [tokens, 128]
                                                    video with its audio
============  ====================================  =====================  ==================

Module use::

    from ecstore.testing import tiny_inputs, tiny_qwen
    d = tiny_qwen.build_tiny_qwen("qwen2_5_vl", ".cache/tiny_qwen2_5_vl")
    tiny_inputs.setup_single_process_env()
    from vllm import LLM, SamplingParams
    llm = LLM(**tiny_qwen.engine_kwargs("qwen2_5_vl", d))
    llm.generate({"prompt": tiny_qwen.prompt("qwen2_5_vl", ["image", "video"]),
                  "multi_modal_data": {"image": tiny_qwen.make_image(1, 112),
                                       "video": tiny_qwen.make_video(2)}},
                 SamplingParams(**tiny_inputs.greedy_sampling_kwargs()))

CLI::

    python -m ecstore.testing.tiny_qwen NAME OUT_DIR [--seed N] [--force]

Facts worth knowing:

* Every language model: hidden 128, 4 heads of 32 (the CPU attention backend
  needs head size >= 32), 2 layers, mrope sections [4, 6, 6]; one BPE
  tokenizer (vocab ~512) holding every special token of the four models.
* Prompts carry one placeholder per item (``<|vision_start|><|image_pad|>
  <|vision_end|>`` for Qwen-VL, ``<|audio_bos|><|AUDIO|><|audio_eos|>`` for
  audio, ``<|vision_bos|><|IMAGE|><|vision_eos|>`` for Omni); vLLM expands it.
* Images are resized to at most 16 tokens, video frames to at most 4 per
  frame pair; audio is a float32 waveform at 16 kHz.
* Videos given as frames need metadata (:func:`make_video`); an mp4 goes
  through ``LLM.chat`` as a ``video_url`` data URL and is decoded by vLLM's
  OpenCV backend, sampled by fps (``media_io_kwargs={"video": {"fps": N}}``).
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
