#!/usr/bin/env python3
"""Build a tiny, random-weight BLIP-2 that the real vLLM (CPU build) can serve offline.

Used by tests, benchmarks and the demo: nothing is downloaded, the build takes a few
seconds and is cached on disk (a marker file holds a hash of the build spec; a directory
whose marker matches is reused as is).

Module use::

    from ecstore.testing import tiny_model
    model_dir = tiny_model.build_tiny_blip2("/tmp/tiny_blip2")          # light, ~3 MB
    tiny_model.setup_single_process_env()      # before the engine starts
    from vllm import LLM, SamplingParams
    llm = LLM(**tiny_model.engine_kwargs(model_dir))
    out = llm.generate(
        {"prompt": tiny_model.prompt("What is in the image?"),
         "multi_modal_data": {"image": tiny_model.make_image(1)}},
        SamplingParams(**tiny_model.greedy_sampling_kwargs()),
    )

CLI::

    python tools/tiny_model.py OUT_DIR [--heavy] [--seed N] [--force]

What gets written to OUT_DIR: ``config.json`` (``Blip2ForConditionalGeneration``),
``model.safetensors`` (float32), ``generation_config.json``, the tokenizer
(``tokenizer.json``, ``tokenizer_config.json`` with a chat template), the processor
(``processor_config.json``, PIL image processor ``BlipImageProcessorPil``), and the
marker ``.tiny_model.json``.

Facts worth knowing when writing tests against this model:

* Prompt format: plain text such as ``"Question: <q> Answer:"``; vLLM's BLIP-2 processor
  inserts the 32 ``<image>`` placeholder tokens itself at the start of the prompt
  (``PromptInsertion`` at ``start()``), so the text must NOT contain ``<image>``. The
  chat template renders ``Question: <text> Answer:`` too, so the OpenAI chat endpoint
  works with ``image_url`` content parts.
* Encoder output per image: ``[32, 128]`` float32 (32 query tokens x OPT hidden 128),
  for both the light and heavy variants.
* Weights are random: generated text is gibberish and EOS may come at any time; use
  ``ignore_eos=True`` (``greedy_sampling_kwargs()``) for a fixed number of tokens.
* The CPU attention backend needs head size >= 32: OPT has hidden 128 / 4 heads.
* Weights use initializer_range 0.2 (not 0.02) so that different images give different
  greedy tokens; the same input gives the same tokens whether the embedding was
  computed or loaded from a connector (checked with vLLM's ECExampleConnector).
* ``mm_hash`` (vLLM's item identifier) hashes the model *path* and the pixels, not the
  weights: rebuilding a different seed into the same directory keeps the hashes.
* Calling the saved HF ``Blip2Processor`` directly with images *and* text fails in
  transformers 5.19 (``'str' object has no attribute 'content'``: the registered
  ``image_token`` comes back as a str). vLLM does not hit this; only direct HF use does.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = [
    "BUILDER_VERSION",
    "IMAGE_TOKEN",
    "LIGHT_SPEC",
    "HEAVY_SPEC",
    "MARKER_NAME",
    "build_tiny_blip2",
    "engine_kwargs",
    "greedy_sampling_kwargs",
    "make_image",
    "model_spec",
    "prompt",
    "server_args",
    "setup_single_process_env",
    "spec_hash",
]

# Bump when the build recipe changes in a way that changes the output files.
BUILDER_VERSION = 3
MARKER_NAME = ".tiny_model.json"

PAD_TOKEN = "<pad>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, IMAGE_TOKEN]  # ids 0..3

NUM_QUERY_TOKENS = 32
TARGET_VOCAB = 512

# Light: ~0.8 M parameters, ~3 MB, encoder a few ms per image.
LIGHT_SPEC: dict[str, Any] = {
    "vision": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 224,
        "patch_size": 14,
    },
    "qformer": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    },
    "text": {
        "hidden_size": 128,
        "ffn_dim": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 2048,
    },
    "num_query_tokens": NUM_QUERY_TOKENS,
    # Larger than transformers' 0.02 default on purpose: with 0.02 every image yields
    # the same greedy tokens (the image barely moves the logits); with 0.2 different
    # images give different tokens, so tests can tell embeddings apart.
    "initializer_range": 0.2,
}

# Heavy: bigger vision tower so the encoder costs 0.2-0.4 s per image on these CPUs
# (enough to see a cache pay off); the LM and the encoder output shape are unchanged.
HEAVY_SPEC: dict[str, Any] = {
    **LIGHT_SPEC,
    "vision": {
        "hidden_size": 384,
        "intermediate_size": 1536,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "image_size": 448,
        "patch_size": 14,
    },
}

_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set text = message['content'] -%}"
    "{%- else -%}"
    "{%- set text = namespace(v='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}"
    "{%- set text.v = text.v + part['text'] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set text = text.v -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{ 'Question: ' + text + ' ' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ 'Answer: ' + text + ' ' }}"
    "{%- else -%}"
    "{{ text + ' ' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Answer:' }}{%- endif -%}"
)

# Fixed training text for the BPE tokenizer: deterministic, no download.
_WORDS = (
    "the a an of and to in is it that this what which who where when how why image "
    "picture photo shows contains color red green blue yellow black white gray orange "
    "purple pink brown square circle line stripe pattern block grid top bottom left "
    "right center middle corner background foreground object person dog cat car tree "
    "house sky water road light dark bright small large big little many few one two "
    "three four five six seven eight nine ten question answer describe content there "
    "are with on at for from by about over under near next see look scene some"
).split()


def model_spec(heavy: bool = False) -> dict[str, Any]:
    """The size spec used for a build (a deep copy; changing it changes nothing)."""
    return json.loads(json.dumps(HEAVY_SPEC if heavy else LIGHT_SPEC))


def _dist_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


def spec_hash(*, heavy: bool = False, seed: int = 0) -> str:
    """Hash of everything that determines the output files (stored in the marker)."""
    payload = {
        "builder": BUILDER_VERSION,
        "spec": model_spec(heavy),
        "seed": int(seed),
        # Cheap (no import): a cache hit must not pay for importing transformers.
        "transformers": _dist_version("transformers"),
        "tokenizers": _dist_version("tokenizers"),
        "torch": _dist_version("torch"),
    }
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


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


def _build_tokenizer(seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens={"image_token": IMAGE_TOKEN},
        model_max_length=1024,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def _build_config(spec: dict[str, Any], vocab_size: int):
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


def _build_processor(spec: dict[str, Any], tokenizer):
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
def _build_lock(out_dir: Path):
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


def _quiet_transformers():
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover
        pass


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
    (``force=True`` rebuilds). The build happens in a temporary sibling directory and
    files are moved in with ``os.replace``; the marker is written last, so a crashed
    build is never mistaken for a finished one. Safe to call from several processes.
    """
    out = Path(out_dir).expanduser().resolve()
    digest = spec_hash(heavy=heavy, seed=seed)
    if not force and _is_built(out, digest):
        return out

    with _build_lock(out):
        if not force and _is_built(out, digest):  # someone else built it meanwhile
            return out
        _quiet_transformers()
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            files = _build_into(tmp, heavy=heavy, seed=seed)
            out.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                (out / MARKER_NAME).unlink()
            for name in files:
                os.replace(tmp / name, out / name)
            marker = {
                "hash": digest,
                "builder": BUILDER_VERSION,
                "heavy": heavy,
                "seed": seed,
                "spec": model_spec(heavy),
                "files": sorted(files),
                "build_seconds": round(time.perf_counter() - t0, 3),
            }
            marker_tmp = out / (MARKER_NAME + ".tmp")
            marker_tmp.write_text(json.dumps(marker, indent=2, sort_keys=True))
            os.replace(marker_tmp, out / MARKER_NAME)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


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

    names = sorted(p.name for p in tmp.iterdir() if p.is_file())
    for name in names:  # some writers create 0600 files; make them world-readable
        os.chmod(tmp / name, 0o644)
    return names


# ----------------------------------------------------------------------------------
# Inputs and engine settings
# ----------------------------------------------------------------------------------


def make_image(seed: int, size: int = 224):
    """A distinct, deterministic RGB PIL image for ``seed`` (``size`` x ``size``).

    A coarse random colour grid (different for every seed) plus a seed-dependent
    gradient: different seeds give different pixels, hence different vLLM mm_hashes.
    """
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    cells = int(rng.integers(4, 9))
    grid = rng.integers(0, 256, size=(cells, cells, 3), dtype=np.uint8)
    reps = -(-size // cells)
    img = np.kron(grid, np.ones((reps, reps, 1), dtype=np.uint8))[:size, :size]
    yy, xx = np.mgrid[0:size, 0:size]
    angle = (seed % 360) * np.pi / 180.0
    grad = ((np.cos(angle) * xx + np.sin(angle) * yy) % 64).astype(np.int16)
    img = (img.astype(np.int16) + grad[..., None]) % 256
    return Image.fromarray(img.astype(np.uint8)).convert("RGB")


def prompt(question: str = "What is in the image?") -> str:
    """The text prompt for ``LLM.generate`` (vLLM inserts the image tokens itself)."""
    return f"Question: {question} Answer:"


def setup_single_process_env() -> None:
    """Set ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core in this process).

    Must run before the engine is created (safest: before ``import vllm``). Does not
    override a value the caller already set.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def engine_kwargs(
    model_dir: str | os.PathLike[str], *, single_process: bool = True, **overrides: Any
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(**kw)`` that start fast on these CPUs.

    ``single_process=True`` (default) adds ``distributed_executor_backend="uni"``
    (worker in the engine-core process); pair it with ``setup_single_process_env()`` so
    the engine core also runs in the caller's process (~3 s start, < 1 GiB RSS).
    ``overrides`` win over the defaults, e.g. ``ec_transfer_config=...``,
    ``enable_prefix_caching=False``.
    Remember the ``if __name__ == "__main__":`` guard in scripts that start an engine.
    """
    kw: dict[str, Any] = {
        "model": str(Path(model_dir).expanduser().resolve()),
        "dtype": "float32",  # the CPU here is AVX2-only: no bf16
        "enforce_eager": True,
        "max_model_len": 1024,
        "kv_cache_memory_bytes": 64 << 20,
        "limit_mm_per_prompt": {"image": 1},
        "seed": 0,
    }
    if single_process:
        kw["distributed_executor_backend"] = "uni"
    kw.update(overrides)
    return kw


def server_args(model_dir: str | os.PathLike[str]) -> list[str]:
    """CLI flags for ``python -m vllm.entrypoints.openai.api_server`` (same settings).

    Add ``--port``; set ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in the server's env for
    single-process mode.
    """
    return [
        "--model",
        str(Path(model_dir).expanduser().resolve()),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "1024",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--distributed-executor-backend",
        "uni",
        "--limit-mm-per-prompt",
        json.dumps({"image": 1}),
    ]


def greedy_sampling_kwargs(max_tokens: int = 8) -> dict[str, Any]:
    """``SamplingParams(**kw)``: greedy and a fixed length (random weights emit EOS)."""
    return {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build a tiny random BLIP-2 for vLLM tests.")
    p.add_argument("out_dir", help="directory to write the model into")
    p.add_argument("--heavy", action="store_true", help="448px, 6-layer vision tower")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    out = build_tiny_blip2(args.out_dir, heavy=args.heavy, seed=args.seed, force=args.force)
    marker = _read_marker(out) or {}
    print(
        json.dumps(
            {
                "path": str(out),
                "hash": marker.get("hash"),
                "heavy": args.heavy,
                "seconds": round(time.perf_counter() - t0, 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
