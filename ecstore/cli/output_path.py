"""Where ``ecstore-dump export`` may write: a new name or a regular file
outside every ecstore store, or ``-`` (standard output).

The file is written under a fresh temporary name and renamed over OUT
(:func:`ecstore.cli.files.write_private_file`), which replaces whatever sits
there: a device, a FIFO, a socket, a symbolic link (``/dev/stdout``), a
store's ``data.mdb``. So OUT is checked first (``lstat``, no link followed)
and those are refused with a :class:`~.exitcodes.CLIError` (exit 2).
"""

from __future__ import annotations

import os
import stat

from ecstore.cli.exitcodes import CLIError
from ecstore.lmdb.store_files import STORE_FILES

#: OUT meaning standard output.
STDOUT = "-"

_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"))


def _store_holding(directory: str) -> str | None:
    """The ecstore (LMDB) store directory ``directory`` is, or whose ``blobs/``
    it is; None if neither."""
    candidates = [directory]
    if os.path.basename(directory) == "blobs":
        candidates.append(os.path.dirname(directory))
    for d in candidates:
        if any(os.path.lexists(os.path.join(d, name)) for name in STORE_FILES):
            return d
    return None


def check_export_path(path: str) -> None:
    """Raise CLIError unless ``path`` (absolute) is a new name or a regular
    file, and not inside an ecstore store directory (nor its ``blobs/``)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise CLIError(f"cannot write {path}: {e.strerror or e}") from None
    else:
        kind = next((what for test, what in _KINDS if test(st.st_mode)), None)
        if kind is not None:
            target = f" (to {os.readlink(path)})" if stat.S_ISLNK(st.st_mode) else ""
            raise CLIError(f"{path} is {kind}{target}: export writes a new file or replaces a regular one, "
                           f"never this; give another path, or '{STDOUT}' for standard output")
        if not stat.S_ISREG(st.st_mode):
            raise CLIError(f"{path} is not a regular file: export writes a new file or replaces a regular one; "
                           f"give another path, or '{STDOUT}' for standard output")
    directory = os.path.realpath(os.path.dirname(path))
    store = _store_holding(directory)
    if store is not None:
        raise CLIError(f"{path} is inside the ecstore store {store}: export never writes into a store "
                       f"directory; give a path outside it, or '{STDOUT}' for standard output")
