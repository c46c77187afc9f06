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

The code lives in three modules, all re-exported here: :mod:`.tiny_spec`
(size spec, tokens, spec hash), :mod:`.tiny_build` (building the checkpoint)
and :mod:`.tiny_inputs` (images, prompt, engine and server arguments).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ecstore.testing.tiny_build import _read_marker, build_tiny_blip2
from ecstore.testing.tiny_inputs import (
    engine_kwargs,
    greedy_sampling_kwargs,
    make_image,
    prompt,
    server_args,
    setup_single_process_env,
)
from ecstore.testing.tiny_spec import (
    BUILDER_VERSION,
    EOS_TOKEN,
    HEAVY_SPEC,
    IMAGE_TOKEN,
    LIGHT_SPEC,
    MARKER_NAME,
    NUM_QUERY_TOKENS,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TARGET_VOCAB,
    UNK_TOKEN,
    model_spec,
    spec_hash,
)

__all__ = [
    "BUILDER_VERSION",
    "EOS_TOKEN",
    "IMAGE_TOKEN",
    "LIGHT_SPEC",
    "HEAVY_SPEC",
    "MARKER_NAME",
    "NUM_QUERY_TOKENS",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "TARGET_VOCAB",
    "UNK_TOKEN",
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


def main(argv: list[str] | None = None) -> int:
    """``python tools/tiny_model.py OUT_DIR [--heavy] [--seed N] [--force]``: build, print a JSON summary."""
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
