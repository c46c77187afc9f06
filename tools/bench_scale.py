"""Sections of ``tools/bench.py`` at scale: ``contains`` (lookups at 10 k to
1 M entries), ``footprint`` (the file against ``max_local_disk_size`` under
churn) and ``mixed`` (small images with Zipf-like reuse)."""

from __future__ import annotations

import gc
import os
import random
import time
from typing import Any

import bench_peers as peers
import bench_report as report
import torch
from bench_core import DTYPE, ROW_BYTES, Bench, GiB, MiB, ids, log, now_ns, timed, ws_load


def build_small_store(b: Bench, st, start: int, stop: int, prefix: str) -> float:
    """Write entries [start, stop) straight through ``store.disk.write_batch``."""
    from ecstore.format import PendingPut, PutOutcome
    from ecstore.lmdb import BatchPut

    t = torch.randn(1, 16, dtype=torch.float32).to(DTYPE)
    batch = 20_000
    t0 = time.perf_counter()
    for lo in range(start, stop, batch):
        reqs = [BatchPut(PendingPut(st.key(h), st.stored_name(h), t), st.model)
                for h in ids(prefix, min(batch, stop - lo), lo)]
        st.disk.write_batch(reqs)
        bad = [r for r in reqs if r.outcome is not PutOutcome.STORED]
        assert not bad, bad[0].outcome
    st.flush()
    return time.perf_counter() - t0


def sec_contains(b: Bench) -> None:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput

    from ecstore.connector import ECStoreWorkerMetadata

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
            # As vLLM's scheduler drives it: per request ensure_cache_available,
            # has_cache_item and update_state_after_alloc; per step of 64
            # requests build_connector_meta (their leases, one commit), and
            # the worker's reports (the releases, one commit).
            reqs = [b.image_request(f"r{size}-{i}", h, rows=1)
                    for i, h in enumerate(hit_ids[pin_calls:2 * pin_calls])]
            samples, per_item = [], []
            out = SchedulerOutput.make_empty()
            for lo in range(0, len(reqs), 64):
                step = reqs[lo:lo + 64]
                t0 = now_ns()
                for r in step:
                    ok = sched.ensure_cache_available(r, 0)
                    h = r.mm_features[0].identifier
                    t1 = now_ns()
                    ok = sched.has_cache_item(h) and ok
                    samples.append((now_ns() - t1) * 1e-9)
                    assert ok, "a stored entry was a miss"
                    sched.update_state_after_alloc(r, 0)
                meta = sched.build_connector_meta(out)
                t_built = now_ns()
                report = ECConnectorOutput(ec_connector_worker_meta=ECStoreWorkerMetadata(
                    loaded=[(s.req_id, s.identifier) for s in meta.loads]))
                t2 = now_ns()
                sched.update_connector_output(report)
                per_item.append((now_ns() - t2 + t_built - t0) * 1e-9 / len(step))
                assert len(meta.loads) == len(step)
            b.add("contains", "ecstore connector has_cache_item (hit)", samples, entries=size,
                  note="scheduler side, an item vLLM holds inputs for (a real BLIP-2 image request); its "
                  "lease is taken with the step's others at its end (see the next row)")
            b.add("contains", "ecstore connector per allocated hit, with its lease (info)", per_item, entries=size,
                  note="ensure_cache_available + has_cache_item + update_state_after_alloc, and the "
                  "step's build_connector_meta (the 64 items' leases: one commit) and update_connector_output "
                  "(their releases: one commit) over 64; one sample per step")
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


def store_disk(d: str) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of a store's files: ``data.mdb``
    plus the blob files in ``blobs/`` (entries of at least
    ``min_file_blob_size``). Files vanishing meanwhile are left out."""
    paths = [os.path.join(d, "data.mdb")]
    blobs = os.path.join(d, "blobs")
    if os.path.isdir(blobs):
        paths += [os.path.join(blobs, n) for n in os.listdir(blobs) if n.endswith(".ecb")]
    size = alloc = 0
    for p in paths:
        try:
            stt = os.stat(p)
        except OSError:
            continue
        size, alloc = size + stt.st_size, alloc + stt.st_blocks * 512
    return size, alloc


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
                size, alloc = store_disk(d)
                mx = max(mx, size / cap, alloc / cap)
        flush()
        stats = st.stats()
        st.close()
        dt = time.perf_counter() - t0
        size, alloc = store_disk(d)
        mx = max(mx, size / cap, alloc / cap)
        res = {"size": size, "alloc": alloc, "max": mx, "logical": stats.disk_bytes,
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
        detail = (f"data.mdb + blobs/ {last['size'] / MiB:.1f} MiB apparent, {last['alloc'] / MiB:.1f} MiB allocated; "
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
        except Exception as e:  # StoreFullError: failed writes are counted below  # noqa: BLE001
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
