"""The encoder identity of a real vLLM config (ecstore.connector.vllm_identity),
per-process identifiers and client uuids. Real VllmConfig objects for the tiny
BLIP-2 (no engine)."""

from __future__ import annotations

import copy

import pytest
from helpers import vllm_objects as vo
from hypothesis import given, settings
from hypothesis import strategies as st

from ecstore.connector.vllm_identity import (
    ENCODER_SETTINGS,
    ROUNDING_ONLY_SETTINGS,
    encoder_identity,
    is_content_hash,
    is_per_process,
    kept_out,
    per_process_naming,
    per_process_warning,
)

pytestmark = pytest.mark.vllm


def ns(cfg, pinned=None) -> str:
    return encoder_identity(cfg, "float32", pinned).namespace


def test_roles_and_lm_only_settings_share_the_identity(tiny_model_dir):
    """Producer and consumer of one deployment must agree; so must settings
    that only concern the language model or the caches."""
    producer = ns(vo.vllm_config(tiny_model_dir, "ec_producer", {}))
    assert ns(vo.vllm_config(tiny_model_dir, "ec_consumer", {})) == producer
    assert ns(vo.vllm_config(tiny_model_dir, "ec_both", {}, max_num_batched_tokens=64)) == producer
    assert ns(vo.vllm_config(tiny_model_dir, "ec_both", {}, mm_processor_cache_gb=0)) == producer


@pytest.mark.parametrize("path,value", [
    ("mm_processor_kwargs", {"do_normalize": False}),
    ("media_io_kwargs", {"image": {"mode": "L"}}),
    ("mm_encoder_attn_dtype", "fp8"),
    ("video_pruning_rate", 0.5),
    ("mm_hasher_algorithm", "sha256"),
])
def test_encoder_settings_change_the_identity(tiny_model_dir, path, value):
    cfg = vo.vllm_config(tiny_model_dir, "ec_both", {})
    changed = copy.deepcopy(cfg)
    mm = changed.model_config.multimodal_config
    setattr(mm, path, (not getattr(mm, path)) if value == "toggle" else value)
    assert ns(changed) != ns(cfg)
    assert f"model_config.multimodal_config.{path}" in {s.path for s in ENCODER_SETTINGS}


@pytest.mark.parametrize("path,value", [
    ("mm_encoder_tp_mode", "data"),
    ("mm_device_do_normalize", "toggle"),
    ("mm_encoder_attn_backend", "FLASH_ATTN"),
])
def test_rounding_only_settings_share_the_identity(tiny_model_dir, path, value):
    """An encoder instance started with these (EPD: E with --mm-encoder-tp-mode data,
    PD without) computes the same function another way: it shares entries."""
    cfg = vo.vllm_config(tiny_model_dir, "ec_both", {})
    changed = copy.deepcopy(cfg)
    mm = changed.model_config.multimodal_config
    setattr(mm, path, (not getattr(mm, path)) if value == "toggle" else value)
    assert getattr(mm, path) != getattr(cfg.model_config.multimodal_config, path)
    assert ns(changed) == ns(cfg)
    assert f"model_config.multimodal_config.{path}" in {s.path for s in ROUNDING_ONLY_SETTINGS}
    assert f"model_config.multimodal_config.{path}" not in {s.path for s in ENCODER_SETTINGS}


def test_hf_config_revision_and_lora_change_the_identity(tiny_model_dir):
    cfg = vo.vllm_config(tiny_model_dir, "ec_both", {})
    vision = copy.deepcopy(cfg)
    vision.model_config.hf_config.vision_config.layer_norm_eps = 1e-3
    rev = copy.deepcopy(cfg)
    rev.model_config.revision = "v2"
    lm_only = copy.deepcopy(cfg)
    lm_only.model_config.hf_config.text_config.max_position_embeddings = 4096  # text sub-config: ignored
    spaces = {ns(cfg), ns(vision), ns(rev)}
    assert len(spaces) == 3 and ns(lm_only) == ns(cfg)


def test_weights_fingerprint_and_pin(tiny_model_dir):
    cfg = vo.vllm_config(tiny_model_dir, "ec_both", {})
    ident = encoder_identity(cfg, "float32", None)
    assert ident.weights.method == "sampled" and ident.model == str(tiny_model_dir)
    pinned = encoder_identity(cfg, "float32", "ckpt-7")
    assert (pinned.weights.method, pinned.weights.value, pinned.revision) == ("pinned", "ckpt-7", None)
    assert pinned.namespace != ident.namespace and pinned.settings == ident.settings
    assert "processor_files" in ident.settings  # preprocessor_config.json etc. of the local dir


def test_per_process_naming_is_detected(tiny_model_dir):
    assert not per_process_naming(vo.vllm_config(tiny_model_dir, "ec_both", {}))
    cfg0 = vo.vllm_config(tiny_model_dir, "ec_both", {}, mm_processor_cache_gb=0)
    assert per_process_naming(cfg0)  # the helper's configs run with prefix caching off
    msg = per_process_warning(cfg0)
    assert "mm_processor_cache_gb=0" in msg and "--mm-processor-cache-gb" in msg


def test_identifier_kinds():
    h = "0f" * 32
    assert is_content_hash(h) and is_content_hash("ab" * 64) and is_content_hash(f"my-lora:{h}")
    for other in ["u", "550e8400-e29b-41d4-a716-446655440000", h[:-1], h.upper(), "renderer0-mm-1-image-0"]:
        assert not is_content_hash(other)
    assert is_per_process("renderer0-mm-12-image-0") and is_per_process("lora:renderer3-mm-1-video-2")
    assert not is_per_process(h)
    assert kept_out("renderer0-mm-1-image-0", share_client_uuids=True) == "per-process"
    assert kept_out("my-uuid", share_client_uuids=False) == "client-uuid"
    assert kept_out("my-uuid", share_client_uuids=True) is None
    assert kept_out(h, share_client_uuids=False) is None  # a hash-shaped uuid cannot be told apart


@settings(max_examples=300, deadline=None)
@given(identifier=st.one_of(
    st.text(max_size=70),
    st.text(alphabet="0123456789abcdefABCDEF\n:-", min_size=63, max_size=65),
    st.builds(lambda h, i: h[:i] + "\n" + h[i + 1:], st.just("0f" * 32), st.integers(0, 63))),
    share=st.booleans())
def test_kept_out_answers_as_its_two_patterns(identifier: str, share: bool) -> None:
    """The fast path for bare 64-digit hashes gives the patterns' answer for any string."""
    want = ("per-process" if is_per_process(identifier)
            else "client-uuid" if not share and not is_content_hash(identifier) else None)
    assert kept_out(identifier, share_client_uuids=share) == want
