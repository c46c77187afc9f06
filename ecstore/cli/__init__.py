"""``ecstore-dump``: inspect and maintain an ecstore encoder-cache store.

With LMCache, operators look at the encoder cache by listing the ``.pt`` files
under ``local_disk``; ecstore keeps every entry inside one LMDB file, so this
tool is how people see them::

    ecstore-dump list    [PATH] [--model M] [--sort key|lru|size|hits|age] [--limit N] [--json]
    ecstore-dump show    [PATH] KEY_OR_MM_HASH [--model M] [--json]
    ecstore-dump stats   [PATH] [--json]
    ecstore-dump export  [PATH] KEY_OR_MM_HASH OUT.safetensors [--model M]
    ecstore-dump verify  [PATH] [--json]
    ecstore-dump purge   [PATH] (--model M | --older-than AGE | --key K | --namespace NS | --all) [--dry-run]
    ecstore-dump compact [PATH]
    ecstore-dump config  [--config FILE] [--json]
    ecstore-dump list|stats|verify redis://host:port/db [--timeout S]   (a remote tier: docs/remote.md)

PATH is the ``local_disk`` directory (or a ``file://`` URI). When omitted it
comes from the effective configuration (:func:`ecstore.config.load_config`:
``--config FILE``, else ``LMCACHE_CONFIG_FILE``, plus ``LMCACHE_EC_*``). With
one positional, ``show`` takes it as the key and the path from the config;
with two, they are PATH and KEY (``export``: two or three positionals).

Behaviour
---------
* Read-only commands (list, show, stats, export, verify, config) open the
  store read-only: no write lock, no LRU or hit-count change, safe while vLLM
  writes to the same store. Records are read in batches of short read
  transactions; each blob is checked in its own transaction.
* The disk cap is not stored in the file: it is taken from the effective
  config when that config's ``local_disk`` is this store, else reported as
  unknown (``null`` in JSON).
* KEY_OR_MM_HASH: a full EC key (``<model>@1@0@<chunk_hash>@<dtype>``) or an
  mm identifier. An identifier selects every entry whose stored identifier
  equals it (several models/dtypes may hold one): ``show`` shows them all,
  ``export`` needs exactly one (narrow with ``--model`` or pass the key).
* purge deletes through a writable :class:`~ecstore.lmdb.tier.LMDBTier`, one
  short write transaction per entry (accounting stays exact and a running
  vLLM is never blocked for long); entries under a live lease are skipped.
* compact needs exclusive use of the store: see :mod:`ecstore.maintenance.compact`.
* The work (verify, page statistics, entry details, purge, compact) is done by
  the library :mod:`ecstore.maintenance` (a remote: :mod:`ecstore.remote.inspect`),
  which returns typed results; this package only parses arguments, formats
  tables/JSON and picks exit codes.
* Progress bars go to stderr, and only when stderr is a terminal.

Modules: :mod:`.parser` (argparse), :mod:`.listing` (list), :mod:`.show`
(show, export), :mod:`.health` (stats, verify), :mod:`.maintain` (purge,
compact), :mod:`.config_cmd` (config), :mod:`.remote` (a redis:// PATH),
:mod:`.target` (which store, opened how), :mod:`.format` (tables, JSON,
sizes, ages, progress), :mod:`.exitcodes` (:class:`ExitCode`, :class:`CLIError`).

Exit status (:class:`ExitCode`): 0 success; 1 ``verify`` found bad entries; 2 error (usage, not
a store, missing path, unknown key, newer schema, corrupt entry on export,
bad config; nothing changed); 3 ``compact`` refused because another process
has the store open (nothing changed); 4 the results could not be written
(standard output on a full disk, an I/O error); 5 a command on a remote
stopped at its ``--timeout`` (the results shown are incomplete).
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
