#!/usr/bin/env python3
"""E -> PD on one node: an encoder-only vLLM server, a prefill/decode server and a
small proxy, sharing one ecstore store.

    python tools/demo_epd.py              # 4 images through the proxy, 1 straight to PD
    python tools/demo_epd.py --smallest   # 1 + 1 (what the tests run)

1. Builds (once; cached in ``.cache/demo-model/``, as tools/demo.py does) the tiny
   random-weight BLIP-2 with the heavier vision tower, or uses ``--model``.
2. Starts two real servers (``python -m vllm.entrypoints.openai.api_server``) on
   127.0.0.1, both with ``ECStoreConnector`` on one ``local_disk`` store:
   **E** with ``"ec_role": "ec_producer"`` (vLLM runs it encoder-only) and **PD**
   with ``"ec_role": "ec_consumer"``.
3. Starts a proxy on 127.0.0.1 that handles ``/v1/chat/completions`` the way
   vLLM's disaggregated-encoder proxy example does: a request with images goes to
   E first (``max_tokens=1``, not streamed); as soon as E answers, the original
   request goes to PD and PD's stream is passed back.
4. Sends new images through the proxy one request at a time and, for contrast,
   one new image straight to PD. For each request it prints where the encoder
   output came from, read from the servers' ``vllm:ec_store_*`` counters on
   ``/metrics`` before and after (E: computed and saved, or already stored;
   PD: loaded from the store, or computed), E's time, how long E's step waited for
   the commit that makes its save visible to PD, and the TTFT the client saw.

Writes ``OUT/demo_epd.json`` and the server logs to ``OUT/logs``; exits 1 if a
request through the proxy was not computed on E and loaded on PD, or PD's log
shows an ``EC put`` (a consumer never writes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# tools/ is sys.path[0] when this runs as a script: demo_server imports from here.
import demo_server
from demo_server import Server

from ecstore.testing import tiny_model

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
DEFAULT_MODEL_DIR = REPO / ".cache" / "demo-model"
QUESTION = "What is in the image?"
WARMUP_SEEDS = (50, 51)


def say(msg: str = "") -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------- proxy
class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes
    server: EPDProxy

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet
        return

    def do_POST(self) -> None:
        if self.path != "/v1/chat/completions":
            self.send_error(404)
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        rec: dict[str, Any] = {"e_ms": None}
        t0 = time.perf_counter()
        try:
            if has_images(body):
                # 1. Encoder instance: same messages, one token, no stream.
                e_body = dict(body, max_tokens=1, stream=False)
                e_body.pop("stream_options", None)
                with _post(self.server.e_url, e_body) as resp:
                    resp.read()
                rec["e_ms"] = (time.perf_counter() - t0) * 1e3
            # 2. As soon as E answered: the original request to PD, streamed back.
            t1 = time.perf_counter()
            with _post(self.server.pd_url, body) as resp:
                self.send_response(resp.status)
                self.send_header("Content-Type", resp.headers.get("Content-Type", "application/json"))
                self.end_headers()
                for line in resp:
                    if rec.get("pd_first_ms") is None and line.startswith(b"data:"):
                        rec["pd_first_ms"] = (time.perf_counter() - t1) * 1e3
                    self.wfile.write(line)
                    self.wfile.flush()
        except Exception as e:  # report to the client; the demo prints it  # noqa: BLE001
            self.server.errors.append(repr(e))
            self.send_error(502, explain=str(e)[:200])
        finally:
            self.server.records.append(rec)


class EPDProxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, e_url: str, pd_url: str) -> None:
        super().__init__((HOST, port), _ProxyHandler)
        self.e_url, self.pd_url = e_url, pd_url
        self.records: list[dict[str, Any]] = []
        self.errors: list[str] = []

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.server_address[1]}"


def has_images(body: dict) -> bool:
    for msg in body.get("messages", []):
        content = msg.get("content")
        if isinstance(content, list) and any(p.get("type") == "image_url" for p in content):
            return True
    return False


def _post(base_url: str, body: dict):
    req = urllib.request.Request(base_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=600)


# ----------------------------------------------------------------- servers
def ec_config(role: str, store: Path) -> dict[str, Any]:
    return {"ec_connector": "ECStoreConnector", "ec_role": role,
            "ec_connector_module_path": "ecstore.connector",
            "ec_connector_extra_config": {"local_disk": str(store), "max_local_disk_size": 1,
                                          "local_cpu": True, "max_local_cpu_size": 1}}


def start_server(name: str, model: str, tiny: bool, role: str, store: Path, logs: Path) -> Server:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    argv += tiny_model.server_args(model) if tiny else ["--model", model]
    port = demo_server.free_port(HOST)
    argv += ["--host", HOST, "--port", str(port), "--seed", "0", "--shutdown-timeout", "10",
             "--no-enable-prefix-caching", "--ec-transfer-config", json.dumps(ec_config(role, store))]
    env = dict(__import__("os").environ)
    env.update(PYTHONUNBUFFERED="1", VLLM_LOG_STATS_INTERVAL="1", VLLM_LOGGING_LEVEL="INFO")
    if tiny:
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for var in list(env):
        if var.startswith("LMCACHE_"):
            del env[var]
    server = Server(name, argv, env, logs / f"{name}.log", HOST, port, cwd=str(REPO))
    server.start()
    return server


# ---------------------------------------------------------------- requests
def counters(server: Server) -> dict[str, float]:
    return demo_server.scrape_ec_counters(server.base_url)


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)
            if after.get(k, 0) != before.get(k, 0)}


def settled(server: Server, before: dict[str, float], keys: tuple[str, ...], timeout: float = 60.0) -> dict:
    """The counter growth once one of ``keys`` moved (vLLM records the step's stats
    right after the request's output; a bounded poll, not synchronisation)."""
    end = time.monotonic() + timeout
    while True:
        d = delta(counters(server), before)
        if any(d.get(k) for k in keys) or time.monotonic() > end:
            return d
        time.sleep(0.1)


def source(e: dict[str, float] | None, pd: dict[str, float]) -> str:
    parts = []
    if e is not None:
        if e.get("saves"):
            parts.append("computed on E")
        elif e.get("hits") or e.get("save_skipped"):
            parts.append("already stored (E skipped its encoder)")
        else:
            parts.append("E: not seen")
    if pd.get("loads"):
        parts.append("loaded on PD")
    elif pd.get("misses"):
        parts.append("computed on PD")
    elif pd.get("load_failures"):
        parts.append("PD load failed")
    else:
        parts.append("PD: not seen")
    return ", ".join(parts)


def one_request(url: str, model: str, seed: int, size: int, max_tokens: int) -> dict[str, Any]:
    import base64
    import io

    buf = io.BytesIO()
    tiny_model.make_image(seed, size).save(buf, format="PNG")
    content = [{"type": "image_url",
                "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}},
               {"type": "text", "text": QUESTION}]
    return demo_server.stream_chat(url, model, content, max_tokens=max_tokens)


# -------------------------------------------------------------------- main
def run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    logs, work = out / "logs", out / "work"
    shutil.rmtree(work, ignore_errors=True)
    store = work / "store"
    if args.model:
        model, tiny = args.model, False
    else:
        say(f"Model: tiny random-weight BLIP-2, heavy vision tower, cached in {DEFAULT_MODEL_DIR}")
        model, tiny = str(tiny_model.build_tiny_blip2(DEFAULT_MODEL_DIR, heavy=True)), True
    say(f"Store: {store} (shared by both servers)")
    t0 = time.monotonic()
    # One start at a time: engines starting at once can pick the same free
    # port for their distributed init.
    e = start_server("E", model, tiny, "ec_producer", store, logs)
    say(f"Starting E  (ec_producer, encoder-only) on {e.base_url} ...")
    e.wait_healthy(args.startup_timeout)
    pd = start_server("PD", model, tiny, "ec_consumer", store, logs)
    say(f"Starting PD (ec_consumer) on {pd.base_url} ...")
    pd.wait_healthy(args.startup_timeout)
    say(f"  both healthy after {time.monotonic() - t0:.0f} s")
    proxy = EPDProxy(args.proxy_port, e.base_url, pd.base_url)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    say(f"Proxy on {proxy.base_url}: images -> E, then the request -> PD")
    # First-request costs (HTTP, encoder, LM, sampler) off the measured rows: one
    # image through the proxy and one straight to PD (not shown; stored as usual).
    for url, seed in ((proxy.base_url, WARMUP_SEEDS[0]), (pd.base_url, WARMUP_SEEDS[1])):
        one_request(url, model, seed, args.image_size, 2)
    say()
    rows: list[dict[str, Any]] = []
    plan = [("proxy", 100 + i) for i in range(args.images)] + [("PD only", 900)]
    proxy.records.clear()
    say(f"{'#':>2}  {'route':<8} {'image':>5}  {'E ms':>7}  {'commit ms':>9}  {'TTFT ms':>8}  encoder output")
    for i, (route, seed) in enumerate(plan, 1):
        e_before, pd_before = counters(e), counters(pd)
        url = proxy.base_url if route == "proxy" else pd.base_url
        n_rec = len(proxy.records)
        res = one_request(url, model, seed, args.image_size, args.max_tokens)
        e_d = settled(e, e_before, ("saves", "hits", "save_skipped")) if route == "proxy" else None
        pd_d = settled(pd, pd_before, ("loads", "misses", "load_failures"))
        rec = proxy.records[n_rec] if route == "proxy" and len(proxy.records) > n_rec else {}
        row = {"n": i, "route": route, "seed": seed, "e_ms": rec.get("e_ms"),
               "pd_first_ms": rec.get("pd_first_ms"), "ttft_ms": res["ttft_s"] * 1e3,
               "source": source(e_d, pd_d), "e_counters": e_d, "pd_counters": pd_d,
               "token_ids": res["token_ids"]}
        rows.append(row)
        e_ms = f"{row['e_ms']:.0f}" if row["e_ms"] is not None else "-"
        commit = f"{e_d.get('commit_seconds', 0) * 1e3:.1f}" if e_d is not None else "-"
        say(f"{i:>2}  {route:<8} {seed:>5}  {e_ms:>7}  {commit:>9}  {row['ttft_ms']:>8.0f}  {row['source']}")
    e_total, pd_total = counters(e), counters(pd)
    proxy.shutdown()
    for s in (e, pd):
        s.stop()
    e_log, pd_log = e.log_text(), pd.log_text()
    checks = {
        "proxied_computed_on_e_loaded_on_pd": all(
            r["source"] == "computed on E, loaded on PD" for r in rows if r["route"] == "proxy"),
        "direct_computed_on_pd": all(r["source"] == "computed on PD" for r in rows if r["route"] == "PD only"),
        "e_reports_saves_on_metrics": e_total.get("saves", 0) >= args.images,
        "pd_never_writes": "EC put:" not in pd_log and pd_total.get("saves", 0) == 0,
        "e_logs_its_puts": e_log.count("EC put: stored") == args.images + 1,  # + the warm-up image
        "proxy_errors": not proxy.errors,
        "servers_stopped": not (e.group_members() or pd.group_members()),
    }
    return {"rows": rows, "e_metrics": e_total, "pd_metrics": pd_total, "checks": checks,
            "proxy_errors": proxy.errors, "elapsed_s": time.monotonic() - t0,
            "processes": [{"name": s.name, "pid": s.pid, "pgid": s.pgid} for s in (e, pd)]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/demo_epd.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "demo-results" / "epd"), help="output folder")
    p.add_argument("--model", default=None, help="model path or HF id (default: the tiny BLIP-2)")
    p.add_argument("--images", type=int, default=4, help="new images sent through the proxy")
    p.add_argument("--smallest", action="store_true", help="CI form: one image through the proxy")
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--proxy-port", type=int, default=0, help="proxy port (default: a free port)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    if args.smallest:
        args.images = 1
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    say("ecstore E -> PD demo: an encoder-only vLLM server, a PD server and a proxy, one store")
    try:
        res = run(args, out)
    except (demo_server.ServerError, KeyboardInterrupt, RuntimeError, OSError) as e:
        say(f"\nerror: {type(e).__name__}: {e}")
        return 2
    finally:
        stopped = demo_server.stop_all()
        if stopped:
            say(f"stopped server process group(s): {', '.join(map(str, stopped))}")
    (out / "demo_epd.json").write_text(json.dumps(res, indent=2))
    say()
    em = res["e_metrics"]
    say(f"E  /metrics: saves={em.get('saves', 0):.0f} saved_bytes={em.get('saved_bytes', 0):.0f} "
        f"save_seconds={em.get('save_seconds', 0):.4f} commit_seconds={em.get('commit_seconds', 0):.4f}")
    pm = res["pd_metrics"]
    say(f"PD /metrics: loads={pm.get('loads', 0):.0f} misses={pm.get('misses', 0):.0f} "
        f"saves={pm.get('saves', 0):.0f}")
    say(f"Results: {out / 'demo_epd.json'}; logs: {out / 'logs'}")
    failed = [k for k, v in res["checks"].items() if not v]
    if failed:
        say(f"CHECK FAILED: {', '.join(failed)}")
        return 1
    say(f"All checks passed in {res['elapsed_s']:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
