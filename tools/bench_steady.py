"""Sections of ``tools/bench.py`` on the steady state of a step (issue 30):

* ``burst``    back-to-back saves: 10 ``save_caches`` in a row with the writer
               still busy with the previous ones (an encoder instance), each
               timed, then ``flush()``: the durable throughput of the burst
               against the device floor (one file + fdatasync, same bytes).
* ``producer`` an encode-only producer's whole step per save: ``save_caches``
               plus ``build_connector_worker_meta``, which returns once the
               entry is committed (visible to other processes).
* ``loadread`` connector loads until the data is read: ``start_load_caches``
               plus one pass over the tensor (``.sum()`` on the CPU; on a GPU
               the load lands on the device), for ecstore and for vLLM's
               ``ECExampleConnector`` (whose tensor is an mmap of its file).
* ``sched``    the scheduler thread's cost per item that must be verified
               before a yes (metadata-only items; tensor parallelism takes the
               same path): ``ensure_cache_available`` + ``has_cache_item`` on
               vLLM's real ``Request``, the first time (summed over the steps
               until the yes: the whole blob is read on the scheduler side's
               verification thread meanwhile, not timed) and for an entry
               verified before (a record read).
"""

from __future__ import annotations

import gc

import bench_peers as peers
import torch
from bench_core import Bench, GiB, MiB, now_ns, step_begin, step_end, sync_device, timed, ws_load
from bench_io import device_floor, fill_ratios

BURST = 10  # saves in a row
STEP_SAVES = 8  # saves in one encode-only step (the producer section's info row, smallest entries)


def sec_burst(b: Bench) -> None:
    rounds = 1 if b.quick else 3
    for name, n in b.workloads:
        src = b.dev_tensor(n)
        nb = src.numel() * 2
        cap = max(4 * BURST * nb, 512 * MiB)
        saves, rates, floors = [], [], []
        for r in range(rounds + 1):  # the first round warms up (the pool's slabs, the writer)
            d = b.dir("burst-ecstore")
            conn = b.store_connector("WORKER", local_disk=d, max_local_disk_size=cap / GiB,
                                     max_local_cpu_size=max(2 * BURST * nb, 256 * MiB) / GiB)
            store = conn.worker_side.store
            hs = b.ids(f"burst-{name}-{r}", BURST)
            gc.collect()
            b.settle()
            t0 = now_ns()
            step_begin(conn)  # one step's saves
            one = [timed(lambda: conn.save_caches({h: src}, h)) for h in hs]
            step_end(conn)
            store.flush()
            dt = (now_ns() - t0) * 1e-9
            assert all(store.contains(h) for h in hs)
            conn.shutdown()
            b.rm(d)
            if r:
                saves += one
                rates.append(BURST * nb / dt / 1e9)
                floors.append(BURST * nb / device_floor(b, src, BURST, "burst-device") / 1e9)
        b.add("burst", "ecstore connector save (back to back)", saves, workload=name,
              note=f"{BURST} `save_caches` in a row, no flush between: the writer busy with the previous ones")
        b.add("burst", "ecstore burst durable throughput", rates, unit="GB/s", workload=name,
              note=f"{BURST} saves then flush(), from the first save to flush's return")
        b.add("burst", "device floor: one file + fdatasync", floors, unit="GB/s", workload=name,
              note="the same bytes appended to one file, one fdatasync (the faster of buffered and O_DIRECT)")
    fill_ratios(b, "burst")


def sec_producer(b: Bench) -> None:
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ecstore.connector import ECStoreConnector

    vcfg = b.vllm_config_for("ec_producer")
    for name, n in b.workloads:
        src = b.dev_tensor(n)
        nb = src.numel() * 2
        reps = b.reps(nb)
        d = b.dir("producer")
        vcfg.ec_transfer_config.ec_connector_extra_config = {
            "local_disk": d, "max_local_disk_size": max(4 * (reps + 1) * nb, 512 * MiB) / GiB}
        sched = ECStoreConnector(vcfg, ECConnectorRole.SCHEDULER)  # creates the shared stats record
        conn = ECStoreConnector(vcfg, ECConnectorRole.WORKER)
        assert conn.worker_side.encode_only
        hs = b.ids(f"producer-{name}", reps + 1)
        step, save, wait = [], [], []
        for i, h in enumerate(hs):
            gc.collect()
            b.settle()  # a new step: the writer idle
            sync_device()  # nothing queued before on a GPU (save_caches waits for its own D2H copy)
            step_begin(conn)
            t0 = now_ns()
            conn.save_caches({h: src}, h)
            t1 = now_ns()
            conn.build_connector_worker_meta()
            sync_device()
            t2 = now_ns()
            conn.clear_connector_metadata()
            if i:
                step.append((t2 - t0) * 1e-9)
                save.append((t1 - t0) * 1e-9)
                wait.append((t2 - t1) * 1e-9)
        other = b.store(d, disk_bytes=max(4 * (reps + 1) * nb, 512 * MiB), local_cpu=False, model=b.model)
        visible = all(other.contains(h) for h in hs)  # another handle (as another process) sees them
        several, commits = [], []
        if name == b.workloads[0][0]:  # the smallest entries: a step with several saves
            for i in range(reps + 1):
                step_hs = b.ids(f"producer-{name}-step{i}", STEP_SAVES)
                gc.collect()
                b.settle()
                txn0 = other.disk.env_info()["last_txnid"]
                step_begin(conn)
                t0 = now_ns()
                for h in step_hs:
                    conn.save_caches({h: src}, h)
                conn.build_connector_worker_meta()
                sync_device()
                t1 = now_ns()
                conn.clear_connector_metadata()
                if i:
                    several.append((t1 - t0) * 1e-9)
                    commits.append(other.disk.env_info()["last_txnid"] - txn0)
        other.close()
        conn.shutdown()
        sched.shutdown()
        b.rm(d)
        if several:
            b.add("producer", f"encode-only step with {STEP_SAVES} saves (info)", several, workload=name,
                  note=f"{STEP_SAVES} `save_caches` + `build_connector_worker_meta`; LMDB commits per step: "
                  f"{min(commits)}–{max(commits)}")
        b.add("producer", "encode-only step per save", step, workload=name,
              note="`save_caches` + `build_connector_worker_meta` (returns once the entry is visible to "
              f"other processes); every entry seen by a second handle: {visible}")
        b.add("producer", "save_caches (info)", save, workload=name, note="the save alone")
        b.add("producer", "wait until visible (info)", wait, workload=name,
              note="`build_connector_worker_meta`: the commit wait")
    fill_ratios(b, "producer")


def read_all(t: torch.Tensor) -> torch.Tensor:
    """What the model does with a loaded tensor, at least: read every byte
    (one pass on the CPU; on a GPU the load's copy to the device read it,
    and :func:`timed` waits for that copy)."""
    if t.device.type == "cpu":
        float(t.sum())
    return t


def sec_loadread(b: Bench) -> None:
    for name, n in b.workloads:
        src = b.tensor(n)
        nb = src.numel() * 2
        reps = b.reps(nb)
        cap = max(8 * nb, 256 * MiB)
        d = b.dir("loadread-ecstore")
        h = b.ids(f"loadread-{name}", 1)[0]
        st = b.store(d, disk_bytes=cap, local_cpu=False)
        st.put(h, src)
        st.flush()
        st.close()
        dev = b.device
        for label, extra in (("memory tier", {"max_local_cpu_size": cap / GiB}), ("LMDB, warm", {"local_cpu": False})):
            conn = b.store_connector("WORKER", local_disk=d, max_local_disk_size=cap / GiB, **extra)
            conn.worker_side.device = dev
            read_all(ws_load(conn, h, n))
            b.add("loadread", f"ecstore connector load + read ({label})",
                  [timed(lambda: read_all(ws_load(conn, h, n))) for _ in range(reps)], workload=name,
                  note="bind metadata + `start_load_caches` + one pass over the tensor")
            conn.shutdown()
        b.rm(d)
        d = b.dir("loadread-example")
        ex = b.example_connector(d)
        peers.example_save(ex, h, src)

        def ex_load() -> object:
            t = peers.example_load(ex, h, n)
            return t.to(dev) if b.on_gpu else read_all(t)

        ex_load()
        b.add("loadread", "ECExampleConnector load + read (warm)", [timed(ex_load) for _ in range(reps)],
              workload=name, note="start_load_caches (an mmap of the file) + one pass over the tensor")
        b.rm(d)
        if b.on_gpu:
            continue  # the read both loads include is their copy to the device (the H2D floor)
        src_sum = [timed(lambda: read_all(src)) for _ in range(reps)]
        b.add("loadread", "one pass over the tensor (info)", src_sum, workload=name,
              note="`.sum()` of a tensor in memory: the read both loads above include")
    fill_ratios(b, "loadread")


def _metadata_only_request(req_id: str, identifier: str, rows: int):
    """vLLM's real Request with one image item vLLM holds no inputs for (an
    EPD consumer's pre-computed item): the scheduler must verify its entry."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    feature = MultiModalFeatureSpec(data=None, modality="image", identifier=identifier, mm_hash=identifier,
                                    mm_position=PlaceholderRange(offset=0, length=rows))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    return Request(req_id, [0] * rows + [1, 2], params, None, mm_features=[feature])


def sec_sched(b: Bench) -> None:
    from vllm.v1.core.sched.output import SchedulerOutput

    for name, n in b.workloads:
        src = b.tensor(n)
        nb = src.numel() * 2
        reps = max(3, b.reps(nb) // 2)
        cap = max(2 * (reps + 1) * nb, 256 * MiB)
        d = b.dir("sched")
        hs = b.ids(f"sched-{name}", reps + 1)
        st = b.store(d, disk_bytes=cap, local_cpu=False)
        for h in hs:
            st.put(h, src)
        st.flush()
        st.close()
        conn = b.store_connector("SCHEDULER", local_disk=d, max_local_disk_size=cap / GiB)
        jobs = conn.scheduler_side._verifications
        first, again, waits, steps = [], [], [], []
        for i, h in enumerate(hs):
            req = _metadata_only_request(f"req-{name}-{i}", h, n)
            gc.collect()
            spent = waited = step = 0
            ok = False
            while not ok and step < 100:  # vLLM asks again at every step until the yes
                step += 1
                t0 = now_ns()
                ok = conn.ensure_cache_available(req, 0) and conn.has_cache_item(h)
                spent += now_ns() - t0
                conn.build_connector_meta(SchedulerOutput.make_empty())  # the step ends: not allocated, let go
                if ok:
                    continue
                assert not conn.take_unavailable_requests(), "a good entry's request was failed"
                t2 = now_ns()
                assert jobs.wait_idle(60)  # the verification thread's work: not the scheduler thread's
                waited += now_ns() - t2
            assert ok, f"not available after {step} steps"
            req2 = _metadata_only_request(f"req-{name}-{i}-again", h, n)
            t2 = now_ns()
            ok2 = conn.ensure_cache_available(req2, 0) and conn.has_cache_item(h)
            t3 = now_ns()
            conn.build_connector_meta(SchedulerOutput.make_empty())
            assert ok2
            if i:
                first.append(spent * 1e-9)
                again.append((t3 - t2) * 1e-9)
                waits.append(waited * 1e-9)
                steps.append(step)
        conn.shutdown()
        b.rm(d)
        b.add("sched", "metadata-only item, first time (scheduler thread)", first, workload=name,
              note="`ensure_cache_available` + `has_cache_item` for a request whose item vLLM cannot encode "
              "(no inputs; tensor parallelism takes the same path), summed over the steps until the yes "
              f"({min(steps)}–{max(steps)} steps): the entry is verified off the scheduler thread meanwhile")
        b.add("sched", "metadata-only item, verified before (scheduler thread)", again, workload=name,
              note="the same item for a second request: the verification is remembered")
        b.add("sched", "wait for the background verification (info)", waits, workload=name,
              note="after the first step, until the verification thread is done reading the entry "
              "(not the scheduler thread's time; in vLLM the request waits that long, in steps)")
    fill_ratios(b, "sched")
