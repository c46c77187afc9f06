#!/usr/bin/env python3
"""Cost breakdowns behind the benchmark's missed targets (``tools/bench.py``).

    python tools/bench_profile.py alloc     # fresh-allocation page faults vs memcpy (save, LMDB hit)
    python tools/bench_profile.py save      # fixed per-save work (lookups, header) besides the copy
    python tools/bench_profile.py get       # LMDB-tier hit: checksum / header / alloc+copy
    python tools/bench_profile.py touch     # LRU touches: one fdatasync'd commit per burst of hits
    python tools/bench_profile.py writer    # background writer: encode / checksum / puts / commit
    python tools/bench_profile.py churn     # failed writes under churn vs the writer's batch size
    python tools/bench_profile.py coldread  # a record read right after a large write (the scheduler's first step)
    python tools/bench_profile.py pages     # new page-cache pages: buffered writes kept one after another vs O_DIRECT
    python tools/bench_profile.py all

Nothing here changes ecstore's code: the "proposed" variants are simulated
in this process only (a different allocator for the copy, blobs built before
``write_batch``, ``ecstore.store.handle.MAX_BATCH_BYTES`` patched on the module).
Timings are medians; on a shared machine run each a few times.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import torch

HIDDEN = 3584
ROW = HIDDEN * 2
SIZES = [("1MB", 140), ("34.3MB", 4785), ("130.8MB", 18248)]
MiB = 1 << 20


def med_ms(fn, reps: int = 11) -> float:
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e3


def hugepage_empty(shape, dtype) -> torch.Tensor:
    """An anonymous mapping advised MADV_HUGEPAGE, as a tensor (the proposed allocator)."""
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(m, dtype=dtype).view(shape)


def new_store(d: str, *, disk_gib: float, cpu_gib: float = 0.0):
    import logging

    from ecstore import ECStore, ECStoreConfig

    logging.getLogger("ecstore").setLevel(logging.WARNING)
    return ECStore(ECStoreConfig(local_disk=d, max_local_disk_size=disk_gib, local_cpu=cpu_gib > 0,
                                 max_local_cpu_size=cpu_gib), model="m", dtype=torch.bfloat16)


# ---------------------------------------------------------------------------
def cmd_alloc(args) -> None:
    print("# copy of one entry: preallocated (memcpy) vs fresh allocation (what put/get do)")
    print(f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}, "
          f"THP {open('/sys/kernel/mm/transparent_hugepage/enabled').read().strip()}")
    for name, n in SIZES:
        src = torch.randn(n, HIDDEN).to(torch.bfloat16)
        dst = torch.empty_like(src)
        dst.copy_(src)
        mc = med_ms(lambda: dst.copy_(src))
        cl = med_ms(lambda: src.clone())
        hp = med_ms(lambda: hugepage_empty(src.shape, src.dtype).copy_(src))
        print(f"{name:8s} memcpy {mc:8.3f} ms | clone() {cl:8.3f} ms ({cl / mc:4.1f}x) | "
              f"hugepage mmap + copy_ {hp:8.3f} ms ({hp / mc:4.1f}x)")
    if not os.environ.get("THP_MEM_ALLOC_ENABLE") and not args.no_env_rerun:
        print("\n# same, with torch's own switch THP_MEM_ALLOC_ENABLE=1 (must be set before torch loads)")
        sys.stdout.flush()
        subprocess.run([sys.executable, __file__, "alloc", "--no-env-rerun"],
                       env={**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}, check=False)


def cmd_save(args) -> None:
    from ecstore.format import codec

    print("# fixed (size-independent) work of one save: ECStoreConnector.save_caches -> "
          "store.contains + store.put (µs, tiny [1, 16] entry, writer not woken)")
    d = tempfile.mkdtemp(prefix="ecstore-prof-")
    st = new_store(d, disk_gib=1.0, cpu_gib=1.0)
    w = st._writer
    orig_submit = w.submit

    def submit_quietly(item, **kw):  # queue without waking the writer (no GIL contention)
        with w.cv:
            w.puts.add(item)

    tiny = torch.randn(1, 16).to(torch.bfloat16)
    ctr = [0]

    def new_id() -> str:
        ctr[0] += 1
        return f"{ctr[0]:064x}"

    def us(fn, reps: int = 2000) -> float:
        xs = []
        for _ in range(reps):
            h = new_id()
            t0 = time.perf_counter()
            fn(h)
            xs.append(time.perf_counter() - t0)
        return statistics.median(xs) * 1e6

    try:
        w.submit = submit_quietly
        r = {
            "store.contains (miss: memory, queue, LMDB read txn)": us(lambda h: st.contains(h)),
            "store.key (xxh64 + f-string)": us(lambda h: st.key(h)),
            "codec.blob_size (builds the JSON header)": us(
                lambda h: codec.blob_size(tiny, identifier=h, model="m")),
            "read path identifier_at (memory, queue, LMDB read txn)": us(lambda h: st._reads.identifier_at(st.key(h))),
            "store.put(copy=False), whole": us(lambda h: st.put(h, tiny, copy=False), 500),
        }
        r["contains + put: what save_caches does"] = (r["store.contains (miss: memory, queue, LMDB read txn)"]
                                                     + r["store.put(copy=False), whole"])
    finally:
        w.submit = orig_submit
        with w.cv:
            w.cv.notify_all()
        st.close()
        shutil.rmtree(d, ignore_errors=True)
    for k, v in r.items():
        print(f"  {k:55s} {v:7.1f} µs")


def cmd_get(args) -> None:
    import numpy as np

    from ecstore.format import blob_check, codec

    print("# LMDB-tier hit (page cache warm, no memory tier): where the time goes (ms)")
    d = tempfile.mkdtemp(prefix="ecstore-prof-")
    st = new_store(d, disk_gib=1.0)
    try:
        for name, n in SIZES:
            src = torch.randn(n, HIDDEN).to(torch.bfloat16)
            dst = torch.empty_like(src)
            dst.copy_(src)
            h = f"{n:064x}"
            st.put(h, src)
            st.flush()
            st.get(h)
            r = {"memcpy": med_ms(lambda: dst.copy_(src)), "ECStore.get": med_ms(lambda: st.get(h))}
            # The same blob bytes the store holds (entries of 512 KiB and more live in blob
            # files, not in LMDB): the steps of a hit on them, one by one.
            blob = codec.encode(src, identifier=st.stored_name(h), model="m")
            hdr = blob_check.parse_header(blob)
            view = np.frombuffer(blob, dtype=np.uint8, count=hdr.data_nbytes, offset=hdr.data_offset)
            r["checksum"] = med_ms(lambda: codec.checksum(blob))
            r["parse_header"] = med_ms(lambda: blob_check.parse_header(blob))

            def fresh():
                out = torch.empty(hdr.shape, dtype=torch.bfloat16)
                codec.raw_bytes_view(out)[:] = view

            def prealloc():
                codec.raw_bytes_view(dst)[:] = view

            def huge():
                out = hugepage_empty(hdr.shape, torch.bfloat16)
                codec.raw_bytes_view(out)[:] = view

            r["torch.empty + copy (today)"] = med_ms(fresh)
            r["hugepage alloc + copy"] = med_ms(huge)
            r["copy into preallocated"] = med_ms(prealloc)
            base = r["memcpy"]
            print(f"{name:8s} " + " | ".join(f"{k} {v:.3f} ({v / base:.1f}x)" for k, v in r.items()))
    finally:
        st.close()
        shutil.rmtree(d, ignore_errors=True)


def cmd_touch(args) -> None:
    import ecstore.lmdb.tier as lt

    print("# every hit queues an LRU touch; the writer commits touches in their own fdatasync'd "
          "LMDB transaction: 500 back-to-back gets of one 1 MB entry")
    commits = [0]
    orig = lt.LMDBTier._write_once

    def counted(self, *a, **k):
        commits[0] += 1
        return orig(self, *a, **k)

    lt.LMDBTier._write_once = counted
    try:
        for cpu in (0.0, 1.0):
            d = tempfile.mkdtemp(prefix="ecstore-prof-")
            st = new_store(d, disk_gib=1.0, cpu_gib=cpu)
            src = torch.randn(140, HIDDEN).to(torch.bfloat16)
            h = f"{1:064x}"
            st.put(h, src)
            st.flush()
            st.get(h)
            st.flush()
            for mode in ("LRU touch (today)", "touch disabled (simulated)"):
                if mode.startswith("touch disabled"):
                    st._writer.touch = lambda *a, **k: None
                commits[0] = 0
                xs = []
                t0 = time.perf_counter()
                for _ in range(500):
                    t1 = time.perf_counter()
                    st.get(h)
                    xs.append(time.perf_counter() - t1)
                loop = time.perf_counter() - t0
                st.flush()
                xs.sort()
                print(f"{'memory' if cpu else 'LMDB':6s} tier, {mode:27s}: get p50 {xs[250] * 1e6:7.1f} µs, "
                      f"p90 {xs[450] * 1e6:7.1f} µs, p99 {xs[495] * 1e6:7.1f} µs; 500 gets {loop * 1e3:5.0f} ms; "
                      f"write txns (one fdatasync each) {commits[0]}")
            st.close()
            shutil.rmtree(d, ignore_errors=True)
    finally:
        lt.LMDBTier._write_once = orig


def cmd_writer(args) -> None:
    import ecstore.lmdb.tier as lt
    from ecstore.format import PendingPut, codec
    from ecstore.lmdb import BatchPut

    print("# background writer, put(copy=False) x N + flush: time per stage (instrumented in-process)")
    acc: dict[str, float] = defaultdict(float)
    orig_encode, orig_wt = lt.codec.encode, lt.LMDBTier._write_txn

    def encode(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig_encode(*a, **k)
        finally:
            acc["encode (new blob + copy)"] += time.perf_counter() - t0

    @contextlib.contextmanager
    def write_txn(self):
        with orig_wt(self) as txn:
            t0 = time.perf_counter()
            yield txn
            acc["txn puts (LMDB copies the value)"] += time.perf_counter() - t0
            t1 = time.perf_counter()
        acc["commit (write-out + fdatasync)"] += time.perf_counter() - t1

    lt.codec.encode, lt.LMDBTier._write_txn = encode, write_txn
    try:
        for name, n, count in (("1MB", 140, 300), ("34.3MB", 4785, 12), ("130.8MB", 18248, 3)):
            src = torch.randn(n, HIDDEN).to(torch.bfloat16)
            acc.clear()
            d = tempfile.mkdtemp(prefix="ecstore-prof-")
            st = new_store(d, disk_gib=4.0, cpu_gib=0.25)
            t0 = time.perf_counter()
            for i in range(count):
                st.put(f"{i:064x}", src, copy=False)
            st.flush()
            dt = time.perf_counter() - t0
            st.close()
            shutil.rmtree(d, ignore_errors=True)
            os.sync()
            tot = n * ROW * count
            print(f"{name:8s} x{count}: {tot / dt / 1e9:.2f} GB/s, {dt * 1e3:.0f} ms; "
                  + ", ".join(f"{k} {v * 1e3:.0f} ms ({v / dt:.0%})" for k, v in acc.items()))
    finally:
        lt.codec.encode, lt.LMDBTier._write_txn = orig_encode, orig_wt

    print("\n# write_batch + sync, blobs encoded inside write_batch (today) vs handed in ready-made "
          "(proposed: put copies the tensor straight into its blob)")
    for name, n, count in (("1MB", 140, 200), ("34.3MB", 4785, 12), ("130.8MB", 18248, 3)):
        src = torch.randn(n, HIDDEN).to(torch.bfloat16)
        res: dict[str, list[float]] = {"today": [], "prebuilt blob": []}
        for _ in range(3):
            for mode in res:
                d = tempfile.mkdtemp(prefix="ecstore-prof-")
                st = new_store(d, disk_gib=4.0)
                hs = [f"{i:064x}" for i in range(count)]
                blobs = ([codec.encode(src, identifier=h, model="m") for h in hs] if mode != "today"
                         else [None] * count)
                t0 = time.perf_counter()
                for h, blob in zip(hs, blobs):
                    st.disk.write_batch([BatchPut(PendingPut(st.key(h), h, src, blob=blob), "m")])
                st.disk.sync()
                dt = time.perf_counter() - t0
                st.close()
                shutil.rmtree(d, ignore_errors=True)
                os.sync()
                res[mode].append(n * ROW * count / dt / 1e9)
        print(f"{name:8s} one entry per commit: " + "; ".join(
            f"{k} {statistics.median(v):.2f} GB/s" for k, v in res.items()))
    # the device's own limit
    d = tempfile.mkdtemp(prefix="ecstore-prof-")
    buf = memoryview(bytes(64 * MiB))
    t0 = time.perf_counter()
    fd = os.open(os.path.join(d, "f"), os.O_WRONLY | os.O_CREAT)
    for _ in range(8):
        os.write(fd, buf)
    os.fdatasync(fd)
    os.close(fd)
    dt = time.perf_counter() - t0
    shutil.rmtree(d, ignore_errors=True)
    print(f"device: 512 MiB sequential write + fdatasync: {512 * MiB / dt / 1e9:.2f} GB/s")


def cmd_churn(args) -> None:
    import logging

    import ecstore.store.handle as es
    from ecstore.errors import StoreFullError

    cap = int(args.cap_mib * MiB)
    logging.getLogger("ecstore").disabled = True  # failed writes are counted, not logged one by one
    print(f"# churn: 10x a {args.cap_mib:g} MiB cap in puts of 1/4/16/34.3 MB (scaled), no flush until the end "
          "(as the connector), by writer batch size")
    base = torch.randn(4785, HIDDEN).to(torch.bfloat16)
    scale = cap / (256 * MiB)
    rows = [max(1, round(mb * 1e6 * scale / ROW)) for mb in (1.0, 4.0, 16.0, 34.3)]
    rng = random.Random(7)
    plan, w = [], 0
    while w < 10 * cap:
        n = rng.choice(rows)
        plan.append(n)
        w += n * ROW
    default = es.MAX_BATCH_BYTES
    for batch in [default] + [int(x * MiB) for x in args.batches]:
        es.MAX_BATCH_BYTES = batch
        for rep in range(args.reps):
            d = tempfile.mkdtemp(prefix="ecstore-prof-")
            st = new_store(d, disk_gib=cap / (1 << 30))
            t0 = time.perf_counter()
            for i, n in enumerate(plan):
                st.put(f"{i:064x}", base[:n], copy=False)
            with contextlib.suppress(StoreFullError):
                st.flush()
            s = st.stats()
            st.close()
            dt = time.perf_counter() - t0
            sz = os.stat(os.path.join(d, "data.mdb"))
            shutil.rmtree(d, ignore_errors=True)
            os.sync()
            print(f"MAX_BATCH_BYTES {batch / MiB:5.0f} MiB run {rep}: failed writes {s.write_errors:3d}/{len(plan)}, "
                  f"evictions {s.disk_evictions}, entries left {s.disk_entries} ({s.disk_bytes / cap:.2f} of cap), "
                  f"data.mdb {sz.st_size / cap:.3f}x cap, {dt:.1f} s")
    es.MAX_BATCH_BYTES = default


def cmd_coldread(args) -> None:
    """What the scheduler thread's first lookup of a fresh entry meets: a
    record read (``stored_record``) right after another handle wrote a
    34.3 MB entry (its copy and file write stream through the CPU caches):
    first as is, after a ``gc.collect()``, after sweeping 64 MiB, then a
    second read of the same record. A miss's read first tells whether the
    cost is the entry's or any first LMDB access's."""
    import gc

    from ecstore import ECStore, ECStoreConfig

    d = tempfile.mkdtemp(prefix="ecstore-prof-")
    cfg = ECStoreConfig(local_cpu=False, local_disk=d, max_local_disk_size=2.0)
    sweep = torch.empty(64 * MiB, dtype=torch.uint8)
    t = torch.randn(4785, HIDDEN).to(torch.bfloat16)
    out: dict[str, list[float]] = defaultdict(list)
    try:
        with ECStore(cfg, model="prof", dtype=torch.bfloat16) as w, \
                ECStore(cfg, model="prof", dtype=torch.bfloat16) as r:
            for i in range(max(9, 3 * args.reps)):
                h = f"{i:064x}"
                w.put(h, t)
                w.flush()
                how = ("as is", "after gc.collect()", "after a 64 MiB sweep")[i % 3]
                if i % 3 == 1:
                    gc.collect()
                elif i % 3 == 2:
                    sweep.fill_(i)
                t0 = time.perf_counter()
                assert not r.contains(f"{i + 10**6:064x}")
                t1 = time.perf_counter()
                assert r.stored_record(h) is not None
                t2 = time.perf_counter()
                assert r.stored_record(h) is not None
                t3 = time.perf_counter()
                out[f"first LMDB access (a miss), {how}"].append(t1 - t0)
                out[f"then the entry's record, {how}"].append(t2 - t1)
                out["the same record again"].append(t3 - t2)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    for label, xs in out.items():
        print(f"{label:55s} {statistics.median(xs) * 1e6:8.1f} µs  (n={len(xs)})")


def cmd_pages(args) -> None:
    """What new page-cache pages cost (the spare files' fill, a buffered
    blob write): 34.3 MB files written one after another and kept, each
    after an ``os.sync()``, into fallocated files through the page cache
    (``pwrite``, 1 MiB pieces) and with ``BlobFiles.write`` (``O_DIRECT``
    from aligned memory: no page-cache pages). On a VM whose balloon
    reports free memory to the host, the buffered writes slow down once
    the guest's warm free pages are used up; ``O_DIRECT`` does not."""
    import numpy as np

    from ecstore.lmdb.blobfiles import DIRECT_ALIGN, BlobFiles, _preallocate
    from ecstore.lmdb.spare import free_page_reporting
    from ecstore.pool import new_slab

    count = max(8, 6 * args.reps)
    nbytes = 4785 * ROW + 320  # a 34.3 MB entry and its header
    src = new_slab(-(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN)[:nbytes]
    src[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    view = memoryview(src)
    if _preallocate is None:
        raise SystemExit("pages: needs fallocate (Linux)")
    d = tempfile.mkdtemp(prefix="ecstore-prof-")
    files = BlobFiles(d, readonly=False)
    buffered: list[float] = []
    direct: list[float] = []
    try:
        for i in range(count):
            os.sync()
            t0 = time.perf_counter()
            fd = os.open(os.path.join(d, f"buffered-{i}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                err = _preallocate(fd, nbytes)  # as BlobFiles.write allocates a new file's blocks
                if err:
                    raise OSError(err, os.strerror(err))
                off = 0
                while off < nbytes:
                    off += os.pwrite(fd, view[off:off + MiB], off)
            finally:
                os.close(fd)
            buffered.append(time.perf_counter() - t0)
            os.sync()
            t0 = time.perf_counter()
            files.write(view)
            direct.append(time.perf_counter() - t0)
    finally:
        files.close()
        shutil.rmtree(d, ignore_errors=True)
    third = max(1, count // 3)
    print(f"free page reporting (virtio balloon): {'yes' if free_page_reporting() else 'no'}")
    for label, xs in (("buffered pwrite into a fallocated file", buffered), ("BlobFiles.write (O_DIRECT)", direct)):
        print(f"{label:42s} first {third}: {statistics.median(xs[:third]) * 1e3:7.1f} ms   "
              f"last {third}: {statistics.median(xs[-third:]) * 1e3:7.1f} ms   "
              f"[{' '.join(f'{x * 1e3:.0f}' for x in xs)}]")


#: The breakdowns, in the order ``all`` runs them (each is ``cmd_<name>``).
COMMANDS = ["alloc", "save", "get", "touch", "writer", "churn", "coldread", "pages"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=[*COMMANDS, "all"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cap-mib", type=float, default=256)
    ap.add_argument("--batches", type=float, nargs="*", default=[32])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-env-rerun", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()}")
    for what in (COMMANDS if args.what == "all" else [args.what]):
        globals()[f"cmd_{what}"](args)
        print()
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
