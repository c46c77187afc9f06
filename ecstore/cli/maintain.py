"""``ecstore-dump purge`` and ``compact``: argument checks and reports around
:func:`ecstore.maintenance.purge` and :func:`ecstore.maintenance.compact`."""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import re
import sys
import time

from ecstore import maintenance
from ecstore.cli.exitcodes import PROG, CLIError, ExitCode
from ecstore.cli.format import Progress, human_size, isatty, n_entries, out, printable
from ecstore.cli.target import need_entries, open_readonly, resolve_target
from ecstore.errors import ECStoreError
from ecstore.maintenance import namespaces

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_older_than(text: str, now_ns: int) -> int:
    """Cutoff (ns since the epoch) for ``--older-than``.

    ``<number><unit>`` with unit s/m/h/d/w counts back from ``now_ns``;
    an ISO 8601 timestamp (``2025-06-01T12:00:00Z``; UTC when no offset is
    given) is used as is.
    """
    shown = printable(text[:60]) + ("..." if len(text) > 60 else "")
    m = _DURATION.match(text)
    if m:
        age_ns = float(m.group(1)) * _UNIT_S[m.group(2)] * 1e9
        if not math.isfinite(age_ns) or age_ns > now_ns:
            raise CLIError(f"--older-than '{shown}' reaches back before 1970: nothing can be that old; "
                           f"give a smaller age (e.g. 30d)")
        return now_ns - int(round(age_ns))
    try:
        t = _dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise CLIError(f"--older-than '{shown}': expected an age like 30m, 12h, 7d, 2w "
                       f"(units s/m/h/d/w) or an ISO 8601 timestamp") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.UTC)
    try:
        delta = t - _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
    except OverflowError:
        delta = _dt.timedelta(days=-1)
    if delta < _dt.timedelta(0):
        raise CLIError(f"--older-than '{shown}' is before 1970: nothing can be that old")
    return (delta.days * 86400 + delta.seconds) * 10**9 + delta.microseconds * 1000


def cmd_purge(args: argparse.Namespace) -> int:
    """``purge [PATH] (--model M | --older-than AGE | --key K | --namespace NS | --all) [--dry-run]``."""
    if args.all and (args.model or args.older_than or args.key or args.namespace):
        raise CLIError("--all cannot be combined with --model, --older-than, --key or --namespace")
    if not (args.all or args.model or args.older_than or args.key or args.namespace):
        raise CLIError("say what to purge: --model M, --older-than AGE, --key K (repeatable), "
                       "--namespace NS or --all")
    if args.namespace:
        try:
            args.namespace = namespaces.check_spec(args.namespace)
        except ECStoreError as e:
            raise CLIError(str(e)) from None
    now = time.time_ns()
    cutoff = parse_older_than(args.older_than, now) if args.older_than else None
    target = resolve_target(args)
    with open_readonly(target) as tier:
        version = tier.schema_version
        total_now = tier.total_bytes()
        keyset: frozenset[str] | None = None
        if args.key:
            found: set[str] = set()
            for q in args.key:
                rows, _ = need_entries(tier, target, q, None)
                found.update(r.key for r in rows)
            keyset = frozenset(found)
        criteria = maintenance.PurgeCriteria(all_entries=args.all, keys=keyset, model=args.model,
                                             cutoff_ns=cutoff, namespace=args.namespace)
        try:
            victims = maintenance.select_victims(tier, criteria, Progress)
        except ECStoreError as e:
            raise CLIError(str(e)) from None
    nbytes = sum(r.rec.blob_size for r in victims if r.rec)
    if args.dry_run:
        for r in victims:
            size = human_size(r.rec.blob_size) if r.rec else "?"
            out(f"would remove  {printable(r.key)}  {size}")
        out(f"dry run: would remove {n_entries(len(victims))} ({human_size(nbytes)}) from {target.path}")
        return ExitCode.OK
    if not victims:
        out(f"nothing to remove from {target.path}")
        return ExitCode.OK
    res = maintenance.purge(
        target.path, victims, schema_version=version, cutoff_ns=cutoff, file_mode=target.file_mode,
        capacity=maintenance.purge_capacity(target.path, target.cap_bytes, total_now),
        on_removed=(lambda key: out(f"removed  {printable(key)}")) if args.verbose else None,
        progress=Progress)
    out(f"removed {n_entries(res.removed)} ({human_size(res.freed)}) from {target.path}"
        + (f"; skipped {res.skipped} leased by a running loader (retry later)" if res.skipped else ""))
    out(f"data.mdb stays {human_size(res.file_size)} (LMDB reuses the freed pages); "
        f"run '{PROG} compact' with vLLM stopped to shrink it")
    return ExitCode.OK


def cmd_compact(args: argparse.Namespace) -> int:
    """Rewrite data.mdb compactly: :func:`ecstore.maintenance.compact`
    (its module docstring describes the lock protocol). Exit 3 when another
    process, or this one, has the store open."""
    target = resolve_target(args)
    try:
        res = maintenance.compact(target.path, Progress if isatty(sys.stderr) else None)
    except maintenance.StoreBusyError as e:
        raise CLIError(str(e), ExitCode.BUSY) from None
    out(f"compacted {res.path}: data.mdb {human_size(res.before)} -> {human_size(res.after)} "
        f"({res.before} -> {res.after} bytes, {n_entries(res.entries)})")
    return ExitCode.OK

