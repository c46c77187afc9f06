"""Run ecstore code as another user, for tests that run as root.

Usage: as_user.py UID GID GROUPS(comma-separated or -) MODE ARGS...

The interpreter starts as root (it lives under /root, which other users
cannot read), imports everything the command needs, then drops to UID/GID
with the given supplementary groups -- from then on every file access is
checked against that user, as for a real other user. MODE:

* ``dump ARGS...``: ``ecstore-dump ARGS...`` (exit status passed through);
* ``put STORE FILE_MODE``: open the store read-write with ``file_mode``
  (octal), put one entry, read it back; prints ``ok``.
* ``open STORE``: open the store read-write; prints ``ok`` or the error.
"""

from __future__ import annotations

import os
import sys


def _import_everything_lazy() -> None:
    """Import every module ecstore or lmdb may import on first use.

    After the privilege drop the checkout may be unreadable (a clone under a
    0700 directory such as ``mktemp -d``): a lazy import then fails with
    ModuleNotFoundError, which is not what the tests are about. The vLLM
    connector is left out (not used here, and slow to import).
    """
    import importlib
    import pkgutil

    import lmdb

    import ecstore

    skips = {ecstore: ("ecstore.connector", "ecstore.testing"), lmdb: ("lmdb.tool", "lmdb.__main__", "lmdb.cffi")}

    def walk(path: list[str], prefix: str, skip: tuple[str, ...]) -> None:
        # Not pkgutil.walk_packages: it imports every package it recurses
        # into, skipped ones too (ecstore.connector imports vLLM: 8 s a run).
        for info in pkgutil.iter_modules(path, prefix):
            if info.name.startswith(skip):
                continue
            try:
                module = importlib.import_module(info.name)
            except ImportError:  # optional parts
                continue
            if info.ispkg:
                walk(list(module.__path__), info.name + ".", skip)

    for pkg, skip in skips.items():
        walk(list(pkg.__path__), pkg.__name__ + ".", skip)
    from ecstore.lmdb import schema

    schema.migrations()  # imported once, then cached


def main() -> int:
    uid, gid, groups, mode, *args = sys.argv[1:]
    import logging  # noqa: F401 - everything the command imports lazily
    import resource  # noqa: F401

    import torch

    from ecstore import ECStore, ECStoreConfig, cli, config, errors  # noqa: F401

    _import_everything_lazy()

    os.setgroups([int(g) for g in groups.split(",")] if groups != "-" else [])
    os.setgid(int(gid))
    os.setuid(int(uid))
    if mode == "dump":
        return cli.main(args)
    store = args[0]
    file_mode = int(args[1], 8) if len(args) > 1 else 0o600
    try:
        cfg = ECStoreConfig(local_cpu=False, local_disk=store, max_local_disk_size=0.01, file_mode=file_mode)
        with ECStore(cfg, model="as/user", dtype=torch.float16) as s:
            if mode == "put":
                t = torch.ones(4, 8, dtype=torch.float16) * os.getuid()
                s.put(f"from-{os.getuid()}", t)
                s.flush()
                got = s.get(f"from-{os.getuid()}")
                assert got is not None and torch.equal(got, t)
    except errors.ECStoreError as e:
        print(f"error: {e}", flush=True)
        return 2
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
