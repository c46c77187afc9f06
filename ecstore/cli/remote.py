"""``ecstore-dump list|stats|verify redis://...``: formatting of a remote tier's view.

The reading and checking is :mod:`ecstore.remote.inspect` (a library); this
module only picks the command and prints its results. Reads never change
anything; ``verify --delete-bad`` removes values that fail verification (only
if unchanged since they were read; never a key of another type than a
string, which is not ecstore's). URLs are shown masked.

Each command is bounded as a whole by ``--timeout`` seconds (default
:data:`DEFAULT_TIMEOUT_S`): past it, what was found so far is shown, a
warning says the command stopped early, and the exit status is
``ExitCode.INCOMPLETE`` (``verify``: ``BAD`` if it found bad values).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ecstore.cli.exitcodes import ExitCode
from ecstore.cli.format import human_size, json_out, out, print_table, warn

if TYPE_CHECKING:
    from ecstore.remote.backend import RedisBackend
    from ecstore.remote.inspect import TimeBound

#: Seconds a whole ``list``/``stats``/``verify`` of a remote may take (``--timeout``).
DEFAULT_TIMEOUT_S = 600.0


def is_remote_path(args: argparse.Namespace) -> bool:
    """Does the command's PATH name a remote (redis://, unix://...)?"""
    from ecstore.remote.inspect import is_remote

    return is_remote(getattr(args, "path", None))


def run_remote(command: str, args: argparse.Namespace) -> int:
    """``list``, ``stats`` or ``verify`` of the remote named by ``args.path``; the exit status.

    The remote modules are imported here, not at the top: the ``redis``
    client is an optional extra.
    """
    from ecstore.remote.inspect import TimeBound, bounded, connect

    seconds = getattr(args, "timeout", None)
    bound = TimeBound.starting_now(DEFAULT_TIMEOUT_S if seconds is None else seconds)
    with bounded(bound):  # the connection's setup too
        backend = connect(args.path)
        try:
            if command == "list":
                return _cmd_list(backend, args, bound)
            if command == "stats":
                return _cmd_stats(backend, args, bound)
            return _cmd_verify(backend, args, bound)
        finally:
            backend.close()


def _stopped(why: str | None) -> dict[str, Any]:
    """The JSON fields saying whether a command finished."""
    return {"complete": why is None, "stopped_early": why}


def _cmd_list(backend: RedisBackend, args: argparse.Namespace, bound: TimeBound) -> int:
    """``list redis://...``."""
    from ecstore.remote.inspect import RemoteEntryInfo, StoppedEarly, iter_entries

    rows: list[RemoteEntryInfo] = []
    why = None
    try:
        rows.extend(e for e in iter_entries(backend, bound) if not args.model or e.model == args.model)
    except StoppedEarly as e:
        why = str(e)
    rows.sort(key=lambda e: e.key)
    if args.limit is not None:
        rows = rows[: args.limit]
    if args.json:
        json_out({"remote": backend.description, "entries": [asdict(e) for e in rows], **_stopped(why)})
        return _finish(why)
    now = time.time_ns()
    print_table(["KEY", "NAMESPACE", "MM_IDENTIFIER", "SHAPE", "DTYPE", "SIZE", "AGE", "TTL"], [
        [e.key, (e.namespace or "-")[:8], e.identifier or f"(unreadable: {e.error})",
         "x".join(map(str, e.shape or ())), e.dtype or "-",
         human_size(e.value_bytes), "-" if e.created_ns is None else f"{(now - e.created_ns) / 1e9:.0f}s",
         "none" if e.ttl_ms is None else f"{e.ttl_ms / 1000:.0f}s"] for e in rows], right={5})
    out(f"{len(rows)} entries, {human_size(sum(e.value_bytes for e in rows))} at {backend.description}"
        + ("" if why is None else " (incomplete)"))
    return _finish(why)


def _finish(why: str | None) -> int:
    """The exit status of a command that stopped early for ``why`` (None: it finished), said on stderr."""
    if why is None:
        return ExitCode.OK
    warn(why)
    return ExitCode.INCOMPLETE


def _cmd_stats(backend: RedisBackend, args: argparse.Namespace, bound: TimeBound) -> int:
    """``stats redis://...``: per model/dtype and server memory."""
    from ecstore.remote.inspect import StoppedEarly, iter_entries, server_info

    groups: dict[tuple[str, str], dict[str, Any]] = {}
    unreadable = 0
    info: dict[str, Any] = {}
    why = None
    try:
        for e in iter_entries(backend, bound):
            if e.error is not None:
                unreadable += 1
                continue
            g = groups.setdefault((e.model or "?", e.dtype or "?"),
                                  {"model": e.model, "dtype": e.dtype, "entries": 0, "bytes": 0})
            g["entries"] += 1
            g["bytes"] += e.value_bytes
        info = server_info(backend, bound)
    except StoppedEarly as e:
        why = str(e)
    if args.json:
        json_out({"remote": backend.description, "groups": list(groups.values()),
                  "unreadable": unreadable, "server": info, **_stopped(why)})
        return _finish(why)
    print_table(["MODEL", "DTYPE", "ENTRIES", "BYTES"],
                [[str(g["model"]), str(g["dtype"]), str(g["entries"]), human_size(g["bytes"])]
                 for g in groups.values()], right={2, 3})
    cap = info.get("maxmemory") or 0
    out(f"remote {backend.description}: redis {info.get('redis_version')}, used memory "
        f"{human_size(info.get('used_memory'))} of "
        f"{human_size(cap) if cap else 'no maxmemory'} (policy {info.get('maxmemory_policy')}), "
        f"evicted keys {info.get('evicted_keys')}, unreadable values {unreadable}"
        + ("" if why is None else " (incomplete)"))
    return _finish(why)


def _cmd_verify(backend: RedisBackend, args: argparse.Namespace, bound: TimeBound) -> int:
    """``verify redis://... [--delete-bad]``."""
    from ecstore.remote.inspect import verify

    res = verify(backend, delete_bad=getattr(args, "delete_bad", False), bound=bound)
    bad = res.bad or []
    if args.json:
        json_out({"remote": backend.description, "checked": res.checked, "bad": bad,
                  "deleted": res.deleted, "vanished": res.vanished, "kept": res.kept,
                  **_stopped(res.stopped_early)})
    else:
        for b in bad:
            out(f"BAD {b['key']}: {b['error']}")
        out(f"checked {res.checked} values at {backend.description}: {len(bad)} bad"
            + (f", {res.deleted} deleted" if res.deleted else "")
            + (f", {res.kept} left alone (keys of another type: not ecstore's)" if res.kept else "")
            + ("" if res.stopped_early is None else " (incomplete)"))
    rc = _finish(res.stopped_early)
    return ExitCode.BAD if bad else rc
