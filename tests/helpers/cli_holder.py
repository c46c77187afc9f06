"""Holds an ecstore store open for tests/cli/test_cli.py until stdin closes.

Usage: cli_holder.py STORE (ro|rw)

``ro``: a plain read-only LMDB environment (what any reader process holds;
no torch import, so it starts fast). ``rw``: an ecstore.ECStore opened for
writing, as vLLM holds it. Prints ``open`` once the store is open, then waits
for EOF on stdin, closes the store and exits 0.
"""

from __future__ import annotations

import sys


def main() -> int:
    store, mode = sys.argv[1:3]
    if mode == "ro":
        import lmdb

        env = lmdb.open(store, readonly=True, max_dbs=8, subdir=True)
        with env.begin() as txn:
            txn.stat(env.open_db(b"entries", txn=txn, create=False))
        print("open", flush=True)
        sys.stdin.read()
        env.close()
    else:
        import torch

        from ecstore import ECStore, ECStoreConfig

        cfg = ECStoreConfig(local_cpu=False, local_disk=store, max_local_disk_size=1.0)
        with ECStore(cfg, model="holder/model", dtype=torch.float16):
            print("open", flush=True)
            sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
