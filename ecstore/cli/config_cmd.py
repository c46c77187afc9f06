"""``ecstore-dump config``: the effective configuration and where each value came from."""

from __future__ import annotations

import argparse
from typing import Any

from ecstore.cli.exitcodes import ExitCode
from ecstore.cli.format import human_size, json_out, out, print_table
from ecstore.cli.target import load_effective_config
from ecstore.config import describe_config


def _yaml_value(v: Any) -> str:
    """A value as YAML would spell it (null, true/false)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def cmd_config(args: argparse.Namespace) -> int:
    """``config [--config FILE] [--json]``: each effective value and its source."""
    cfg = load_effective_config(args.config, show_warnings=True)
    rows = describe_config(cfg)
    if args.json:
        json_out({
            "config_file": cfg.config_file,
            "values": {k: {"value": v, "source": s} for k, v, s in rows},
            "disk_capacity_bytes": cfg.disk_capacity_bytes,
            "cpu_capacity_bytes": cfg.cpu_capacity_bytes,
        })
        return ExitCode.OK
    print_table(["KEY", "VALUE", "SOURCE"], [[k, _yaml_value(v), s] for k, v, s in rows])
    if cfg.local_disk:
        out(f"disk cap: {human_size(cfg.disk_capacity_bytes)} ({cfg.disk_capacity_bytes} bytes) "
            f"at {cfg.local_disk}")
    else:
        out("no disk tier (local_disk not set): memory-only encoder cache")
    return ExitCode.OK

