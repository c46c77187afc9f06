"""How maintenance reports progress without knowing about terminals.

A :class:`ProgressFactory` is called with a label and a total (items, or
MiB for compact; None when unknown) and returns a context manager whose value
has ``advance(n)``. The CLI passes its stderr progress bar class; library
callers pass nothing (:data:`NO_PROGRESS`). Called from the calling thread only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol


class Ticker(Protocol):
    def advance(self, n: int = 1) -> None: ...


class ProgressFactory(Protocol):
    def __call__(self, label: str, total: int | None) -> AbstractContextManager[Ticker]: ...


class _Silent:
    def advance(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def _no_progress(label: str, total: int | None) -> Iterator[Ticker]:
    yield _Silent()


NO_PROGRESS: ProgressFactory = _no_progress
