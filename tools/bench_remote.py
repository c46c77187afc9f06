#!/usr/bin/env python3
"""Benchmark of the remote tier on loopback against a real redis-server.

    python tools/bench_remote.py [--reps N] [--sizes 1,34.3,130.8] [--out bench-results/remote.json]

Starts its own redis-server (127.0.0.1, free port, temp dir, no persistence),
then for ``[n, 3584]`` bfloat16 entries of 1 / 34.3 / 130.8 MB measures:

* floor: raw redis-py ``SET`` / ``GET`` of the same number of bytes;
* ecstore put: ``ECStore.put`` + ``flush`` (encode, frame, checksum, pipelined
  SET NX) on a store with no local tiers, so only the remote is timed;
* ecstore get: ``ECStore.get`` on a store with no local tiers (GET, its reply
  received in place into reused memory, checksum/identity verified, the tensor
  a view of it);

The ratios printed are raw time / ecstore time: above 1, ecstore is faster.
* lookups (``--lookups N``): ``ECStore.contains`` and the scheduler
  connector's ``has_cache_item`` for a local LMDB hit and for an entry only
  the remote holds (one EXISTS), p50/p99 in microseconds.

Prints a table and writes every sample as JSON. Numbers on a shared machine
are noisy; the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ecstore import ECStore, ECStoreConfig
from ecstore.testing.redis_server import RedisServer

HIDDEN = 3584
MB = 1e6


def summary(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"median": statistics.median(s), "p99": s[min(len(s) - 1, int(len(s) * 0.99))],
            "min": s[0], "n": len(s)}


def bench_sizes(url: str, port: int, sizes: list[float], reps: int) -> dict:
    import redis

    raw = redis.Redis(port=port)
    out: dict = {}
    for size in sizes:
        rows = max(1, round(size * MB / (HIDDEN * 2)))
        t = torch.randn(rows, HIDDEN).to(torch.bfloat16)
        nbytes = t.numel() * 2
        payload = t.view(torch.uint8).numpy().tobytes()
        r: dict[str, list[float]] = {"floor_set": [], "floor_get": [], "put": [], "get": []}
        for i in range(reps):
            raw.flushall()
            t0 = time.perf_counter()
            raw.set(f"floor{i}", payload)
            r["floor_set"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = raw.get(f"floor{i}")
            r["floor_get"].append(time.perf_counter() - t0)
            assert got is not None and len(got) == len(payload)
            del got
            raw.flushall()
            cfg = ECStoreConfig(local_cpu=False, remote_url=url, remote_timeout_seconds=30,
                                max_remote_queue_size=1.0)
            with ECStore(cfg, model="bench", dtype=torch.bfloat16) as st:
                st.contains("warm-up")  # connect outside the timing, as the floor's client is
                t0 = time.perf_counter()
                st.put(f"e{i}", t)
                st.flush()
                r["put"].append(time.perf_counter() - t0)
                assert st.stats().remote_puts == 1
            with ECStore(cfg, model="bench", dtype=torch.bfloat16) as st:
                st.contains("warm-up")
                t0 = time.perf_counter()
                back = st.get(f"e{i}")
                r["get"].append(time.perf_counter() - t0)
                assert back is not None and torch.equal(back.view(torch.int16), t.view(torch.int16))
        raw.flushall()
        res = {k: summary(v) for k, v in r.items()}
        res["nbytes"] = nbytes
        for k in ("put", "get"):
            floor = res[f"floor_{'set' if k == 'put' else 'get'}"]["median"]
            res[f"{k}_vs_floor"] = floor / res[k]["median"]
        out[f"{size:g}MB"] = res
    return out


def bench_lookups(url: str, n: int, tmp: Path, model_dir: str) -> dict:
    from bench_core import ids, tiny_vllm_config

    from ecstore.connector.scheduler_side import SchedulerSide

    # The scheduler side reads vLLM's parallel and transfer configs: the real
    # VllmConfig of the tiny BLIP-2 (a consumer), as in an engine.
    vcfg = tiny_vllm_config(model_dir, role="ec_consumer")

    t = torch.zeros(4, 16, dtype=torch.bfloat16)
    # Content-hash-like names, as vLLM makes them (others are never looked up).
    names = ids("remote-lookups", n)
    cfg = ECStoreConfig(local_cpu=False, local_disk=str(tmp / "node-a"), max_local_disk_size=0.1, remote_url=url)
    with ECStore(cfg, model="bench", dtype=torch.bfloat16) as a:
        for i in range(n):
            a.put(names[i], t)
        a.flush()
    res: dict[str, list[float]] = {"contains_local": [], "contains_remote": [],
                                   "has_cache_item_local": [], "has_cache_item_remote": []}
    for node, kind in (("node-a", "local"), ("node-b", "remote")):
        ncfg = ECStoreConfig(local_cpu=False, local_disk=str(tmp / node), max_local_disk_size=0.1, remote_url=url)
        with ECStore(ncfg, model="bench", dtype=torch.bfloat16) as st:
            for i in range(n):
                t0 = time.perf_counter()
                found = st.contains(names[i])
                res[f"contains_{kind}"].append(time.perf_counter() - t0)
                assert found
        side = SchedulerSide(vcfg, ncfg, model="bench", dtype=torch.bfloat16, is_producer=False, is_consumer=True)
        try:
            for i in range(n):
                ident = names[i]
                t0 = time.perf_counter()
                found = side.has_cache_item(ident)
                res[f"has_cache_item_{kind}"].append(time.perf_counter() - t0)
                assert found
                side._release([ident])
                side._step_hits.clear()
        finally:
            side.shutdown()
    return {k: {q: v * 1e6 for q, v in summary(s).items() if q != "n"} | {"n": len(s)} for k, s in res.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes", default="1,34.3,130.8")
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--out", default="bench-results/remote.json")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "ecstore-bench-tiny-blip2"),
                    help="tiny BLIP-2 build dir (cached) for the scheduler connector's real VllmConfig")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        server = RedisServer(tmp).start()
        port = server.port
        try:
            url = server.url
            load0 = os.getloadavg()[0]
            sizes = bench_sizes(url, port, [float(s) for s in a.sizes.split(",")], a.reps)
            lookups = bench_lookups(url, a.lookups, tmp, a.model_dir) if a.lookups else {}
            load1 = os.getloadavg()[0]
        finally:
            server.kill()
    print(f"load average {load0:.2f} -> {load1:.2f}")
    print(f"{'entry':>9} {'floor SET':>10} {'put':>9} {'ratio':>6} {'floor GET':>10} {'get':>9} {'ratio':>6}"
          "  (MB/s, median)")
    for name, r in sizes.items():
        mbps = {k: r["nbytes"] / MB / r[k]["median"] for k in ("floor_set", "put", "floor_get", "get")}
        print(f"{name:>9} {mbps['floor_set']:>10.0f} {mbps['put']:>9.0f} {r['put_vs_floor']:>6.2f} "
              f"{mbps['floor_get']:>10.0f} {mbps['get']:>9.0f} {r['get_vs_floor']:>6.2f}")
    for name, r in lookups.items():
        print(f"{name:>24}: p50 {r['median']:8.1f} us  p99 {r['p99']:8.1f} us  (n={r['n']})")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"sizes": sizes, "lookups_us": lookups, "loadavg": [load0, load1]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
