"""A tiny Qwen2.5-VL whose vision tower dominates a video's prefill (the video demo).

Same recipe, tokenizer and language model as :mod:`ecstore.testing.tiny_qwen`'s
``qwen2_5_vl`` (hidden 128, 2 layers), with a heavier vision tower (hidden 256,
8 layers, 4 heads) and larger video frames (224 x 224 pixels: 64 merged tokens
per frame pair): encoding a video then takes most of the time to the
first token, as with Qwen2.5-VL-7B on long videos, so the saving of a cached
encoder output shows and grows with the frame count (tools/demo_video.py).
Random weights, float32, about 10 M parameters (41 MB); built in seconds and
cached on disk like the other tiny models (marker with a spec hash).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ecstore.testing.tiny_build import build_cached, saved_files
from ecstore.testing.tiny_qwen_build import _RECIPES, _set_top_ids, _tokenizer
from ecstore.testing.tiny_qwen_spec import QWEN_BUILDER_VERSION, qwen_spec, qwen_spec_hash

#: Bump when the heavy variant's recipe changes.
HEAVY_VERSION = 1
#: Side of the demo's video frames (pixels): 16 x 16 patches of 14, 64 merged tokens per frame pair.
FRAME_SIZE = 224


def heavy_spec() -> dict[str, Any]:
    """``qwen2_5_vl``'s spec with the heavier vision tower and video frames."""
    spec = qwen_spec("qwen2_5_vl")
    spec["vision"].update({"depth": 8, "hidden_size": 256, "intermediate_size": 1024, "num_heads": 4,
                           "fullatt_block_indexes": [3, 7], "window_size": 112})
    spec["text"]["max_position_embeddings"] = 8192  # 128 frames: 4096 visual tokens plus the text
    spec["video_pixels"] = {"min_pixels": 56 * 56, "max_pixels": FRAME_SIZE * FRAME_SIZE * 2}
    return spec


def _build_into(tmp: Path, seed: int) -> list[str]:
    import torch

    tokenizer = _tokenizer("qwen2_5_vl", seed)
    recipe = _RECIPES["qwen2_5_vl"](heavy_spec(), tokenizer)
    _set_top_ids(recipe.config)
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = recipe.model_cls(recipe.config)
    finally:
        torch.random.set_rng_state(rng_state)
    model.to(torch.float32).eval().save_pretrained(str(tmp), safe_serialization=True)
    recipe.processor.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    return saved_files(tmp)


def build_tiny_qwen2_5_vl_heavy(out_dir: str | os.PathLike[str], *, seed: int = 0, force: bool = False) -> Path:
    """Build (or reuse) the heavy tiny Qwen2.5-VL in ``out_dir``; its absolute
    path. Serve it with ``tiny_qwen.engine_kwargs("qwen2_5_vl", path)`` and
    prompts/videos of ``tiny_qwen`` (``make_video(seed, n, FRAME_SIZE)``)."""
    payload = {"heavy": HEAVY_VERSION, "builder": QWEN_BUILDER_VERSION, "spec": heavy_spec(),
               "base": qwen_spec_hash("qwen2_5_vl", seed=seed)}
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    marker = {"builder": QWEN_BUILDER_VERSION, "model": "qwen2_5_vl_heavy", "seed": seed, "spec": heavy_spec()}
    return build_cached(out_dir, digest=digest, build_into=lambda tmp: _build_into(tmp, seed),
                        marker=marker, force=force)
