"""A separate process using ecstore.lmdb.blobfiles, for tests/lmdb/test_blobfiles.py.

Run as a script (``python blobfiles_child.py MODE STORE_DIR ...``); talks one
JSON line at a time on stdout, waits for the parent on stdin (no sleeps):

* ``write STORE N SIZE``: write N blobs of SIZE bytes (byte i of blob k is
  ``(k + i) % 251``), print their names, then block reading stdin; at EOF
  close the handle and exit (the parent may SIGKILL it instead).
* ``forkwrite STORE``: write one blob, fork a grandchild (no exec) that
  blocks reading stdin, print ``[name, grandchild pid]``, then block on
  stdin too (the parent SIGKILLs this process, the grandchild lives on).
* ``spare STORE SIZE``: write one blob of SIZE bytes, have a spare file
  made for the next one, print ``[name, spare ready]``, then block on stdin
  (the parent SIGKILLs it).
* ``sweep STORE REFERENCED_JSON``: open a handle, print "ready", wait for a
  line on stdin, sweep with the given referenced names, print the count.
* ``fsize STORE LIMIT SIZE``: with RLIMIT_FSIZE at LIMIT bytes (SIGXFSZ
  ignored), write a blob of SIZE bytes; print the error and the directory.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

import numpy as np

from ecstore.errors import StoreFullError
from ecstore.lmdb.blobfiles import BlobFiles


def pattern(k: int, size: int) -> np.ndarray:
    return ((np.arange(size, dtype=np.int64) + k) % 251).astype(np.uint8)


def say(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(mode: str, store: str, *args: str) -> None:
    if mode == "write":
        files = BlobFiles(store, readonly=False)
        n, size = int(args[0]), int(args[1])
        say([files.write(pattern(k, size)).name for k in range(n)])
        sys.stdin.read()
        files.close()
    elif mode == "spare":
        files = BlobFiles(store, readonly=False)
        name = files.write(pattern(0, int(args[0]))).name
        files.prepare_spare()
        say([name, files.wait_spare()])
        sys.stdin.read()
    elif mode == "forkwrite":
        files = BlobFiles(store, readonly=False)
        name = files.write(pattern(0, 100)).name
        pid = os.fork()
        if pid == 0:  # the grandchild: holds whatever it inherited until stdin closes
            sys.stdin.read()
            os._exit(0)
        say([name, pid])
        sys.stdin.read()
    elif mode == "sweep":
        files = BlobFiles(store, readonly=False)
        keep = set(json.loads(args[0]))
        say("ready")
        sys.stdin.readline()
        say(files.sweep(lambda: keep))
        files.close()
    elif mode == "fsize":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        files = BlobFiles(store, readonly=False)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(args[0]), resource.RLIM_INFINITY))
        try:
            files.write(pattern(0, int(args[1])))
            error = None
        except StoreFullError as e:
            error = str(e)
        say({"error": error, "files": sorted(os.listdir(files.dir))})
        files.close()
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(*sys.argv[1:])
