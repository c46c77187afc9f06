"""Size specs, special tokens and chat template of the tiny Qwen models.

Data and cheap functions only (no transformers/torch import). One tokenizer
recipe serves all four models (Qwen2.5-VL, Qwen3-VL, Qwen2-Audio, the
Qwen2.5-Omni thinker): it holds every special token any of them names. Every
language model is 128 wide with 4 heads (head size 32: the CPU attention
backend needs >= 32); sizes are small enough that a build takes seconds and
the weights a few MB. See :mod:`ecstore.testing.tiny_qwen`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ecstore.testing.tiny_spec import _WORDS, _dist_version

# Bump when the build recipe changes in a way that changes the output files.
QWEN_BUILDER_VERSION = 1

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
AUDIO_BOS = "<|audio_bos|>"
AUDIO_EOS = "<|audio_eos|>"
AUDIO = "<|AUDIO|>"  # Qwen2-Audio and Omni audio placeholder
OMNI_IMAGE = "<|IMAGE|>"
OMNI_VIDEO = "<|VIDEO|>"
VISION_BOS = "<|vision_bos|>"  # Omni's names for vision start / end
VISION_EOS = "<|vision_eos|>"

QWEN_SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD,
                       AUDIO_BOS, AUDIO_EOS, AUDIO, OMNI_IMAGE, OMNI_VIDEO, VISION_BOS, VISION_EOS]  # ids 0..13
QWEN_TARGET_VOCAB = 512

#: The models this module builds (names used in directory names and specs).
QWEN_MODELS = ("qwen2_5_vl", "qwen3_vl", "qwen2_audio", "qwen2_5_omni")

_TEXT: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,  # head size 32
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    # mrope over head size 32: sections sum to 16 (t, h, w).
    "mrope_section": [4, 6, 6],
}

# Qwen2-VL style vision tower (Qwen2.5-VL, Omni): patch 14, 2x2 merge -> a
# token per 28x28 pixels. Images are resized into [min, max] pixels.
_VISION_25: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 56,
    "fullatt_block_indexes": [1],
    "tokens_per_second": 2,
}
_PIXELS_25 = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16}  # 4..16 tokens an image
_VIDEO_PIXELS_25 = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 4 * 2}  # per frame pair

_AUDIO: dict[str, Any] = {
    "num_mel_bins": 128,
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 128,
    "d_model": 64,
    "max_source_positions": 1500,
}

SPECS: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": {"text": _TEXT, "vision": _VISION_25, "image_pixels": _PIXELS_25,
                   "video_pixels": _VIDEO_PIXELS_25, "initializer_range": 0.2},
    "qwen3_vl": {
        "text": {**_TEXT, "head_dim": 32},
        # deepstack: one extra 128-wide output per listed layer -> 384-wide encoder output.
        "vision": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "patch_size": 16,
                   "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
                   "deepstack_visual_indexes": [0, 1]},
        "image_pixels": {"min_pixels": 64 * 64, "max_pixels": 32 * 32 * 16},
        "video_pixels": {"min_pixels": 64 * 64, "max_pixels": 32 * 32 * 4 * 2},
        "initializer_range": 0.2,
    },
    "qwen2_audio": {"text": _TEXT, "audio": _AUDIO, "initializer_range": 0.2},
    "qwen2_5_omni": {"text": _TEXT, "vision": _VISION_25, "audio": _AUDIO, "image_pixels": _PIXELS_25,
                     "video_pixels": _VIDEO_PIXELS_25, "initializer_range": 0.2},
}

# Qwen-style chat template: text parts verbatim, media parts as the model's placeholders.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') -%}{{ image_placeholder }}"
    "{%- elif part['type'] in ('video', 'video_url') -%}{{ video_placeholder }}"
    "{%- elif part['type'] in ('audio', 'audio_url', 'input_audio') -%}{{ audio_placeholder }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def qwen_corpus(seed: int) -> list[str]:
    """Fixed training text for the shared tokenizer (deterministic, no download)."""
    import random

    rng = random.Random(2000 + seed)
    lines = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))) for _ in range(400)]
    lines += ["user\nWhat is in the image?\nassistant\n", "Describe the video.", "What is said in the audio?"] * 30
    return lines


def qwen_spec(name: str) -> dict[str, Any]:
    """The size spec of model ``name`` (a deep copy; changing it changes nothing)."""
    if name not in SPECS:
        raise ValueError(f"unknown tiny Qwen model {name!r}; known: {', '.join(QWEN_MODELS)}")
    return json.loads(json.dumps(SPECS[name]))


def qwen_spec_hash(name: str, *, seed: int = 0) -> str:
    """Hash of everything that determines model ``name``'s files (stored in the marker)."""
    payload = {
        "builder": QWEN_BUILDER_VERSION,
        "model": name,
        "spec": qwen_spec(name),
        "tokens": QWEN_SPECIAL_TOKENS,
        "template": QWEN_CHAT_TEMPLATE,
        "seed": int(seed),
        "transformers": _dist_version("transformers"),
        "tokenizers": _dist_version("tokenizers"),
        "torch": _dist_version("torch"),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
