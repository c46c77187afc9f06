"""Worker counters of an encode-only instance, handed to its scheduler side.

vLLM 0.32 runs an ``ec_producer``-only instance as an encoder-only engine: its
model runner returns ``make_empty_encoder_model_runner_output`` and drops the
step's EC connector output, worker metadata included. The counters ecstore
sends in that metadata (saves, saved bytes, save and commit time, skips,
evictions) would never reach vLLM's stats log or ``/metrics``.

Instead, the worker adds them to a small shared record: a file of
``len(COUNTERS)`` little-endian float64 cumulative totals, memory-mapped by
the worker (the only writer) and the scheduler side (the only reader), which
reports the growth since its previous read. The file lives in ``/dev/shm``
(else the temp directory), is named after the engine (vLLM's
``instance_id``, which every process of one engine shares, and the data
parallel rank) and holds no store data: it is outside the store, and the
scheduler side removes it at shutdown.

Consistency: each counter is one aligned 8-byte store, so a read never sees a
torn value; a read may see one counter of a step updated and another not yet,
which the next read picks up (totals are exact, intervals may shift by a step).
The worker updates the record at the end of each step, before the step's
output leaves the model runner, so the scheduler side's read in that step's
``update_from_output`` already includes it.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import tempfile
from typing import Any

import numpy as np

from .stats import COUNTERS

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
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _SIZE:
                os.ftruncate(fd, _SIZE)  # zero-filled; never shrinks a record in use
            self._mm = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._values = np.frombuffer(self._mm, dtype="<f8", count=len(COUNTERS))
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
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("ecstore: could not remove the stats record %s: %s", self.path, e)
