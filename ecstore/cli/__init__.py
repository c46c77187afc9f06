"""``ecstore-dump``: inspect and maintain an ecstore encoder-cache store.

:func:`main` runs one command and turns every error into one stderr line and
an :class:`ExitCode` (0 ok, 1 bad entries, 2 error, 3 busy, 4 output, 5
remote timeout, 130 Ctrl-C). Read-only commands never take the write lock and are safe
while vLLM writes. This package only parses arguments, formats results and
picks exit codes; the work is :mod:`ecstore.maintenance` (a remote:
:mod:`ecstore.remote.inspect`). Commands, behaviour, exit status and the
module layout: docs/cli.md (#exit-status-and-code-layout).
"""

from __future__ import annotations

import contextlib
import os
import sys

import lmdb

from ecstore.cli.exitcodes import PROG, CLIError, ExitCode, OutputError
from ecstore.cli.format import err, flush_out, human_age, human_size, iso
from ecstore.cli.maintain import parse_older_than
from ecstore.cli.parser import build_parser
from ecstore.errors import ECStoreError

__all__ = ["PROG", "CLIError", "ExitCode", "build_parser", "human_age", "human_size", "iso", "main", "parse_older_than"]


def main(argv: list[str] | None = None) -> int:
    """Run ``ecstore-dump`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage error (2) or --help/--version (0)
        return e.code if isinstance(e.code, int) else int(ExitCode.ERROR)
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    try:
        rc = args.func(args)
        flush_out()
        return int(rc)
    except OutputError as e:
        err(str(e))
        _discard_stdout()  # what stays buffered must not fail again at exit
        return int(e.code)
    except CLIError as e:
        err(str(e))
        return int(e.code)
    except ECStoreError as e:  # StoreOpenError, SchemaError, ConfigError, ...
        err(str(e))
        return int(ExitCode.ERROR)
    except lmdb.Error as e:
        err(f"LMDB error: {e}")
        return int(ExitCode.ERROR)
    except BrokenPipeError:  # `ecstore-dump list | head`
        _discard_stdout()
        return int(ExitCode.OK)
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return int(ExitCode.INTERRUPTED)


def _discard_stdout() -> None:
    """Point stdout's descriptor at /dev/null: what is still buffered for a
    reader that went away or a full disk is dropped at exit, not reported
    again as an exception."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
