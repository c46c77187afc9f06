"""Worker counters of an encode-only instance, handed to its scheduler side.

vLLM 0.32's V1 runner drops an encoder-only instance's worker metadata, so the
worker (rank 0, the only writer) adds its counters at each step's end to a
memory-mapped file of ``len(COUNTERS)`` float64 totals in ``/dev/shm``, which
the scheduler side (the only reader) reports the growth of. No torn values;
intervals may shift by a step, totals are exact; the name is removed once
both have it mapped. Why and how: docs/disaggregation.md#metrics-of-the-encoder-tier.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import tempfile
from typing import Any

import numpy as np

from ecstore.connector.stats import COUNTERS

log = logging.getLogger("ecstore")

_SIZE = 8 * len(COUNTERS)


def record_path(vllm_config: Any) -> str:
    """The record file of the engine ``vllm_config`` belongs to."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    instance = re.sub(r"[^A-Za-z0-9_.-]", "_", str(getattr(vllm_config, "instance_id", "") or "none"))
    dp_rank = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
    return os.path.join(base, f"ecstore-stats-{instance}-dp{dp_rank}.bin")


class SharedCounters:
    """One engine's cumulative worker counters in a shared memory-mapped file.

    ``add`` (worker, one thread) and ``take_delta`` (scheduler side, one
    thread) may run in different processes at the same time.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        fd, first = _open_record(path)
        try:
            if os.fstat(fd).st_size < _SIZE:
                os.ftruncate(fd, _SIZE)  # zero-filled; never shrinks a record in use
            self._mm = mmap.mmap(fd, _SIZE)
            self._ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        self._values = np.frombuffer(self._mm, dtype="<f8", count=len(COUNTERS))
        if not first:
            # Both sides (the creator and us) have it mapped now: drop the
            # name, so nothing is left behind however the engine ends.
            self._unlink_if_ours()
        # The reader's last totals: zero, so counts the worker added before
        # the scheduler side opened the record are reported too.
        self._seen = np.zeros(len(COUNTERS), dtype="<f8")

    def add(self, counters: dict[str, float]) -> None:
        """Add a step's counters (unknown keys are ignored)."""
        for i, key in enumerate(COUNTERS):
            v = counters.get(key)
            if v:
                self._values[i] += v

    def take_delta(self) -> dict[str, float]:
        """The growth of every counter since the previous call (non-zero ones)."""
        now = self._values.copy()
        delta = {key: float(now[i] - self._seen[i]) for i, key in enumerate(COUNTERS)
                 if now[i] != self._seen[i]}
        self._seen = now
        return delta

    def close(self, *, remove: bool = False) -> None:
        try:
            del self._values
            self._mm.close()
        except (BufferError, AttributeError, ValueError):
            pass  # a view is still alive or already closed: the OS unmaps at exit
        if remove:
            self._unlink_if_ours()

    def _unlink_if_ours(self) -> None:
        """Remove the file name if it still names this record (not one a
        later engine with the same name created)."""
        try:
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("ecstore: could not remove the stats record %s: %s", self.path, e)


def _open_record(path: str) -> tuple[int, bool]:
    """(fd, created by this call). The scheduler side and worker rank 0 of an
    engine each open the record once; whichever comes second unlinks it."""
    for _ in range(3):
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), True
        except FileExistsError:
            pass
        try:
            return os.open(path, os.O_RDWR), False
        except FileNotFoundError:
            continue  # unlinked in between: create it afresh
    raise OSError(f"could not open the stats record {path}")
