"""``ecstore-dump list``: every entry of a store (or a remote) as a table or JSON."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from ecstore.cli.exitcodes import ExitCode
from ecstore.cli.format import (
    Progress,
    human_age,
    human_size,
    is_utf8,
    iso,
    json_key,
    json_out,
    n_entries,
    out,
    print_table,
    printable,
)
from ecstore.cli.remote import is_remote_path, run_remote
from ecstore.cli.target import open_readonly, resolve_target
from ecstore.errors import ECStoreError
from ecstore.key import parse_key
from ecstore.maintenance import Row, key_bytes, namespaces, scan


def row_json(row: Row) -> dict[str, Any]:
    """One entry as JSON (``list --json``, ``show --json``)."""
    d: dict[str, Any] = {"key": json_key(row.key), "model": row.model}
    if not is_utf8(row.key):
        d["key_hex"] = key_bytes(row.key).hex()
    try:
        d["chunk_hash"] = parse_key(row.key).chunk_hash
    except ECStoreError:
        d["chunk_hash"] = None
    r = row.rec
    if r is None:
        d["error"] = row.error or "unreadable record"
        return d
    d.update(
        identifier=r.mm_identifier, namespace=r.namespace, shape=list(r.shape), dtype=r.dtype,
        bytes=r.blob_size,
        tensor_bytes=r.nbytes, created=iso(r.created_ns), created_ns=r.created_ns,
        last_access=iso(r.last_access_ns), last_access_ns=r.last_access_ns, hits=r.hits,
        lru_seq=r.lru_seq, checksum=f"{r.checksum:016x}",
    )
    return d


#: ``--sort`` choices: (sort key of a row, largest first).
SORTS: dict[str, tuple[Callable[[Row], Any], bool]] = {
    "key": (lambda r: r.key, False),
    "lru": (lambda r: (r.rec is None, r.rec.lru_seq if r.rec else 0), False),
    "size": (lambda r: r.rec.blob_size if r.rec else -1, True),
    "hits": (lambda r: r.rec.hits if r.rec else -1, True),
    "age": (lambda r: (r.rec is None, r.rec.created_ns if r.rec else 0), False),
}


def cmd_list(args: argparse.Namespace) -> int:
    """``list [PATH] [--model M] [--sort S] [--limit N] [--json]``."""
    if is_remote_path(args):
        return run_remote("list", args)
    target = resolve_target(args)
    with open_readonly(target) as tier:
        with Progress("reading entries", tier.entry_count()) as prog:
            rows = list(scan(tier, prog))
        version = tier.schema_version
    total_entries = len(rows)
    total_bytes = sum(r.rec.blob_size for r in rows if r.rec)
    shown = [r for r in rows if args.model is None or r.model == args.model]
    keyfn, reverse = SORTS[args.sort]
    shown.sort(key=keyfn, reverse=reverse)
    if args.limit is not None:
        shown = shown[: args.limit]
    shown_bytes = sum(r.rec.blob_size for r in shown if r.rec)
    if args.json:
        json_out({
            "store": target.path,
            "schema_version": version,
            "sort": args.sort,
            "model": args.model,
            "entries": [row_json(r) for r in shown],
            "shown": {"entries": len(shown), "bytes": shown_bytes},
            "totals": {"entries": total_entries, "bytes": total_bytes, **target.cap_json(total_bytes)},
        })
        return ExitCode.OK
    now = time.time_ns()
    table = []
    for r in shown:
        rec = r.rec
        if rec is None:
            table.append([printable(r.key), "", f"<{r.error}>", "", "", "", "", "", ""])
            continue
        table.append([
            printable(r.key), namespaces.short(rec.namespace), printable(rec.mm_identifier),
            "x".join(map(str, rec.shape)), rec.dtype,
            human_size(rec.blob_size), human_age(rec.created_ns, now), human_age(rec.last_access_ns, now),
            str(rec.hits),
        ])
    print_table(["KEY", "NAMESPACE", "MM IDENTIFIER", "SHAPE", "DTYPE", "SIZE", "CREATED", "LAST ACCESS",
                 "HITS"], table, right={5, 8})
    if len(shown) != total_entries:
        what = f" of model {args.model!r}" if args.model else ""
        out(f"shown: {n_entries(len(shown))}{what}, {human_size(shown_bytes)}")
    out(f"total: {n_entries(total_entries)}, {human_size(total_bytes)} ({total_bytes} bytes); "
        f"{target.cap_text(total_bytes)}")
    return ExitCode.OK
