"""Deterministic test tensors and bit-exact comparison.

Importable both from the tests (``from helpers.tensors import ...``) and from
the subprocess entry points in this folder (``from tensors import ...``). The
tensors themselves live in :mod:`ecstore.testing.tensors` (the shipped store
contract uses them); this module adds what only the suite needs.
"""

from __future__ import annotations

import torch

from ecstore.testing.tensors import SPECIALS, assert_same, make_tensor, raw_bytes, same_tensor

__all__ = ["SPECIALS", "assert_same", "make_tensor", "raw_bytes", "same_tensor", "stored_name"]


def stored_name(ident: str, model: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """What an ``ECStore(model=model, dtype=dtype)`` opened without an identity
    stores for mm identifier ``ident`` (blob sizes depend on it)."""
    from ecstore.identity import library_identity, qualify

    return qualify(library_identity(model, str(dtype).removeprefix("torch.")).namespace, ident)
