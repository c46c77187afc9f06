"""Argument parsing of ``ecstore-dump``: one sub-parser per command."""

from __future__ import annotations

import argparse
from typing import Any

from ecstore.cli.config_cmd import cmd_config
from ecstore.cli.exitcodes import PROG
from ecstore.cli.health import cmd_stats, cmd_verify
from ecstore.cli.listing import SORTS, cmd_list
from ecstore.cli.maintain import cmd_compact, cmd_purge
from ecstore.cli.show import cmd_export, cmd_show


def build_parser() -> argparse.ArgumentParser:
    """The ``ecstore-dump`` argument parser; each sub-command sets ``func`` (its ``cmd_*``)."""
    from ecstore import __version__

    p = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect and maintain an ecstore encoder-cache store (LMDB + safetensors).",
        epilog="PATH is the local_disk directory or a file:// URI; when omitted it comes from the effective "
               "config (--config FILE, else LMCACHE_CONFIG_FILE, plus LMCACHE_EC_* variables). Exit status: "
               "0 ok, 1 verify found bad entries, 2 error (nothing changed), 3 compact refused: store in use, "
               "4 the output could not be written, 5 a remote command stopped at its --timeout.",
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
    sp.add_argument("--sort", choices=sorted(SORTS), default="key",
                    help="key (default), lru (least recently used first), size (largest first), "
                         "hits (most first), age (oldest first)")
    sp.add_argument("--limit", type=_nonneg_int, metavar="N", help="show at most N entries")
    sp.add_argument("--json", action="store_true", help="machine-readable output (exact bytes, ISO times)")
    _remote_timeout(sp)

    sp = cmd("show", "one entry's record and safetensors header", cmd_show,
             usage=f"{PROG} show [-h] [--config FILE] [--model M] [--json] [PATH] KEY_OR_MM_HASH")
    sp.add_argument("pos", nargs="+", metavar="[PATH] KEY_OR_MM_HASH",
                    help="a full key, or an mm identifier (all entries holding it are shown)")
    sp.add_argument("--model", help="with an mm identifier: only this model's entry")
    sp.add_argument("--json", action="store_true")

    sp = cmd("stats", "entries and bytes per model and dtype, fill, schema, LMDB pages, readers", cmd_stats)
    sp.add_argument("path", nargs="?", metavar="PATH")
    sp.add_argument("--json", action="store_true")
    _remote_timeout(sp)

    sp = cmd("export", "write one entry as a standalone .safetensors file (tensor 'ec'): a new file, over a "
                       "regular one (never into a store), or '-' (standard output)", cmd_export,
             usage=f"{PROG} export [-h] [--config FILE] [--model M] [PATH] KEY_OR_MM_HASH OUT.safetensors")
    sp.add_argument("pos", nargs="+", metavar="[PATH] KEY_OR_MM_HASH OUT.safetensors")
    sp.add_argument("--model", help="with an mm identifier held by several models: pick this one")

    sp = cmd("verify", "check every blob's checksum and header; exit 1 if any is bad", cmd_verify)
    sp.add_argument("path", nargs="?", metavar="PATH")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--delete-bad", action="store_true",
                    help="with a remote URL as PATH: delete the values that fail verification")
    _remote_timeout(sp)

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


def _remote_timeout(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--timeout", type=_positive_seconds, metavar="SECONDS",
                    help="with a remote URL as PATH: stop after SECONDS for the whole command (default 600), "
                         "show what was found and exit 5")


def _positive_seconds(text: str) -> float:
    """``--timeout SECONDS``: a finite number > 0."""
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < s < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return s


def _nonneg_int(text: str) -> int:
    """``--limit N``: a whole number >= 0."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {n}")
    return n

