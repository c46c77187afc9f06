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
    ecstore-dump list|stats|verify redis://host:port/db   (a remote tier: docs/remote.md)

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
* The work (verify, page statistics, purge, compact) is done by the library
  :mod:`ecstore.maintenance`, which returns typed results; this module only
  parses arguments, formats tables/JSON and picks exit codes.
* Progress bars go to stderr, and only when stderr is a terminal.

Exit status: 0 success; 1 ``verify`` found bad entries; 2 error (usage, not
a store, missing path, unknown key, newer schema, corrupt entry on export,
bad config; nothing changed); 3 ``compact`` refused because another process
has the store open (nothing changed).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import re
import shlex
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import AbstractSet, Any, Iterable, Iterator, Sequence

import lmdb

from . import codec, maintenance, namespaces, schema
from .codec import CorruptBlobError
from .config import ECStoreConfig, load_config, normalize_local_disk
from .errors import ConfigError, ECStoreError
from .files import PRIVATE_FILE_MODE, write_private_file
from .key import parse_key
from .lmdb import LMDBTier
from .maintenance import Row, entry_problem, find_entries, key_bytes, read_entry, scan

PROG = "ecstore-dump"

EXIT_OK = 0
EXIT_BAD = 1
EXIT_ERROR = 2
EXIT_BUSY = 3



class CLIError(Exception):
    """A user-facing failure: one line on stderr, then ``code``."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------
# Small output helpers
# --------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(str(text).split("\n")).replace("\r", " ")


def _printable(text: str) -> str:
    """``text`` with control characters escaped (identifiers may hold any)
    and bytes that were not UTF-8 (surrogate escapes) shown as ``\\xNN``."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape_char(c) for c in text)


def _escape_char(c: str) -> str:
    if 0xDC80 <= ord(c) <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{ord(c) - 0xDC00:02x}"
    return c.encode("unicode_escape").decode("ascii")


def _is_utf8(key: str) -> bool:
    try:
        key.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _shell_arg(text: str) -> str:
    """``text`` quoted for a POSIX shell; non-UTF-8 bytes as ``$'\\xNN'``."""
    if _is_utf8(text) and text.isprintable():
        return shlex.quote(text)
    return "$'" + "".join(
        f"\\x{b:02x}" if b < 0x20 or b >= 0x7F or chr(b) in "'\\" else chr(b) for b in key_bytes(text)) + "'"


def _err(message: str) -> None:
    sys.stderr.write(f"{PROG}: error: {_one_line(message)}\n")
    sys.stderr.flush()


def _warn(message: str) -> None:
    sys.stderr.write(f"{PROG}: warning: {_one_line(message)}\n")
    sys.stderr.flush()


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def _out(line: str = "") -> None:
    sys.stdout.write(line + "\n")


def _json_out(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def human_size(n: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units, like the GiB of the config)."""
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    v = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        v /= 1024
        if v < 1024 or unit == "PiB":
            return f"{v:.1f} {unit}"
    raise AssertionError("unreachable")


def human_age(ns: int | None, now_ns: int) -> str:
    """How long before ``now_ns`` the instant ``ns`` was: ``"3m ago"``."""
    if ns is None:
        return "?"
    s = (now_ns - ns) / 1e9
    if s < 0:
        return "in future"
    for limit, div, unit in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h"),
                             (7 * 86400, 86400, "d"), (float("inf"), 7 * 86400, "w")):
        if s < limit:
            return f"{int(s // div)}{unit} ago"
    raise AssertionError("unreachable")


def iso(ns: int | None) -> str | None:
    """Nanoseconds since the epoch -> ISO 8601 UTC, microsecond precision."""
    if ns is None:
        return None
    sec, rest = divmod(int(ns), 10**9)
    t = _dt.datetime.fromtimestamp(sec, tz=_dt.timezone.utc) + _dt.timedelta(microseconds=rest // 1000)
    return t.isoformat(timespec="microseconds")


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], right: AbstractSet[int] = frozenset()) -> None:
    rows = [list(r) for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))

    def fmt(cells: Sequence[str]) -> str:
        parts = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)]
        return "  ".join(parts).rstrip()

    _out(fmt(headers))
    for r in rows:
        _out(fmt(r))


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal.

    Redrawn at most every 0.1 s; cleared on close. Piped output never sees it.
    """

    WIDTH = 28

    def __init__(self, label: str, total: int | None, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _isatty(self.stream)
        self.label = label
        self.total = total
        self.done = 0
        self._last_draw = 0.0
        self._width = 0
        if self.enabled:
            self._draw()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.enabled and (time.monotonic() - self._last_draw >= 0.1 or self.done == self.total):
            self._draw()

    def _draw(self) -> None:
        if self.total:
            frac = min(1.0, self.done / self.total)
            fill = int(frac * self.WIDTH)
            text = (f"{self.label} [{'#' * fill}{'.' * (self.WIDTH - fill)}] "
                    f"{self.done}/{self.total} {frac * 100:3.0f}%")
        else:
            text = f"{self.label} {self.done}"
        self._width = max(self._width, len(text))
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._last_draw = time.monotonic()

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


# --------------------------------------------------------------------------
# Locating and opening the store
# --------------------------------------------------------------------------


@dataclass
class Target:
    """The store a command works on, and its cap when the config knows it."""

    path: str
    cfg: ECStoreConfig | None
    cap_bytes: int | None
    cap_source: str | None
    #: ``file_mode`` of the config when its ``local_disk`` is this store, else None.
    file_mode: int | None = None

    def cap_json(self, used: int) -> dict[str, Any]:
        return {
            "cap_bytes": self.cap_bytes,
            "cap_source": self.cap_source,
            "cap_used": (used / self.cap_bytes) if self.cap_bytes else None,
        }

    def cap_text(self, used: int) -> str:
        if not self.cap_bytes:
            return "cap unknown (max_local_disk_size not configured for this store)"
        return (f"cap {human_size(self.cap_bytes)} (from {self.cap_source}), "
                f"{used / self.cap_bytes * 100:.1f}% used")


def _output_mode(target: Target) -> int:
    """Mode of files the tool writes (export): private unless the config of
    this store shares it with a group on purpose (``file_mode``)."""
    return PRIVATE_FILE_MODE if target.file_mode is None else target.file_mode


def _load_config(path: str | None, *, show_warnings: bool) -> ECStoreConfig:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(path)
    if show_warnings:
        for w in caught:
            _warn(str(w.message))
    return cfg


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def resolve_target(args: argparse.Namespace) -> Target:
    """PATH from the command line, else ``local_disk`` of the effective config."""
    explicit = getattr(args, "path", None)
    cfg: ECStoreConfig | None = None
    try:
        cfg = _load_config(args.config, show_warnings=explicit is None)
    except ConfigError:
        # An explicit PATH does not need the config (only its cap): ignore a
        # broken ambient config, but not one named with --config.
        if explicit is None or args.config is not None:
            raise
    if explicit is not None:
        path = normalize_local_disk(explicit, "command line")
        if not path:
            raise CLIError("empty store path")
    else:
        assert cfg is not None
        if not cfg.local_disk:
            where = cfg.config_file or "no config file (LMCACHE_CONFIG_FILE unset)"
            raise CLIError(f"no store given: pass PATH, or set local_disk (ec_local_disk, "
                           f"LMCACHE_EC_LOCAL_DISK) in the config; config read: {where}")
        path = cfg.local_disk
    cap = src = mode = None
    if cfg is not None and cfg.local_disk and _same_dir(cfg.local_disk, path):
        mode = cfg.file_mode
        if cfg.disk_capacity_bytes:
            cap, src = cfg.disk_capacity_bytes, cfg.source_of("max_local_disk_size")
    return Target(path, cfg, cap, src, mode)


@contextlib.contextmanager
def open_readonly(target: Target) -> Iterator[LMDBTier]:
    """The store of ``target`` opened read-only: :func:`ecstore.maintenance.open_readonly`."""
    with maintenance.open_readonly(target.path, target.cap_bytes, target.file_mode) as tier:
        yield tier


# --------------------------------------------------------------------------
# Reading entries
# --------------------------------------------------------------------------


def _row_json(row: Row) -> dict[str, Any]:
    """One entry as JSON (``list --json``, ``show --json``)."""
    d: dict[str, Any] = {"key": _json_key(row.key), "model": row.model}
    if not _is_utf8(row.key):
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


def _json_key(key: str) -> str:
    """A key for JSON output: bytes that are not UTF-8 shown as ``\\xNN``
    (``key_hex`` then carries the exact bytes)."""
    return key if _is_utf8(key) else "".join(
        _escape_char(c) if 0xDC80 <= ord(c) <= 0xDCFF else c for c in key)


def _need_entries(tier: LMDBTier, target: Target, text: str, model: str | None) -> tuple[list[Row], str]:
    rows, how = find_entries(tier, text, model)
    if not rows:
        extra = f" for model {model!r}" if model else ""
        raise CLIError(f"no entry with key or mm identifier '{_printable(text)}'{extra} in {target.path}")
    return rows, how


# --------------------------------------------------------------------------
# list
# --------------------------------------------------------------------------

_SORTS = {
    "key": (lambda r: r.key, False),
    "lru": (lambda r: (r.rec is None, r.rec.lru_seq if r.rec else 0), False),
    "size": (lambda r: r.rec.blob_size if r.rec else -1, True),
    "hits": (lambda r: r.rec.hits if r.rec else -1, True),
    "age": (lambda r: (r.rec is None, r.rec.created_ns if r.rec else 0), False),
}


def _remote_path(args: argparse.Namespace) -> bool:
    from .remote.inspect import is_remote

    return is_remote(getattr(args, "path", None))


def _remote_command(name: str, args: argparse.Namespace) -> int:
    """list/stats/verify of a remote tier (PATH is a redis:// URL): see ecstore.remote.inspect."""
    from .remote.inspect import run

    return run(name, args)


def cmd_list(args: argparse.Namespace) -> int:
    if _remote_path(args):
        return _remote_command("list", args)
    target = resolve_target(args)
    with open_readonly(target) as tier:
        with Progress("reading entries", tier.entry_count()) as prog:
            rows = list(scan(tier, prog))
        version = tier.schema_version
    total_entries = len(rows)
    total_bytes = sum(r.rec.blob_size for r in rows if r.rec)
    shown = [r for r in rows if args.model is None or r.model == args.model]
    keyfn, reverse = _SORTS[args.sort]
    shown.sort(key=keyfn, reverse=reverse)
    if args.limit is not None:
        shown = shown[: args.limit]
    shown_bytes = sum(r.rec.blob_size for r in shown if r.rec)
    if args.json:
        _json_out({
            "store": target.path,
            "schema_version": version,
            "sort": args.sort,
            "model": args.model,
            "entries": [_row_json(r) for r in shown],
            "shown": {"entries": len(shown), "bytes": shown_bytes},
            "totals": {"entries": total_entries, "bytes": total_bytes, **target.cap_json(total_bytes)},
        })
        return EXIT_OK
    now = time.time_ns()
    table = []
    for r in shown:
        rec = r.rec
        if rec is None:
            table.append([_printable(r.key), "", f"<{r.error}>", "", "", "", "", "", ""])
            continue
        table.append([
            _printable(r.key), namespaces.short(rec.namespace), _printable(rec.mm_identifier),
            "x".join(map(str, rec.shape)), rec.dtype,
            human_size(rec.blob_size), human_age(rec.created_ns, now), human_age(rec.last_access_ns, now),
            str(rec.hits),
        ])
    _table(["KEY", "NAMESPACE", "MM IDENTIFIER", "SHAPE", "DTYPE", "SIZE", "CREATED", "LAST ACCESS",
            "HITS"], table, right={5, 8})
    if len(shown) != total_entries:
        what = f" of model {args.model!r}" if args.model else ""
        _out(f"shown: {_entries(len(shown))}{what}, {human_size(shown_bytes)}")
    _out(f"total: {_entries(total_entries)}, {human_size(total_bytes)} ({total_bytes} bytes); "
         f"{target.cap_text(total_bytes)}")
    return EXIT_OK


# --------------------------------------------------------------------------
# show
# --------------------------------------------------------------------------


def _split_positionals(args: argparse.Namespace, names: Sequence[str], usage: str) -> None:
    """Map ``args.pos`` onto ``[path] + names``: PATH only when all are given."""
    pos = list(args.pos)
    if len(pos) == len(names) + 1:
        args.path = pos.pop(0)
    elif len(pos) == len(names):
        args.path = None
    else:
        raise CLIError(f"expected {usage}, got {len(pos)} argument(s)")
    for n, v in zip(names, pos):
        setattr(args, n, v)


def _entry_detail(tier: LMDBTier, row: Row) -> dict[str, Any]:
    rec, blob, present = read_entry(tier, row.key)
    d = _row_json(Row(row.key, rec, row.error))
    if not present:
        d["check"] = "removed while reading"
        return d
    d["check"] = entry_problem(row.key, rec, blob) or "ok"
    d["blob_bytes"] = None if blob is None else len(blob)
    d["header"] = None
    if blob is not None:
        try:
            hdr = codec.parse_header(blob)
            d["header"] = hdr.raw
            d["header_bytes"] = hdr.data_offset - 8
            d["data_offset"] = hdr.data_offset
        except CorruptBlobError as e:
            d["header_error"] = str(e)
        except Exception as e:  # noqa: BLE001 - a hostile header (wrong JSON types...)
            d["header_error"] = f"{type(e).__name__}: {_one_line(str(e))[:200]}"
    return d


def cmd_show(args: argparse.Namespace) -> int:
    _split_positionals(args, ["query"], "[PATH] KEY_OR_MM_HASH")
    target = resolve_target(args)
    with open_readonly(target) as tier:
        rows, how = _need_entries(tier, target, args.query, args.model)
        details = [_entry_detail(tier, r) for r in rows]
        descriptions = tier.namespace_descriptions()
    for d in details:
        if "namespace" in d:
            d["identity"] = namespaces.identity_of(descriptions, d["namespace"])
    if args.json:
        _json_out({"store": target.path, "query": args.query, "matched_by": how, "entries": details})
        return EXIT_OK
    now = time.time_ns()
    if how == "identifier" and len(details) > 1:
        _out(f"{len(details)} entries hold mm identifier {_printable(args.query)}:")
        _out()
    for i, d in enumerate(details):
        if i:
            _out()
        lines = [("key", _printable(d["key"])), ("model", _printable(d["model"])),
                 ("chunk hash", str(d.get("chunk_hash")))]
        if "identifier" in d:
            lines += [
                ("mm identifier", _printable(d["identifier"])),
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
            _out(f"{k + ':':<{w + 1}} {v}")
        if d.get("header") is not None:
            _out(f"safetensors header ({d['header_bytes']} bytes, data at offset {d['data_offset']}):")
            for name, value in d["header"].items():
                if name == "__metadata__" and isinstance(value, dict):
                    _out("  __metadata__:")
                    mw = max((len(str(k)) for k in value), default=0)
                    for k, v in value.items():
                        _out(f"    {str(k) + ':':<{mw + 1}} {_printable(str(v))}")
                else:
                    _out(f"  tensor {json.dumps(name)}: {json.dumps(value)}")
        elif d.get("header_error"):
            _out(f"safetensors header: unreadable ({d['header_error']})")
    return EXIT_OK


# --------------------------------------------------------------------------
# stats
# --------------------------------------------------------------------------


def cmd_stats(args: argparse.Namespace) -> int:
    if _remote_path(args):
        return _remote_command("stats", args)
    target = resolve_target(args)
    with open_readonly(target) as tier:
        st = maintenance.store_stats(tier, Progress)
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
        _json_out(res)
        return EXIT_OK
    _out(f"store:          {target.path}")
    _out(f"schema version: {version} (this ecstore supports up to {res['schema_supported']})")
    _out(f"entries:        {len(rows)}" + (f" ({unreadable} with unreadable records)" if unreadable else ""))
    _out(f"bytes:          {human_size(total)} ({total} bytes; accounted in meta: {accounted})")
    _out(f"fill:           {target.cap_text(total)}")
    _out(f"hits:           {res['hits']}")
    if recs:
        _out(f"oldest entry:   {res['oldest_created']}")
        _out(f"newest access:  {res['newest_access']}")
    _out()
    _table(["MODEL", "DTYPE", "ENTRIES", "SIZE", "BYTES", "HITS"],
           [[_printable(g.model), g.dtype, str(g.entries), human_size(g.bytes), str(g.bytes),
             str(g.hits)] for g in by], right={2, 3, 4, 5})
    _out()
    _table(["NAMESPACE", "ENTRIES", "SIZE", "HITS", "IDENTITY"],
           [[n.namespace or namespaces.LEGACY, str(n.entries), human_size(n.bytes), str(n.hits),
             _identity_line(n.identity, n.namespace)] for n in by_namespace], right={1, 2, 3})
    _out()
    ps = lm["page_size"]
    _out(f"LMDB file:      {human_size(lm['file_size'])} ({lm['file_pages']} pages of {ps} bytes), "
         f"map size {human_size(lm['map_size'])}")
    _out(f"live pages:     {lm['tree_pages']} (B-tree and overflow pages of all databases + 2 meta)")
    _out(f"free pages:     {lm['free_pages']} ({human_size(lm['free_bytes'])}): below the high-water mark "
         f"(last_pgno {lm['last_pgno']}) but holding no live data; reused by later writes")
    if lm["tail_pages"]:
        _out(f"tail pages:     {lm['tail_pages']} beyond the high-water mark")
    _out(f"compact would reclaim about {human_size(lm['reclaimable_bytes'])}")
    active = [r for r in readers if not r["this_process"]]
    pids = ", ".join(f"{r['pid']}{'' if r['alive'] else ' (dead)'}" for r in active) or "none"
    _out(f"readers:        {len(active)} slot(s) held by other processes ({pids}); "
         f"{lm['reader_slots_high_water']} of {lm['max_readers']} slots used so far")
    return EXIT_OK


def _identity_line(identity: dict[str, Any] | None, namespace: str | None) -> str:
    if namespace is None:
        return "written before encoder identities: never served"
    if not identity:
        return "?"
    w = identity.get("weights") or {}
    return _printable(f"{identity.get('model')} {identity.get('dtype')} weights={w.get('method')}:"
                      f"{str(w.get('value'))[:12]}")


# --------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    _split_positionals(args, ["query", "out"], "[PATH] KEY_OR_MM_HASH OUT.safetensors")
    target = resolve_target(args)
    with open_readonly(target) as tier:
        rows, how = _need_entries(tier, target, args.query, args.model)
        if len(rows) > 1:
            keys = ", ".join(_printable(r.key) for r in rows)
            raise CLIError(f"{len(rows)} entries hold mm identifier {_printable(args.query)!r} ({keys}); "
                           f"pass the full key or --model")
        key = rows[0].key
        rec, blob, present = read_entry(tier, key)
    if not present:
        raise CLIError(f"entry {key} was removed while reading it")
    problem = entry_problem(key, rec, blob)
    if problem:
        raise CLIError(f"entry {_printable(key)} is corrupt ({problem}); not exported. "
                       f"Remove it with: {PROG} purge {_shell_arg(target.path)} --key {_shell_arg(key)}")
    assert rec is not None and blob is not None
    out = os.path.abspath(args.out)
    try:  # a fresh exclusive temporary file, renamed: never follows a symlink
        write_private_file(out, blob, _output_mode(target))
    except OSError as e:
        raise CLIError(f"cannot write {out}: {e.strerror or e}") from None
    _out(f"exported {_printable(key)} ({rec.dtype} {list(rec.shape)}, {len(blob)} bytes, tensor 'ec') to {out}")
    return EXIT_OK


# --------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    if _remote_path(args):
        return _remote_command("verify", args)
    target = resolve_target(args)
    with open_readonly(target) as tier:
        res = maintenance.verify(tier, Progress)
    checked, vanished, problems = res.checked, res.vanished, res.problems
    bad: list[dict[str, Any]] = [{"key": _json_key(b.key), "identifier": b.identifier, "error": b.error}
                                 for b in res.bad]
    ok = checked - len(bad)
    if args.json:
        _json_out({"store": target.path, "checked": checked, "ok": ok, "bad": bad, "vanished": vanished,
                   "problems": problems})
    else:
        for b in bad:
            _out(f"BAD  {_printable(b['key'])}  {b['error']}")
        for p in problems:
            _out(f"BAD  store: {p}")
        _out(f"verified {_entries(checked)} in {target.path}: {ok} ok, {len(bad)} bad"
             + (f", {vanished} removed meanwhile" if vanished else "")
             + (f"; {len(problems)} store problem(s)" if problems else ""))
        if bad:
            _out(f"remove bad entries with: {PROG} purge {target.path} --key KEY")
    return EXIT_BAD if bad or problems else EXIT_OK


# --------------------------------------------------------------------------
# purge
# --------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_older_than(text: str, now_ns: int) -> int:
    """Cutoff (ns since the epoch) for ``--older-than``.

    ``<number><unit>`` with unit s/m/h/d/w counts back from ``now_ns``;
    an ISO 8601 timestamp (``2025-06-01T12:00:00Z``; UTC when no offset is
    given) is used as is.
    """
    shown = _printable(text[:60]) + ("..." if len(text) > 60 else "")
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
        t = t.replace(tzinfo=_dt.timezone.utc)
    try:
        delta = t - _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
    except OverflowError:
        delta = _dt.timedelta(days=-1)
    if delta < _dt.timedelta(0):
        raise CLIError(f"--older-than '{shown}' is before 1970: nothing can be that old")
    return (delta.days * 86400 + delta.seconds) * 10**9 + delta.microseconds * 1000


def cmd_purge(args: argparse.Namespace) -> int:
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
                rows, _ = _need_entries(tier, target, q, None)
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
            _out(f"would remove  {_printable(r.key)}  {size}")
        _out(f"dry run: would remove {_entries(len(victims))} ({human_size(nbytes)}) from {target.path}")
        return EXIT_OK
    if not victims:
        _out(f"nothing to remove from {target.path}")
        return EXIT_OK
    res = maintenance.purge(
        target.path, victims, schema_version=version, cutoff_ns=cutoff, file_mode=target.file_mode,
        capacity=maintenance.purge_capacity(target.path, target.cap_bytes, total_now),
        on_removed=(lambda key: _out(f"removed  {_printable(key)}")) if args.verbose else None,
        progress=Progress)
    _out(f"removed {_entries(res.removed)} ({human_size(res.freed)}) from {target.path}"
         + (f"; skipped {res.skipped} leased by a running loader (retry later)" if res.skipped else ""))
    _out(f"data.mdb stays {human_size(res.file_size)} (LMDB reuses the freed pages); "
         f"run '{PROG} compact' with vLLM stopped to shrink it")
    return EXIT_OK


# --------------------------------------------------------------------------
# compact
# --------------------------------------------------------------------------


def cmd_compact(args: argparse.Namespace) -> int:
    """Rewrite data.mdb compactly: :func:`ecstore.maintenance.compact`
    (its module docstring describes the lock protocol). Exit 3 when another
    process, or this one, has the store open."""
    target = resolve_target(args)
    try:
        res = maintenance.compact(target.path, Progress if _isatty(sys.stderr) else None)
    except maintenance.StoreBusyError as e:
        raise CLIError(str(e), EXIT_BUSY) from None
    _out(f"compacted {res.path}: data.mdb {human_size(res.before)} -> {human_size(res.after)} "
         f"({res.before} -> {res.after} bytes, {_entries(res.entries)})")
    return EXIT_OK


# --------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------


def _describe(cfg: ECStoreConfig) -> list[tuple[str, Any, str]]:
    try:
        from .config import describe_config
    except ImportError:  # pragma: no cover - older config module
        from dataclasses import fields

        rows = [("config_file", cfg.sources.get("__file__"), cfg.sources.get("config_file", "default"))]
        return rows + [(f.name, getattr(cfg, f.name), cfg.sources.get(f.name, "default"))
                       for f in fields(cfg) if f.name != "sources"]
    return describe_config(cfg)


def _yaml_value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def cmd_config(args: argparse.Namespace) -> int:
    cfg = _load_config(args.config, show_warnings=True)
    rows = _describe(cfg)
    if args.json:
        _json_out({
            "config_file": cfg.config_file,
            "values": {k: {"value": v, "source": s} for k, v, s in rows},
            "disk_capacity_bytes": cfg.disk_capacity_bytes,
            "cpu_capacity_bytes": cfg.cpu_capacity_bytes,
        })
        return EXIT_OK
    _table(["KEY", "VALUE", "SOURCE"], [[k, _yaml_value(v), s] for k, v, s in rows])
    if cfg.local_disk:
        _out(f"disk cap: {human_size(cfg.disk_capacity_bytes)} ({cfg.disk_capacity_bytes} bytes) "
             f"at {cfg.local_disk}")
    else:
        _out("no disk tier (local_disk not set): memory-only encoder cache")
    return EXIT_OK


# --------------------------------------------------------------------------
# argument parsing
# --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect and maintain an ecstore encoder-cache store (LMDB + safetensors).",
        epilog="PATH is the local_disk directory or a file:// URI; when omitted it comes from the effective "
               "config (--config FILE, else LMCACHE_CONFIG_FILE, plus LMCACHE_EC_* variables). Exit status: "
               "0 ok, 1 verify found bad entries, 2 error (nothing changed), 3 compact refused: store in use.",
    )
    p.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE",
                        help="LMCache/ecstore YAML config (default: $LMCACHE_CONFIG_FILE)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def cmd(name: str, help_: str, func: Any, **kw: Any) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_, parents=[common], **kw)
        sp.set_defaults(func=func)
        return sp

    sp = cmd("list", "list entries: key, mm identifier, shape, dtype, size, times, hits, totals", cmd_list)
    sp.add_argument("path", nargs="?", metavar="PATH")
    sp.add_argument("--model", help="only entries of this model")
    sp.add_argument("--sort", choices=sorted(_SORTS), default="key",
                    help="key (default), lru (least recently used first), size (largest first), "
                         "hits (most first), age (oldest first)")
    sp.add_argument("--limit", type=_nonneg_int, metavar="N", help="show at most N entries")
    sp.add_argument("--json", action="store_true", help="machine-readable output (exact bytes, ISO times)")

    sp = cmd("show", "one entry's record and safetensors header", cmd_show,
             usage=f"{PROG} show [-h] [--config FILE] [--model M] [--json] [PATH] KEY_OR_MM_HASH")
    sp.add_argument("pos", nargs="+", metavar="[PATH] KEY_OR_MM_HASH",
                    help="a full key, or an mm identifier (all entries holding it are shown)")
    sp.add_argument("--model", help="with an mm identifier: only this model's entry")
    sp.add_argument("--json", action="store_true")

    sp = cmd("stats", "entries and bytes per model and dtype, fill, schema, LMDB pages, readers", cmd_stats)
    sp.add_argument("path", nargs="?", metavar="PATH")
    sp.add_argument("--json", action="store_true")

    sp = cmd("export", "write one entry as a standalone .safetensors file (tensor 'ec')", cmd_export,
             usage=f"{PROG} export [-h] [--config FILE] [--model M] [PATH] KEY_OR_MM_HASH OUT.safetensors")
    sp.add_argument("pos", nargs="+", metavar="[PATH] KEY_OR_MM_HASH OUT.safetensors")
    sp.add_argument("--model", help="with an mm identifier held by several models: pick this one")

    sp = cmd("verify", "check every blob's checksum and header; exit 1 if any is bad", cmd_verify)
    sp.add_argument("path", nargs="?", metavar="PATH")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--delete-bad", action="store_true",
                    help="with a remote URL as PATH: delete the values that fail verification")

    sp = cmd("purge", "remove entries by model, last-access age, key, or all", cmd_purge)
    sp.add_argument("path", nargs="?", metavar="PATH")
    sp.add_argument("--model", help="entries of this model (combines with --older-than)")
    sp.add_argument("--older-than", metavar="AGE",
                    help="entries last used before AGE ago (30m, 12h, 7d, 2w; units s/m/h/d/w) "
                         "or before an ISO 8601 timestamp (UTC unless an offset is given)")
    sp.add_argument("--key", action="append", metavar="K",
                    help="this key, or every entry holding this mm identifier (repeatable)")
    sp.add_argument("--namespace", metavar="NS",
                    help="entries of this encoder identity (its hex digits, or a unique prefix of 6+ as "
                         "'list' shows), or 'none': entries written before identities (never served)")
    sp.add_argument("--all", action="store_true", help="every entry")
    sp.add_argument("--dry-run", action="store_true", help="list what would be removed; change nothing")
    sp.add_argument("-v", "--verbose", action="store_true", help="print each removed key")

    sp = cmd("compact", "rewrite data.mdb compactly; refuses while any other process has the store open",
             cmd_compact)
    sp.add_argument("path", nargs="?", metavar="PATH")

    sp = cmd("config", "the effective encoder-cache config and where each value came from", cmd_config)
    sp.add_argument("--json", action="store_true")
    return p


def _nonneg_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {n}")
    return n


def main(argv: list[str] | None = None) -> int:
    """Run ``ecstore-dump`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage error (2) or --help/--version (0)
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    try:
        rc = args.func(args)
        sys.stdout.flush()
        return rc
    except CLIError as e:
        _err(str(e))
        return e.code
    except ECStoreError as e:  # StoreOpenError, SchemaError, ConfigError, ...
        _err(str(e))
        return EXIT_ERROR
    except lmdb.Error as e:
        _err(f"LMDB error: {e}")
        return EXIT_ERROR
    except BrokenPipeError:  # `ecstore-dump list | head`
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
