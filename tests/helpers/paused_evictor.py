"""An evictor in its own process that stops between marking its victims and
committing their removal.

Usage: paused_evictor.py STORE_DIR CAP_BYTES

Opens the store as an :class:`~ecstore.lmdb.LMDBTier`, prints ``ready`` and
waits for a line on stdin. Then evicts one byte's worth (the least recently
used entry) in one write transaction: after steps (2) and (3) of the
eviction-marker protocol (its tombstones are written, the leases checked
again, see :mod:`ecstore.lmdb.leases`) and before the commit (4) it prints
``marked`` and waits for another line; then commits, prints ``evicted N``
(entries removed) and exits 0.
"""

from __future__ import annotations

import sys

from ecstore.lmdb import LMDBTier


def main() -> int:
    tier = LMDBTier(sys.argv[1], int(sys.argv[2]))
    real = tier.leased_keys
    calls = {"n": 0}

    def leased_keys() -> set[bytes]:
        got = real()
        calls["n"] += 1
        if calls["n"] == 2:  # step (3): right after the tombstones were written
            print("marked", flush=True)
            sys.stdin.readline()
        return got

    tier.leased_keys = leased_keys  # type: ignore[method-assign]
    print("ready", flush=True)
    sys.stdin.readline()
    before = tier.evictions
    tier._evict_to(tier.total_bytes() - 1)
    print(f"evicted {tier.evictions - before}", flush=True)
    tier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
