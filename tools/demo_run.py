"""One server lifetime of the demo (``tools/demo.py``): the vLLM server's command
line, environment and connector config; starting it, measuring phases on it,
waiting (bounded) for the connector's asynchronous effects, reading its log,
its ``/metrics`` counters and its store; stopping it. Also the console
progress output (``say``, :class:`Ticker`) the demo prints while it runs.

Every server is started and stopped through :class:`demo_server.Server` (its
own process group, registered until stopped).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import demo_server
from demo_server import Server, ServerError
from demo_workload import ImageSet, ModelInfo, measure, warm_up

if TYPE_CHECKING:
    from demo import Demo

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
CONNECTORS = ("ecstore", "example", "none")
TITLES = {
    "ecstore": "ecstore (LMDB)",
    "example": "ECExampleConnector",
    "none": "no connector",
}
EC_PUT = re.compile(r"EC put: stored (\d+) bytes for mm_hash=(\S+)")
EC_METRICS = re.compile(r"EC Transfer metrics: (.*)$")


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
        except BaseException as e:  # noqa: BLE001
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


def wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    """Poll ``cond`` until true or ``timeout`` s pass (bounded wait for asynchronous
    effects: the background LMDB writer, the periodic stats logger)."""
    end = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return True
        except Exception:  # noqa: BLE001
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

    def __init__(self, demo: Demo, connector: str, index: int, name: str) -> None:
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

    def __enter__(self) -> Run:
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
