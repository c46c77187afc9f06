"""Stops itself (SIGSTOP) inside a lease write transaction of a store.

Usage: lease_txn_stopper.py STORE_DIR CAP_BYTES KEY [fork]

Opens the store as an :class:`~ecstore.lmdb.LMDBTier` and leases KEY through
the tier's own code (``LMDBTier.lease``), whose lease-file write transaction
this helper stops in: the moment the transaction is begun it prints
``inside`` and stops itself with SIGSTOP, holding every lock a lease writer
takes (as a process stopped by a debugger, a job-control ^Z or a cgroup
freezer would). Once continued (SIGCONT) it commits the lease, prints
``leased`` and exits 0.

``fork``: once the store is open it first forks a child (no exec), which
prints ``child PID`` and lives until its stdin (shared with this process)
reaches end of file, then exits without cleanup (``os._exit``); the test can
then kill this process inside its transaction while the child lives.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from ecstore.lmdb import LMDBTier


class _StopsInsideWrites:
    """The lease environment, but a write transaction stops the process once begun."""

    def __init__(self, env: Any) -> None:
        self._env = env

    def begin(self, *args: Any, **kwargs: Any) -> Any:
        txn = self._env.begin(*args, **kwargs)
        if kwargs.get("write"):
            os.write(1, b"inside\n")  # one write: a forked child writes to the same pipe
            os.kill(os.getpid(), signal.SIGSTOP)
        return txn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def main() -> int:
    path, cap, key = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    tier = LMDBTier(path, cap)
    table = tier._leases
    assert table is not None
    if sys.argv[4:] == ["fork"]:
        child = os.fork()
        if child == 0:
            os.write(1, f"child {os.getpid()}\n".encode())
            sys.stdin.read()
            os._exit(0)
    table.env = _StopsInsideWrites(table.env)  # type: ignore[assignment]
    tier.lease([key], 600)
    print("leased", flush=True)
    tier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
