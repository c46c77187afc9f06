"""Building the tiny Qwen checkpoints: tokenizer, config, weights, processor.

:func:`build_tiny_qwen` is the entry point (re-exported by
:mod:`ecstore.testing.tiny_qwen`); caching, locking and the marker come from
:func:`ecstore.testing.tiny_build.build_cached`. Weights are random (fixed
seed, float32); the caller's torch RNG state is restored afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ecstore.testing.tiny_build import build_cached, saved_files, train_tokenizer
from ecstore.testing.tiny_qwen_spec import (
    AUDIO,
    AUDIO_BOS,
    AUDIO_EOS,
    ENDOFTEXT,
    IM_END,
    IM_START,
    IMAGE_PAD,
    OMNI_IMAGE,
    OMNI_VIDEO,
    QWEN_BUILDER_VERSION,
    QWEN_CHAT_TEMPLATE,
    QWEN_SPECIAL_TOKENS,
    QWEN_TARGET_VOCAB,
    VIDEO_PAD,
    VISION_BOS,
    VISION_END,
    VISION_EOS,
    VISION_START,
    qwen_corpus,
    qwen_spec,
    qwen_spec_hash,
)

TOKEN_ID = {t: i for i, t in enumerate(QWEN_SPECIAL_TOKENS)}

# What each model calls its placeholders (prompt text and chat template).
PLACEHOLDERS: dict[str, dict[str, str]] = {
    "qwen2_5_vl": {"image": VISION_START + IMAGE_PAD + VISION_END, "video": VISION_START + VIDEO_PAD + VISION_END},
    "qwen3_vl": {"image": VISION_START + IMAGE_PAD + VISION_END, "video": VISION_START + VIDEO_PAD + VISION_END},
    "qwen2_audio": {"audio": AUDIO_BOS + AUDIO + AUDIO_EOS},
    "qwen2_5_omni": {"image": VISION_BOS + OMNI_IMAGE + VISION_EOS, "video": VISION_BOS + OMNI_VIDEO + VISION_EOS,
                     "audio": AUDIO_BOS + AUDIO + AUDIO_EOS},
}

_EXTRA_TOKENS: dict[str, dict[str, str]] = {
    "qwen2_5_vl": {"image_token": IMAGE_PAD, "video_token": VIDEO_PAD, "vision_start_token": VISION_START,
                   "vision_end_token": VISION_END},
    "qwen2_audio": {"audio_token": AUDIO, "audio_bos_token": AUDIO_BOS, "audio_eos_token": AUDIO_EOS},
    "qwen2_5_omni": {"image_token": OMNI_IMAGE, "video_token": OMNI_VIDEO, "audio_token": AUDIO,
                     "vision_bos_token": VISION_BOS, "vision_eos_token": VISION_EOS,
                     "audio_bos_token": AUDIO_BOS, "audio_eos_token": AUDIO_EOS},
}
_EXTRA_TOKENS["qwen3_vl"] = _EXTRA_TOKENS["qwen2_5_vl"]


@dataclass
class _Recipe:
    """What one model's build writes: ``config`` (saved as config.json),
    ``model_cls(model_config)`` random weights (their state-dict names passed
    through ``rename`` to the checkpoint layout vLLM loads, when set; else
    written by ``save_pretrained``), ``processor``."""

    config: Any
    model_cls: Any
    processor: Any
    model_config: Any = None
    rename: Callable[[str], str] | None = None


def _tokenizer(name: str, seed: int) -> Any:
    ph = PLACEHOLDERS[name]
    template = (QWEN_CHAT_TEMPLATE.replace("{{ image_placeholder }}", "{{{{ '{}' }}}}".format(ph.get("image", "")))
                .replace("{{ video_placeholder }}", "{{{{ '{}' }}}}".format(ph.get("video", "")))
                .replace("{{ audio_placeholder }}", "{{{{ '{}' }}}}".format(ph.get("audio", ""))))
    return train_tokenizer(special_tokens=QWEN_SPECIAL_TOKENS, corpus=qwen_corpus(seed), vocab_size=QWEN_TARGET_VOCAB,
                           pad_token=ENDOFTEXT, eos_token=IM_END, bos_token=None, unk_token=None,
                           extra_special_tokens=_EXTRA_TOKENS[name], chat_template=template)


def _padded(vocab_size: int) -> int:
    return ((vocab_size + 63) // 64) * 64


def _text_config(spec: dict[str, Any], vocab_size: int, *, mrope: bool = True) -> dict[str, Any]:
    t = dict(spec["text"])
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 1000000.0}
    section = t.pop("mrope_section")
    if mrope:
        rope["mrope_section"] = section
    return {**t, "vocab_size": _padded(vocab_size), "hidden_act": "silu", "tie_word_embeddings": False,
            "rope_parameters": rope,
            "initializer_range": spec["initializer_range"], "bos_token_id": TOKEN_ID[ENDOFTEXT],
            "eos_token_id": TOKEN_ID[IM_END], "pad_token_id": TOKEN_ID[ENDOFTEXT], "dtype": "float32"}


def _set_top_ids(config: Any) -> None:
    config.pad_token_id = TOKEN_ID[ENDOFTEXT]
    config.bos_token_id = TOKEN_ID[ENDOFTEXT]
    config.eos_token_id = TOKEN_ID[IM_END]


def _pixels(spec: dict[str, Any], key: str) -> dict[str, Any]:
    p = spec[key]
    return {"size": {"shortest_edge": p["min_pixels"], "longest_edge": p["max_pixels"]}}


def _vision_config(spec: dict[str, Any], text: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {**spec["vision"], "out_hidden_size": text["hidden_size"], **extra,
            "initializer_range": spec["initializer_range"]}


#: The vision token ids of the Qwen-VL configs (Qwen2.5-VL, Qwen3-VL).
_VL_TOKEN_IDS: dict[str, Any] = {"image_token_id": TOKEN_ID[IMAGE_PAD], "video_token_id": TOKEN_ID[VIDEO_PAD],
                 "vision_start_token_id": TOKEN_ID[VISION_START], "vision_end_token_id": TOKEN_ID[VISION_END]}


def _vision_processors(spec: dict[str, Any], video_cls: Any) -> dict[str, Any]:
    """The image and video processors of a Qwen vision tower, sized by ``spec``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    v = spec["vision"]
    grid = {"patch_size": v["patch_size"], "temporal_patch_size": v["temporal_patch_size"],
            "merge_size": v["spatial_merge_size"]}
    return {"image_processor": Qwen2VLImageProcessorPil(**_pixels(spec, "image_pixels"), **grid),
            "video_processor": video_cls(**_pixels(spec, "video_pixels"), **grid)}


def _qwen2_5_vl(spec: dict[str, Any], tokenizer: Any) -> _Recipe:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    text = _text_config(spec, len(tokenizer))
    config = Qwen2_5_VLConfig(text_config=text, vision_config=_vision_config(spec, text, hidden_act="silu"),
                              **_VL_TOKEN_IDS, tie_word_embeddings=False, dtype="float32")
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    processor = Qwen2_5_VLProcessor(**_vision_processors(spec, Qwen2VLVideoProcessor), tokenizer=tokenizer,
                                    chat_template=tokenizer.chat_template)
    return _Recipe(config, Qwen2_5_VLForConditionalGeneration, processor)


def _qwen3_vl(spec: dict[str, Any], tokenizer: Any) -> _Recipe:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    text = _text_config(spec, len(tokenizer))
    rope = text.pop("rope_parameters")
    text["rope_parameters"] = {**rope, "mrope_interleaved": True}
    config = Qwen3VLConfig(text_config=text, vision_config=_vision_config(spec, text), **_VL_TOKEN_IDS,
                           tie_word_embeddings=False, dtype="float32")
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    processor = Qwen3VLProcessor(**_vision_processors(spec, Qwen3VLVideoProcessor), tokenizer=tokenizer,
                                 chat_template=tokenizer.chat_template)
    return _Recipe(config, Qwen3VLForConditionalGeneration, processor)


def _audio_config(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec["audio"], "initializer_range": spec["initializer_range"]}


def _feature_extractor(spec: dict[str, Any]) -> Any:
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=spec["audio"]["num_mel_bins"], sampling_rate=16000)


def _qwen2_audio(spec: dict[str, Any], tokenizer: Any) -> _Recipe:
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor

    text = _text_config(spec, len(tokenizer), mrope=False)
    config = Qwen2AudioConfig(audio_config={"model_type": "qwen2_audio_encoder", **_audio_config(spec)},
                              text_config={"model_type": "qwen2", **text}, audio_token_index=TOKEN_ID[AUDIO],
                              dtype="float32")
    config.architectures = ["Qwen2AudioForConditionalGeneration"]
    processor = Qwen2AudioProcessor(feature_extractor=_feature_extractor(spec), tokenizer=tokenizer,
                                    chat_template=tokenizer.chat_template)
    # transformers 5.19 saves this model's LM as language_model.model.model.*;
    # vLLM loads the original layout (audio_tower.*, language_model.model.*).
    return _Recipe(config, Qwen2AudioForConditionalGeneration, processor, rename=_qwen2_audio_name)


def _qwen2_audio_name(key: str) -> str:
    if key.startswith("lm_head."):
        return "language_model." + key
    if key.startswith("model.language_model."):
        return "language_model.model." + key.removeprefix("model.language_model.")
    return key.removeprefix("model.")


def _qwen2_5_omni(spec: dict[str, Any], tokenizer: Any) -> _Recipe:
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniProcessor, Qwen2_5OmniThinkerConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniThinkerForConditionalGeneration
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    text = _text_config(spec, len(tokenizer))
    thinker = Qwen2_5OmniThinkerConfig(
        audio_config={**_audio_config(spec), "output_dim": text["hidden_size"], "n_window": 100},
        vision_config=_vision_config(spec, text, hidden_act="silu"),
        text_config=text, audio_token_index=TOKEN_ID[AUDIO], image_token_index=TOKEN_ID[OMNI_IMAGE],
        video_token_index=TOKEN_ID[OMNI_VIDEO], audio_start_token_id=TOKEN_ID[AUDIO_BOS],
        audio_end_token_id=TOKEN_ID[AUDIO_EOS], user_token_id=TOKEN_ID[IM_START],
        initializer_range=spec["initializer_range"], dtype="float32")
    thinker.vision_start_token_id = TOKEN_ID[VISION_BOS]
    thinker.vision_end_token_id = TOKEN_ID[VISION_EOS]
    _set_top_ids(thinker)
    # Talker and token2wav are configured (vLLM reads the whole config) but get no weights.
    config = Qwen2_5OmniConfig(thinker_config=thinker.to_dict(), enable_audio_output=False, dtype="float32")
    config.architectures = ["Qwen2_5OmniModel"]
    processor = Qwen2_5OmniProcessor(**_vision_processors(spec, Qwen2VLVideoProcessor),
                                     feature_extractor=_feature_extractor(spec), tokenizer=tokenizer,
                                     chat_template=tokenizer.chat_template)
    return _Recipe(config, Qwen2_5OmniThinkerForConditionalGeneration, processor, model_config=thinker,
                   rename=lambda key: "thinker." + key)


_RECIPES: dict[str, Callable[[dict[str, Any], Any], _Recipe]] = {
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "qwen2_audio": _qwen2_audio,
    "qwen2_5_omni": _qwen2_5_omni,
}


def _build_into(tmp: Path, name: str, seed: int) -> list[str]:
    import torch

    spec = qwen_spec(name)
    tokenizer = _tokenizer(name, seed)
    recipe = _RECIPES[name](spec, tokenizer)
    _set_top_ids(recipe.config)
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = recipe.model_cls(recipe.model_config or recipe.config)
    finally:
        torch.random.set_rng_state(rng_state)
    model = model.to(torch.float32).eval()
    if recipe.rename is not None:
        from safetensors.torch import save_file

        state = {recipe.rename(k): v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        recipe.config.save_pretrained(str(tmp))
    else:
        model.save_pretrained(str(tmp), safe_serialization=True)
    recipe.processor.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    return saved_files(tmp)


def build_tiny_qwen(name: str, out_dir: str | os.PathLike[str], *, seed: int = 0, force: bool = False) -> Path:
    """Build (or reuse) tiny random model ``name`` (one of
    :data:`~ecstore.testing.tiny_qwen_spec.QWEN_MODELS`) in ``out_dir``; return
    its absolute path. Deterministic given (name, seed); a directory whose
    marker holds the same spec hash is reused; safe from several processes."""
    digest = qwen_spec_hash(name, seed=seed)  # raises ValueError on an unknown name
    marker = {"builder": QWEN_BUILDER_VERSION, "model": name, "seed": seed, "spec": qwen_spec(name)}
    return build_cached(out_dir, digest=digest, build_into=lambda tmp: _build_into(tmp, name, seed),
                        marker=marker, force=force)
