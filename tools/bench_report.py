"""Statistics, targets, Markdown table and PNG plot for ``tools/bench.py``."""

from __future__ import annotations

import math
from typing import Any

MS = 1e3
US = 1e6


def quantile(xs: list[float], p: float) -> float:
    """Linear-interpolated quantile of sorted ``xs``."""
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    pos = p * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(samples: list[float]) -> dict[str, Any]:
    xs = sorted(float(x) for x in samples)
    out = {
        "median": quantile(xs, 0.5),
        "p10": quantile(xs, 0.1),
        "p90": quantile(xs, 0.9),
        "p99": quantile(xs, 0.99),
        "min": xs[0] if xs else float("nan"),
        "max": xs[-1] if xs else float("nan"),
        "n": len(xs),
    }
    if len(xs) <= 64:
        out["samples"] = [float(x) for x in samples]
    return out


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ---------------------------------------------------------------------------
# formatting
# ---------------------------------------------------------------------------
def fmt_time(s: float | None) -> str:
    if s is None or not is_number(s):
        return "n/a"
    if s < 1e-3:
        return f"{s * US:.1f} µs"
    if s < 1.0:
        return f"{s * MS:.2f} ms"
    return f"{s:.2f} s"


def fmt_value(v: float | None, unit: str) -> str:
    if v is None or not is_number(v):
        return "n/a"
    if unit == "s":
        return fmt_time(v)
    if unit == "GB/s":
        return f"{v:.2f} GB/s"
    if unit == "x":
        return f"{v:.2f}×"
    if unit == "req/s":
        return f"{v:.0f} req/s"
    if unit == "ratio":
        return f"{v:.3f}"
    return f"{v:.4g} {unit}"


def fmt_ratio(r: float | None) -> str:
    if r is None or not is_number(r):
        return ""
    if r < 0.1:
        return f"{r:.3f}×"
    return f"{r:.2f}×" if r < 100 else f"{r:.0f}×"


# ---------------------------------------------------------------------------
# targets
# ---------------------------------------------------------------------------
def find(rows: list[dict], **kw) -> dict | None:
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def evaluate_targets(res: dict) -> list[dict]:
    """One row per (target, workload): measured value, ratio, goal, met."""
    rows = res["rows"]
    wls = [w["name"] for w in res["workloads"]]
    out: list[dict] = []

    def add(target: str, workload: str, measured: float | None, unit: str, ratio: float | None,
            goal: str, met: bool | None, detail: str = "") -> None:
        out.append({"target": target, "workload": workload, "measured": measured, "unit": unit,
                    "ratio": ratio, "goal": goal,
                    "met": None if met is None else bool(met), "detail": detail})

    # The targets of issue 13 (ratios within one run).
    for w in wls:
        mc = find(rows, section="floor", workload=w, system="memcpy")
        save = find(rows, section="save", workload=w, system="ecstore connector")
        ex = find(rows, section="save", workload=w, system="ECExampleConnector")
        if mc and save:
            small = (find(res["workloads"], name=w) or {}).get("nbytes", 0) < 2e6
            r = save["median"] / mc["median"]
            if small:  # issue 30: ≤ 100 µs in the step (was 50 µs + 1.5× memcpy, issue 13)
                budget = 100e-6
                cold = find(rows, section="floor", workload=w, system="memcpy after settle (info)")
                like = (f"; {save['median'] / cold['median']:.2f}× the same copy after a settle "
                        f"({fmt_time(cold['median'])})") if cold and cold["median"] else ""
                add("1 MB save in model step ≤ 100 µs", w, save["median"], "s", save["median"] / budget,
                    "≤ 1.0× of 100 µs", save["median"] <= budget,
                    f"{r:.2f}× memcpy {fmt_time(mc['median'])}{like}")
            else:
                add("save in model step ≤ 1.5× memcpy", w, save["median"], "s", r, "≤ 1.5×", r <= 1.5,
                    f"memcpy {fmt_time(mc['median'])}")
        if ex and save:
            r = ex["median"] / save["median"]
            add("save ≥ 2× faster than ECExampleConnector", w, ex["median"], "s", r, "≥ 2×", r >= 2.0,
                f"ECExample {fmt_time(ex['median'])} / ecstore {fmt_time(save['median'])}")
    for w in wls:
        m = find(rows, section="hit", workload=w, system="ecstore get (memory tier)")
        if m:
            r = m["median"] / 1e-4
            add("memory-tier hit ≤ 0.1 ms", w, m["median"], "s", r, "≤ 1.0× of 0.1 ms", r <= 1.0,
                f"p90 {fmt_time(m['p90'])}")
    for w in wls:
        # A hit's floor: memcpy; on a GPU the H2D copy from pinned memory.
        mc = (find(rows, section="floor", workload=w, system="H2D")
              or find(rows, section="floor", workload=w, system="memcpy"))
        m = find(rows, section="hit", workload=w, system="ecstore get (LMDB, warm)")
        small = (find(res["workloads"], name=w) or {}).get("nbytes", 0) < 2e6
        if mc and m and not small:  # 1 MB: against the raw-file peer (issue 30), below
            r = m["median"] / mc["median"]
            add("LMDB-tier warm hit ≤ 1.5× memcpy", w, m["median"], "s", r, "≤ 1.5×", r <= 1.5,
                f"memcpy {fmt_time(mc['median'])}")
        raw = find(rows, section="hit", workload=w, system="raw files get + checksum (warm)")
        if m and raw and small:
            r = m["median"] / raw["median"]
            add("1 MB disk-tier hit ≤ 1.3× the raw-file peer with checksum", w, m["median"], "s", r, "≤ 1.3×",
                r <= 1.3, f"raw file read + xxh3 {fmt_time(raw['median'])}")
        # Connector loads against ECExampleConnector's count until the data is read (issue 30's
        # answer to the lazily mapped tensors of issue 13's comparison): the loadread section.
        c = find(rows, section="loadread", workload=w, system="ecstore connector load + read (LMDB, warm)")
        exl = find(rows, section="loadread", workload=w, system="ECExampleConnector load + read (warm)")
        if c and exl:
            r = c["median"] / exl["median"]
            add("connector load until read ≤ ECExampleConnector's until read", w, c["median"], "s", r,
                "≤ 1.0×", r <= 1.0, f"ECExample {fmt_time(exl['median'])} (load + one pass over the tensor)")
    # The targets of issue 30 (entries of 34.3 and 130.8 MB; ratios within one run).
    for w in wls:
        large = (find(res["workloads"], name=w) or {}).get("nbytes", 0) >= 2e6
        mc = find(rows, section="floor", workload=w, system="memcpy")
        bb = find(rows, section="burst", workload=w, system="ecstore connector save (back to back)")
        if mc and bb and large:
            r = bb["median"] / mc["median"]
            add("back-to-back save median ≤ 1.5× memcpy", w, bb["median"], "s", r, "≤ 1.5×", r <= 1.5,
                f"memcpy {fmt_time(mc['median'])}; n={bb['n']}")
            r = bb["max"] / mc["median"]
            add("back-to-back save worst ≤ 3× memcpy", w, bb["max"], "s", r, "≤ 3×", r <= 3.0,
                f"memcpy {fmt_time(mc['median'])}; n={bb['n']}")
        rate = find(rows, section="burst", workload=w, system="ecstore burst durable throughput")
        dev = find(rows, section="burst", workload=w, system="device floor: one file + fdatasync")
        if rate and dev and large:
            r = rate["median"] / dev["median"]
            add("back-to-back durable throughput ≥ 0.8× the device floor", w, rate["median"], "GB/s", r,
                "≥ 0.8×", r >= 0.8, f"one file + fdatasync {dev['median']:.2f} GB/s")
        step = find(rows, section="producer", workload=w, system="encode-only step per save")
        if mc and step and large:
            r = step["median"] / mc["median"]
            add("encode-only producer step ≤ 4× memcpy", w, step["median"], "s", r, "≤ 4×", r <= 4.0,
                f"memcpy {fmt_time(mc['median'])} (save + wait until visible to other processes)")
        v = find(rows, section="sched", workload=w, system="metadata-only item, first time (scheduler thread)")
        if v:
            r = v["median"] / 50e-6
            add("scheduler thread per verified item ≤ 50 µs", w, v["median"], "s", r, "≤ 1.0× of 50 µs",
                r <= 1.0, "ensure_cache_available + has_cache_item, metadata-only item")
    for w in wls:
        e = find(rows, section="write", workload=w, system="ecstore put+flush")
        raw = find(rows, section="write", workload=w, system="raw files (fsync)")
        dev = find(rows, section="write", workload=w, system="device floor: one file + fdatasync")
        if e and dev and (find(res["workloads"], name=w) or {}).get("nbytes", 0) >= 2e6:
            r = e["median"] / dev["median"]
            add("durable write ≥ 0.8× the device floor", w, e["median"], "GB/s", r, "≥ 0.8×", r >= 0.8,
                f"one file + fdatasync {dev['median']:.2f} GB/s")
        if e and raw:
            r = e["median"] / raw["median"]
            add("durable write ≥ raw-file peer (fsync)", w, e["median"], "GB/s", r, "≥ 1.0×", r >= 1.0,
                f"raw files (fsync) {raw['median']:.2f} GB/s")
    cont = [r for r in rows if r["section"] == "contains" and r["system"] == "ecstore contains (hit)"]
    if cont:
        big = max(cont, key=lambda r: r["entries"])
        r = big["median"] / 1e-5
        label = f"{big['entries']:,} entries"
        add("contains p50 ≤ 10 µs at 1 M entries", label, big["median"], "s", r, "≤ 1.0× of 10 µs",
            r <= 1.0, f"p99 {fmt_time(big['p99'])}"
            + ("" if big["entries"] >= 1_000_000 else " (fewer than 1 M entries in this run)"))
    hci = [r for r in rows if r["section"] == "contains" and r["system"] == "ecstore connector has_cache_item (hit)"]
    if hci:
        big = max(hci, key=lambda r: r["entries"])
        r = big["median"] / 15e-6
        add("has_cache_item p50 ≤ 15 µs at 1 M entries", f"{big['entries']:,} entries", big["median"], "s", r,
            "≤ 1.0× of 15 µs", r <= 1.0, f"with its lease; p99 {fmt_time(big['p99'])}"
            + ("" if big["entries"] >= 1_000_000 else " (fewer than 1 M entries in this run)"))
    for fp in [r for r in rows if r["section"] == "footprint" and r["system"].startswith("ecstore")]:
        r = fp["median"]
        failed = fp.get("failed_writes") or []
        lost = sum(failed)
        detail = fp.get("detail", "")
        if lost:
            detail += (f"; **{lost} writes failed** (StoreFullError) in {len(failed)} run(s): "
                       "a file within the bound says little when entries were dropped, so not met")
        add("store files ≤ 1.25× max_local_disk_size after churn", fp["system"].removeprefix("ecstore "),
            r, "ratio", r, "≤ 1.25× and no failed write", r <= 1.25 and not lost, detail)
    return out


# ---------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------
SECTION_TITLES = {
    "floor": "Floors (per entry)",
    "save": "1. Save cost inside the model step (`save_caches` / `put` of a new entry)",
    "hit": "2. Hit latency: time until the caller holds a usable tensor",
    "write": "3. Background durable write throughput (put + flush, GB/s of tensor data)",
    "contains": "4. Lookup latency (`contains` / `has_cache_item`), per call",
    "footprint": "5. Disk footprint after churn (10× the cap written, mixed sizes)",
    "mixed": "Mixed workload (small images, Zipf-like reuse)",
    "burst": "6. Back-to-back saves (10 in a row, the writer busy), then flush",
    "producer": "7. An encode-only producer's step per save (until visible to other processes)",
    "loadread": "8. Connector loads until the data is read (one pass over the tensor)",
    "sched": "9. The scheduler thread per item it must verify (metadata-only / tensor parallelism)",
}


def markdown(res: dict) -> str:
    meta = res["meta"]
    L: list[str] = []
    L.append(f"# ecstore benchmark ({'quick' if meta['quick'] else 'full'} run)")
    L.append("")
    L.append(f"- date: {meta['date']}  ")
    L.append(f"- machine: {meta['machine']}  ")
    L.append(f"- load average (1/5/15 min): before {fmt_load(meta['loadavg_before'])}, "
             f"after {fmt_load(meta['loadavg_after'])}; max 1-min during run "
             f"{meta.get('loadavg_max_1min', float('nan')):.2f} on {meta['cpus']} CPUs  ")
    L.append(f"- versions: {meta['versions']}  ")
    L.append(f"- duration: {meta['duration_s']:.0f} s; entries are `[n, {meta['hidden']}]` "
             f"{meta['dtype']}; medians with p10–p90 over repeated runs (n = repetitions)")
    L.append("")
    L.append("## Targets")
    L.append("")
    L.append("| target | workload | measured | ratio | goal | met | detail |")
    L.append("|---|---|---:|---:|---|---|---|")
    for t in res["targets"]:
        met = "n/a" if t["met"] is None else ("**met**" if t["met"] else "**not met**")
        L.append(f"| {t['target']} | {t['workload']} | {fmt_value(t['measured'], t['unit'])} | "
                 f"{fmt_ratio(t['ratio'])} | {t['goal']} | {met} | {t.get('detail', '')} |")
    L.append("")
    rows = res["rows"]
    for section, title in SECTION_TITLES.items():
        sec = [r for r in rows if r["section"] == section]
        if not sec:
            continue
        L.append(f"## {title}")
        L.append("")
        if section == "contains":
            L.append("| entries | system | p50 | p99 | p10–p90 | n | note |")
            L.append("|---:|---|---:|---:|---|---:|---|")
            for r in sec:
                L.append(f"| {r['entries']:,} | {r['system']} | {fmt_time(r['median'])} | "
                         f"{fmt_time(r['p99'])} | {fmt_time(r['p10'])}–{fmt_time(r['p90'])} | {r['n']} | "
                         f"{r.get('note', '')} |")
        elif section == "mixed":
            L.append("| system | throughput (median) | p10–p90 | GB/s | hit ratio | n | note |")
            L.append("|---|---:|---|---:|---:|---:|---|")
            for r in sec:
                L.append(f"| {r['system']} | {fmt_value(r['median'], 'req/s')} | "
                         f"{fmt_value(r['p10'], 'req/s')}–{fmt_value(r['p90'], 'req/s')} | "
                         f"{r.get('gbps', float('nan')):.2f} | {r.get('hit_ratio', float('nan')):.3f} | "
                         f"{r['n']} | {r.get('note', '')} |")
        elif section == "footprint":
            L.append("| system | file(s) / cap (median) | apparent / cap | allocated / cap | max during churn "
                     "| n | note |")
            L.append("|---|---:|---:|---:|---:|---:|---|")
            for r in sec:
                L.append(f"| {r['system']} | {r['median']:.3f}× | {r.get('size_ratio', float('nan')):.3f}× | "
                         f"{r.get('alloc_ratio', float('nan')):.3f}× | {r.get('max_ratio', float('nan')):.3f}× | "
                         f"{r['n']} | {r.get('note', '')} |")
        else:
            unit = sec[0]["unit"]
            ratio_head = "× memcpy" if unit == "s" else "× ecstore"
            L.append(f"| workload | system | median | p10–p90 | {ratio_head} | n | note |")
            L.append("|---|---|---:|---|---:|---:|---|")
            for r in sec:
                ru = r["unit"]  # a section may mix times and rates (burst)
                ratio = r.get("x_memcpy") if ru == "s" else r.get("x_ecstore")
                L.append(f"| {r['workload']} | {r['system']} | {fmt_value(r['median'], ru)} | "
                         f"{fmt_value(r['p10'], ru)}–{fmt_value(r['p90'], ru)} | {fmt_ratio(ratio)} | "
                         f"{r['n']} | {r.get('note', '')} |")
        L.append("")
    if res.get("notes"):
        L.append("## Notes")
        L.append("")
        for n in res["notes"]:
            L.append(f"- {n}")
        L.append("")
    return "\n".join(L)


def fmt_load(t: Any) -> str:
    try:
        return "/".join(f"{x:.2f}" for x in t)
    except TypeError:
        return "n/a"


# ---------------------------------------------------------------------------
# plot
# ---------------------------------------------------------------------------
def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = res["rows"]
    wls = [w["name"] for w in res["workloads"]]
    fig, axes = plt.subplots(2, 3, figsize=(19, 10.5))
    meta = res["meta"]
    fig.suptitle(f"ecstore benchmark ({'quick' if meta['quick'] else 'full'}) — {meta['date']} — "
                 f"{meta['machine']} — load avg {fmt_load(meta['loadavg_before'])} → "
                 f"{fmt_load(meta['loadavg_after'])}", fontsize=10)

    def bars(ax, section: str, systems: list[str], scale: float, ylabel: str, title: str,
             log: bool = True) -> None:
        def lookup(w: str, s: str) -> dict | None:
            if s == "memcpy (floor)":
                return find(rows, section="floor", workload=w, system="memcpy")
            return find(rows, section=section, workload=w, system=s)

        present = [s for s in systems if any(lookup(w, s) for w in wls)]
        width = 0.8 / max(1, len(present))
        x = np.arange(len(wls))
        for i, s in enumerate(present):
            med, lo, hi = [], [], []
            for w in wls:
                r = lookup(w, s)
                if r is None:
                    med.append(np.nan)
                    lo.append(0)
                    hi.append(0)
                    continue
                med.append(r["median"] * scale)
                lo.append(max(0.0, (r["median"] - r["p10"]) * scale))
                hi.append(max(0.0, (r["p90"] - r["median"]) * scale))
            ax.bar(x + (i - (len(present) - 1) / 2) * width, med, width, yerr=[lo, hi], capsize=2,
                   label=s)
        ax.set_xticks(x)
        ax.set_xticklabels(wls)
        if log:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3, which="both")

    bars(axes[0, 0], "save",
         ["memcpy (floor)", "ecstore connector", "ECExampleConnector", "raw files (no fsync)",
          "raw files (fsync)", "diskcache"],
         MS, "ms (log)", "1. save cost in the model step (lower is better)")
    bars(axes[0, 1], "hit",
         ["memcpy (floor)", "ecstore get (memory tier)", "ecstore get (LMDB, warm)",
          "ecstore get (LMDB, cold)", "ECExampleConnector load (warm)", "ECExampleConnector load (cold)",
          "raw files get (warm)", "raw files get (cold)", "diskcache get (warm)", "diskcache get (cold)"],
         MS, "ms (log)", "2. hit latency (lower is better)")
    bars(axes[0, 2], "write",
         ["device floor: one file + fdatasync", "ecstore put+flush", "ecstore put(copy=False)+flush",
          "raw files (fsync)", "raw files (no fsync)", "ECExampleConnector", "ECExampleConnector + fsync",
          "diskcache"],
         1.0, "GB/s", "3. write throughput (higher is better)", log=False)
    axes[0, 2].axhline(1.0, color="red", linestyle="--", linewidth=0.8)

    ax = axes[1, 0]
    cont = [r for r in rows if r["section"] == "contains"]
    for s in dict.fromkeys(r["system"] for r in cont):
        pts = sorted((r["entries"], r["median"] * US, r["p99"] * US) for r in cont if r["system"] == s)
        if not pts:
            continue
        xs = [p[0] for p in pts]
        line, = ax.plot(xs, [p[1] for p in pts], marker="o", label=f"{s} p50")
        ax.plot(xs, [p[2] for p in pts], marker="x", linestyle=":", color=line.get_color())
    ax.axhline(10, color="red", linestyle="--", linewidth=0.8, label="target p50 10 µs")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("entries")
    ax.set_ylabel("µs per call (solid p50, dotted p99)")
    ax.set_title("4. lookup latency vs entries", fontsize=10)
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3, which="both")

    ax = axes[1, 1]
    fp = [r for r in rows if r["section"] == "footprint"]
    if fp:
        names = [r["system"].replace(" (", "\n(") for r in fp]
        ax.bar(names, [r["median"] for r in fp], color="tab:blue", label="final")
        for x, r in enumerate(fp):
            lost = sum(r.get("failed_writes") or [])
            if lost:
                ax.annotate(f"{lost} writes\nfailed", (x, r["median"]), ha="center", va="bottom", fontsize=7,
                            color="red")
        ax.scatter(names, [r.get("max_ratio", np.nan) for r in fp], color="black", zorder=3,
                   label="max during churn")
        ax.axhline(1.25, color="red", linestyle="--", linewidth=0.8, label="target 1.25×")
        ax.axhline(1.0, color="gray", linestyle=":", linewidth=0.8)
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize=7)
    ax.set_ylabel("on-disk size / cap")
    ax.set_title("5. disk footprint after writing 10× the cap", fontsize=10)
    ax.grid(axis="y", alpha=0.3)

    ax = axes[1, 2]
    mx = [r for r in rows if r["section"] == "mixed"]
    if mx:
        names = [r["system"] for r in mx]
        y = [r["median"] for r in mx]
        err = [[max(0.0, r["median"] - r["p10"]) for r in mx], [max(0.0, r["p90"] - r["median"]) for r in mx]]
        b = ax.bar(names, y, yerr=err, capsize=3, color="tab:green")
        for rect, r in zip(b, mx):
            ax.annotate(f"hit {r.get('hit_ratio', float('nan')):.2f}", (rect.get_x() + rect.get_width() / 2,
                        rect.get_height()), ha="center", va="bottom", fontsize=7)
        ax.tick_params(axis="x", labelsize=7, rotation=15)
    ax.set_ylabel("requests / s")
    ax.set_title("mixed workload: throughput and hit ratio", fontsize=10)
    ax.grid(axis="y", alpha=0.3)

    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
