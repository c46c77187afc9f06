#!/usr/bin/env python3
"""ecstore end-to-end demo: the real vLLM server, a restart, and what the cache saved.

Run it (the README's first command sets up .venv and then runs this)::

    bash tools/demo.sh                 # full demo, a few minutes on 2 CPU cores
    bash tools/demo.sh --smallest      # CI form: one image, one restart, ecstore only
    .venv/bin/python tools/demo.py --help

What it does
------------
1. Builds (once; cached in ``.cache/demo-model/``) a tiny random-weight BLIP-2 whose
   448-px, 6-layer vision tower makes encoding an image a visible share of
   time-to-first-token (TTFT). ``--model PATH_OR_ID`` runs the same demo on a real
   model instead (nothing is built; the model must already be on disk/in the HF cache).
2. Starts ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with
   ``--ec-transfer-config`` naming ``ecstore.connector`` and a YAML config file
   written the way a user would (LMCache KV-cache keys plus ``ec_`` overrides) with
   a fresh ``local_disk``.
3. Sends streaming chat completions with PNG data-URL images, greedy, and measures
   TTFT (request sent -> first streamed chunk carrying generated tokens):
   new images (cold), the same images again (warm, same process), then restarts the
   server and sends the same images again (after restart: ecstore's LMDB tier), then
   different new images.
4. Repeats that with vLLM's in-tree ``ECExampleConnector`` and with no connector.
5. Shows how the saving grows with the encoder's share of the work: 1, 2 and 4
   images at once (several images per request for models that accept them; the tiny
   BLIP-2 takes one image per prompt, so it sends that many one-image requests at
   the same moment and the engine encodes them in one batch).
6. Prints the table and the three signals a user checks (``EC put`` log lines, vLLM's
   ``EC Transfer metrics`` line and the ``vllm:ec_store_*`` counters on ``/metrics``,
   ``ecstore-dump list``), and writes ``demo.json`` and ``demo.png`` to ``--out``.
7. Stops every process it started (process group, by id) on success, failure,
   Ctrl-C or SIGTERM.

Exit status: 0 when ecstore behaved as expected (cold images stored, loaded after
the restart, identical greedy outputs), 1 when a check failed, 2 on errors
(server did not start, bad arguments), 130/143 when interrupted.

Modules (tools/): this one (command line, the demo's flow per connector, exit
status), ``demo_workload`` (model, image sets, one measured request set),
``demo_run`` (one server lifetime: command line, start, phases, counters, log,
store, stop; console progress), ``demo_results`` (medians, speed-ups, output
comparison, checks, machine), ``demo_report`` (table, signals, chart) and
``demo_server`` (processes and HTTP).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
# tools/ is sys.path[0] when this runs as a script: the demo_* modules import from here.

import demo_report  # noqa: E402
import demo_results  # noqa: E402
import demo_server  # noqa: E402
from demo_run import (  # noqa: E402
    CONNECTORS,
    HOST,
    TITLES,
    Run,
    ec_transfer_config,
    ecstore_dump,
    run_with_ticker,
    say,
    store_summary,
    write_ecstore_config,
)
from demo_server import Server, ServerError  # noqa: E402
from demo_workload import ImageSet, ModelInfo, make_sets  # noqa: E402

DEFAULT_MODEL_DIR = REPO / ".cache" / "demo-model"


class DemoError(RuntimeError):
    """A failure the demo reports in one message (exit status 2)."""


class Interrupted(BaseException):
    """Ctrl-C / SIGTERM / SIGHUP: unwinds through every ``finally``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum



# ---------------------------------------------------------------- the demo
class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.work = self.out / "work"
        self.processes: list[Server] = []
        self.model: ModelInfo
        self.concurrent = False
        self.results: dict[str, Any] = {}

    # -- setup -------------------------------------------------------------
    def prepare_model(self) -> None:
        a = self.args
        if a.model:
            p = Path(a.model).expanduser()
            tiny = (p / ".tiny_model.json").is_file()
            path = str(p.resolve()) if p.exists() else a.model
            say(f"Model: {path} (given with --model{'; a tiny BLIP-2 built by tools/tiny_model.py' if tiny else ''})")
        else:
            from ecstore.testing import tiny_model

            say(f"Model: tiny random-weight BLIP-2, heavy vision tower (448 px, 6 layers), cached in "
                f"{DEFAULT_MODEL_DIR}")
            path = str(run_with_ticker("building the model (first run only; ~5 s)",
                                       lambda: tiny_model.build_tiny_blip2(DEFAULT_MODEL_DIR, heavy=True)))
            tiny = True
        max_images = max(a.image_counts)
        if a.multi_image == "auto":
            self.concurrent = tiny
        else:
            self.concurrent = a.multi_image == "concurrent"
        self.model = ModelInfo(path=path, tiny=tiny, mm_limit=1 if self.concurrent else max_images)

    # -- main flow -----------------------------------------------------------
    def run(self) -> int:
        a = self.args
        t_start = time.monotonic()
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "logs").mkdir(exist_ok=True)
        if self.work.exists():
            shutil.rmtree(self.work)
        self.prepare_model()
        say(f"Images: PNG data URLs, {a.image_size} px; greedy decoding, {a.max_tokens} tokens "
            f"(temperature 0, ignore_eos)")
        pc = ("ON (--enable-prefix-caching)" if a.prefix_caching else
              "OFF (--no-enable-prefix-caching), so 'warm' measures vLLM's own encoder cache only")
        say(f"Prefix caching: {pc}")
        if len(a.image_counts) > 1 or max(a.image_counts) > 1:
            how = ("N one-image requests sent at the same moment (this model accepts one image per "
                   "prompt; the engine encodes them in one batch)" if self.concurrent
                   else "N images in one request")
            say(f"Images at once: {', '.join(map(str, a.image_counts))} = {how}")
        sets, news = make_sets(a.image_counts, a.reps, a.image_size, with_new=not a.smallest)
        say(f"Server: http://{HOST}:{a.port or '<a free port>'}; stats logged every "
            f"{a.log_stats_interval} s (VLLM_LOG_STATS_INTERVAL)")
        say()

        connectors = [c for c in CONNECTORS if c in a.connectors]
        per: dict[str, Any] = {}
        for c in connectors:
            per[c] = self.run_connector(c, sets, news)
        self.results = demo_results.assemble(per, sets, news, time.monotonic() - t_start, args=a,
                                             model=self.model, concurrent=self.concurrent)
        return 0

    def run_connector(self, c: str, sets: list[ImageSet], news: list[ImageSet]) -> dict[str, Any]:
        work = self.work / c
        work.mkdir(parents=True, exist_ok=True)
        rec: dict[str, Any] = {"title": TITLES[c], "ec_transfer_config": ec_transfer_config(c, work)}
        say(f"=== {TITLES[c]} ===")
        if c == "ecstore":
            text = write_ecstore_config(work / "ecstore.yaml", work / "store")
            rec.update(config_file=str(work / "ecstore.yaml"), config_text=text, store=str(work / "store"))
            say(f"  config file {work / 'ecstore.yaml'}:")
            for line in text.splitlines():
                if line and not line.startswith("#"):
                    say(f"      {line}")
        elif c == "example":
            rec["store"] = str(work / "store")
        say(f"  --ec-transfer-config '{json.dumps(rec['ec_transfer_config'])}'" if rec["ec_transfer_config"]
            else "  (no --ec-transfer-config)")
        n_cold = sum(s.n for s in sets)
        n_new = sum(s.n for s in news)
        runs = []
        with Run(self, c, 1, "first start") as r1:
            r1.phase("cold", sets, "new images: the vision encoder runs"
                     + ("; ecstore stores each output" if c == "ecstore" else
                        "; the example connector writes each to a file" if c == "example" else ""))
            r1.snapshot("after_cold", {"misses": n_cold, "saves": n_cold})
            r1.phase("warm", sets, "same images, same server process: vLLM's own encoder cache "
                     "answers, the connector is not asked")
            r1.snapshot("after_warm")
            r1.settle(n_cold)
            runs.append(r1.finish())
        say("  -- restarting the server (its in-memory caches are gone) --")
        with Run(self, c, 2, "after restart") as r2:
            note = {"ecstore": "same images: loaded from ecstore's LMDB store, the encoder does not run",
                    "example": "same images: loaded from the example connector's safetensors files",
                    "none": "same images: nothing survived the restart, the encoder runs again"}[c]
            if news:  # each repeat followed by a new set of the same size: paired, same minute
                order = [x for pair in zip(sets, news) for x in pair]
                r2.phase(["restart", "new_after_restart"] * len(sets), order,
                         note + "; each followed by different new images (computed)")
            else:
                r2.phase("restart", sets, note)
            r2.snapshot("after_restart", {"hits": n_cold, "loads": n_cold, "misses": n_new, "saves": n_new})
            r2.settle(n_cold + (n_new if c != "none" else 0))
            runs.append(r2.finish())
        rec["runs"] = runs
        if c == "ecstore":
            store, cfg = work / "store", work / "ecstore.yaml"
            p = ecstore_dump(["list", str(store), "--config", str(cfg)])
            rec["store_list_cmd"] = f"ecstore-dump list {store} --config {cfg}"
            rec["store_list_text"] = (p.stdout + p.stderr).rstrip()
            pj = ecstore_dump(["list", str(store), "--config", str(cfg), "--json"])
            rec["store_list"] = json.loads(pj.stdout) if pj.returncode == 0 else {"error": pj.stderr}
        rec["store_final"] = store_summary(c, work)
        say()
        return rec


# ---------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tools/demo.py",
        description="ecstore end-to-end demo with the real vLLM OpenAI server: TTFT for new images, "
                    "repeats, and repeats after a server restart, with ecstore, vLLM's "
                    "ECExampleConnector and no connector.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=str(REPO / "demo-results"),
                   help="output folder: demo.json, demo.png, logs/, work/ (stores)")
    p.add_argument("--model", default=None,
                   help="model path or HF id to run the demo on (default: build the tiny BLIP-2 "
                        f"into {DEFAULT_MODEL_DIR})")
    p.add_argument("--port", type=int, default=0, help="server port (default: a free port)")
    p.add_argument("--keep", action="store_true",
                   help="keep the stores in OUT/work for inspection (logs are always kept)")
    p.add_argument("--smallest", "--quick", dest="smallest", action="store_true",
                   help="CI form: one image, one restart, ecstore only")
    p.add_argument("--connectors", default=",".join(CONNECTORS),
                   help="comma-separated subset of ecstore,example,none")
    p.add_argument("--images", default="1,2,4",
                   help="images at once for the encoder-share rows (comma-separated)")
    p.add_argument("--reps", type=int, default=3, help="distinct image sets per size (median taken)")
    p.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per request")
    p.add_argument("--image-size", type=int, default=448, help="side of the generated PNG images")
    p.add_argument("--multi-image", choices=("auto", "per-request", "concurrent"), default="auto",
                   help="how N images are sent: in one request, or as N one-image requests at once "
                        "(auto: concurrent for the tiny BLIP-2, which takes one image per prompt)")
    p.add_argument("--prefix-caching", action="store_true",
                   help="leave vLLM's prefix caching on (then 'warm' may also skip the prefill)")
    p.add_argument("--log-stats-interval", type=float, default=1.0,
                   help="VLLM_LOG_STATS_INTERVAL for the server (EC Transfer metrics line)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds to wait for a server's /health")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra vLLM server arguments (repeatable, split on spaces), e.g. "
                        "--server-arg='--max-model-len 8192'")
    p.add_argument("--no-chart", action="store_true", help="skip the PNG chart")
    a = p.parse_args(argv)
    a.connectors = [c.strip() for c in a.connectors.split(",") if c.strip()]
    bad = [c for c in a.connectors if c not in CONNECTORS]
    if bad or not a.connectors:
        p.error(f"--connectors: unknown {bad}; choose from {', '.join(CONNECTORS)}")
    try:
        a.image_counts = sorted({int(x) for x in a.images.split(",") if x.strip()})
    except ValueError:
        p.error("--images: comma-separated positive integers")
    if not a.image_counts or min(a.image_counts) < 1:
        p.error("--images: comma-separated positive integers")
    if 1 not in a.image_counts:
        a.image_counts = [1] + a.image_counts
    if a.reps < 1:
        p.error("--reps must be >= 1")
    if a.smallest:
        a.connectors, a.image_counts, a.reps = ["ecstore"], [1], 1
    return a


def _on_signal(signum: int, _frame: Any) -> None:
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    demo = Demo(args)
    status = 0
    say("ecstore demo: a persistent encoder cache for vLLM, seen from the client")
    say(f"  {datetime.now().astimezone().isoformat(timespec='seconds')}; "
        f"{os.cpu_count()} CPU cores; output in {demo.out}")
    say()
    try:
        demo.run()
    except Interrupted as e:
        say(f"\ninterrupted by {signal.Signals(e.signum).name}")
        status = 128 + e.signum
    except ServerError as e:
        say(f"\nerror: {e}")
        status = 2
    except DemoError as e:
        say(f"\nerror: {e}")
        status = 2
    except Exception as e:  # e.g. a request the server refused: report, then clean up  # noqa: BLE001
        import traceback

        traceback.print_exc()
        say(f"\nerror: {type(e).__name__}: {e}")
        status = 2
    finally:
        # Never leave a server behind; a second Ctrl-C must not interrupt this.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        stopped = demo_server.stop_all()
        if stopped:
            say(f"stopped server process group(s): {', '.join(map(str, stopped))}")
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
    if status:
        _cleanup_work(demo, keep=args.keep)
        return status

    res = demo.results
    res["processes"] = [{"name": s.name, "pid": s.pid, "pgid": s.pgid, "stopped": not s.group_members()}
                        for s in demo.processes]
    json_path = demo.out / "demo.json"
    png_path = demo.out / "demo.png"
    demo_report.print_report(res, say)
    if not args.no_chart:
        try:
            demo_report.write_chart(res, png_path)
            res["chart"] = str(png_path)
        except Exception as e:  # matplotlib missing or broken: the table is the result  # noqa: BLE001
            say(f"(chart not written: {e})")
    json_path.write_text(json.dumps(res, indent=2, default=str))
    _cleanup_work(demo, keep=args.keep)
    say()
    say(f"Results: {json_path}" + (f"\nChart:   {png_path}" if res.get("chart") else ""))
    say(f"Logs:    {demo.out / 'logs'}")
    if args.keep:
        say(f"Stores kept in {demo.work} (inspect: ecstore-dump list {demo.work / 'ecstore' / 'store'})")
    say(f"Done in {res['elapsed_s']:.0f} s; every server process stopped: "
        f"{'yes' if all(p['stopped'] for p in res['processes']) else 'NO'}")
    checks = res["checks"]
    if not checks.get("passed"):
        failed = [k for k, v in checks.items() if k not in ("details", "passed") and not v]
        say(f"CHECK FAILED: {', '.join(failed)} (details in {json_path})")
        return 1
    return 0


def _cleanup_work(demo: Demo, keep: bool) -> None:
    if not keep and demo.work.exists():
        shutil.rmtree(demo.work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
