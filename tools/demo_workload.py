"""The demo's workload (``tools/demo.py``): the model it serves, the image sets it
sends, and one measured set of requests (TTFT) against a running server.

Client side only: requests go through :mod:`demo_server`; nothing here starts
or stops a process. Images are generated deterministically from their seeds.
"""

from __future__ import annotations

import argparse
import base64
import io
from dataclasses import dataclass, field
from typing import Any

import demo_server
from demo_server import Server

QUESTION = "What is in the image?"


@dataclass
class ModelInfo:
    path: str         # what --model gets
    tiny: bool        # the built tiny BLIP-2 (CPU settings, one image per prompt)
    mm_limit: int     # images per prompt the server is started with


@dataclass
class ImageSet:
    label: str
    seeds: list[int]
    urls: list[str] = field(repr=False)

    @property
    def n(self) -> int:
        return len(self.seeds)


def data_url(seed: int, size: int) -> str:
    from ecstore.testing import tiny_model

    buf = io.BytesIO()
    tiny_model.make_image(seed, size).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def make_sets(counts: list[int], reps: int, size: int, with_new: bool) -> tuple[list[ImageSet], list[ImageSet]]:
    """The measured image sets, and for each a 'new' set of the same size (distinct images
    everywhere), sent right after it on the restarted server (interleaved pairs)."""
    sets, news, seed, new_seed = [], [], 100, 5000
    for r in range(reps):
        for n in counts:
            seeds = list(range(seed, seed + n))
            seed += n
            sets.append(ImageSet(f"{n}img#{r + 1}", seeds, [data_url(s, size) for s in seeds]))
            if with_new:
                seeds = list(range(new_seed, new_seed + n))
                new_seed += n
                news.append(ImageSet(f"{n}new#{r + 1}", seeds, [data_url(s, size) for s in seeds]))
    return sets, news



def content_for(images: list[str], question: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in images]
    parts.append({"type": "text", "text": question})
    return parts


def measure(server: Server, model: ModelInfo, s: ImageSet, phase: str, args: argparse.Namespace,
            concurrent: bool) -> dict[str, Any]:
    """Send image set ``s``; TTFT of the set = until every request has its first token."""
    if concurrent or s.n == 1:
        contents = [content_for([u], QUESTION) for u in s.urls]
        if len(contents) == 1:
            results = [demo_server.stream_chat(server.base_url, model.path, contents[0],
                                               max_tokens=args.max_tokens)]
        else:
            results = demo_server.stream_chat_concurrent(server.base_url, model.path, contents,
                                                         max_tokens=args.max_tokens)
    else:
        q = "What is in these images?"
        results = [demo_server.stream_chat(server.base_url, model.path, content_for(s.urls, q),
                                           max_tokens=args.max_tokens)]
    send = min(r["send"] for r in results)
    first = max(r["first"] for r in results)
    end = max(r["end"] for r in results)
    return {
        "phase": phase,
        "set": s.label,
        "n_images": s.n,
        "seeds": s.seeds,
        "requests": len(results),
        "ttft_ms": round((first - send) * 1e3, 1),
        "total_ms": round((end - send) * 1e3, 1),
        "per_request_ttft_ms": [round(r["ttft_s"] * 1e3, 1) for r in results],
        "token_ids": [r["token_ids"] for r in results],
        "text": [r["text"] for r in results],
    }


def warm_up(server: Server, model: ModelInfo, args: argparse.Namespace) -> None:
    """One text-only request: first-request costs (HTTP, LM, sampler) are not charged to a
    measured row; it has no image, so it never touches the encoder cache or the connector."""
    demo_server.stream_chat(server.base_url, model.path, [{"type": "text", "text": QUESTION}],
                            max_tokens=2)
