"""A tiny random-weight Whisper: the encoder-decoder audio model vLLM serves
without the EC connector's loads (its model runners skip the connector's
context for encoder-decoder models), for the tests that check ecstore stays
out of the way there. Built in seconds, no download, cached on disk like the
other tiny models (spec-hash marker, concurrent builds locked out).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ecstore.testing.tiny_build import build_cached, saved_files, train_tokenizer
from ecstore.testing.tiny_spec import _dist_version

BUILDER_VERSION = 1
#: Whisper's special tokens the processor and vLLM's prompt handling look up.
SPECIAL_TOKENS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|translate|>",
                  "<|notimestamps|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>"]
SPEC: dict[str, Any] = {"vocab_size": 320, "num_mel_bins": 80, "d_model": 64, "layers": 1, "heads": 2,
                        "ffn_dim": 64, "max_source_positions": 1500, "max_target_positions": 64}
EOS = "<|endoftext|>"  # also Whisper's pad, bos and unk
#: The decoder prompt a transcription starts from.
DECODER_PROMPT = "<|startoftranscript|>"


def _spec_hash(seed: int) -> str:
    """Hash of everything that determines the files (stored in the marker), as the other tiny models'."""
    payload = {"builder": BUILDER_VERSION, "model": "whisper", "spec": SPEC, "tokens": SPECIAL_TOKENS,
               "seed": int(seed), "transformers": _dist_version("transformers"),
               "tokenizers": _dist_version("tokenizers"), "torch": _dist_version("torch")}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _build_into(tmp: Path, seed: int) -> list[str]:
    import torch
    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )

    bpe = train_tokenizer(special_tokens=SPECIAL_TOKENS, corpus=["hello world the quick brown fox"] * 20,
                          vocab_size=300, pad_token=EOS, eos_token=EOS, bos_token=EOS, unk_token=None,
                          extra_special_tokens={}, chat_template="")
    bpe.backend_tokenizer.save(str(tmp / "tokenizer.json"))
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}  # train_tokenizer gives them ids 0.. in order
    config = WhisperConfig(
        vocab_size=SPEC["vocab_size"], num_mel_bins=SPEC["num_mel_bins"], d_model=SPEC["d_model"],
        encoder_layers=SPEC["layers"], decoder_layers=SPEC["layers"], encoder_attention_heads=SPEC["heads"],
        decoder_attention_heads=SPEC["heads"], encoder_ffn_dim=SPEC["ffn_dim"], decoder_ffn_dim=SPEC["ffn_dim"],
        max_source_positions=SPEC["max_source_positions"], max_target_positions=SPEC["max_target_positions"],
        pad_token_id=ids[EOS], bos_token_id=ids[EOS], eos_token_id=ids[EOS],
        decoder_start_token_id=ids["<|startoftranscript|>"])
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model: Any = WhisperForConditionalGeneration(config)
    finally:
        torch.random.set_rng_state(rng_state)
    model.to(torch.float32).eval().save_pretrained(str(tmp), safe_serialization=True)
    extractor = WhisperFeatureExtractor(feature_size=SPEC["num_mel_bins"])
    tokenizer = WhisperTokenizer(tokenizer_file=str(tmp / "tokenizer.json"), unk_token=EOS, bos_token=EOS,
                                 eos_token=EOS, pad_token=EOS)
    WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(str(tmp))
    return saved_files(tmp)


def build_tiny_whisper(out_dir: str | os.PathLike[str], *, seed: int = 0, force: bool = False) -> Path:
    """Build (or reuse) the tiny Whisper in ``out_dir``; return its absolute
    path. Deterministic given ``seed``; safe from several processes."""
    marker = {"builder": BUILDER_VERSION, "model": "whisper", "seed": seed, "spec": SPEC}
    return build_cached(out_dir, digest=_spec_hash(seed), build_into=lambda tmp: _build_into(tmp, seed),
                        marker=marker, force=force)


def engine_kwargs(model_dir: str | os.PathLike[str], **overrides: Any) -> dict[str, Any]:
    """``EngineArgs`` for the tiny Whisper on the CPU build (one process, eager)."""
    kw: dict[str, Any] = dict(model=str(model_dir), tokenizer=str(model_dir), dtype="float32",
                              enforce_eager=True, max_model_len=SPEC["max_target_positions"],
                              kv_cache_memory_bytes=16 << 20, distributed_executor_backend="uni",
                              max_num_seqs=4, max_num_batched_tokens=2048)
    kw.update(overrides)
    return kw
