"""Subprocess entry point: grow a store's LMDB map from another process.

Usage: ``python grow_store.py DIR N_MIB [PREFIX]``. Opens ``DIR`` with a
256 MiB cap (so a large map), puts N_MIB entries of 1 MiB each
(``ecstore.testing.faults.entry_tensor(i, 1024)``, identifiers ``PREFIX-i``), flushes
and exits; prints the data file's size.
"""

from __future__ import annotations

import os
import sys

import torch

from ecstore import ECStore, ECStoreConfig
from ecstore.testing import faults as fc


def main() -> None:
    path, n = sys.argv[1], int(sys.argv[2])
    prefix = sys.argv[3] if len(sys.argv) > 3 else "grow"
    cfg = ECStoreConfig(local_cpu=False, local_disk=path, max_local_disk_size=0.25,
                        min_file_blob_size=64.0)  # inside LMDB: the entries grow its map
    with ECStore(cfg, model=fc.MODEL, dtype=torch.bfloat16) as s:
        for i in range(n):
            s.put(f"{prefix}-{i}", fc.entry_tensor(i, 1024))
        s.flush()
    print(os.path.getsize(os.path.join(path, "data.mdb")))


if __name__ == "__main__":
    main()
