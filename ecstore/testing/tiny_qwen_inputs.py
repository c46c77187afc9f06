"""Inputs and engine settings for the tiny Qwen models: prompts with the right
placeholders, images, video frames (numpy + metadata), an mp4 clip, audio
waveforms, and ``vllm.LLM`` arguments.

Re-exported by :mod:`ecstore.testing.tiny_qwen`; nothing here builds or
loads a model. Deterministic: the same seed gives the same bytes.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

from ecstore.testing.tiny_inputs import make_image
from ecstore.testing.tiny_qwen_build import PLACEHOLDERS

#: Sampling rate the Whisper-style feature extractors of Qwen2-Audio and Omni expect (Hz).
AUDIO_SAMPLE_RATE = 16000
#: Frame rate of :func:`make_video` clips and their metadata (frames per second).
VIDEO_FPS = 2.0

_QUESTION = {"image": "What is in the image?", "video": "Describe the video.", "audio": "What is said in the audio?"}


def prompt(model: str, modalities: tuple[str, ...] | list[str] = ("image",), question: str | None = None) -> str:
    """The text prompt for ``LLM.generate``: one placeholder per entry of
    ``modalities`` (in order, e.g. ``("image", "audio")``), then ``question``,
    in the Qwen chat format. vLLM expands each placeholder to the item's
    number of tokens itself."""
    ph = PLACEHOLDERS[model]
    try:
        media = "".join(ph[m] for m in modalities)
    except KeyError as e:
        raise ValueError(f"{model} takes no {e.args[0]} input (it takes {', '.join(ph)})") from None
    q = question if question is not None else _QUESTION[modalities[0]] if modalities else "Hello."
    return f"<|im_start|>user\n{media}{q}<|im_end|>\n<|im_start|>assistant\n"


def make_frames(seed: int, num_frames: int = 4, size: int = 56) -> Any:
    """``num_frames`` distinct RGB frames, a uint8 array ``[T, size, size, 3]``
    (frame ``i`` is :func:`make_image` of ``seed * 1000 + i``)."""
    import numpy as np

    return np.stack([np.asarray(make_image(seed * 1000 + i, size)) for i in range(num_frames)])


def video_metadata(num_frames: int, fps: float = VIDEO_FPS) -> dict[str, Any]:
    """The metadata vLLM's Qwen video path takes with already-sampled frames
    (every frame used; ``do_sample_frames`` off)."""
    return {"fps": fps, "duration": num_frames / fps, "total_num_frames": num_frames,
            "frames_indices": list(range(num_frames)), "video_backend": "opencv", "do_sample_frames": False}


def make_video(seed: int, num_frames: int = 4, size: int = 56) -> tuple[Any, dict[str, Any]]:
    """A video item for ``multi_modal_data={"video": ...}``: (frames, metadata)."""
    return make_frames(seed, num_frames, size), video_metadata(num_frames)


def make_mp4(seed: int, num_frames: int = 8, size: int = 56, fps: float = VIDEO_FPS) -> bytes:
    """An mp4 clip (MPEG-4 part 2, OpenCV's bundled FFmpeg) of
    :func:`make_frames`; decode-side vLLM uses its OpenCV video backend."""
    import tempfile

    import cv2

    frames = make_frames(seed, num_frames, size)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "clip.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter.fourcc(*"mp4v"), fps, (size, size))
        if not writer.isOpened():
            raise RuntimeError("OpenCV cannot write mp4 here (no FFmpeg in this cv2 build)")
        for f in frames:
            writer.write(cv2.cvtColor(f, cv2.COLOR_RGB2BGR))
        writer.release()
        return Path(path).read_bytes()


def mp4_data_url(clip: bytes) -> str:
    """``clip`` as a ``data:video/mp4;base64,...`` URL (a ``video_url`` chat part)."""
    return "data:video/mp4;base64," + base64.b64encode(clip).decode()


def make_audio(seed: int, seconds: float = 1.0) -> Any:
    """A deterministic float32 mono waveform at :data:`AUDIO_SAMPLE_RATE`
    (a few seed-dependent tones plus noise), for ``{"audio": (wave, rate)}``."""
    import numpy as np

    rng = np.random.default_rng(10_000 + seed)
    t = np.arange(int(seconds * AUDIO_SAMPLE_RATE), dtype=np.float64) / AUDIO_SAMPLE_RATE
    freqs = rng.uniform(100, 3000, size=3)
    wave = sum(np.sin(2 * np.pi * f * t) for f in freqs) / 3 + 0.05 * rng.standard_normal(t.shape)
    return (0.5 * wave).astype(np.float32)


def audio_item(seed: int, seconds: float = 1.0) -> tuple[Any, int]:
    """An audio item for ``multi_modal_data={"audio": ...}``: (waveform, rate)."""
    return make_audio(seed, seconds), AUDIO_SAMPLE_RATE


_LIMITS = {
    "qwen2_5_vl": {"image": 2, "video": 1},
    "qwen3_vl": {"image": 2, "video": 1},
    "qwen2_audio": {"audio": 1},
    "qwen2_5_omni": {"image": 1, "video": 1, "audio": 1},
}


def engine_kwargs(model: str, model_dir: str | os.PathLike[str], *, single_process: bool = True,
                  **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(**kw)`` serving tiny ``model`` from
    ``model_dir`` on these CPUs (float32, eager, small KV cache, a few items
    per prompt). ``single_process`` as in
    :func:`ecstore.testing.tiny_inputs.engine_kwargs` (pair it with
    ``setup_single_process_env()``); ``overrides`` win."""
    kw: dict[str, Any] = {
        "model": str(Path(model_dir).expanduser().resolve()),
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 2048,
        "max_num_batched_tokens": 2048,
        "kv_cache_memory_bytes": 64 << 20,
        "limit_mm_per_prompt": dict(_LIMITS[model]),
        "seed": 0,
    }
    if single_process:
        kw["distributed_executor_backend"] = "uni"
    kw.update(overrides)
    return kw
