#!/usr/bin/env python3
"""What the E -> PD visibility guarantee costs an encode-only producer.

    python tools/bench_epd.py                       # 1 MB and 34 MB entries
    python tools/bench_epd.py --sizes 1,34 --reps 10 --batch 4 --json out.json

An encode-only ``ec_producer`` step does, per new encoder output,
``save_caches`` (one copy into the entry's safetensors blob, handed to the
background writer), and at the end of the step waits until the writer has
committed the step's saves to LMDB (``ECStore.wait_committed``), so that the
request's output leaves the engine only once a PD instance can find the
entry. This script runs exactly that sequence on a real store with the
workload entries of ``tools/bench.py`` (``[n, 3584]`` bfloat16: 1 MB is
n=140, 34.3 MB is n=4785) and reports, per step:

* ``save_ms``   time in save_caches (paid with or without the guarantee);
* ``commit_ms`` time the step end waits for the commit: the latency the
                guarantee adds to each request (the commit started on the
                writer thread during save_caches; nothing else overlaps it
                in a one-item step);
* ``visible_ms`` save start -> committed (when another process can see it).

One item per step (``--batch 1``) and ``--batch`` items per step. Compare
``commit_ms`` with the encoder's own time for an output of that size on
your accelerator (``--encoder-ms`` adds that ratio to the table). The
store's directory is created in ``--dir`` (default: a temporary directory
on the same file system as /tmp) and removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ecstore import ECStore, ECStoreConfig

WIDTH = 3584  # a 7B VLM's hidden size (Qwen2.5-VL-7B)
MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"


def rows_for(mb: float) -> int:
    return max(1, round(mb * 1e6 / (WIDTH * 2)))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(store: ECStore, rows: int, reps: int, batch: int, tag: str) -> dict:
    save, commit, visible = [], [], []
    for r in range(reps):
        tensors = [torch.randn(rows, WIDTH, dtype=torch.bfloat16) for _ in range(batch)]
        t0 = time.perf_counter()
        for i, t in enumerate(tensors):
            assert store.put(f"{tag}-{r}-{i}", t, copy=True)  # what save_caches does
        t1 = time.perf_counter()
        store.wait_committed()  # the step end of an encode-only producer
        t2 = time.perf_counter()
        save.append((t1 - t0) * 1e3)
        commit.append((t2 - t1) * 1e3)
        visible.append((t2 - t0) * 1e3)
    return {"rows": rows, "mb": rows * WIDTH * 2 / 1e6, "batch": batch, "reps": reps,
            "save_ms": statistics.median(save), "commit_ms": statistics.median(commit),
            "commit_p90_ms": pct(commit, 0.9), "visible_ms": statistics.median(visible)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,34", help="entry sizes in MB, comma-separated")
    ap.add_argument("--reps", type=int, default=10, help="steps per configuration")
    ap.add_argument("--batch", type=int, default=4, help="items per step in the batched rows")
    ap.add_argument("--encoder-ms", default="",
                    help="the encoder's own time per item for each size (ms, comma-separated): adds ratios")
    ap.add_argument("--dir", default=None, help="parent directory of the store")
    ap.add_argument("--json", default=None, help="write the results here too")
    a = ap.parse_args(argv)
    sizes = [float(s) for s in a.sizes.split(",") if s.strip()]
    encoder = [float(s) for s in a.encoder_ms.split(",") if s.strip()]
    parent = Path(tempfile.mkdtemp(prefix="bench-epd-", dir=a.dir))
    results = []
    try:
        for si, mb in enumerate(sizes):
            rows = rows_for(mb)
            need = rows * WIDTH * 2 * a.reps * (1 + a.batch) * 1.3 + (64 << 20)
            cfg = ECStoreConfig(local_cpu=False, local_disk=str(parent / f"ec-{mb:g}"),
                                max_local_disk_size=need / 2**30)
            with ECStore(cfg, model=MODEL, dtype=torch.bfloat16) as store:
                measure(store, rows, 1, 1, "warm")
                for batch in sorted({1, a.batch}):
                    row = measure(store, rows, a.reps, batch, f"b{batch}")
                    if si < len(encoder):
                        row["encoder_ms"] = encoder[si] * batch
                        row["commit_to_encoder"] = row["commit_ms"] / row["encoder_ms"]
                    results.append(row)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    head = f"{'entry':>9} {'items/step':>10} {'save ms':>8} {'commit ms':>10} {'p90':>7} {'visible ms':>11}"
    print(head + ("  commit/encoder" if encoder else ""))
    for r in results:
        line = (f"{r['mb']:>7.1f}MB {r['batch']:>10} {r['save_ms']:>8.2f} {r['commit_ms']:>10.2f} "
                f"{r['commit_p90_ms']:>7.2f} {r['visible_ms']:>11.2f}")
        if "commit_to_encoder" in r:
            line += f"  {r['commit_to_encoder']:>14.3f}"
        print(line)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
