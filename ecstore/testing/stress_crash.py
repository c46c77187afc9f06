#!/usr/bin/env python
"""Crash-consistency stress test: SIGKILL writers at random moments, check the store.

    .venv/bin/python tools/stress_crash.py --kills 100 --seed 1
    .venv/bin/python tools/stress_crash.py --kills 100 --writers 4 --seed 2

Writer processes put and flush on an evicting or a roomy store and are killed
after a seeded number of their progress reports; after each round the store
must open, pass ``audit`` and hold every flushed entry bit-exact (or evicted,
in LRU order). :func:`run` raises AssertionError on the first violation and
returns a summary dict. Details: docs/guarantees.md#the-crash-run-stress_crashpy.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing.connection
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from ecstore import ECStore, ECStoreConfig
from ecstore.testing import faults as fc

MiB = 1 << 20
GiB = 1 << 30
NEVER = 1_000_000  # puts per writer: it is always killed long before


# --------------------------------------------------------------------------
# Writer (runs in the child)
# --------------------------------------------------------------------------

def writer(conn: Any, spec: dict[str, Any]) -> None:
    """Put entries ``spec["start"]...`` into the store until killed."""
    lock = threading.Lock()  # the writer thread reports commits too

    def say(msg: str) -> None:
        with lock:
            conn.send_bytes(msg.encode())  # one write(2) of a few bytes: atomic on a pipe

    class CommitReporter(logging.Handler):
        """``C <id>`` for each entry the background writer has committed
        (ecstore logs "EC put: stored ..." after the commit)."""

        def emit(self, record: logging.LogRecord) -> None:
            if str(record.msg).startswith("EC put: stored") and isinstance(record.args, tuple) and record.args:
                say(f"C {_parse_idx(str(record.args[-1]))}")

    try:
        torch.set_num_threads(1)
        logger = logging.getLogger("ecstore")
        logger.setLevel(logging.INFO)
        logger.addHandler(CommitReporter())
        rng = random.Random(spec["seed"])
        cfg = ECStoreConfig(local_cpu=False, local_disk=spec["dir"], max_local_disk_size=spec["cap"] / GiB)
        store = ECStore(cfg, model=fc.MODEL, dtype=torch.bfloat16)
        say("O")
        pending: list[int] = []
        until_flush = rng.randint(1, spec["flush_every"])
        for idx in range(spec["start"], spec["start"] + NEVER):
            rows = fc.rows_for(idx, spec["salt"], spec["min_bytes"], spec["max_bytes"])
            t = fc.entry_tensor(idx, rows)
            say(f"P {idx}")
            if not store.put(fc.identifier(idx), t, copy=False):
                raise RuntimeError(f"put of new entry {idx} returned False")
            pending.append(idx)
            until_flush -= 1
            if until_flush == 0:
                say("S")  # about to flush: a kill may land inside the commit or its fsync
                store.flush()  # raises StoreFullError if a write failed
                say(f"F {pending[0]} {pending[-1]}")
                pending, until_flush = [], rng.randint(1, spec["flush_every"])
    except BaseException as e:
        import traceback

        say("E " + json.dumps(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise


# --------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------

LANE = 10**7  # writer w of a round puts ids w*LANE + 0, 1, 2, ... (its "lane")


@dataclass
class StoreState:
    name: str
    dir: str
    cap: int
    min_bytes: int
    max_bytes: int
    salt: int
    roomy: bool
    attempted: dict[int, int] = field(default_factory=dict)  # id -> rows (reported P)
    flushed: dict[int, list[int]] = field(default_factory=dict)  # lane -> ids reported flushed, ascending
    committed: set[int] = field(default_factory=set)  # known committed: reported C, flushed, or seen
    maybe_committed: set[int] = field(default_factory=set)  # put after a round's last known commit
    next_idx: dict[int, int] = field(default_factory=dict)  # lane -> next id
    rounds: int = 0
    max_evicted: int = 0
    max_entries: int = 0
    max_total: int = 0

    def rows(self, idx: int) -> int:
        return fc.rows_for(idx, self.salt, self.min_bytes, self.max_bytes)

    def size(self, idx: int) -> int:
        return fc.blob_size(idx, self.rows(idx))

    def all_flushed(self) -> list[int]:
        return [i for lane in sorted(self.flushed) for i in self.flushed[lane]]


def _parse_idx(ident: str) -> int:
    assert ident.startswith("crash-entry-"), f"unexpected identifier {ident!r} in the store"
    return int(ident.removeprefix("crash-entry-"))


def check_store(st: StoreState) -> dict[str, Any]:
    """Open the store after a kill and check it (see the module docstring)."""
    cfg = ECStoreConfig(local_cpu=False, local_disk=st.dir, max_local_disk_size=st.cap / GiB)
    with ECStore(cfg, model=fc.MODEL, dtype=torch.bfloat16) as rw, \
            ECStore(cfg, model=fc.MODEL, dtype=torch.bfloat16, readonly=True) as ro:
        a = fc.audit(st.dir, st.cap, tier=rw.disk).check()
        # The read-write open swept what the killed writers left: blob files
        # written but never committed, or evicted but not yet deleted.
        assert not a.unreferenced_files, f"[{st.name}] blob files left after the kill: {a.unreferenced_files[:5]}"
        present: set[int] = set()
        for key, (ident, size) in a.entries.items():
            idx = _parse_idx(ident)
            assert idx in st.attempted, f"[{st.name}] entry {idx} is in the store but was never put"
            assert key == rw.key(ident), f"[{st.name}] entry {idx} under the wrong key {key}"
            assert size == st.size(idx), f"[{st.name}] entry {idx}: blob size {size} != {st.size(idx)}"
            got = ro.get(ident)  # read-only handle: no LRU update, so put order stays LRU order
            assert got is not None, f"[{st.name}] entry {idx} listed but unreadable"
            want = fc.entry_tensor(idx, st.rows(idx))
            assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), \
                f"[{st.name}] entry {idx}: {got.dtype} {tuple(got.shape)} != {want.dtype} {tuple(want.shape)}"
            assert fc.tensor_bytes(got) == fc.tensor_bytes(want), f"[{st.name}] entry {idx}: bytes differ"
            present.add(idx)
        missing = [i for i in st.all_flushed() if i not in present]
        if st.roomy:
            assert sum(st.size(i) for i in st.all_flushed()) <= st.cap, "roomy cap too small for the test"
            assert not missing, f"[{st.name}] flushed entries lost without eviction: {missing[:10]}"
        elif missing:
            # Eviction is LRU and writers only put: within a lane (one writer
            # after another, ids ascending) commit order is id order, so the
            # evicted entries of each lane are its oldest.
            for lane, flushed in st.flushed.items():
                gone = [i for i in flushed if i not in present]
                assert gone == flushed[: len(gone)], (
                    f"[{st.name}] lane {lane}: flushed entries missing out of LRU order: missing {gone[:10]}..., "
                    f"oldest flushed {flushed[: len(gone)][:10]}...")
            # Eviction needed: what was (or may have been) committed exceeds the cap.
            seen = st.committed | set(st.all_flushed()) | present | st.maybe_committed
            assert sum(st.size(i) for i in seen) > st.cap, \
                f"[{st.name}] flushed entries missing although everything ever committed fits under the cap"
        st.committed |= present
        st.max_evicted = max(st.max_evicted, len(missing))
        st.max_entries = max(st.max_entries, len(present))
        st.max_total = max(st.max_total, a.total_bytes)
        return {"entries": len(present), "total": a.total_bytes, "missing": len(missing),
                "file": a.file_size, "map": a.map_size}


def _kill_round(ctx: Any, st: StoreState, rng: random.Random, writers: int, max_msgs: int,
                flush_every: int) -> dict[str, Any]:
    """Start ``writers`` writer processes on ``st``; SIGKILL each after it has
    sent its own random number of reports; read everything they reported."""
    procs: dict[Any, tuple[int, Any, int]] = {}  # conn -> (lane, process, kill after N reports)
    starts = {}
    for lane in range(writers):
        start = st.next_idx.setdefault(lane, lane * LANE)
        starts[lane] = start
        spec = {"dir": st.dir, "cap": st.cap, "start": start, "salt": st.salt, "min_bytes": st.min_bytes,
                "max_bytes": st.max_bytes, "seed": rng.getrandbits(32), "flush_every": flush_every}
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=writer, args=(send, spec), daemon=True)
        p.start()
        send.close()
        procs[recv] = (lane, p, rng.randint(1, max_msgs))
    counts: dict[str, Any] = {"reports": 0, "puts": 0, "flushes": 0}
    seen_msgs = {conn: 0 for conn in procs}
    errors = []
    live = list(procs)
    while live:
        # wait() hands back some of the objects it was given: here, Connections.
        for conn in cast(list[multiprocessing.connection.Connection], multiprocessing.connection.wait(live)):
            lane, p, n_kill = procs[conn]
            try:
                m = conn.recv_bytes().decode()
            except EOFError:
                live.remove(conn)
                continue
            seen_msgs[conn] += 1
            counts["reports"] += 1
            if m[0] == "P":
                idx = int(m[2:])
                st.attempted[idx] = st.rows(idx)
                st.next_idx[lane] = max(st.next_idx[lane], idx + 1)
                counts["puts"] += 1
            elif m[0] == "F":
                lo, hi = map(int, m[2:].split())
                st.flushed.setdefault(lane, []).extend(i for i in range(lo, hi + 1) if i in st.attempted)
                st.committed.update(range(lo, hi + 1))
                counts["flushes"] += 1
            elif m[0] == "C":
                st.committed.add(int(m[2:]))
            elif m[0] == "E":
                errors.append(json.loads(m[2:]))
            if seen_msgs[conn] == n_kill:
                p.kill()  # SIGKILL
    codes = []
    for conn, (lane, p, _) in procs.items():
        p.join()
        conn.close()
        codes.append(p.exitcode)
        # A writer commits in put order: its puts after its last known commit
        # may or may not have been committed.
        known = max((i for i in st.committed if starts[lane] <= i < (lane + 1) * LANE), default=starts[lane] - 1)
        st.maybe_committed.update(i for i in range(known + 1, st.next_idx[lane]) if i in st.attempted)
    assert not errors, f"writer failed: {errors[0]}"
    assert codes == [-9] * writers, f"writers exited with {codes}, expected SIGKILL (-9) for all"
    counts["exit_codes"] = codes
    counts["kill_after"] = [n for _, _, n in procs.values()]
    return counts


def run(kills: int = 20, seed: int = 0, root: str | os.PathLike | None = None, *, writers: int = 1,
        evict_cap: int = 48 * MiB, evict_max_bytes: int = 24 * MiB, roomy_max_bytes: int = 1 * MiB,
        min_bytes: int = 4096, max_msgs: int = 40, flush_every: int = 6, duration: float | None = None,
        verify_every: int = 0, log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Run at least ``kills`` kill rounds, and more until ``duration``
    seconds have passed (if given); raise AssertionError on the first
    violation. Each round runs ``writers`` writer processes at once on one
    store and SIGKILLs every one of them. ``verify_every``: run
    ``ecstore-dump verify`` on both stores every that many rounds (0: only
    at the end). ``root``: work directory (kept); default a temporary one,
    removed."""
    assert 1 <= writers <= 9
    own_root = root is None
    root = Path(tempfile.mkdtemp(prefix="ecstore-crash-")) if root is None else Path(root)
    rng = random.Random(seed)
    stores = [
        StoreState("evicting", str(root / "evicting"), evict_cap, min_bytes, evict_max_bytes, seed * 2 + 1, False),
        StoreState("roomy", str(root / "roomy"), 4 * GiB, min_bytes, roomy_max_bytes, seed * 2 + 2, True),
    ]
    ctx = fc.mp_context()
    t0 = time.monotonic()
    killed = 0
    r = 0
    try:
        while r < kills or (duration is not None and time.monotonic() - t0 < duration):
            st = stores[r % 2]
            c = _kill_round(ctx, st, rng, writers, max_msgs, flush_every)
            killed += writers
            st.rounds += 1
            res = check_store(st)
            if log:
                log(f"round {r:4d} [{st.name:8s}] {writers} writer(s) killed after {c['kill_after']} reports "
                    f"(read {c['reports']}): {c['puts']} puts, {c['flushes']} flushes | store {res['entries']} "
                    f"entries, {res['total'] / MiB:.1f}/{st.cap / MiB:.0f} MiB, "
                    f"{len(st.all_flushed())} flushed so far, {res['missing']} of them evicted | ok")
            r += 1
            if verify_every and r % verify_every == 0:
                _verify(stores, log)
        _verify(stores, log)
        summary = {
            "kills": r, "processes_killed": killed, "writers_per_round": writers, "seed": seed,
            "seconds": round(time.monotonic() - t0, 1),
            "stores": {st.name: {"rounds": st.rounds, "attempted": len(st.attempted),
                                 "flushed": len(st.all_flushed()), "max_entries": st.max_entries,
                                 "max_evicted_flushed": st.max_evicted,
                                 "max_total_mib": round(st.max_total / MiB, 1), "cap_mib": st.cap // MiB}
                       for st in stores},
        }
        if log:
            log(json.dumps(summary))
        return summary
    finally:
        if own_root:
            shutil.rmtree(root, ignore_errors=True)


def _verify(stores: list[StoreState], log: Callable[[str], None] | None) -> None:
    for st in stores:
        if not os.path.exists(os.path.join(st.dir, "data.mdb")):
            continue
        cp = fc.run_verify_cli(st.dir)
        assert cp.returncode == 0, f"ecstore-dump verify {st.dir} exited {cp.returncode}:\n{cp.stdout}\n{cp.stderr}"
        if log:
            log(f"verify [{st.name}]: {cp.stdout.strip().splitlines()[-1]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=100, help="kill rounds (default 100)")
    ap.add_argument("--writers", type=int, default=1,
                    help="writer processes per round, all on one store, each killed (default 1, at most 9)")
    ap.add_argument("--duration", type=float, default=None,
                    help="keep going until this many seconds have passed (at least --kills rounds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="work directory (kept); default: a temporary one (removed)")
    ap.add_argument("--evict-cap-mb", type=float, default=48)
    ap.add_argument("--evict-max-mb", type=float, default=24, help="largest entry on the evicting store")
    ap.add_argument("--roomy-max-mb", type=float, default=1, help="largest entry on the roomy store")
    ap.add_argument("--max-reports", type=int, default=40, help="kill after 1..this many writer reports")
    ap.add_argument("--flush-every", type=int, default=6, help="flush after 1..this many puts")
    ap.add_argument("--verify-every", type=int, default=25, help="run ecstore-dump verify every N rounds")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    if a.dir:
        os.makedirs(a.dir, exist_ok=True)
    run(a.kills, a.seed, a.dir, writers=a.writers, evict_cap=int(a.evict_cap_mb * MiB),
        evict_max_bytes=int(a.evict_max_mb * MiB),
        roomy_max_bytes=int(a.roomy_max_mb * MiB), max_msgs=a.max_reports, flush_every=a.flush_every,
        duration=a.duration, verify_every=a.verify_every, log=None if a.quiet else print)
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
