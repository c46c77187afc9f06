"""Building tiny checkpoints: the cached-build machinery, a local BPE tokenizer,
and the tiny BLIP-2 (config, weights, processor, marker).

:func:`build_tiny_blip2` is the BLIP-2 entry point (re-exported by
:mod:`ecstore.testing.tiny_model`); :func:`build_cached` and
:func:`train_tokenizer` are shared with :mod:`ecstore.testing.tiny_qwen`.
Builds are serialised per directory with a file lock and made visible
atomically (files moved in, marker written last), so concurrent processes
may call them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ecstore.testing.tiny_spec import (
    _CHAT_TEMPLATE,
    _WORDS,
    BUILDER_VERSION,
    EOS_TOKEN,
    IMAGE_TOKEN,
    MARKER_NAME,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TARGET_VOCAB,
    UNK_TOKEN,
    model_spec,
    spec_hash,
)


def _corpus(seed: int) -> list[str]:
    import random

    rng = random.Random(1000 + seed)
    lines = []
    for _ in range(400):
        n = rng.randint(4, 14)
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(n)))
    # Prompt-shaped lines, so "Question:"/"Answer:" become short token sequences.
    lines += ["Question: what is in the image? Answer: a picture"] * 50
    return lines


def train_tokenizer(*, special_tokens: list[str], corpus: list[str], vocab_size: int, pad_token: str,
                    eos_token: str, bos_token: str | None, unk_token: str | None,
                    extra_special_tokens: dict[str, str], chat_template: str) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``corpus`` (no download).

    ``special_tokens`` get ids 0.. in order; ``extra_special_tokens`` registers
    named ones (``{"image_token": "<image>"}`` gives ``tokenizer.image_token``).
    Deterministic given its arguments."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    for i, t in enumerate(special_tokens):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=pad_token,
        eos_token=eos_token,
        bos_token=bos_token,
        unk_token=unk_token,
        extra_special_tokens=extra_special_tokens,
        model_max_length=1024,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template
    return fast


def _build_tokenizer(seed: int) -> Any:
    return train_tokenizer(special_tokens=SPECIAL_TOKENS, corpus=_corpus(seed), vocab_size=TARGET_VOCAB,
                           pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, unk_token=UNK_TOKEN,
                           extra_special_tokens={"image_token": IMAGE_TOKEN}, chat_template=_CHAT_TEMPLATE)


def _build_config(spec: dict[str, Any], vocab_size: int) -> Any:
    from transformers import Blip2Config

    v, q, t = spec["vision"], spec["qformer"], spec["text"]
    padded_vocab = ((vocab_size + 63) // 64) * 64
    image_token_id = SPECIAL_TOKENS.index(IMAGE_TOKEN)
    config = Blip2Config(
        vision_config={
            **v,
            "layer_norm_eps": 1e-6,
            # transformers' vision default is 1e-10 (weights ~0: all images alike)
            "initializer_range": spec["initializer_range"],
        },
        qformer_config={
            **q,
            "encoder_hidden_size": v["hidden_size"],
            "cross_attention_frequency": 1,
            "vocab_size": 64,
            "max_position_embeddings": 64,
            "initializer_range": spec["initializer_range"],
        },
        text_config={
            "model_type": "opt",
            **t,
            "word_embed_proj_dim": t["hidden_size"],
            "vocab_size": padded_vocab,
            "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
            "bos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
            "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
            "do_layer_norm_before": True,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "tie_word_embeddings": True,
            "init_std": spec["initializer_range"],
        },
        num_query_tokens=spec["num_query_tokens"],
        image_token_index=image_token_id,
        dtype="float32",
        initializer_range=spec["initializer_range"],
    )
    config.architectures = ["Blip2ForConditionalGeneration"]
    # Top-level token ids, read by generation / vLLM.
    config.pad_token_id = SPECIAL_TOKENS.index(PAD_TOKEN)
    config.bos_token_id = SPECIAL_TOKENS.index(EOS_TOKEN)
    config.eos_token_id = SPECIAL_TOKENS.index(EOS_TOKEN)
    return config


def _build_processor(spec: dict[str, Any], tokenizer: Any) -> Any:
    from transformers import Blip2Processor
    from transformers.models.blip.image_processing_pil_blip import (
        BlipImageProcessorPil,
    )

    size = spec["vision"]["image_size"]
    image_processor = BlipImageProcessorPil(size={"height": size, "width": size})
    return Blip2Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        num_query_tokens=spec["num_query_tokens"],
    )


def _read_marker(out_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None


def _is_built(out_dir: Path, digest: str) -> bool:
    marker = _read_marker(out_dir)
    if not marker or marker.get("hash") != digest:
        return False
    return all((out_dir / name).is_file() for name in marker.get("files", []))


@contextlib.contextmanager
def _build_lock(out_dir: Path) -> Iterator[None]:
    """Serialize concurrent builds of the same directory (pytest-xdist, parallel demos)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.parent / f".{out_dir.name}.build.lock"
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover  # noqa: BLE001
        pass


def build_cached(out_dir: str | os.PathLike[str], *, digest: str, build_into: Callable[[Path], list[str]],
                 marker: dict[str, Any], force: bool = False) -> Path:
    """Build (or reuse) a checkpoint in ``out_dir``; return its absolute path.

    ``build_into(tmp)`` writes the files into an empty temporary sibling
    directory and returns their names. A directory whose marker holds
    ``digest`` (and whose listed files exist) is reused without work
    (``force=True`` rebuilds). Files are moved in with ``os.replace`` and the
    marker (``marker`` plus hash, file list and build time) is written last, so
    a crashed build is never mistaken for a finished one. Builds of one
    directory are serialised with a file lock: safe from several processes.
    """
    out = Path(out_dir).expanduser().resolve()
    if not force and _is_built(out, digest):
        return out

    with _build_lock(out):
        if not force and _is_built(out, digest):  # someone else built it meanwhile
            return out
        _quiet_transformers()
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            files = build_into(tmp)
            for name in files:  # some writers create 0600 files; make them world-readable
                os.chmod(tmp / name, 0o644)
            out.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                (out / MARKER_NAME).unlink()
            for name in files:
                os.replace(tmp / name, out / name)
            full = {**marker, "hash": digest, "files": sorted(files),
                    "build_seconds": round(time.perf_counter() - t0, 3)}
            marker_tmp = out / (MARKER_NAME + ".tmp")
            marker_tmp.write_text(json.dumps(full, indent=2, sort_keys=True))
            os.replace(marker_tmp, out / MARKER_NAME)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_tiny_blip2(
    out_dir: str | os.PathLike[str],
    *,
    heavy: bool = False,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """Build (or reuse) a tiny random BLIP-2 in ``out_dir``; return its absolute path.

    Deterministic given (heavy, seed): same bytes for the weights and tokenizer. A
    directory whose marker file holds the same spec hash is reused without work
    (``force=True`` rebuilds); see :func:`build_cached`. Safe to call from
    several processes.
    """
    marker = {"builder": BUILDER_VERSION, "heavy": heavy, "seed": seed, "spec": model_spec(heavy)}
    return build_cached(out_dir, digest=spec_hash(heavy=heavy, seed=seed),
                        build_into=lambda tmp: _build_into(tmp, heavy=heavy, seed=seed), marker=marker, force=force)


def saved_files(directory: Path) -> list[str]:
    """The names of the plain files in ``directory`` (what a ``build_into`` returns)."""
    return sorted(p.name for p in directory.iterdir() if p.is_file())


def _build_into(tmp: Path, *, heavy: bool, seed: int) -> list[str]:
    import torch
    from transformers import Blip2ForConditionalGeneration

    spec = model_spec(heavy)
    tokenizer = _build_tokenizer(seed)
    config = _build_config(spec, vocab_size=len(tokenizer))

    # Random init on CPU under a fixed seed -> deterministic weights. The global RNG
    # state is restored so that callers' randomness is unaffected.
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Blip2ForConditionalGeneration(config)
        # transformers initialises the Q-Former queries to zeros: 32 identical
        # queries would give 32 identical embedding rows. Make them distinct.
        with torch.no_grad():
            model.query_tokens.normal_(mean=0.0, std=config.initializer_range)
    finally:
        torch.random.set_rng_state(rng_state)
    # transformers declares PreTrainedModel.to with @wraps(torch.nn.Module.to): mypy then
    # takes the unbound signature (self first) for the bound method.
    model = model.to(torch.float32).eval()  # type: ignore[arg-type]
    model.save_pretrained(str(tmp), safe_serialization=True)

    processor = _build_processor(spec, tokenizer)
    processor.save_pretrained(str(tmp))
    # Also store the template next to the tokenizer (older loaders look there).
    tokenizer.save_pretrained(str(tmp))

    return saved_files(tmp)
