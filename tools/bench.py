#!/usr/bin/env python3
"""ecstore benchmark harness: what ecstore costs, and what the alternatives cost,
on the same machine in the same run.

    python tools/bench.py                  # full run -> bench-results/
    python tools/bench.py --quick --out D  # CI-sized run (< 60 s), same outputs
    python tools/bench.py --sections save,hit --reps 5

Outputs in ``--out`` (default ``bench-results/``): ``bench.json`` (every
measurement: median, p10/p90, p99, min/max, n, raw samples when few),
``bench.md`` (tables + targets met/not met), ``bench.png`` (plot; only when
matplotlib is installed, the run succeeds without it) and
``ecstore.log`` (ecstore's own INFO log lines during the run).

Workloads: ``[n, 3584]`` bfloat16 entries of 1 MB (n=140), 34.3 MB (n=4785)
and 130.8 MB (n=18248; a 10-minute video at 32 / 128 frames for a 7B VLM),
plus a mixed workload of small image entries with Zipf-like reuse.

Sections (``--sections``, default all):

* ``floor``     ``Tensor.copy_`` into a preallocated tensor (memcpy) and xxh3_64
                of the same bytes; ``clone()`` (fresh allocation) for reference.
* ``save``      what the vLLM worker pays in ``save_caches`` for a new entry:
                the ecstore connector vs vLLM's real ``ECExampleConnector``
                (local directory), plus synchronous peers.
* ``hit``       memory-tier hit, LMDB-tier hit (page cache warm and cold:
                ``POSIX_FADV_DONTNEED`` on data.mdb after fsync + ``os.sync()``),
                through the store and through the connectors, and the peers.
* ``write``     background durable write throughput: N puts then ``flush()``.
* ``contains``  ``contains`` / ``pin_if_present``+``release`` / the scheduler
                connector's ``has_cache_item`` at 10 k, 100 k, 1 M entries.
* ``footprint`` LMDB file size vs ``max_local_disk_size`` after writing 10x the cap.
* ``mixed``     Zipf-like reuse of small image entries: hit ratio, throughput.
* ``burst``     10 saves back to back (the writer busy), then flush: each save
                and the burst's durable throughput against the device floor.
* ``producer``  an encode-only producer's step per save: save_caches plus
                build_connector_worker_meta (until visible to other processes).
* ``loadread``  connector loads until the data is read (one pass over the
                tensor), ecstore vs ECExampleConnector.
* ``sched``     the scheduler thread's cost per item it must verify
                (metadata-only items, tensor parallelism).

Peers: vLLM's ``ECExampleConnector`` (the real class), a raw-file store with
an in-memory index modelled on LMCache's local-disk backend (**our own small
re-implementation**, ``tools/bench_peers.py``; with and without fsync) and
``diskcache``.

Timings on a shared machine are noisy: the load average before and after,
and the maximum seen during the run, are recorded in the outputs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_core as core
import bench_report as report
import torch
from bench_core import (
    ALL_SECTIONS,
    DTYPE,
    GPU_SECTIONS,
    HIDDEN,
    REPO,
    ROW_BYTES,
    Bench,
    check_device,
    device_sections,
    freeze_gc,
    log,
)
from bench_io import sec_floor, sec_hit, sec_save, sec_write
from bench_scale import sec_contains, sec_footprint, sec_mixed
from bench_steady import sec_burst, sec_loadread, sec_producer, sec_sched
from machine import cpu_name

SECTIONS: dict[str, Callable[[Bench], None]] = {
    "floor": sec_floor, "save": sec_save, "hit": sec_hit, "write": sec_write,
    "contains": sec_contains, "footprint": sec_footprint, "mixed": sec_mixed,
    "burst": sec_burst, "producer": sec_producer, "loadread": sec_loadread, "sched": sec_sched,
}


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------
def machine_desc() -> str:
    cpu = cpu_name()
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            mem = f", {kb / 1024 / 1024:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return f"{socket.gethostname()}: {os.cpu_count()}× {cpu}{mem}, Linux {platform.release()}"


def fs_desc(path: str) -> str:
    try:
        real = os.path.realpath(path)
        best = ("", "?", "?")
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, typ = line.split()[:3]
                if real.startswith(mnt) and len(mnt) >= len(best[0]):
                    best = (mnt, typ, dev)
        return f"{best[1]} on {best[2]} (mounted at {best[0]})"
    except OSError:
        return "?"


def versions() -> str:
    import diskcache
    import lmdb
    import safetensors
    import xxhash

    out = [f"python {platform.python_version()}", f"torch {torch.__version__}", f"lmdb {lmdb.__version__}",
           f"safetensors {safetensors.__version__}", f"xxhash {xxhash.VERSION}",
           f"diskcache {diskcache.__version__}"]
    try:
        import vllm

        out.append(f"vllm {vllm.__version__}")
    except Exception:  # noqa: BLE001
        pass
    return ", ".join(out)


def write_chart(res: dict, path: Path, errors: list[str]) -> bool:
    """Draw ``bench.png`` at ``path``; return whether it was written.

    matplotlib is optional (``pip install matplotlib``, or the ``bench``
    extra): without it the run still writes bench.json and bench.md and
    succeeds, and this says how to draw the chart later (``--from-json``).
    Any other plotting failure is appended to ``errors`` (the run then exits 1).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        log(f"bench.png not written: matplotlib is not available ({e}). To get the chart: "
            f"pip install matplotlib  (or pip install 'ecstore[bench]'), then "
            f"python tools/bench.py --from-json {path.parent / 'bench.json'} --out {path.parent}")
        return False
    try:
        report.plot(res, str(path))
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        errors.append(f"plot: {type(e).__name__}: {e}")
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI-sized run: small sizes, few reps, ≤ 10k entries")
    ap.add_argument("--out", default=str(REPO / "bench-results"), help="output directory (default bench-results/)")
    ap.add_argument("--sections", default=None,
                    help=f"comma-separated subset of {','.join(ALL_SECTIONS)} (default: all; with --device "
                         f"cuda {','.join(GPU_SECTIONS)})")
    ap.add_argument("--reps", type=int, default=0, help="repetitions per measurement (default: by size)")
    ap.add_argument("--max-entries", type=int, default=0, help="largest store for the contains section")
    ap.add_argument("--peer-max-entries", type=int, default=None,
                    help="largest index for raw-file/diskcache lookups (default 100k; quick 10k)")
    ap.add_argument("--workdir", default=None, help="where stores are created (default: $TMPDIR)")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "ecstore-bench-tiny-blip2"),
                    help="tiny BLIP-2 build dir (cached) for the real VllmConfig")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--from-json", metavar="BENCH_JSON",
                    help="measure nothing: re-evaluate targets and rewrite bench.md/bench.png in --out "
                         "from an earlier run's bench.json")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a shared machine a multi-threaded copy_ "
                         "waits for a free core, which makes floors and ecstore's own copies erratic)")
    ap.add_argument("--device", default="cpu",
                    help="where encoder outputs live: cpu (default) or cuda[:N]. With cuda, saves copy D2H "
                         "and loads land on the GPU; floors are pinned D2H/H2D copies; sections "
                         f"{','.join(GPU_SECTIONS)} only (the default), fewer repetitions (aimed at five "
                         "minutes; not measured yet); peers without a GPU path are skipped. Fails at once "
                         "where CUDA is not available")
    args = ap.parse_args(argv)
    try:
        core.DEVICE = check_device(args.device)
        args.sections = device_sections(core.DEVICE, args.sections)
    except ValueError as e:
        ap.error(str(e))
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    if {"save", "hit", "burst", "producer", "loadread", "sched"} & set(args.sections):
        if "floor" not in args.sections:
            args.sections.insert(0, "floor")  # ratios need the floor
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        res["targets"] = report.evaluate_targets(res)
        (out / "bench.json").write_text(json.dumps(res, indent=1, default=str))
        (out / "bench.md").write_text(report.markdown(res))
        plot_errors: list[str] = []
        charted = write_chart(res, out / "bench.png", plot_errors)
        log(f"rewrote {out}/bench.json, bench.md{', bench.png' if charted else ''} from {args.from_json}")
        return 1 if plot_errors else 0

    # ecstore logs one INFO line per stored entry: keep them (their cost is part
    # of the path measured) but in a file, not on the console.
    eclog = logging.getLogger("ecstore")
    handler = logging.FileHandler(out / "ecstore.log", mode="w")
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"))
    eclog.addHandler(handler)
    eclog.setLevel(logging.INFO)
    eclog.propagate = False

    b = Bench(args)
    t_start = time.time()
    load_before = os.getloadavg()
    log(f"work dir {b.work} ({fs_desc(b.work)}); load average {report.fmt_load(load_before)}; "
        f"sections {','.join(args.sections)}{' (quick)' if args.quick else ''}")
    errors: list[str] = []
    try:
        if any(s in args.sections for s in ("save", "hit", "contains", "mixed", "burst", "producer", "loadread",
                                            "sched")):
            b.vllm_config()
        freeze_gc()
        for s in args.sections:
            b.sample_load()
            log(f"section {s}")
            try:
                SECTIONS[s](b)
            except Exception as e:  # record and go on: one broken section must not hide the others  # noqa: BLE001
                import traceback

                traceback.print_exc()
                errors.append(f"{s}: {type(e).__name__}: {e}")
            b.sample_load()
    finally:
        if not args.keep:
            shutil.rmtree(b.work, ignore_errors=True)
    load_after = os.getloadavg()
    res: dict[str, Any] = {
        "meta": {
            "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": machine_desc(),
            "cpus": os.cpu_count(),
            "filesystem": fs_desc(b.work),
            "versions": versions(),
            "quick": bool(args.quick),
            "sections": args.sections,
            "argv": sys.argv[1:] if argv is None else argv,
            "loadavg_before": load_before,
            "loadavg_after": load_after,
            "loadavg_max_1min": max([x[0] for x in b.load_samples] + [load_before[0], load_after[0]]),
            "loadavg_samples": b.load_samples,
            "duration_s": time.time() - t_start,
            "hidden": HIDDEN,
            "dtype": str(DTYPE).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),
            "device": str(core.DEVICE) + (f" ({torch.cuda.get_device_name(core.DEVICE)})"
                                          if core.DEVICE.type == "cuda" else ""),
            "errors": errors,
        },
        "workloads": [{"name": nm, "shape": [n, HIDDEN], "dtype": "bfloat16", "nbytes": n * ROW_BYTES}
                      for nm, n in b.workloads],
        "rows": b.rows,
        "notes": b.notes + [f"section failed: {e}" for e in errors],
    }
    res["targets"] = report.evaluate_targets(res)
    (out / "bench.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "bench.md").write_text(report.markdown(res))
    charted = write_chart(res, out / "bench.png", errors)
    log(f"wrote {out}/bench.json, bench.md{', bench.png' if charted else ''} in {res['meta']['duration_s']:.0f} s; "
        f"load average {report.fmt_load(load_after)}")
    for t in res["targets"]:
        met = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT met")
        log(f"  target {t['target']} [{t['workload']}]: {report.fmt_value(t['measured'], t['unit'])} "
            f"ratio {report.fmt_ratio(t['ratio'])} -> {met}")
    if errors:
        log("errors: " + "; ".join(errors))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
