"""Counting the copies of an entry into a blob: ``codec.encode_view`` (the
put's copy, or the LMDB tier's for a handed-over tensor), still run for real."""

from __future__ import annotations

import pytest

from ecstore.format import codec


def count_encodes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """From now until ``monkeypatch.undo()``: the shape of every tensor
    encoded into a blob, appended to the list returned."""
    shapes: list[tuple[int, ...]] = []
    real = codec.encode_view

    def counted(tensor, **kw):
        shapes.append(tuple(tensor.shape))
        return real(tensor, **kw)

    monkeypatch.setattr(codec, "encode_view", counted)
    return shapes
