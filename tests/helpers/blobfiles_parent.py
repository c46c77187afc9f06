"""The parent's side of tests/helpers/blobfiles_child.py, and reading a blob
file back, for the tests/lmdb/test_blobfiles*.py modules."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from ecstore.lmdb.blobfiles import BlobFiles, FileRef

CHILD = str(Path(__file__).with_name("blobfiles_child.py"))


@contextlib.contextmanager
def child(*args: str) -> Iterator[tuple[subprocess.Popen, object]]:
    """A child process (see blobfiles_child.py) and its first JSON line;
    killed at exit if still running."""
    p = subprocess.Popen([sys.executable, CHILD, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line, f"child {args} exited with {p.wait()}"
        yield p, json.loads(line)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def read_back(files: BlobFiles, ref: FileRef) -> bytes:
    """The file's whole content (one byte more is asked for: a longer file shows)."""
    fd = files.open(ref)
    assert fd is not None
    try:
        return os.pread(fd, ref.size + 1, 0)
    finally:
        os.close(fd)
