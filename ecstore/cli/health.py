"""``ecstore-dump stats`` and ``verify``: formatting of :mod:`ecstore.maintenance.inspect` results."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from ecstore import maintenance
from ecstore.cli.exitcodes import PROG, ExitCode
from ecstore.cli.format import Progress, human_size, iso, json_key, json_out, n_entries, out, print_table, printable
from ecstore.cli.remote import is_remote_path, run_remote
from ecstore.cli.target import open_readonly, resolve_target
from ecstore.lmdb import schema
from ecstore.maintenance import namespaces


def cmd_stats(args: argparse.Namespace) -> int:
    """``stats [PATH] [--json]``: totals per model/dtype/namespace, fill, LMDB pages, readers."""
    if is_remote_path(args):
        return run_remote("stats", args)
    target = resolve_target(args)
    with open_readonly(target) as tier:
        st = maintenance.store_report(tier, Progress)
    rows, by, by_namespace, version = st.rows, st.by_model, st.by_namespace, st.schema_version
    unreadable, recs, total = st.unreadable, st.records, st.bytes
    lm = st.pages.as_json()
    accounted = st.pages.accounted_bytes
    readers = [asdict(r) for r in st.readers]
    res = {
        "store": target.path,
        "schema_version": version,
        "schema_supported": schema.current_version(),
        "entries": len(rows),
        "unreadable_records": unreadable,
        "bytes": total,
        "accounted_bytes": accounted,
        "tensor_bytes": sum(g.tensor_bytes for g in by),
        "hits": sum(g.hits for g in by),
        **target.cap_json(total),
        "oldest_created": iso(min((r.created_ns for r in recs), default=None)),
        "newest_access": iso(max((r.last_access_ns for r in recs), default=None)),
        "by_model": [asdict(g) for g in by],
        "by_namespace": [n.as_json() for n in by_namespace],
        "lmdb": lm,
        "readers": readers,
    }
    if args.json:
        json_out(res)
        return ExitCode.OK
    out(f"store:          {target.path}")
    out(f"schema version: {version} (this ecstore supports up to {res['schema_supported']})")
    out(f"entries:        {len(rows)}" + (f" ({unreadable} with unreadable records)" if unreadable else ""))
    out(f"bytes:          {human_size(total)} ({total} bytes; accounted in meta: {accounted})")
    out(f"fill:           {target.cap_text(total)}")
    out(f"hits:           {res['hits']}")
    if recs:
        out(f"oldest entry:   {res['oldest_created']}")
        out(f"newest access:  {res['newest_access']}")
    out()
    print_table(["MODEL", "DTYPE", "ENTRIES", "SIZE", "BYTES", "HITS"],
           [[printable(g.model), g.dtype, str(g.entries), human_size(g.bytes), str(g.bytes),
             str(g.hits)] for g in by], right={2, 3, 4, 5})
    out()
    print_table(["NAMESPACE", "ENTRIES", "SIZE", "HITS", "IDENTITY"],
           [[n.namespace or namespaces.LEGACY, str(n.entries), human_size(n.bytes), str(n.hits),
             _identity_line(n.identity, n.namespace)] for n in by_namespace], right={1, 2, 3})
    out()
    ps = lm["page_size"]
    out(f"LMDB file:      {human_size(lm['file_size'])} ({lm['file_pages']} pages of {ps} bytes), "
        f"map size {human_size(lm['map_size'])}")
    out(f"live pages:     {lm['tree_pages']} (B-tree and overflow pages of all databases + 2 meta)")
    out(f"free pages:     {lm['free_pages']} ({human_size(lm['free_bytes'])}): below the high-water mark "
        f"(last_pgno {lm['last_pgno']}) but holding no live data; reused by later writes")
    if lm["tail_pages"]:
        out(f"tail pages:     {lm['tail_pages']} beyond the high-water mark")
    out(f"compact would reclaim about {human_size(lm['reclaimable_bytes'])}")
    out(f"blob files:     {lm['blob_files']} ({human_size(lm['blob_file_bytes'])}) in blobs/: "
        f"entries of at least min_file_blob_size")
    active = [r for r in readers if not r["this_process"]]
    pids = ", ".join(f"{r['pid']}{'' if r['alive'] else ' (dead)'}" for r in active) or "none"
    out(f"readers:        {len(active)} slot(s) held by other processes ({pids}); "
        f"{lm['reader_slots_high_water']} of {lm['max_readers']} slots used so far")
    return ExitCode.OK


def _identity_line(identity: dict[str, Any] | None, namespace: str | None) -> str:
    """A namespace's encoder identity in one line for the stats table."""
    if namespace is None:
        return "written before encoder identities: never served"
    if not identity:
        return "?"
    w = identity.get("weights") or {}
    return printable(f"{identity.get('model')} {identity.get('dtype')} weights={w.get('method')}:"
                      f"{str(w.get('value'))[:12]}")


def cmd_verify(args: argparse.Namespace) -> int:
    """``verify [PATH] [--json]``: check every entry; exit 1 when any is bad."""
    if is_remote_path(args):
        return run_remote("verify", args)
    target = resolve_target(args)
    with open_readonly(target) as tier:
        res = maintenance.verify(tier, Progress)
    checked, vanished, problems = res.checked, res.vanished, res.problems
    bad: list[dict[str, Any]] = [{"key": json_key(b.key), "identifier": b.identifier, "error": b.error}
                                 for b in res.bad]
    ok = checked - len(bad)
    if args.json:
        json_out({"store": target.path, "checked": checked, "ok": ok, "bad": bad, "vanished": vanished,
                   "problems": problems})
    else:
        for b in bad:
            out(f"BAD  {printable(b['key'])}  {b['error']}")
        for p in problems:
            out(f"BAD  store: {p}")
        out(f"verified {n_entries(checked)} in {target.path}: {ok} ok, {len(bad)} bad"
            + (f", {vanished} removed meanwhile" if vanished else "")
            + (f"; {len(problems)} store problem(s)" if problems else ""))
        if bad:
            out(f"remove bad entries with: {PROG} purge {target.path} --key KEY")
    return ExitCode.BAD if bad or problems else ExitCode.OK

