"""Worker counters of an encode-only instance, handed to its scheduler side.

vLLM 0.32 runs an ``ec_producer``-only instance as an encoder-only engine. Its
V1 model runner (the one vLLM's CPU backend and, where Model Runner V2 is not
selected, GPUs use) returns ``make_empty_encoder_model_runner_output`` and
drops the step's EC connector output, worker metadata included: the counters
ecstore sends there (saves, saved bytes, save and commit time, skips,
evictions) would never reach vLLM's stats log or ``/metrics``. (V2's
encoder-only runner keeps the output; the counters take this route there too,
so they are counted once either way.)

Instead, the worker adds them to a small shared record: a file of
``len(COUNTERS)`` little-endian float64 cumulative totals, memory-mapped by
the worker (the only writer) and the scheduler side (the only reader), which
reports the growth since its previous read. The file lives in ``/dev/shm``
(else the temp directory), is named after the engine (vLLM's
``instance_id``, which every process of one engine shares, and the data
parallel rank) and holds no store data. Its two users are the scheduler side
and worker rank 0: whichever opens it second removes the name at once (both
keep their mappings), so no file outlives the engine even when it is killed.

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
