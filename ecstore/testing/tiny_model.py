#!/usr/bin/env python3
"""Build a tiny, random-weight BLIP-2 that the real vLLM (CPU build) can serve offline.

Nothing is downloaded; a build takes seconds, is ~3 MB (light) and is cached on
disk (a marker holds a hash of the build spec; a matching directory is reused).
Encoder output per image: ``[32, 128]`` float32. Re-exports :mod:`.tiny_spec`,
:mod:`.tiny_build` and :mod:`.tiny_inputs`. Usage, the CLI, the files written
and the facts to know when testing against it: docs/testing.md#using-a-tiny-model.
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
