"""``ecstore-dump show`` and ``export``: one entry (found by key or mm identifier)."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from ecstore.cli.exitcodes import PROG, CLIError, ExitCode
from ecstore.cli.files import write_private_file
from ecstore.cli.format import human_age, human_size, json_out, note, out, printable, shell_arg, write_binary_out
from ecstore.cli.listing import row_json
from ecstore.cli.output_path import STDOUT, check_export_path
from ecstore.cli.target import need_entries, open_readonly, output_mode, resolve_target, split_positionals
from ecstore.maintenance import EntryDetail, entry_detail, entry_problem, namespaces, read_entry


def detail_json(det: EntryDetail) -> dict[str, Any]:
    """An :class:`~ecstore.maintenance.EntryDetail` as ``show --json`` prints it."""
    d = row_json(det.row)
    if not det.present:
        d["check"] = "removed while reading"
        return d
    d["check"] = det.problem or "ok"
    d["blob_bytes"] = det.blob_bytes
    d["header"] = det.header
    if det.header is not None:
        d["header_bytes"] = det.header_bytes
        d["data_offset"] = det.data_offset
    elif det.header_error is not None:
        d["header_error"] = det.header_error
    return d


def cmd_show(args: argparse.Namespace) -> int:
    """``show [PATH] KEY_OR_MM_HASH [--model M] [--json]``: every matching entry in detail."""
    split_positionals(args, ["query"], "[PATH] KEY_OR_MM_HASH")
    target = resolve_target(args)
    with open_readonly(target) as tier:
        rows, how = need_entries(tier, target, args.query, args.model)
        details = [detail_json(entry_detail(tier, r)) for r in rows]
        descriptions = tier.namespace_descriptions()
    for d in details:
        if "namespace" in d:
            d["identity"] = namespaces.identity_of(descriptions, d["namespace"])
    if args.json:
        json_out({"store": target.path, "query": args.query, "matched_by": how, "entries": details})
        return ExitCode.OK
    now = time.time_ns()
    if how == "identifier" and len(details) > 1:
        out(f"{len(details)} entries hold mm identifier {printable(args.query)}:")
        out()
    for i, d in enumerate(details):
        if i:
            out()
        lines = [("key", printable(d["key"])), ("model", printable(d["model"])),
                 ("chunk hash", str(d.get("chunk_hash")))]
        if "identifier" in d:
            lines += [
                ("mm identifier", printable(d["identifier"])),
                ("namespace", d["namespace"] or "none (written before encoder identities: never served)"),
                ("identity", json.dumps(d["identity"], sort_keys=True) if d.get("identity") else "-"),
                ("dtype", d["dtype"]),
                ("shape", str(d["shape"])),
                ("tensor bytes", f"{d['tensor_bytes']} ({human_size(d['tensor_bytes'])})"),
                ("blob bytes", f"{d['bytes']} ({human_size(d['bytes'])})"),
                ("checksum", f"xxh3-64 {d['checksum']}"),
                ("created", f"{d['created']} ({human_age(d['created_ns'], now)})"),
                ("last access", f"{d['last_access']} ({human_age(d['last_access_ns'], now)})"),
                ("hits", str(d["hits"])),
                ("lru seq", f"{d['lru_seq']} (smaller = evicted sooner)"),
            ]
        else:
            lines.append(("record", d.get("error", "unreadable")))
        lines.append(("blob check", d["check"]))
        w = max(len(k) for k, _ in lines)
        for k, v in lines:
            out(f"{k + ':':<{w + 1}} {v}")
        if d.get("header") is not None:
            out(f"safetensors header ({d['header_bytes']} bytes, data at offset {d['data_offset']}):")
            for name, value in d["header"].items():
                if name == "__metadata__" and isinstance(value, dict):
                    out("  __metadata__:")
                    mw = max((len(str(k)) for k in value), default=0)
                    for k, v in value.items():
                        out(f"    {str(k) + ':':<{mw + 1}} {printable(str(v))}")
                else:
                    out(f"  tensor {json.dumps(name)}: {json.dumps(value)}")
        elif d.get("header_error"):
            out(f"safetensors header: unreadable ({d['header_error']})")
    return ExitCode.OK


def cmd_export(args: argparse.Namespace) -> int:
    """``export [PATH] KEY_OR_MM_HASH OUT.safetensors``: one verified entry's blob to a new file
    (or over a regular one: :func:`~.output_path.check_export_path`), or to standard output (``-``)."""
    split_positionals(args, ["query", "out"], "[PATH] KEY_OR_MM_HASH OUT.safetensors")
    target = resolve_target(args)
    with open_readonly(target) as tier:
        rows, how = need_entries(tier, target, args.query, args.model)
        if len(rows) > 1:
            keys = ", ".join(printable(r.key) for r in rows)
            raise CLIError(f"{len(rows)} entries hold mm identifier {printable(args.query)!r} ({keys}); "
                           f"pass the full key or --model")
        key = rows[0].key
        rec, blob, present = read_entry(tier, key)
    if not present:
        raise CLIError(f"entry {key} was removed while reading it")
    problem = entry_problem(key, rec, blob)
    if problem:
        raise CLIError(f"entry {printable(key)} is corrupt ({problem}); not exported. "
                       f"Remove it with: {PROG} purge {shell_arg(target.path)} --key {shell_arg(key)}")
    assert rec is not None and blob is not None
    what = f"exported {printable(key)} ({rec.dtype} {list(rec.shape)}, {len(blob)} bytes, tensor 'ec')"
    if args.out == STDOUT:
        write_binary_out(blob)
        note(f"{what} to standard output")
        return ExitCode.OK
    out_path = os.path.abspath(args.out)
    check_export_path(out_path)
    try:  # a fresh exclusive temporary file, renamed: never follows a symlink
        write_private_file(out_path, blob, output_mode(target))
    except OSError as e:
        raise CLIError(f"cannot write {out_path}: {e.strerror or e}") from None
    out(f"{what} to {out_path}")
    return ExitCode.OK

