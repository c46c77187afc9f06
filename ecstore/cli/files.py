"""Files ecstore writes outside LMDB, written safely.

:func:`write_private_file` is how ``ecstore-dump export`` (and any other
tool output) reaches the file system: a temporary file created with
``O_CREAT | O_EXCL | O_NOFOLLOW`` (``tempfile.mkstemp``) in the target's own
directory, given exactly ``mode`` (whatever the umask), written, fsynced and
renamed over the target. A symlink planted at a predictable name is never
followed: the temporary name is random and exclusive, and ``rename`` replaces
a symlink at the target itself, not what it points to.

Thread-safe; no global state.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

#: Mode of files ecstore creates unless configured otherwise (``file_mode``).
PRIVATE_FILE_MODE = 0o600


def fsync_dir(path: str) -> None:
    """fsync a directory (a rename in it is then durable); errors ignored
    where the file system cannot fsync directories."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_private_file(path: str, data: Any, mode: int = PRIVATE_FILE_MODE) -> None:
    """Atomically replace ``path`` with ``data`` (bytes-like), file mode
    exactly ``mode``. Raises OSError (the temporary file is removed)."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)
