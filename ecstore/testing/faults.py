"""Shared code of the fault tests (tests/store/test_faults.py) and the stress
scripts (tools/stress_crash.py, tools/stress_concurrency.py).

* :func:`entry_tensor` -- an entry's content as a pure function of an integer
  id and a size, so a parent can check bit for bit what a killed child wrote.
* :func:`audit` -- the store's integrity check (:mod:`ecstore.lmdb.check`,
  the one ``ecstore-dump verify`` runs) from one read transaction: no
  partial entry, exact byte accounting, LRU index complete, bound held,
  data file within the map.
* :func:`mp_context` -- a ``forkserver`` multiprocessing context that has
  imported torch and ecstore once: workers are real processes (their own
  pid, LMDB environment, reader slots and locks; killable with SIGKILL) that
  start in milliseconds instead of seconds, so CI can afford dozens of them.
  No store is ever open in the fork server, so nothing crosses a fork.
* :func:`run_forked` -- run one function in such a worker with a timeout:
  a crash (SIGBUS, SIGSEGV) or a hang is reported instead of taking the
  caller down.
* :func:`corrupt_entry` -- the back door of the state machines and fault
  tests: damage one stored entry's record or blob in place, the way a bad
  disk block or a writer outside ecstore would.

Importable as ``ecstore.testing.faults``.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ecstore.format import codec
from ecstore.identity import library_identity, qualify
from ecstore.lmdb import LMDBTier
from ecstore.lmdb.check import StoreCheck, check_store
from ecstore.lmdb.txn import file_ref

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
COLS = 512  # bf16 columns: one row is 1 KiB
ROW_BYTES = COLS * 2


# --------------------------------------------------------------------------
# Content
# --------------------------------------------------------------------------

def corrupt_entry(tier: LMDBTier, key: str, part: str) -> None:
    """Damage the entry under ``key`` in place, in one write transaction:
    ``part="record"`` makes its record unreadable (an unknown record version,
    as after a flipped first byte), ``part="blob"`` flips the last byte of its
    blob (the checksum no longer matches; the file's last byte for a blob
    kept in a file), ``part="file"`` deletes its blob file and
    ``part="truncate"`` cuts its blob file short by one byte, and
    ``part="pointer"`` flips the first byte of the pointer LMDB keeps to
    that file (no longer a pointer: read as a damaged inline blob)
    (AssertionError for an inline blob). ``total_bytes``, the LRU row and
    the files index are left as they were. AssertionError if there is no
    such entry."""
    if part not in ("record", "blob", "file", "truncate", "pointer"):
        raise ValueError(f"part must be 'record', 'blob', 'file', 'truncate' or 'pointer', got {part!r}")
    k = key.encode()
    with tier._write_txn() as txn:
        db = tier._dbs.entries if part == "record" else tier._dbs.blobs
        raw = txn.get(k, db=db)
        assert raw is not None, f"no {part} under {key!r}"
        if part == "pointer":
            assert file_ref(raw) is not None, f"the blob of {key!r} is not in a file"
            txn.put(k, bytes([raw[0] ^ 0xFF]) + bytes(raw[1:]), db=db)
            return
        ref = None if part == "record" else file_ref(raw)
        if ref is not None:
            path = os.path.join(tier.files.dir, ref.name)
            if part == "file":
                os.unlink(path)
            elif part == "truncate":
                os.truncate(path, ref.size - 1)
            else:
                with open(path, "r+b") as f:
                    f.seek(-1, os.SEEK_END)
                    last = f.read(1)[0]
                    f.seek(-1, os.SEEK_END)
                    f.write(bytes([last ^ 0xFF]))
            return
        assert part in ("record", "blob"), f"the blob of {key!r} is not in a file"
        data = bytearray(raw)
        if part == "record":
            data[0] = 0x09
        else:
            data[-1] ^= 0xFF
        txn.put(k, bytes(data), db=db)


def identifier(idx: int) -> str:
    return f"crash-entry-{idx:09d}"


def rows_for(idx: int, salt: int, min_bytes: int, max_bytes: int) -> int:
    """Rows of entry ``idx``: log-uniform between min_bytes and max_bytes of
    tensor data, a pure function of (idx, salt)."""
    r = random.Random(idx * 1_000_003 + salt)
    lo, hi = np.log(max(min_bytes, ROW_BYTES)), np.log(max(max_bytes, min_bytes, ROW_BYTES))
    return max(1, int(np.exp(r.uniform(lo, hi))) // ROW_BYTES)


def entry_tensor(idx: int, rows: int, cols: int = COLS, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A ``[rows, cols]`` tensor whose bytes are a pure function of (idx, rows):
    random bit patterns (NaN payloads included), fast enough for tens of MB."""
    nbytes = rows * cols * dtype.itemsize
    raw = np.random.Generator(np.random.PCG64([idx, rows])).bytes(nbytes)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(rows, cols)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def blob_size(idx: int, rows: int, model: str = MODEL) -> int:
    t = torch.empty(rows, COLS, dtype=torch.bfloat16)
    # an ECStore opened without an identity stores "<namespace>/<identifier>"
    name = qualify(library_identity(model, "bfloat16").namespace, identifier(idx))
    return codec.blob_size(t, identifier=name, model=model)


# --------------------------------------------------------------------------
# Audit
# --------------------------------------------------------------------------

class Audit(StoreCheck):
    """What :func:`audit` found (everything from one read transaction):
    :class:`ecstore.lmdb.check.StoreCheck` with an asserting :meth:`check`."""

    def check(self) -> Audit:
        found = [f"{b.key}: {b.error}" for b in self.bad] + self.problems
        assert not found, "store audit failed:\n  " + "\n  ".join(found[:20])
        return self


def audit(path: str | os.PathLike, cap: int | None = None, *, tier: LMDBTier | None = None) -> Audit:
    """Check a store's invariants from one read transaction
    (:func:`ecstore.lmdb.check.check_store` with ``one_snapshot``: what
    ``ecstore-dump verify`` checks, plus the exact byte accounting, LRU rows,
    ``total <= cap`` and the map size; keys need not be EC keys); returns an
    :class:`Audit` (call ``.check()``). Uses ``tier`` if given, else opens
    the directory read-only (sharing this process's environment, if any).
    """
    own = tier is None
    if tier is None:
        tier = LMDBTier(str(path), cap or 1, readonly=True, create=False)
    try:
        found = check_store(tier, one_snapshot=True, ec_keys=False, cap=cap)
    finally:
        if own:
            tier.close()
    return Audit(**vars(found))


def run_verify_cli(path: str | os.PathLike, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m ecstore.cli verify PATH`` in a fresh interpreter."""
    return subprocess.run([sys.executable, "-m", "ecstore.cli", "verify", str(path)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "LMCACHE_CONFIG_FILE": ""})


# --------------------------------------------------------------------------
# Worker processes
# --------------------------------------------------------------------------

_PRELOAD = ["torch", "numpy", "lmdb", "ecstore", "ecstore.cli", "ecstore.testing.faults"]


def mp_context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context (server started on first use, then reused)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _call(conn: Any, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    try:
        torch.set_num_threads(1)
        conn.send(("ok", fn(*args, **kwargs)))
    except BaseException as e:  # report, never hang the parent  # noqa: BLE001
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


@dataclass
class Forked:
    """Outcome of :func:`run_forked`."""

    status: str  # "ok" | "error" | "crashed" | "hung"
    value: Any = None
    exitcode: int | None = None

    def ok(self) -> Any:
        assert self.status == "ok", f"worker {self.status} (exit code {self.exitcode}): {self.value}"
        return self.value


def run_forked(fn: Callable[..., Any], *args: Any, timeout: float = 120, **kwargs: Any) -> Forked:
    """Run ``fn(*args, **kwargs)`` in a fresh worker process; its return value
    must pickle. A worker that dies by a signal is "crashed", one still
    running after ``timeout`` seconds is killed and "hung"."""
    ctx = mp_context()
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_call, args=(send, fn, args, kwargs), daemon=True)
    p.start()
    send.close()
    result: Forked | None = None
    if not recv.poll(timeout):  # poll is True on an answer and on EOF (worker died)
        p.kill()
        p.join()
        return Forked("hung", f"no answer within {timeout}s", p.exitcode)
    try:
        status, value = recv.recv()
        result = Forked(status, value)
    except EOFError:
        pass
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
    if result is None:
        sig = -p.exitcode if p.exitcode and p.exitcode < 0 else None
        name = signal.Signals(sig).name if sig else f"exit {p.exitcode}"
        return Forked("crashed", f"worker died ({name}) without answering", p.exitcode)
    result.exitcode = p.exitcode
    return result
