"""Holds the write lock of an ecstore LMDB file until a line arrives on stdin.

Usage: lmdb_lock_holder.py STORE_DIR

Opens the store's LMDB environment as a plain ``lmdb`` reader/writer, begins
a write transaction (LMDB allows one writer at a time across all processes),
prints ``locked`` and waits for one line on stdin; then aborts the
transaction (nothing changes), prints ``released`` and exits 0. While it holds
the lock, no other process can commit: a test uses it to tell "committed
before returning" from "handed to a background writer".
"""

from __future__ import annotations

import sys

import lmdb


def main() -> int:
    env = lmdb.open(sys.argv[1], max_dbs=16, subdir=True, map_size=1 << 20)
    txn = env.begin(write=True)
    print("locked", flush=True)
    sys.stdin.readline()
    txn.abort()
    print("released", flush=True)
    env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
