"""Another process opening a store whose lease file (``leases.mdb``) is in
use, damaged or out of reach, then evicting everything it may evict.

Usage: lease_file_opener.py STORE_DIR CAP_BYTES (plain|scarce-fds) [hold KEY]

``plain``: opens the store as an :class:`~ecstore.lmdb.LMDBTier` once.
``scarce-fds``: opens it under a limit on open file descriptors, raised by
one descriptor per attempt from "none free" until an open succeeds: one of
those attempts gets LMDB's data environment open and fails on the lease
file with EMFILE (a transient error, the file is fine). Every failing
attempt must raise an ECStoreError and leave ``leases.mdb`` in place (the
same inode: other processes hold leases in it).

Once open: ``hold KEY`` leases KEY for 600 s, prints one JSON line and waits
for a line on stdin before closing; otherwise it evicts every entry it may
(``_evict_to(0)``: leased entries stay) and prints one JSON line:
``{"errors": [[type, message], ...], "inode_changed": bool, "opened": bool,
"evicted": n, "leases_inode": ino}`` and exits 0 (3 on an exception that is
not an ECStoreError).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile

from ecstore.errors import ECStoreError
from ecstore.lmdb import LMDBTier


def _inode(path: str) -> int | None:
    try:
        return os.stat(os.path.join(path, "leases.mdb")).st_ino
    except FileNotFoundError:
        return None


def _lowest_free_fd() -> int:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    return fd


def main() -> int:
    path, cap, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    hold = sys.argv[5] if len(sys.argv) > 5 and sys.argv[4] == "hold" else None
    before = _inode(path)
    errors: list[list[str]] = []
    changed = False
    tier = None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with tempfile.TemporaryDirectory() as warm:  # lazy imports (py-lmdb's, ...) before fds get scarce
        LMDBTier(os.path.join(warm, "s"), cap).close()
    base = _lowest_free_fd()
    for extra in range(64 if mode == "scarce-fds" else 1):
        if mode == "scarce-fds":
            resource.setrlimit(resource.RLIMIT_NOFILE, (base + extra, hard))
        try:
            tier = LMDBTier(path, cap)
        except ECStoreError as e:
            errors.append([type(e).__name__, str(e)])
        except Exception as e:  # noqa: BLE001 - reported: the test fails on it
            print(json.dumps({"foreign": [type(e).__name__, str(e)]}), flush=True)
            return 3
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        changed = changed or _inode(path) != before
        if tier is not None:
            break
    out: dict[str, object] = {"errors": errors, "inode_changed": changed, "opened": tier is not None,
                              "evicted": 0, "leases_inode": _inode(path)}
    if tier is not None:
        if hold is not None:
            tier.lease([hold], 600)
            print(json.dumps(out), flush=True)
            sys.stdin.readline()
        else:
            before_ev = tier.evictions
            tier._evict_to(0)
            out["evicted"] = tier.evictions - before_ev
            print(json.dumps(out), flush=True)
        tier.close()
    else:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
