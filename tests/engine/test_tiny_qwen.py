"""The tiny Qwen builders (ecstore.testing.tiny_qwen): cached builds, the
tokenizer's special tokens, the prompts' placeholders, the inputs.

The builds are the session fixtures' (.cache/tiny_<name>); nothing here runs
an engine (tests/engine/test_modalities_engine.py does).
"""

from __future__ import annotations

import json

import pytest

from ecstore.testing import tiny_qwen
from ecstore.testing.tiny_spec import MARKER_NAME


@pytest.fixture(params=["qwen2_5_vl", "qwen3_vl", "qwen2_audio", "qwen2_5_omni"])
def built(request):
    return request.param, request.getfixturevalue(f"tiny_{request.param}_dir")


def test_a_finished_build_is_reused(built):
    name, d = built
    marker = json.loads((d / MARKER_NAME).read_text())
    assert marker["hash"] == tiny_qwen.qwen_spec_hash(name) and marker["model"] == name
    assert tiny_qwen.build_tiny_qwen(name, d) == d
    assert json.loads((d / MARKER_NAME).read_text()) == marker  # not rebuilt
    assert all((d / f).is_file() for f in marker["files"])
    assert sum((d / f).stat().st_size for f in marker["files"]) < 8 << 20


def test_a_build_elsewhere_gives_the_same_bytes(tiny_qwen2_5_omni_dir, tmp_path):
    """Deterministic (the model with the most parts; one rebuild keeps the suite fast)."""
    again = tiny_qwen.build_tiny_qwen("qwen2_5_omni", tmp_path / "omni")
    for f in ("model.safetensors", "tokenizer.json", "config.json", "processor_config.json"):
        assert (again / f).read_bytes() == (tiny_qwen2_5_omni_dir / f).read_bytes(), f


def test_placeholders_are_single_special_tokens_of_the_tokenizer(built):
    from transformers import AutoTokenizer

    name, d = built
    tok = AutoTokenizer.from_pretrained(str(d))
    modalities = list(tiny_qwen.PLACEHOLDERS[name])
    ids = tok(tiny_qwen.prompt(name, modalities))["input_ids"]
    config = json.loads((d / "config.json").read_text())
    config = config.get("thinker_config", config)
    for modality in modalities:
        token_id = config.get(f"{modality}_token_id", config.get(f"{modality}_token_index"))
        assert ids.count(token_id) == 1, (modality, ids)
    for token in tiny_qwen.QWEN_SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(token) == tiny_qwen.QWEN_SPECIAL_TOKENS.index(token)


def test_a_wrong_modality_or_model_is_a_clear_error():
    with pytest.raises(ValueError, match="takes no audio"):
        tiny_qwen.prompt("qwen2_5_vl", ["audio"])
    with pytest.raises(ValueError, match="unknown tiny Qwen model"):
        tiny_qwen.qwen_spec("qwen9")


def test_inputs_are_deterministic_and_distinct():
    import numpy as np

    frames, meta = tiny_qwen.make_video(1)
    assert frames.shape == (4, 56, 56, 3) and frames.dtype == np.uint8 and meta["total_num_frames"] == 4
    assert np.array_equal(frames, tiny_qwen.make_video(1)[0]) and not np.array_equal(frames, tiny_qwen.make_video(2)[0])
    wave, rate = tiny_qwen.audio_item(1)
    assert rate == 16000 and wave.dtype == np.float32 and wave.shape == (16000,)
    assert not np.array_equal(wave, tiny_qwen.make_audio(2))
    clip = tiny_qwen.make_mp4(1)
    assert clip == tiny_qwen.make_mp4(1) and clip[4:8] == b"ftyp"
