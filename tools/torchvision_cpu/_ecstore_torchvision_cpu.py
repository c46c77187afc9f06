"""Let PyPI's torchvision (Python part) import beside the CPU build of torch.

PyPI's ``torchvision==0.28.0`` is built against the CUDA torch: with torch
``2.13.0+cpu`` its C extension does not load, and its module-level fake
registrations for ``torchvision::nms`` / ``torchvision::qnms`` then stop the
import (``operator torchvision::nms does not exist``), and with it ``import
vllm`` and transformers' Qwen-VL video processor. Image and video *processing*
(what vLLM's Qwen-VL processors use) needs none of torchvision's C ops.

This module is imported at interpreter start by a ``.pth`` file that
``tools/setup_env.sh`` writes next to it into the venv's site-packages. It
only installs an import hook (no torch import at start-up): the first
``import torchvision`` defines the two op schemas, with no kernels, before
torchvision's own code runs. Calling those ops still fails (no kernel), as it
would with no extension at all. Safe with a working torchvision build too: a
schema that is already defined is left alone.
"""

from __future__ import annotations

import importlib.abc
import sys

_SCHEMAS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def define_schemas() -> None:
    """Define the ``torchvision::`` op schemas torchvision's import needs (idempotent)."""
    import torch

    for name, schema in _SCHEMAS.items():
        if hasattr(torch.ops, "torchvision") and hasattr(torch.ops.torchvision, name):
            continue
        try:
            torch.library.define(f"torchvision::{name}", schema)
        except RuntimeError:  # defined meanwhile (a real extension loaded it)
            pass


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            define_schemas()
        return None  # the ordinary finders import torchvision itself


def install() -> None:
    if not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
