"""Persistence across handles and processes: close/reopen, a fresh process,
a process that dies after flush, and two processes sharing one store.

Children run tests/helpers/store_child.py and are driven line by line over
pipes: the parent only sends a phase once every child has answered the
previous one, so no sleeps or timing are involved.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gib
from helpers.tensors import assert_same, make_tensor, stored_name

from ecstore import ECStore, ECStoreConfig
from ecstore.format import codec

CHILD = str(Path(__file__).parents[1] / "helpers" / "store_child.py")
MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"


class Child:
    """One store_child.py process."""

    def __init__(self, tmp_path: Path, name: str) -> None:
        self.name = name
        self.err_path = tmp_path / f"{name}.stderr"
        self._err = open(self.err_path, "w")
        self.p = subprocess.Popen([sys.executable, CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self._err, text=True, bufsize=1)
        self.sent = 0

    def send(self, *cmds: dict[str, Any]) -> None:
        for c in cmds:
            self.p.stdin.write(json.dumps(c) + "\n")
        self.p.stdin.flush()
        self.sent += len(cmds)

    def recv(self) -> list[Any]:
        """Answers to everything sent and not yet answered, in order."""
        out = []
        while self.sent:
            line = self.p.stdout.readline()
            assert line, f"child {self.name} died:\n{self.err_path.read_text()}"
            ans = json.loads(line)
            assert "error" not in ans, f"child {self.name}: {ans['error']}\n{ans.get('trace', '')}"
            out.append(ans["result"])
            self.sent -= 1
        return out

    def call(self, op: str, **kw: Any) -> Any:
        self.send({"op": op, **kw})
        return self.recv()[0]

    def finish(self) -> None:
        self.p.stdin.close()
        rc = self.p.wait(timeout=120)
        self._err.close()
        assert rc == 0, f"child {self.name} exited {rc}:\n{self.err_path.read_text()}"

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        self._err.close()


@pytest.fixture
def children(tmp_path):
    made: list[Child] = []

    def make(name: str) -> Child:
        c = Child(tmp_path, name)
        made.append(c)
        return c

    yield make
    for c in made:
        c.kill()


def open_store(path: Path, cap: int, **kw) -> ECStore:
    cfg = ECStoreConfig(local_cpu=False, local_disk=str(path), max_local_disk_size=gib(cap))
    return ECStore(cfg, model=MODEL, dtype=torch.bfloat16, **kw)


def cost(ident: str, rows: int = 4, cols: int = 16) -> int:
    return codec.blob_size(make_tensor(0, rows, cols), identifier=stored_name(ident, MODEL), model=MODEL)


def seed_of(ident: str) -> int:
    return sum(ident.encode()) * 131 + len(ident)


def check_accounting(store: ECStore, cap: int) -> None:
    keys = store.disk.lru_keys()
    sizes = [len(store.disk.blob_bytes(k)) for k in keys]
    st = store.stats()
    assert st.disk_bytes == sum(sizes) <= cap
    assert st.disk_entries == len(keys) == len(set(keys))
    assert sorted(keys) == sorted(k for k, _ in store.disk.iter_records())
    for k, rec in store.disk.iter_records():
        assert rec is not None and rec.blob_size == len(store.disk.blob_bytes(k))


# ----------------------------------------------------------------------------


def test_close_and_reopen_in_process(tmp_store_dir):
    ids = [f"img-{i}" for i in range(6)]
    with open_store(tmp_store_dir, 1 << 20) as store:
        for i, h in enumerate(ids):
            store.put(h, make_tensor(i, 1 + i, 16))
        store.get(ids[0])
        # no flush: close flushes
    with open_store(tmp_store_dir, 1 << 20) as store:
        assert store.disk.lru_keys() == [store.key(h) for h in ids[1:] + ids[:1]]
        check_accounting(store, 1 << 20)
        for i, h in enumerate(ids):
            assert_same(store.get(h), make_tensor(i, 1 + i, 16))
        store.flush()
        assert store.disk.lru_keys() == [store.key(h) for h in ids]


def test_reopen_with_a_smaller_cap_evicts_lru_first(tmp_store_dir):
    ids = [f"img-{i}" for i in range(6)]
    c = cost(ids[0])
    with open_store(tmp_store_dir, 1 << 20) as store:
        for i, h in enumerate(ids):
            store.put(h, make_tensor(i))
        store.flush()
        store.get(ids[0])
    with open_store(tmp_store_dir, 3 * c) as store:
        assert [h for h in ids if store.contains(h)] == [ids[0], ids[4], ids[5]]
        assert store.disk.lru_keys() == [store.key(h) for h in (ids[4], ids[5], ids[0])]
        check_accounting(store, 3 * c)


def test_a_fresh_process_reads_what_was_written(tmp_store_dir, children):
    ids = [f"proc-{i:02d}" for i in range(8)]
    with open_store(tmp_store_dir, 1 << 20) as store:
        for h in ids:
            assert store.put(h, make_tensor(seed_of(h), 3, 16))
        store.flush()
        lru = store.disk.lru_keys()
        disk_bytes = store.stats().disk_bytes
    child = children("reader")
    child.send({"op": "open", "dir": str(tmp_store_dir), "disk_bytes": 1 << 20},
               *({"op": "get", "id": h, "seed": seed_of(h), "rows": 3} for h in ids),
               {"op": "contains", "id": "never-put"},
               {"op": "get", "id": "never-put"},
               {"op": "stats"})
    _, *gets, contains, miss, stats = child.recv()
    assert gets == ["hit"] * len(ids)
    assert contains is False and miss == "miss"
    assert stats["disk_bytes"] == disk_bytes and stats["disk_entries"] == len(ids)
    assert stats["disk_hits"] == len(ids) and stats["misses"] == 1
    # the child's gets reach LMDB once flushed: they are the new LRU order
    child.send({"op": "flush"}, {"op": "lru_keys"}, {"op": "close"})
    _, lru_child, _ = child.recv()
    assert lru_child == lru  # same order: every entry was read once, oldest first
    child.finish()


def test_eviction_order_survives_a_restart(tmp_store_dir, children):
    ids = [f"ev-{i:02d}" for i in range(9)]
    c = cost(ids[0])
    cap = 5 * c + c // 3
    with open_store(tmp_store_dir, cap) as store:
        for h in ids[:5]:
            store.put(h, make_tensor(seed_of(h)))
        store.flush()
        store.get(ids[1])
        store.get(ids[3])
        store.flush()
        keys = {h: store.key(h) for h in ids}
        assert store.disk.lru_keys() == [keys[h] for h in ("ev-00", "ev-02", "ev-04", "ev-01", "ev-03")]
    child = children("evictor")
    child.send({"op": "open", "dir": str(tmp_store_dir), "disk_bytes": cap},
               {"op": "lru_keys"},
               {"op": "put", "id": "ev-05", "seed": seed_of("ev-05")},
               {"op": "put", "id": "ev-06", "seed": seed_of("ev-06")},
               {"op": "flush"},
               *({"op": "contains", "id": h} for h in ids[:7]),
               {"op": "get", "id": "ev-04", "seed": seed_of("ev-04")},
               {"op": "flush"},
               {"op": "put", "id": "ev-07", "seed": seed_of("ev-07")},
               {"op": "flush"},
               {"op": "lru_keys"},
               {"op": "stats"},
               {"op": "close"})
    (_, lru0, p5, p6, _, *contains, g4, _, p7, _, lru1, stats, _) = child.recv()
    child.finish()
    assert lru0 == [keys[h] for h in ("ev-00", "ev-02", "ev-04", "ev-01", "ev-03")]
    assert (p5, p6, p7) == (True, True, True)
    assert dict(zip(ids[:7], contains)) == {"ev-00": False, "ev-01": True, "ev-02": False, "ev-03": True,
                                            "ev-04": True, "ev-05": True, "ev-06": True}
    assert g4 == "hit"
    assert lru1 == [keys[h] for h in ("ev-03", "ev-05", "ev-06", "ev-04", "ev-07")]
    assert stats["disk_bytes"] <= cap and stats["disk_evictions"] == 3
    with open_store(tmp_store_dir, cap) as store:  # and back in this process
        assert store.disk.lru_keys() == lru1
        for h in ("ev-03", "ev-05", "ev-06", "ev-04", "ev-07"):
            assert_same(store.get(h), make_tensor(seed_of(h)))
        check_accounting(store, cap)


def test_flushed_entries_survive_a_process_that_dies(tmp_store_dir, children):
    child = children("crasher")
    ids = [f"crash-{i}" for i in range(5)]
    child.send({"op": "open", "dir": str(tmp_store_dir), "disk_bytes": 1 << 20},
               *({"op": "put", "id": h, "seed": seed_of(h)} for h in ids),
               {"op": "flush"},
               {"op": "get", "id": ids[0]},
               {"op": "flush"})
    child.recv()
    child.send({"op": "exit_now"})  # no close, no atexit
    assert child.p.wait(timeout=120) == 0
    with open_store(tmp_store_dir, 1 << 20) as store:
        assert store.disk.lru_keys()[-1] == store.key(ids[0])
        check_accounting(store, 1 << 20)
        for h in ids:
            assert_same(store.get(h), make_tensor(seed_of(h)))
        # the dead process's reader slot does not block writers
        assert store.put("after", make_tensor(1))
        store.flush()
        assert store.contains("after")


_LEFT_OPEN = f"""
import sys, torch
from ecstore import ECStore, ECStoreConfig
cfg = ECStoreConfig(local_cpu=False, local_disk=sys.argv[1], max_local_disk_size=1)
store = ECStore(cfg, model={MODEL!r}, dtype=torch.bfloat16)
for i in range(12):  # small entries inline in LMDB, large ones as blob files
    store.put(f"left-{{i}}", torch.full((4 if i % 2 else 1024, 2048), float(i), dtype=torch.bfloat16))
print("put", flush=True)
"""


def test_a_handle_left_open_at_exit_is_closed_and_loses_nothing(tmp_store_dir):
    """A script that puts and exits without ``close``: its pending puts died
    with the writer (a daemon thread; a single put was lost every time).
    The handle is now closed at exit (ecstore.store.left_open), as close
    would: every entry written and durable, nothing logged."""
    r = subprocess.run([sys.executable, "-c", _LEFT_OPEN, str(tmp_store_dir)], capture_output=True, text=True,
                       timeout=300)
    assert (r.returncode, r.stdout, r.stderr) == (0, "put\n", "")
    with open_store(tmp_store_dir, 1 << 30) as store:
        for i in range(12):
            want = torch.full((4 if i % 2 else 1024, 2048), float(i), dtype=torch.bfloat16)
            assert store.verify(f"left-{i}")
            assert_same(store.get(f"left-{i}"), want)


_DROPPED = f"""
import gc, sys, weakref, torch
from ecstore import ECStore, ECStoreConfig
cfg = ECStoreConfig(local_cpu=True, local_disk=sys.argv[1], max_local_disk_size=1)
store = ECStore(cfg, model={MODEL!r}, dtype=torch.bfloat16)
for i in range(4):
    store.put(f"dropped-{{i}}", torch.full((1024, 2048), float(i), dtype=torch.bfloat16))
memory = weakref.ref(store.memory)
del store
gc.collect()
print("memory tier freed" if memory() is None else "memory tier held", flush=True)
"""


def test_a_handle_dropped_without_close_frees_its_memory_tier_and_its_puts_are_written_at_exit(tmp_store_dir):
    """The exit hook holds a handle weakly: one dropped without close is
    garbage as before (holding it kept its memory tier's tensors until the
    exit), and its background part (writer, LMDB) still writes its puts."""
    r = subprocess.run([sys.executable, "-c", _DROPPED, str(tmp_store_dir)], capture_output=True, text=True,
                       timeout=300)
    assert (r.returncode, r.stdout, r.stderr) == (0, "memory tier freed\n", "")
    with open_store(tmp_store_dir, 1 << 30) as store:
        for i in range(4):
            assert_same(store.get(f"dropped-{i}"), torch.full((1024, 2048), float(i), dtype=torch.bfloat16))


_CLOSED_DURING_THE_EXIT = f"""
import gc, sys, torch
from ecstore import ECStore, ECStoreConfig
from ecstore.store import left_open
cfg = ECStoreConfig(local_cpu=False, local_disk=sys.argv[1], max_local_disk_size=1)
store = ECStore(cfg, model={MODEL!r}, dtype=torch.bfloat16)
store.put("closed-late", torch.ones(8, 16, dtype=torch.bfloat16))
real = left_open.close_handles

def closed_meanwhile(left, timeout):  # after close_all took the handles, before their turn
    global store
    left_open.close_handles = real
    store.close()
    del store
    gc.collect()
    return real(left, timeout)
left_open.close_handles = closed_meanwhile
print(left_open.close_all(), flush=True)
"""


def test_a_handle_closed_and_dropped_while_the_exit_closes_is_not_closed_twice(tmp_store_dir):
    """Its background part was closed a second time ("closing a store left
    open at exit failed: ... is closed" logged)."""
    r = subprocess.run([sys.executable, "-c", _CLOSED_DURING_THE_EXIT, str(tmp_store_dir)], capture_output=True,
                       text=True, timeout=300)
    assert (r.returncode, r.stdout, r.stderr) == (0, "True\n", "")
    with open_store(tmp_store_dir, 1 << 30) as store:
        assert store.contains("closed-late")


_FORK_HOLDING_THE_LOCK = """
import os
from ecstore.store import left_open
with left_open._lock:  # as another thread of the parent might hold it at the fork
    pid = os.fork()
    if pid == 0:
        left_open.close_all()
        os._exit(0)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_child_forked_while_the_exit_hooks_lock_is_held_exits():
    """The child inherited the lock held and waited for it for ever at its exit."""
    r = subprocess.run([sys.executable, "-c", _FORK_HOLDING_THE_LOCK], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (0, "0\n", "")


def test_only_handles_with_a_background_writer_wait_for_exit_and_close_forgets_them(tmp_store_dir):
    from ecstore.store import left_open

    before = left_open.tracked()
    memory_only = ECStore(ECStoreConfig(local_cpu=True, local_disk=None), model=MODEL, dtype=torch.bfloat16)
    assert left_open.tracked() == before  # nothing pending at exit: not held
    disk = open_store(tmp_store_dir, 1 << 20)
    assert left_open.tracked() == before + 1
    disk.close()
    memory_only.close()
    assert left_open.tracked() == before  # closed: not held until exit


@pytest.mark.parametrize("roomy", [True, False], ids=["all-fit", "evicting"])
def test_two_processes_write_and_read_one_store(tmp_store_dir, children, roomy):
    own = {name: [f"{name}-{i:02d}" for i in range(10)] for name in ("a", "b")}
    shared = [f"shared-{i:02d}" for i in range(6)]
    c = cost(own["a"][0])  # every identifier above has the same length
    assert all(cost(h) == c for h in own["a"] + own["b"] + shared)
    cap = 64 * c if roomy else 7 * c + c // 2
    procs = {name: children(name) for name in ("a", "b")}
    for p in procs.values():  # open both; the first one creates the store
        p.send({"op": "open", "dir": str(tmp_store_dir), "disk_bytes": cap})
    for p in procs.values():
        p.recv()
    # phase 1, concurrently: own keys and shared keys interleaved, then flush
    for name, p in procs.items():
        cmds = []
        for i, h in enumerate(own[name]):
            cmds.append({"op": "put", "id": h, "seed": seed_of(h)})
            if i < len(shared):
                s = shared[i] if name == "a" else shared[-1 - i]
                cmds.append({"op": "put", "id": s, "seed": seed_of(s)})
        cmds += [{"op": "flush"}, {"op": "stats"}]
        p.send(*cmds)
    phase1 = {name: p.recv() for name, p in procs.items()}
    for name in procs:
        assert phase1[name][-1]["disk_bytes"] <= cap
        assert phase1[name][-1]["write_errors"] == 0
    # phase 2, after both finished: each reads the other's keys and the shared ones
    for name, p in procs.items():
        other = "b" if name == "a" else "a"
        p.send(*({"op": "get", "id": h, "seed": seed_of(h)} for h in own[other] + shared),
               {"op": "stats"}, {"op": "blob_sizes"}, {"op": "close"})
    phase2 = {name: p.recv() for name, p in procs.items()}
    for p in procs.values():
        p.finish()
    for name in procs:
        *gets, stats, sizes, _ = phase2[name]
        assert "mismatch" not in gets
        if roomy:
            assert gets == ["hit"] * len(gets)
        assert stats["disk_bytes"] <= cap
        assert stats["disk_bytes"] == sum(sizes.values())  # nothing is written in phase 2
    with open_store(tmp_store_dir, cap) as store:
        check_accounting(store, cap)
        all_ids = own["a"] + own["b"] + shared
        present = [h for h in all_ids if store.contains(h)]
        for h in present:
            assert_same(store.get(h), make_tensor(seed_of(h)))
        if roomy:
            assert present == all_ids
            assert store.stats().disk_bytes == len(all_ids) * c
            assert store.stats().disk_entries == len(all_ids)  # shared keys stored once
        else:
            assert 1 <= len(present) <= 7
            assert store.stats().disk_bytes == len(store.disk.lru_keys()) * c


def _answer_within(child: Child, seconds: float) -> Any:
    """The child's next answer, or a failure if none comes in ``seconds``
    (a bound on a hang, not a timing)."""
    ready, _, _ = select.select([child.p.stdout], [], [], seconds)
    assert ready, f"child {child.name} did not answer within {seconds} s"
    return child.recv()[0]


@pytest.mark.parametrize("torn", [False, True], ids=["killed", "killed-then-file-torn"])
def test_entry_is_visible_before_its_blob_file_is_synced_and_a_kill_there_loses_nothing(
        tmp_store_dir, children, torn):
    """wait_committed (an encode-only producer's step end) returns
    once the entry is committed, without waiting for its blob file's
    fdatasync (before: the file was synced before the commit, so it waited
    for the disk; this test then hung in wait_committed). SIGKILLed right
    there, nothing is lost: the file is whole in the page cache, and the
    entry reads back bit for bit with exact accounting. Should a power loss
    tear that not-yet-synced file (simulated: truncated), its read is a
    checked miss, the entry is dropped and the accounting stays exact."""
    cap = 64 << 20
    rows, cols = 512, 1024  # 1 MiB: its blob goes to a file of its own
    child = children("producer")
    child.send({"op": "open", "dir": str(tmp_store_dir), "disk_bytes": cap}, {"op": "hold_blob_syncs"},
               {"op": "put", "id": "big", "seed": 7, "rows": rows, "cols": cols})
    child.recv()
    child.send({"op": "wait_committed"})
    _answer_within(child, 60)
    with open_store(tmp_store_dir, cap) as other:  # another process sees it now
        assert other.contains("big")
    child.kill()  # SIGKILL while the file's sync never returned
    files = list((tmp_store_dir / "blobs").glob("*.ecb"))
    assert len(files) == 1
    if torn:
        with open(files[0], "r+b") as f:
            f.truncate(files[0].stat().st_size // 2)
    with open_store(tmp_store_dir, cap) as store:
        got = store.get("big")
        if torn:
            assert got is None
            assert not store.contains("big")
            assert store.stats().disk_bytes == 0
        else:
            assert_same(got, make_tensor(7, rows, cols))
        check_accounting(store, cap)
    left = list((tmp_store_dir / "blobs").glob("*.ecb"))
    assert left == ([] if torn else files)


def test_flush_syncs_the_file_of_an_entry_another_process_committed_and_has_not_synced(
        tmp_store_dir, children, monkeypatch):
    """Visible first, durable next: a producer commits an entry and syncs its
    blob file after the commit. This handle's put of the same entry, queued
    before that commit and written after it, comes out "present"; flush()
    then vouches for it (docs/guarantees.md, power loss after flush()), so
    it must sync that file too. Before, only stored puts' files were synced:
    flush() returned with the producer's file never synced (here the
    producer's sync never returns), and a power loss could tear it."""
    cap = 64 << 20
    rows, cols = 512, 1024  # 1 MiB: blob files of their own
    store = open_store(tmp_store_dir, cap)
    real_sync = store.disk.files.sync
    real_write = store.disk.write_batch
    synced: list[str] = []
    gate = threading.Event()
    big = store.stored_name("big")

    def recording_sync(names, **kw):  # the real sync; names recorded
        names = list(names)
        real_sync(names, **kw)
        synced.extend(names)

    def held_write(puts, touches=None, **kw):  # the batch with "big" waits for the gate
        if any(p.put.identifier == big for p in puts):
            assert gate.wait(60), "the gate was never opened"
        return real_write(puts, touches, **kw)

    monkeypatch.setattr(store.disk.files, "sync", recording_sync)
    monkeypatch.setattr(store.disk, "write_batch", held_write)
    try:
        assert store.put("x", make_tensor(3, rows, cols))
        store.wait_committed()
        # Nobody holds it yet: queued, and its batch waits (the writer used
        # to wait in x's sync here; its syncs run on a thread of their own now).
        assert store.put("big", make_tensor(7, rows, cols))
        producer = children("producer")
        producer.send({"op": "open", "dir": str(tmp_store_dir), "disk_bytes": cap}, {"op": "hold_blob_syncs"},
                      {"op": "put", "id": "big", "seed": 7, "rows": rows, "cols": cols}, {"op": "wait_committed"})
        assert producer.recv()[2] is True  # the producer stored it (its file's sync never returns)
        gate.set()
        store.flush()  # this handle's "big" comes out present
        files = {f.name for f in (tmp_store_dir / "blobs").glob("*.ecb")}
        assert len(files) == 2  # x's and the producer's "big"
        assert set(synced) == files, "flush() returned without syncing the producer's file"
        assert_same(store.get("big"), make_tensor(7, rows, cols))
        producer.kill()
    finally:
        gate.set()
        store.close()


def test_flush_syncs_the_file_of_an_entry_a_skipped_put_found_unsynced(tmp_store_dir, children, monkeypatch):
    """The same as above when this handle's put comes after the producer's
    commit: put() finds the entry held and returns False (skipped); flush()
    ("everything put so far is durable") must still sync its file. Before,
    a skipped put left nothing to sync: flush() returned with the producer's
    file never synced."""
    cap = 64 << 20
    rows, cols = 512, 1024  # 1 MiB: a blob file of its own
    producer = children("producer")
    producer.send({"op": "open", "dir": str(tmp_store_dir), "disk_bytes": cap}, {"op": "hold_blob_syncs"},
                  {"op": "put", "id": "big", "seed": 7, "rows": rows, "cols": cols}, {"op": "wait_committed"})
    assert producer.recv()[2] is True  # committed; its file's sync never returns
    with open_store(tmp_store_dir, cap) as store:
        real_sync = store.disk.files.sync
        synced: list[str] = []

        def recording_sync(names, **kw):
            names = list(names)
            real_sync(names, **kw)
            synced.extend(names)

        monkeypatch.setattr(store.disk.files, "sync", recording_sync)
        assert store.put("big", make_tensor(7, rows, cols)) is False  # already held: skipped
        store.flush()
        files = {f.name for f in (tmp_store_dir / "blobs").glob("*.ecb")}
        assert len(files) == 1
        assert set(synced) == files, "flush() returned without syncing the producer's file"
        assert store.stats().sync_errors == 0
    producer.kill()


def test_the_exit_does_not_wait_forever_for_a_handle_that_cannot_close(caplog):
    """A handle whose close never returns (a call of another thread stuck)
    must not hang the process's exit: left_open gives up after its bound."""
    from ecstore.store import left_open

    release = threading.Event()

    class Stuck:
        def close(self) -> None:
            release.wait()
    try:
        with caplog.at_level("ERROR", logger="ecstore"):
            assert left_open.close_handles([Stuck()], timeout=0.2) is False
        assert "did not close within" in caplog.text
    finally:
        release.set()
    assert left_open.close_handles([], timeout=0.2) is True
