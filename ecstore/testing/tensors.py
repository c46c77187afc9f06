"""Deterministic test tensors and bit-exact comparison (CPU tensors only).

``make_tensor(seed, ...)`` is a pure function of its arguments, so a parent
and a child process build the very same tensor from a seed. Used by
:mod:`ecstore.testing.store_contract` and, through ``tests/helpers/tensors.py``,
by the test suite.
"""

from __future__ import annotations

import torch

#: Values every floating test tensor starts with (where the dtype has them).
SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1.0, -1.5]


def make_tensor(seed: int, rows: int = 4, cols: int = 16, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A ``[rows, cols]`` tensor of ``dtype`` whose bytes are a pure function
    of ``seed``: random bit patterns (so NaN payloads, subnormals and
    negative zeros occur), with NaN/Inf/-0.0 written first for float dtypes."""
    nbytes = rows * cols * dtype.itemsize
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        raw &= 1  # only 0 and 1 are valid bools
    t = raw.view(dtype).reshape(rows, cols)
    if dtype.is_floating_point and dtype.itemsize >= 2:
        flat = t.reshape(-1)
        for i, v in enumerate(SPECIALS[: flat.numel()]):
            flat[i] = v
    return t.clone()


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Same dtype, shape and bytes (NaN payloads included)."""
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and raw_bytes(a) == raw_bytes(b)


def assert_same(a: torch.Tensor | None, b: torch.Tensor | None) -> None:
    assert a is not None, "got None, expected a tensor"
    assert b is not None
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert tuple(a.shape) == tuple(b.shape), (tuple(a.shape), tuple(b.shape))
    assert a.device.type == "cpu"
    assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8)), "tensor bytes differ"

