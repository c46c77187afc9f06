"""Opens (and closes) the store at a path with blob files, as a new process
using a store created there would: the open creates the store if needed and
sweeps dead writers' blob files. Usage: store_opener.py STORE_DIR"""

from __future__ import annotations

import sys

from ecstore.lmdb import LMDBTier


def main() -> int:
    LMDBTier(sys.argv[1], 16 << 20, file_blobs_from=0).close()
    print("opened", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
