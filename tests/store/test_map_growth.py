"""Another process grows the LMDB map (``MDB_MAP_RESIZED``): long-lived and
read-only handles of this process adopt the new size and every kind of
transaction goes on; with a small cap and four writing processes, puts evict
and proceed. Real LMDB files, real processes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.fault_workers import open_store
from helpers.tensors import assert_same, make_tensor

from ecstore.testing import faults as fc

MiB = 1 << 20


GROW = str(Path(__file__).resolve().parents[1] / "helpers" / "grow_store.py")


def grow_from_another_process(path, mib: int, prefix: str = "grow") -> int:
    """Another process puts ``mib`` 1 MiB entries with a large cap; returns
    the data file's size afterwards."""
    cp = subprocess.run([sys.executable, GROW, str(path), str(mib), prefix], capture_output=True, text=True,
                        timeout=300)
    assert cp.returncode == 0, cp.stderr
    return int(cp.stdout.split()[-1])


def test_long_lived_handle_works_after_another_process_grew_the_map(tmp_path):
    """This process opened the store with a small map (1 MiB cap); another
    process then grows the file past it. Every kind of transaction in this
    process still works: opening another handle (schema check), contains,
    get, a tooling scan, a put that evicts, a flush."""
    path = tmp_path / "s"
    s = open_store(path, cap=1 * MiB)
    try:
        s.put("mine", make_tensor(0))
        s.flush()
        small_map = s.disk.env_info()["map_size"]
        assert grow_from_another_process(path, 8) > small_map
        with open_store(path, cap=256 * MiB) as other:  # ensure_schema in this process
            assert other.contains("grow-3")
        assert s.contains("grow-0") and s.contains("mine")
        assert fc.tensor_bytes(s.get("grow-7")) == fc.tensor_bytes(fc.entry_tensor(7, 1024))
        assert len(list(s.disk.iter_records())) == 9
        s.put("mine-2", make_tensor(2))
        s.flush()  # evicts down to the 1 MiB cap
        assert_same(s.get("mine-2"), make_tensor(2))
        assert s.disk.total_bytes() <= 1 * MiB
        assert s.disk.env_info()["map_size"] > small_map  # adopted the other process's size
        fc.audit(path, 1 * MiB, tier=s.disk).check()
    finally:
        s.close()


def _readonly_reader_after_growth(path: str) -> list[str]:
    """Worker: a read-only handle (as ``ecstore-dump`` and the tooling open
    one) whose map is the file's size at open; another process grows it."""
    from helpers.fault_workers import open_store as open_

    out = []
    with open_(path, cap=1 * MiB, readonly=True) as ro:
        out.append(f"before {ro.contains('grow-0')}")
        grow_from_another_process(path, 6, "more")
        out.append(f"after {ro.contains('more-5')} {ro.get('more-5') is not None}")
        out.append(f"scan {len(list(ro.disk.iter_records()))}")
    return out


def test_readonly_handle_adopts_a_grown_map(tmp_path):
    path = tmp_path / "s"
    with open_store(path, cap=256 * MiB) as s:
        s.put("grow-0", make_tensor(0))
    r = fc.run_forked(_readonly_reader_after_growth, str(path), timeout=300).ok()
    assert r == ["before True", "after True True", "scan 7"], r


def test_small_cap_four_writing_processes_puts_evict_and_proceed(tmp_path):
    """4 MiB cap, entries up to 1 MiB, 4 processes putting, reading, pinning,
    deleting and shrinking at once (tools/stress_concurrency.py): every put
    evicts and proceeds (no flush raises StoreFullError: the map filled with
    pages that other processes' read snapshots still held, and the writer
    gave up), accounting exact, verify clean."""
    from ecstore.testing import stress_concurrency

    s = stress_concurrency.run(procs=4, ops=500, seed=2, mode="evict", root=tmp_path, cap=4 * MiB,
                               max_bytes=1 * MiB, log=print)
    assert s["disk_evictions"] > 0 and s["ops"]["put_new"] > 0
