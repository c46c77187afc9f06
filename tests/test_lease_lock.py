"""A process stopped inside a lease write transaction never makes another
process's ``pin_if_present`` (the vLLM scheduler's step) wait.

The other process is real (``helpers/lease_txn_stopper.py``): it begins a
lease write transaction through the tier's own code, says so, and stops
itself (SIGSTOP); this process waits until the kernel reports it stopped
(``waitpid(WUNTRACED)``), so the interleaving is fixed, not timed. LMDB's
own write lock has no try or timeout: a pin used to wait until SIGCONT.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ecstore.key import make_key
from ecstore.lmdb import LMDBTier, PutRequest
from ecstore.testing import faults as fc

HELPERS = Path(__file__).resolve().parent / "helpers"
CAP = 64 << 20


def key(idx: int) -> str:
    return make_key(fc.MODEL, f"{idx:016x}", "bfloat16")


def name(idx: int) -> str:
    return f"{0:032x}/img-{idx}"


@contextmanager
def stopped_inside_a_lease_write(path: Path) -> Iterator[subprocess.Popen[str]]:
    """A real process stopped inside a lease write transaction of ``path``'s
    store for the duration of the block; continued and reaped after."""
    proc = subprocess.Popen([sys.executable, str(HELPERS / "lease_txn_stopper.py"), str(path), str(CAP), key(99)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "inside"
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        yield proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.strip() == "leased"


def call_with_hang_guard(fn):
    """``fn()`` on a thread, joined with a generous hang guard (it needs
    microseconds): (finished, result)."""
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    t.start()
    t.join(timeout=60)
    return (not t.is_alive()), (result[0] if result else None)


def test_pin_if_present_is_a_miss_while_another_process_is_stopped_in_a_lease_write(tmp_path: Path) -> None:
    path = tmp_path / "s"
    tier = LMDBTier(str(path), CAP)
    try:
        tier.write_batch([PutRequest(key(1), name(1), fc.MODEL, fc.entry_tensor(1, 4))])
        assert tier.pin_if_present(key(1), name(1), 60)  # a free lease file: pinned as before
        tier.release([key(1)])
        with stopped_inside_a_lease_write(path) as other:
            finished, answer = call_with_hang_guard(lambda: tier.pin_if_present(key(1), name(1), 60))
            assert finished, "pin_if_present waited for a stopped process's lease write"
            assert answer is False  # a miss: the item is computed
            finished, released = call_with_hang_guard(lambda: tier.release([key(1)], wait=False))
            assert finished and released is False
            assert other.poll() is None  # still stopped in its transaction all along
        # Continued (it committed its lease and exited): nothing of ours was
        # left leased by the miss, and pins work again.
        assert tier._leases is not None
        assert tier._leases.leased_keys() == set()
        assert tier.pin_if_present(key(1), name(1), 60)
        assert tier.release([key(1)], wait=False)
    finally:
        tier.close()
