"""Table, signals and chart for ``tools/demo.py`` (reads the demo's result dict)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

Say = Callable[[str], None]

ROW_NOTES = [
    ("cold", "a new image: the vision encoder runs (ecstore / the example connector also "
             "store its output)"),
    ("warm", "the same image again, same server process: vLLM's own encoder cache (and its "
             "multimodal processor cache) answer; the connector is not asked"),
    ("after restart", "server restarted, same image again: ecstore loads the encoder output "
                      "from its LMDB store, ECExampleConnector from its safetensors file; with "
                      "no connector the encoder runs again"),
    ("", "(after restart still pays for decoding and preprocessing the image: vLLM's "
         "multimodal processor cache lived in memory; the load itself is load_ms in the EC "
         "Transfer metrics line)"),
    ("new after rst", "different new images on the restarted server, each sent right after a "
                      "repeat: computed like cold, measured in the same minute as the repeats"),
    ("speed-up", "new after rst / after restart: computing vs not computing, same server, same "
                 "minute (sturdier than cold / after restart on a busy machine; both are in demo.json)"),
    ("hits", "ecstore: images served from the store after the restart / images sent "
             "(vllm:ec_store_hits_total); ECExampleConnector keeps no counters"),
    ("entries, bytes", "what the connector's storage holds at the end (ecstore-dump list; "
                       "files for the example connector)"),
    ("no connector", "nothing survives its restart, so its speed-up shows the run-to-run noise "
                     "of this machine (ideally 1.00x)"),
]


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    v = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        v /= 1024
        if v < 1024 or unit == "TiB":
            return f"{v:.1f} {unit}"
    return f"{n} B"


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


def times(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _table(headers: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [fmt(headers), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]


def main_table(res: dict[str, Any]) -> list[str]:
    headers = ["connector", "cold", "warm", "after restart", "new after rst", "speed-up", "hits",
               "entries", "bytes"]
    rows = []
    for c, rec in res["connectors"].items():
        s = rec["summary"]
        if c == "ecstore":
            hits = f"{s.get('hits', 0)}/{s.get('restart_images', 0)}"
        elif c == "example":
            hits = "n/a"
        else:
            hits = "-"
        rows.append([rec["title"], ms(s["cold_ms"]), ms(s["warm_ms"]), ms(s["restart_ms"]),
                     ms(s["new_ms"]), times(s["speedup"]), hits,
                     "-" if s.get("entries") is None else str(s["entries"]), human_bytes(s.get("bytes"))])
    return _table(headers, rows)


def sweep_table(res: dict[str, Any]) -> list[str]:
    headers = ["images", "connector", "cold (1st start)", "new after rst", "after restart", "saved",
               "speed-up"]
    rows = []
    for row in res["sweep"]:
        for k, (c, v) in enumerate(row["per_connector"].items()):
            base = v["new_ms"] if v.get("new_ms") is not None else v["cold_ms"]
            rest = v["restart_ms"]
            saved = None if base is None or rest is None else base - rest
            rows.append([str(row["images"]) if k == 0 else "", res["connectors"][c]["title"],
                         ms(v["cold_ms"]), ms(v.get("new_ms")), ms(rest), ms(saved), times(v["speedup"])])
    return _table(headers, rows, left=2)


def print_report(res: dict[str, Any], say: Say) -> None:
    st = res["settings"]
    m = res["machine"]
    say("=" * 100)
    say(f"Results ({res['date']}; {m.get('cpus_usable', m.get('cpus'))} CPU cores"
        f"{', GPU ' + m['gpu'] if m.get('gpu') else ', no GPU'}; model {Path(st['model']).name})")
    say(f"TTFT for one image, median of {st['reps']} image(s) per row; prefix caching "
        f"{'on' if st['prefix_caching'] else 'off'}; greedy, {st['max_tokens']} tokens")
    say()
    for line in main_table(res):
        say("  " + line)
    say()
    for name, text in ROW_NOTES:
        say(f"  {name:<15} {text}")
    if len(res["sweep"]) > 1:
        say()
        how = ("N one-image requests sent together, since the tiny BLIP-2 takes one image per "
               "prompt; TTFT = until every request has its first token"
               if st["multi_image"] == "concurrent" else "N images in one request")
        say(f"The saving grows with the encoder's share of the work: N images at once ({how}):")
        say()
        for line in sweep_table(res):
            say("  " + line)
    ec = res["connectors"].get("ecstore")
    if ec is not None:
        print_signals(ec, say)
    out = res["outputs"]
    say()
    ex = out.get("example") or {}
    sample = next(iter(ex.values()), [[]])[0] if ex else []
    say(f"Greedy outputs: token ids identical for every image set across "
        f"{'cold / warm / after restart / connectors' if len(res['connectors']) > 1 else 'cold / warm / after restart'}"
        f": {'yes' if out['identical'] else 'NO'} ({out['sets']} image sets, {out['compared']} "
        f"responses; e.g. {sample})")
    for mm in out["mismatches"][:5]:
        say(f"    mismatch: set {mm['set']} at {mm['where']}: {mm['token_ids']} != {mm['expected']}")
    ch = res["checks"]
    if "restart_hit" in ch:
        names = ["cold_stored", "warm_not_asked", "restart_hit", "no_put_after_restart",
                 "store_entries", "outputs_identical"]
        say("Checks: " + ", ".join(f"{n} {'ok' if ch.get(n) else 'FAILED'}" for n in names))


def print_signals(ec: dict[str, Any], say: Say) -> None:
    r1, r2 = ec["runs"]
    say()
    say("What to look at (ecstore):")
    say(f" 1. 'EC put' lines in the server log. First start ({r1['log']}): "
        f"{len(r1['ec_put'])} line(s), one per new image:")
    for line in r1["ec_put_lines"][:4]:
        say(f"      {_short(line)}")
    if len(r1["ec_put_lines"]) > 4:
        say(f"      ... {len(r1['ec_put_lines']) - 4} more")
    first = {p["mm_hash"] for p in r1["ec_put"]}
    again = [p for p in r2["ec_put"] if p["mm_hash"] in first]
    had_new = any(q["phase"] == "new_after_restart" for q in r2["requests"])
    if had_new:
        say(f"    After restart ({r2['log']}): {len(again)} for those images; "
            f"{len(r2['ec_put']) - len(again)} for the different new images:")
        for line in r2["ec_put_lines"][:2]:
            say(f"      {_short(line)}")
        if len(r2["ec_put_lines"]) > 2:
            say(f"      ... {len(r2['ec_put_lines']) - 2} more")
    else:
        say(f"    After restart ({r2['log']}): {len(r2['ec_put'])} (nothing was computed)")
    say(" 2. vLLM's EC metrics. The periodic log line after restart (VLLM_LOG_STATS_INTERVAL):")
    for line in r2["ec_transfer_metrics"][:3]:
        say(f"      EC Transfer metrics: {line}")
    if len(r2["ec_transfer_metrics"]) > 3:
        say(f"      ... {len(r2['ec_transfer_metrics']) - 3} more")
    p = r2["prom"].get("after_restart", {})
    keys = ("hits", "loads", "loaded_bytes", "load_failures", "misses", "saves")
    say("    /metrics of the restarted server: "
        + " ".join(f"vllm:ec_store_{k}_total={int(p.get(k, 0))}" for k in keys))
    say("    (hits/loads: the repeats; misses/saves: the different new images"
        + ("" if r2["ec_put"] else ", none in this run") + ")")
    p1 = r1["prom"].get("after_warm", {})
    say("    (first start, after cold + warm requests: "
        + " ".join(f"{k}={int(p1.get(k, 0))}" for k in ("hits", "misses", "saves"))
        + ": warm repeats never reached the connector)")
    say(f" 3. The store: {ec.get('store_list_cmd', 'ecstore-dump list')}")
    lines = (ec.get("store_list_text") or "").splitlines()
    if len(lines) > 8:  # header, a few entries, the total line
        lines = lines[:6] + [f"... {len(lines) - 7} more entries"] + lines[-1:]
    for line in lines:
        say(f"      {line}")


def _short(line: str) -> str:
    """Drop vLLM's '(EngineCore pid=...)' prefix if any; keep the rest verbatim."""
    if line.startswith("(") and ") " in line:
        line = line.split(") ", 1)[1]
    return line


# ---------------------------------------------------------------- chart
def write_chart(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conns = list(res["connectors"])
    sweep = res["sweep"]
    two = len(sweep) > 1
    fig, axes = plt.subplots(1, 2 if two else 1, figsize=(13 if two else 7, 4.8))
    ax = axes[0] if two else axes
    phases = [("cold_ms", "cold (new image)", "#c44e52"),
              ("warm_ms", "warm (same process)", "#8c8c8c"),
              ("restart_ms", "after restart", "#4c72b0"),
              ("new_ms", "new image after restart", "#dd8452")]
    phases = [p for p in phases if any(res["connectors"][c]["summary"].get(p[0]) is not None for c in conns)]
    width = 0.8 / len(phases)
    for i, (key, label, color) in enumerate(phases):
        xs = [j + (i - (len(phases) - 1) / 2) * width for j in range(len(conns))]
        vals = [res["connectors"][c]["summary"].get(key) or 0 for c in conns]
        bars = ax.bar(xs, vals, width, label=label, color=color)
        for b, v in zip(bars, vals):
            if v:
                ax.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom",
                            fontsize=7, xytext=(0, 1), textcoords="offset points")
    ax.set_xticks(range(len(conns)))
    ax.set_xticklabels([res["connectors"][c]["title"] for c in conns])
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT, one image (median)")
    top = max((res["connectors"][c]["summary"].get(k) or 0) for c in conns for k, _, _ in phases)
    ax.set_ylim(0, top * 1.3 if top else 1)
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    ax.grid(axis="y", alpha=0.3)
    if two:
        ax2 = axes[1]
        colors = {"ecstore": "#4c72b0", "example": "#55a868", "none": "#8c8c8c"}
        ns = [row["images"] for row in sweep]
        base_c = "ecstore" if "ecstore" in conns else conns[0]
        base = [row["per_connector"][base_c].get("new_ms") or row["per_connector"][base_c]["cold_ms"]
                for row in sweep]
        ax2.plot(ns, base, marker="s", color="#c44e52", lw=2,
                 label=f"new images, computed ({res['connectors'][base_c]['title']}, restarted server)")
        for c in conns:
            vals = [row["per_connector"][c]["restart_ms"] for row in sweep]
            ax2.plot(ns, vals, marker="o", color=colors.get(c),
                     label=f"same images after restart: {res['connectors'][c]['title']}")
        if "ecstore" in conns:
            for i, (n, b, row) in enumerate(zip(ns, base, sweep)):
                v = row["per_connector"]["ecstore"]
                if b and v["restart_ms"] and v["speedup"]:
                    ha = "left" if i == 0 else "right" if i == len(ns) - 1 else "center"
                    ax2.annotate(f"ecstore saves {b - v['restart_ms']:.0f} ms\n"
                                 f"({v['speedup']:.1f}x faster)", (n, b), fontsize=8,
                                 color=colors["ecstore"], xytext=(0, -30), textcoords="offset points", ha=ha)
        ax2.set_xticks(ns)
        ax2.set_xlabel("images at once" + (" (concurrent one-image requests)"
                                           if res["settings"]["multi_image"] == "concurrent" else " (in one request)"))
        ax2.set_ylabel("time to first token (ms)")
        ax2.set_ylim(bottom=0)
        ax2.set_title("The saving grows with the encoder's share of the work")
        ax2.legend(fontsize=8)
        ax2.grid(alpha=0.3)
    m = res["machine"]
    fig.suptitle(f"ecstore demo, {Path(res['settings']['model']).name}, "
                 f"{m.get('cpus_usable', m.get('cpus'))} CPU cores"
                 f"{', ' + m['gpu'] if m.get('gpu') else ', no GPU'} ({res['date'][:10]})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
