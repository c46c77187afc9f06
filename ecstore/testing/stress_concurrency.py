#!/usr/bin/env python
"""Concurrency stress test: several processes hammer one store.

    .venv/bin/python tools/stress_concurrency.py --procs 8 --ops 2000 --seed 1
    .venv/bin/python tools/stress_concurrency.py --procs 8 --duration 300 --mode evict

Worker processes put, get, delete, pin and flush on one store while a reader
checks the accounting; entries may vanish (``evict``), never be wrong, and a
roomy store loses no committed entry. :func:`run` raises AssertionError on the
first violation and returns a summary dict. Details:
docs/guarantees.md#the-concurrency-run-stress_concurrencypy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ecstore import ECStore, ECStoreConfig
from ecstore.format import blob_read
from ecstore.lmdb import LMDBTier
from ecstore.lmdb.txn import _u64, file_ref
from ecstore.testing import faults as fc

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
PRIVATE_BASE = 1_000_000
SALT = 77


def ident(idx: int) -> str:
    return f"conc-{idx:09d}"


def idx_of(identifier: str) -> int:
    assert identifier.startswith("conc-"), f"unexpected identifier {identifier!r}"
    return int(identifier[5:])


def rows(idx: int, spec: dict[str, Any]) -> int:
    return fc.rows_for(idx, SALT, spec["min_bytes"], spec["max_bytes"])


def content(idx: int, spec: dict[str, Any]) -> torch.Tensor:
    """Same bytes in every process: ranks put identical tensors."""
    return fc.entry_tensor(idx, rows(idx, spec))


def _config(spec: dict[str, Any], cap: int, cpu: int = 0) -> ECStoreConfig:
    return ECStoreConfig(local_cpu=cpu > 0, max_local_cpu_size=cpu / GiB, local_disk=spec["dir"],
                         max_local_disk_size=cap / GiB, min_file_blob_size=spec["file_blob_bytes"] / MiB)


# --------------------------------------------------------------------------
# Worker and reader (run in child processes)
# --------------------------------------------------------------------------

def worker(conn: Any, barriers: tuple[Any, Any], spec: dict[str, Any], w: int) -> None:
    try:
        conn.send(("ok", _worker(barriers, spec, w)))
    except BaseException as e:  # noqa: BLE001
        for b in barriers:
            b.abort()
        conn.send(("error", f"worker {w}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def _dump_stacks_if_stuck(spec: dict[str, Any], name: str) -> None:
    """Debug aid: if the parent set ``stack_dir``, a process still running
    after ``stack_after_s`` seconds writes its threads' stacks there."""
    if spec.get("stack_dir"):
        import faulthandler

        fh = open(os.path.join(spec["stack_dir"], f"stacks-{name}-{os.getpid()}.txt"), "w")
        faulthandler.dump_traceback_later(spec["stack_after_s"], exit=False, file=fh)


def _worker(barriers: tuple[Any, Any], spec: dict[str, Any], w: int) -> dict[str, Any]:
    start, phase = barriers  # all processes incl. the reader; the workers only
    _dump_stacks_if_stuck(spec, f"worker{w}")
    torch.set_num_threads(1)
    rng = random.Random(spec["seed"] * 1000 + w)
    roomy = spec["mode"] == "roomy"
    cap = spec["cap"]
    cpu = spec["cpu_bytes"] if w % 2 else 0
    store = ECStore(_config(spec, cap, cpu), model=fc.MODEL, dtype=torch.bfloat16)
    shared = list(range(spec["shared"]))
    own = [PRIVATE_BASE * (w + 1) + j for j in range(spec["private"])]
    # Half of the shared entries are pinned and never deleted (see "pin").
    pin_ids = shared[: max(1, len(shared) // 2)]
    pinnable = set(pin_ids)
    others = [PRIVATE_BASE * (v + 1) + j for v in range(spec["procs"]) if v != w for j in range(spec["private"])]
    counts = {k: 0 for k in ("put", "put_new", "get", "hit", "contains", "delete", "flush", "pin", "pinned",
                             "shrink", "shrink_evicted")}
    last_own: dict[int, bool] = {}  # own id -> present after my last op on it (roomy bookkeeping)
    put_shared: set[int] = set()

    def check_hit(i: int, t: torch.Tensor | None) -> None:
        if t is not None:
            counts["hit"] += 1
            want = content(i, spec)
            assert tuple(t.shape) == tuple(want.shape) and fc.tensor_bytes(t) == fc.tensor_bytes(want), \
                f"worker {w}: get({ident(i)}) returned wrong content"

    def flush() -> None:
        store.flush()  # raises StoreFullError on any failed write
        counts["flush"] += 1
        st = store.stats()
        assert st.disk_bytes <= cap, f"worker {w}: {st.disk_bytes} bytes stored, cap {cap}"

    start.wait(timeout=300)
    # Phase 1: every rank puts the same entries, in the same order.
    for i in shared[: spec["shared_first"]]:
        counts["put_new"] += store.put(ident(i), content(i, spec))
        counts["put"] += 1
    flush()
    phase.wait(timeout=300)
    for i in shared[: spec["shared_first"]]:
        t = store.get(ident(i))
        counts["get"] += 1
        if roomy:
            assert t is not None, f"worker {w}: shared entry {i} missing after phase 1"
        check_hit(i, t)
    # Phase 2: random operations.
    for _ in range(spec["ops"]):
        op = rng.choices(["put", "get", "contains", "delete", "flush", "pin", "shrink"],
                         [34, 30, 8, 10, 8, 8, 0 if roomy else 2])[0]
        pool = rng.choice([shared, own, others])
        i = rng.choice(pool)
        if op == "put":
            if pool is others:
                pool, i = own, rng.choice(own)  # only the owner writes its ids
            counts["put_new"] += store.put(ident(i), content(i, spec))
            counts["put"] += 1
            if pool is own:
                last_own[i] = True
            else:
                put_shared.add(i)
        elif op == "get":
            check_hit(i, store.get(ident(i)))
            counts["get"] += 1
        elif op == "contains":
            if store.contains(ident(i)):
                check_hit(i, store.get(ident(i)))
            counts["contains"] += 1
        elif op == "delete":
            if (roomy and pool is not own) or i in pinnable:
                pool, i = own, rng.choice(own)
            store.delete(ident(i))
            counts["delete"] += 1
            if pool is own:
                last_own[i] = False
        elif op == "flush":
            flush()
        elif op == "pin":
            counts["pin"] += 1
            # Only entries nobody deletes: a lease pins against eviction, not
            # against an explicit delete (another worker deleting the entry
            # right after the pin made this check fail, rarely, before).
            i = rng.choice(pin_ids)
            if store.pin_if_present(ident(i), ttl_s=600):
                counts["pinned"] += 1
                # The lease must keep the entry on disk whatever the others evict.
                assert store.disk is not None  # _config sets local_disk
                k = store.key(ident(i))
                t = store.disk.get(k, store.stored_name(ident(i)))
                assert t is not None, (f"worker {w}: pinned entry {i} vanished from disk (record now "
                                       f"{store.disk.record(k)}, leased {k.encode() in store.disk.leased_keys()})")
                check_hit(i, t)
                store.release([ident(i)])
        elif op == "shrink":
            counts["shrink"] += 1
            with ECStore(_config(spec, cap // 2), model="other/model@tp", dtype=torch.float16) as small:
                assert small.disk is not None  # _config sets local_disk
                counts["shrink_evicted"] += small.disk.evictions  # others keep writing: no bound to check here
    flush()
    st = store.stats()
    store.close()
    return {"worker": w, "counts": counts, "last_own": {str(k): v for k, v in last_own.items()},
            "put_shared": sorted(put_shared),
            "write_errors": st.write_errors, "disk_evictions": st.disk_evictions,
            "corrupt_dropped": st.corrupt_dropped}


def reader(conn: Any, barrier: Any, stop: Any, spec: dict[str, Any]) -> None:
    try:
        torch.set_num_threads(1)
        rng = random.Random(spec["seed"])
        tier = LMDBTier(spec["dir"], spec["cap"], readonly=True, create=False)
        checks = reads = 0
        max_total = 0
        barrier.wait(timeout=300)
        while not stop.is_set():
            with tier.snapshot() as (txn, dbs):
                total = _u64(txn, b"total_bytes", dbs.meta, spec["dir"])
                recs = []
                with txn.cursor(db=dbs.entries) as cur:
                    for k, raw in cur:
                        recs.append((bytes(k), fc.codec.unpack_record(raw)))
                s = sum(r.blob_size for _, r in recs)
                assert total == s, f"reader: meta total_bytes {total} != sum of records {s}"
                assert total <= spec["cap"], f"reader: {total} bytes stored, cap {spec['cap']}"
                if recs:
                    k, rec = rng.choice(recs)
                    blob = txn.get(k, db=dbs.blobs)
                    assert blob is not None, "reader: record without blob"
                    ref = file_ref(blob)
                    if ref is not None:  # a blob file: its contents
                        blob = tier.resolve_blob(blob)
                        if len(blob) == 0 and not tier.points_to(k, ref):
                            continue  # evicted and deleted after this snapshot: gone, not damaged
                    assert len(blob) == rec.blob_size, "reader: partial entry"
                    t = blob_read.decode(blob, expected_checksum=rec.checksum, identifier=rec.identifier)
                    i = idx_of(rec.mm_identifier)
                    assert fc.tensor_bytes(t) == fc.tensor_bytes(content(i, spec)), \
                        f"reader: entry {i} has wrong content"
                    reads += 1
            info = tier.env_info()
            assert info["file_size"] <= info["map_size"], f"reader: data.mdb {info['file_size']} > map"
            max_total = max(max_total, total)
            checks += 1
        tier.close()
        conn.send(("ok", {"checks": checks, "reads": reads, "max_total": max_total}))
    except BaseException as e:  # noqa: BLE001
        barrier.abort()
        conn.send(("error", f"reader: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


# --------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------

def run(procs: int = 4, ops: int = 150, seed: int = 0, mode: str = "evict", root: str | os.PathLike | None = None,
        *, cap: int | None = None, shared: int = 24, shared_first: int = 12, private: int = 12,
        min_bytes: int = 2 * KiB, max_bytes: int = 128 * KiB, cpu_bytes: int = 512 * KiB,
        file_blob_bytes: int = MiB // 2, timeout: float = 600, stack_dir: str | None = None,
        log: Callable[[str], None] | None = print) -> dict[str, Any]:
    assert mode in ("roomy", "evict")
    own_root = root is None
    root = Path(tempfile.mkdtemp(prefix="ecstore-conc-")) if root is None else Path(root)
    d = root / f"store-{mode}"
    if cap is None:
        cap = 1 * GiB if mode == "roomy" else 1 * MiB
    spec = {"dir": str(d), "cap": cap, "mode": mode, "seed": seed, "procs": procs, "ops": ops,
            "shared": shared, "shared_first": shared_first, "private": private, "min_bytes": min_bytes,
            "max_bytes": max_bytes, "cpu_bytes": cpu_bytes, "stack_dir": stack_dir,
            "file_blob_bytes": file_blob_bytes,
            "stack_after_s": max(1.0, timeout - 10)}
    t0 = time.monotonic()
    try:
        ECStore(_config(spec, cap), model=fc.MODEL, dtype=torch.bfloat16).close()  # create it
        ctx = fc.mp_context()
        barriers = (ctx.Barrier(procs + 1), ctx.Barrier(procs))
        stop = ctx.Event()
        children = []
        for w in range(procs):
            rc, sc = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker, args=(sc, barriers, spec, w), daemon=True)
            p.start()
            sc.close()
            children.append((f"worker {w}", p, rc))
        rc, sc = ctx.Pipe(duplex=False)
        rp = ctx.Process(target=reader, args=(sc, barriers[0], stop, spec), daemon=True)
        rp.start()
        sc.close()
        results: dict[str, Any] = {}
        errors: list[str] = []

        def collect(name: str, p: Any, conn: Any) -> None:
            left = max(1.0, timeout - (time.monotonic() - t0))
            if not conn.poll(left):
                p.kill()
                errors.append(f"{name}: no result within {timeout}s (hung?)")
            else:
                try:
                    status, value = conn.recv()
                    if status == "ok":
                        results[name] = value
                    else:
                        errors.append(value)
                except EOFError:
                    p.join()
                    errors.append(f"{name}: died with exit code {p.exitcode}")
            p.join()

        for name, p, conn in children:
            collect(name, p, conn)
        stop.set()  # the workers are done: the reader finishes its pass and reports
        collect("reader", rp, rc)
        assert not errors, "\n".join(errors)
        workers = [results[f"worker {w}"] for w in range(procs)]
        for r in workers:
            assert r["write_errors"] == 0, f"worker {r['worker']}: {r['write_errors']} write errors"
            assert r["corrupt_dropped"] == 0, f"worker {r['worker']}: corrupt entries dropped"
        rd = results["reader"]
        assert rd["checks"] > 0, "the reader never checked the store"

        # Final state.
        a = fc.audit(d, cap).check()
        present = {idx_of(i) for i in a.identifiers}
        with ECStore(_config(spec, cap), model=fc.MODEL, dtype=torch.bfloat16, readonly=True) as ro:
            for i in present:
                t = ro.get(ident(i))
                assert t is not None and fc.tensor_bytes(t) == fc.tensor_bytes(content(i, spec)), \
                    f"entry {i} wrong or unreadable at the end"
        if mode == "roomy":
            expect = set(range(shared_first))  # phase 1
            for r in workers:
                expect |= set(r["put_shared"])  # shared ids are never deleted in this mode
                expect |= {int(k) for k, v in r["last_own"].items() if v}
            gone = {int(k) for r in workers for k, v in r["last_own"].items() if not v}
            lost = sorted(expect - present)
            assert not lost, f"committed entries lost: {lost[:10]}"
            stale = sorted(gone & present)
            assert not stale, f"deleted entries still present: {stale[:10]}"
        else:
            # Evictions by the workers' own handles or by their shrinking
            # handles (a shrink may leave the others nothing to evict).
            evicted = sum(r["disk_evictions"] + r["counts"]["shrink_evicted"] for r in workers)
            assert evicted > 0 or a.total_bytes > cap // 2, \
                "evict mode never evicted: raise --ops or lower --cap-kb"
        cp = fc.run_verify_cli(d)
        assert cp.returncode == 0, f"ecstore-dump verify exited {cp.returncode}:\n{cp.stdout}\n{cp.stderr}"
        totals: dict[str, int] = {}
        for r in workers:
            for k, v in r["counts"].items():
                totals[k] = totals.get(k, 0) + v
        summary = {"mode": mode, "procs": procs, "ops_per_proc": ops, "seed": seed,
                   "seconds": round(time.monotonic() - t0, 1), "ops": totals,
                   "disk_evictions": sum(r["disk_evictions"] for r in workers),
                   "reader_checks": rd["checks"], "reader_reads": rd["reads"],
                   "max_total_bytes": rd["max_total"], "cap": cap, "final_entries": len(a.entries),
                   "final_bytes": a.total_bytes, "verify": cp.stdout.strip().splitlines()[-1]}
        if log:
            log(json.dumps(summary))
        return summary
    finally:
        if own_root:
            shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--ops", type=int, default=2000, help="random operations per worker")
    ap.add_argument("--duration", type=float, default=None,
                    help="repeat whole runs (seed, seed+1, ...) until this many seconds have passed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=["roomy", "evict", "both"], default="both")
    ap.add_argument("--cap-kb", type=int, default=1024, help="cap of the evict mode (KiB)")
    ap.add_argument("--max-kb", type=int, default=128, help="largest entry (KiB)")
    ap.add_argument("--dir", default=None, help="work directory (kept); default: a temporary one")
    a = ap.parse_args(argv)
    modes = ["roomy", "evict"] if a.mode == "both" else [a.mode]
    t0 = time.monotonic()
    seed = a.seed
    while True:
        for m in modes:
            root = None
            if a.dir:
                root = Path(a.dir) / f"seed{seed}"
                root.mkdir(parents=True, exist_ok=True)
            run(a.procs, a.ops, seed, m, root, cap=None if m == "roomy" else a.cap_kb * KiB,
                max_bytes=a.max_kb * KiB)
        seed += 1
        if a.duration is None or time.monotonic() - t0 >= a.duration:
            break
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
