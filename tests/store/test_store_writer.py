"""The background writer against concurrent callers (ecstore/store/writer.py).

Interleavings are forced with events and a hook around the real
``LMDBTier.write_batch`` (real LMDB underneath), never with sleeps; the
timeouts below only keep a broken build from hanging the suite.

* ``flush()`` waits for what was put (and read) before the call, not for a
  moment with nothing queued: other threads that keep putting or reading
  cannot hold it up, and what it covered is committed when it returns.
* A ``put`` racing ``close()`` is written by close, or raises
  "store is closed": never a True answer for an entry that is never written.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers.pool_refs import record_pool_buffers
from helpers.writer_state import asleep_since, batch_done_since, writer_asleep

import ecstore
from ecstore.errors import ECStoreError
from ecstore.store import writer as writer_mod

#: Safety bound (s) on every wait: reached only by a broken build.
BOUND_S = 60.0


def _config(path) -> ecstore.ECStoreConfig:
    return ecstore.ECStoreConfig(local_cpu=False, local_disk=str(path), max_local_disk_size=0.05)


def _open(path) -> ecstore.ECStore:
    return ecstore.ECStore(_config(path), model="m", dtype=torch.float32)


def _tensor(i: int) -> torch.Tensor:
    return torch.full((4, 4), float(i))


def _committed(path, names: list[str], hits_of: str) -> tuple[list[bool], int]:
    """What another process sees in the store at ``path``: for each name
    whether it is stored, and the hit count the file holds for ``hits_of``."""
    code = (
        "import sys, torch, ecstore\n"
        "cfg = ecstore.ECStoreConfig(local_cpu=False, local_disk=sys.argv[1], max_local_disk_size=0.05)\n"
        "with ecstore.ECStore(cfg, model='m', dtype=torch.float32, readonly=True) as s:\n"
        "    print(','.join(str(int(s.contains(n))) for n in sys.argv[3:]))\n"
        "    print(s.disk.record(s.key(sys.argv[2])).hits)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path), hits_of, *names], check=True,
                         capture_output=True, text=True, timeout=BOUND_S).stdout.split()
    return [c == "1" for c in out[0].split(",")], int(out[1])


def _flush_in_thread(s: ecstore.ECStore, returned: threading.Event) -> tuple[threading.Thread, list[BaseException]]:
    """``s.flush()`` on a new thread (started); ``returned`` is set when it
    returns, and what it raised is in the list."""
    errors: list[BaseException] = []

    def flusher() -> None:
        try:
            s.flush()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        returned.set()

    th = threading.Thread(target=flusher)
    th.start()
    return th, errors


@pytest.mark.parametrize("feed", ["puts", "reads"])
def test_flush_returns_while_other_threads_keep_putting_or_reading(tmp_path, monkeypatch, feed):
    """A flusher waits for what came before its call: the batch holding that
    is committed, then every later batch finds new work queued by another
    thread (a put, or a read whose LRU touch is pending). The flush must
    return while that next batch is still held, and another process must
    then see the entry put and the hit read before the call."""
    monkeypatch.setattr(writer_mod, "TOUCH_DELAY_S", 3600.0)  # touches go only with puts or flushes
    path = tmp_path / "s"
    s = _open(path)
    s.put("a", _tensor(0))
    s.flush()
    w, real_write = s._writer, s.disk.write_batch
    in_first, go_first, returned, release = (threading.Event() for _ in range(4))
    batches = 0
    fed: list[str] = []

    def feed_one() -> None:  # new work after the flush call: a put, or a read (an LRU touch)
        if feed == "puts":
            name = f"f{len(fed)}"
            assert s.put(name, _tensor(len(fed) + 1))
        else:
            name = "a"
            assert s.get("a") is not None
        fed.append(name)

    def hooked(puts, touches=None, **kw):
        nonlocal batches
        batches += 1
        if batches == 1:  # the batch of everything before the flush call
            in_first.set()
            assert go_first.wait(BOUND_S)
        elif not release.is_set():
            feed_one()  # the writer will find work queued after this batch too
            release.wait(BOUND_S)  # held until the flush returned (or the test gave up)
        return real_write(puts, touches, **kw)

    s.disk.write_batch = hooked
    try:
        assert s.get("a") is not None  # a read before the flush call ...
        assert s.put("p0", _tensor(9))  # ... and a put: both ride in the first batch
        assert in_first.wait(BOUND_S)
        th, errors = _flush_in_thread(s, returned)
        with w.cv:  # the flush call has begun (it waits in the writer's drain)
            assert w.cv.wait_for(lambda: w.drainers == 1, timeout=BOUND_S)
        feed_one()  # after the call: must not hold the flush up
        go_first.set()
        flushed = returned.wait(BOUND_S)
        if flushed:
            seen, hits = _committed(path, ["a", "p0"], "a")
        release.set()
        th.join(BOUND_S)
        assert flushed, f"flush() did not return while another thread kept {feed} going"
        assert not errors
        assert seen == [True, True]
        assert hits == 1  # the read before the flush call is in the file; the later one not yet
    finally:
        release.set()
        go_first.set()
        s.disk.write_batch = real_write
        s.close()
    with _open(path) as s:  # close wrote the rest
        assert all(s.contains(n) for n in fed)
        assert s.disk.record(s.key("a")).hits == (1 + len(fed) if feed == "reads" else 1)


def test_put_racing_close_is_written_or_refused(tmp_path):
    """A put that passed the closed check hands its entry to the writer only
    after close() began: the put must raise "store is closed", or return
    True and the entry be in the store afterwards (it was lost: True, never
    written). Since close() waits for running calls (ecstore/store/calls.py), the
    put is written."""
    path = tmp_path / "s"
    s = _open(path)
    w = s._writer
    real_submit = w.submit
    at_submit, closed = threading.Event(), threading.Event()

    def hooked(item, **kw):
        at_submit.set()
        assert closed.wait(BOUND_S)
        return real_submit(item, **kw)

    w.submit = hooked
    outcome: list[object] = []

    def putter() -> None:
        try:
            outcome.append(s.put("x", _tensor(1)))
        except ECStoreError as e:
            outcome.append(e)

    th = threading.Thread(target=putter)
    th.start()
    closer = threading.Thread(target=s.close)
    try:
        assert at_submit.wait(BOUND_S)
        closer.start()
        gate = s._calls  # close() began: new calls refused; it waits for the running put
        with gate._cv:
            assert gate._cv.wait_for(lambda: gate.closing, BOUND_S)
    finally:
        closed.set()
        th.join(BOUND_S)
        if closer.ident is not None:
            closer.join(BOUND_S)
    assert not w.is_alive()
    assert len(outcome) == 1
    with _open(path) as s2:
        stored = s2.contains("x")
    if isinstance(outcome[0], ECStoreError):
        assert "store is closed" in str(outcome[0])
        assert not stored
    else:
        assert outcome[0] is True and stored, "put returned True but the entry was never written"


@contextlib.contextmanager
def _held_in_batch_of_a(s: ecstore.ECStore, bound: int):
    """``s``'s writer bounded to ``bound`` bytes of pending puts and held
    inside the batch that writes "a" (the real ``write_batch`` underneath)
    until the block ends or ``go`` is set. Yields (in_batch, go, batches):
    ``in_batch`` is set once the writer holds that batch; ``batches`` lists
    the names each batch wrote."""
    s._writer.max_bytes = bound
    real_write = s.disk.write_batch
    in_batch, go = threading.Event(), threading.Event()
    batches: list[list[str]] = []

    def hooked(puts, touches=None, **kw):
        batches.append([p.put.identifier.rsplit("/", 1)[-1] for p in puts])
        if any(p.put.identifier.endswith("/a") for p in puts):
            in_batch.set()
            assert go.wait(BOUND_S)
        return real_write(puts, touches, **kw)

    s.disk.write_batch = hooked
    try:
        yield in_batch, go, batches
    finally:
        go.set()
        s.disk.write_batch = real_write


def _put_noting_wait(s: ecstore.ECStore, name: str, tensor: torch.Tensor
                     ) -> tuple[threading.Thread, threading.Event, list[str]]:
    """``s.put(name, tensor)`` on a new thread (started). ``settled`` is set
    once the put either waits on the writer's condition (``seen`` gets
    "waited") or returns without waiting ("admitted"); the put's result or
    error is appended to ``seen`` when it returns."""
    w = s._writer
    settled = threading.Event()
    seen: list[str] = []

    def tracer(frame, event, arg):
        if (event == "call" and frame.f_code is threading.Condition.wait.__code__
                and frame.f_locals.get("self") is w.cv and not settled.is_set()):
            seen.append("waited")
            settled.set()
        return None

    def putter() -> None:
        sys.settrace(tracer)
        try:
            seen.append(repr(s.put(name, tensor)))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            seen.append(repr(e))
        finally:
            sys.settrace(None)
            if not settled.is_set():
                seen.insert(0, "admitted")
                settled.set()

    th = threading.Thread(target=putter)
    th.start()
    return th, settled, seen


def test_back_pressure_counts_the_batch_being_written(tmp_path):
    """``max_write_queue_size`` bounds the bytes waiting for the writer,
    including the batch it is writing: a put that would exceed it waits for
    that batch (it was let in whenever nothing else was queued, holding
    twice the bound). The writer is held inside its batch; the second put
    must wait on the writer's condition, not be admitted."""
    path = tmp_path / "s"
    s = _open(path)
    try:
        with _held_in_batch_of_a(s, 1024) as (in_batch, go, _):  # bytes; each tensor below holds 800
            assert s.put("a", torch.ones(200, 1))
            assert in_batch.wait(BOUND_S)
            th, settled, seen = _put_noting_wait(s, "b", torch.ones(200, 1))
            assert settled.wait(BOUND_S)
            go.set()
            th.join(BOUND_S)
            assert seen and seen[0] == "waited", f"admitted past the bound: {seen}"
            assert seen[1:] == ["True"]
        s.flush()
    finally:
        s.close()
    with _open(path) as s:
        assert s.contains("a") and s.contains("b")


def test_back_pressure_admits_puts_in_the_order_they_came(tmp_path):
    """A put waiting for room holds back later puts, even ones that would
    fit: before, a small put from another thread went past a large one
    waiting, so a steady stream of small puts could keep the large one out
    forever. The writer is held inside a batch; "big" must wait for room,
    then "small" (which fits) must wait behind it, and both are written in
    that order."""
    path = tmp_path / "s"
    s = _open(path)
    threads = []
    try:
        # bytes; "a" and "big" hold 800 each, "small" 100
        with _held_in_batch_of_a(s, 1024) as (in_batch, go, batches):
            assert s.put("a", torch.ones(200, 1))
            assert in_batch.wait(BOUND_S)
            big, big_settled, big_seen = _put_noting_wait(s, "big", torch.ones(200, 1))
            threads.append(big)
            assert big_settled.wait(BOUND_S)
            assert big_seen[0] == "waited", big_seen  # 800 in flight + 800 > 1024
            small, small_settled, small_seen = _put_noting_wait(s, "small", torch.ones(25, 1))
            threads.append(small)
            assert small_settled.wait(BOUND_S)
            assert small_seen[0] == "waited", f"a later put went past one waiting for room: {small_seen}"
            go.set()
            for th in threads:
                th.join(BOUND_S)
            assert big_seen[1:] == ["True"] and small_seen[1:] == ["True"]
            s.flush()
            assert [n for b in batches for n in b] == ["a", "big", "small"]
    finally:
        s.close()
    with _open(path) as s:
        assert s.contains("a") and s.contains("big") and s.contains("small")


def test_puts_waiting_in_line_are_refused_when_the_store_closes(tmp_path):
    """Puts waiting in line for room when close() begins are refused with
    "store is closed" (none waits for a turn that never comes) and leave
    the line. The writer is held in a batch; "b" waits for room, "c"
    behind it; then close() begins."""
    path = tmp_path / "s"
    s = _open(path)
    w = s._writer
    try:
        with _held_in_batch_of_a(s, 1024) as (in_batch, _, _):
            assert s.put("a", torch.ones(200, 1))
            assert in_batch.wait(BOUND_S)
            b, b_settled, b_seen = _put_noting_wait(s, "b", torch.ones(200, 1))
            assert b_settled.wait(BOUND_S)
            c, c_settled, c_seen = _put_noting_wait(s, "c", torch.ones(25, 1))
            assert c_settled.wait(BOUND_S)
            with w.cv:
                w.stopping = True  # what close() does first, before it waits for the writer
                w.cv.notify_all()
            b.join(BOUND_S)
            c.join(BOUND_S)
            assert not b.is_alive() and not c.is_alive()
            assert "store is closed" in b_seen[-1] and "store is closed" in c_seen[-1], (b_seen, c_seen)
            assert not w.in_line
    finally:
        s.close()
    with _open(path) as s:
        assert s.contains("a") and not s.contains("b") and not s.contains("c")


def test_flush_returns_while_a_hot_entry_is_read_after_every_put(tmp_path, monkeypatch):
    """One put per batch (4 MiB puts, batches of at most cap/8) and an entry
    read after every put: at each batch the entry's pending reads straddle
    the first put still queued, so its LRU touch is split. The kept part
    carried the ticket of the entry's very first read, so a flush waited
    until the feeding stopped (here: never returned while a batch was held).
    It must return once what came before its call is committed."""
    monkeypatch.setattr(writer_mod, "TOUCH_DELAY_S", 3600.0)
    path = tmp_path / "s"
    s = _open(path)
    s.put("a", _tensor(0))
    s.flush()
    w, real_write = s._writer, s.disk.write_batch
    assert w.batch_bytes < 8 << 20  # two 4 MiB puts never share a batch
    big = torch.zeros(1024, 1024)  # 4 MiB
    in_first, go_first, returned = (threading.Event() for _ in range(3))
    batches = 0
    fed: list[str] = []

    def feed_one() -> None:  # a put, then a read of the hot entry
        name = f"f{len(fed)}"
        assert s.put(name, big)
        assert s.get("a") is not None
        fed.append(name)

    def hooked(puts, touches=None, **kw):
        nonlocal batches
        batches += 1
        if batches == 1:
            in_first.set()
            assert go_first.wait(BOUND_S)
        elif batches in (2, 3):
            feed_one()
        else:
            returned.wait(BOUND_S)  # held until the flush returned (or the test gave up)
        return real_write(puts, touches, **kw)

    s.disk.write_batch = hooked
    try:
        assert s.put("x0", big)  # the held first batch
        assert in_first.wait(BOUND_S)
        assert s.get("a") is not None
        assert s.put("p1", big) and s.put("p2", big)
        assert s.get("a") is not None  # read after the last queued put
        th, errors = _flush_in_thread(s, returned)
        with w.cv:
            assert w.cv.wait_for(lambda: w.drainers == 1, timeout=BOUND_S)
        go_first.set()
        flushed = returned.wait(BOUND_S)
        if flushed:
            seen, _ = _committed(path, ["x0", "p1", "p2"], "a")
        th.join(BOUND_S)
        assert flushed, "flush() did not return while a hot entry was read after every put"
        assert not errors
        assert seen == [True, True, True]
    finally:
        returned.set()
        go_first.set()
        s.disk.write_batch = real_write
        s.close()
    with _open(path) as s:
        assert all(s.contains(n) for n in fed)
        assert s.disk.record(s.key("a")).hits == 2 + len(fed)  # every read counted once


def _bounded(call) -> list[BaseException | None]:
    """``call()`` on another thread, bounded by BOUND_S: [None] if it
    returned, [error] if it raised, [] if it was still waiting (a hang: the
    thread is a daemon, so a broken build fails here instead of hanging)."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(BOUND_S)
    return out


def test_a_failure_to_ready_the_next_saves_memory_does_not_stop_the_writer(tmp_path, monkeypatch):
    """Before the commit the writer asks the pool to ready memory for the
    next save of the same layout; that call sat outside the writer's error
    handling, so its failure (no thread can be started: the process is at
    its limit) ended the thread with the batch marked in flight: flush(),
    close(), delete() and back-pressured puts then waited forever."""
    def cannot_start(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(writer_mod.POOL, "prefault_soon", cannot_start)
    s = _open(tmp_path)
    assert s.put("a", torch.randn(512, 512))  # 1 MiB: a pooled blob, prefault asked for
    assert _bounded(s.flush) == [None], "flush() hung: the writer thread died"
    assert s._writer.is_alive()
    assert s.disk.contains(s.key("a"), s.stored_name("a"))
    assert _bounded(s.close) == [None]


def test_once_flush_returns_the_writer_holds_no_blob_it_wrote(tmp_path, monkeypatch):
    """Regression (CI, test_pool's second burst faulted one fresh slab): the
    writer thread kept its last batch in a local until it took the next one,
    so after ``flush`` the blobs it had just written stayed referenced and
    their slabs out of the pool: the next save faulted fresh memory. The
    batch is released before a drainer wakes."""
    bufs = record_pool_buffers(writer_mod.POOL, monkeypatch.setattr)
    s = _open(tmp_path)  # local_cpu=False: no memory tier holds a blob
    try:
        for i in range(3):
            assert s.put(f"k{i}", torch.randn(512, 512))  # 1 MiB: pooled blobs
        assert _bounded(s.flush) == [None]
        assert len(bufs) == 3
        assert [r() is None for r in bufs] == [True] * 3, "a written blob is still referenced after flush"
    finally:
        s.close()


def test_a_failed_write_leaves_no_blob_referenced_by_its_recorded_error(tmp_path, monkeypatch):
    """Regression: a write that failed with an error ecstore did not foresee
    was recorded with its traceback, whose frames (the writer's, the tier's)
    held the batch's requests and so their blobs until a flush took it. The
    error is recorded without its traceback (flush reports its message), and
    its traceback is logged when it happens."""
    bufs = record_pool_buffers(writer_mod.POOL, monkeypatch.setattr)
    s = _open(tmp_path)  # local_cpu=False: no memory tier holds a blob

    def broken(reqs, touches, sync_files=True):
        raise RuntimeError(f"unforeseen, with {len(reqs)} requests at hand")

    monkeypatch.setattr(s.disk, "write_batch", broken)
    try:
        # A handler that prints, as in a server (pytest's own keep every record, and so its traceback).
        out = io.StringIO()
        handler = logging.StreamHandler(out)
        monkeypatch.setattr(logging.getLogger("ecstore"), "propagate", False)
        logging.getLogger("ecstore").addHandler(handler)
        try:
            for i in range(3):
                assert s.put(f"k{i}", torch.randn(512, 512))  # 1 MiB: pooled blobs
            s.wait_committed()  # written (failed): no flush has taken the errors yet
        finally:
            logging.getLogger("ecstore").removeHandler(handler)
        assert "background write failed" in out.getvalue() and "in broken" in out.getvalue()  # where: logged
        gc.collect()
        assert len(bufs) == 3
        assert [r() is None for r in bufs] == [True] * 3, "a recorded error keeps the failed batch's blobs"
        got = _bounded(s.flush)
        assert got and isinstance(got[0], ECStoreError) and "unforeseen" in str(got[0]), got
    finally:
        monkeypatch.undo()
        s.close()


def test_a_writer_thread_that_dies_fails_flush_and_puts_instead_of_hanging(tmp_path, monkeypatch):
    """Whatever ends the writer thread early (a defect, an exhausted
    process), every caller waiting for it must be told: the puts it did not
    write fail flush(), later puts raise, close() returns."""
    s = _open(tmp_path)
    w = s._writer

    def broken(*args, **kwargs):
        raise RuntimeError("unforeseen")

    monkeypatch.setattr(w, "_split_touches", broken)
    assert s.put("a", _tensor(1))
    got = _bounded(s.flush)
    assert got and isinstance(got[0], ECStoreError), f"flush after the writer died: {got or 'hung'}"
    assert "background writer stopped" in str(got[0])
    with pytest.raises(ECStoreError, match="background writer stopped"):
        s.put("b", _tensor(2))
    assert _bounded(s.close) == [None], "close() hung on a dead writer"


def test_an_lmdb_error_from_the_final_sync_is_an_ecstore_error(tmp_path):
    """flush() and close() end with LMDBTier.sync (mdb_env_sync(force)); it
    had lost its error-translating decorator (moved to the method inserted
    above it), so an LMDB error there (EIO from the fsync; here: the
    environment closed underneath, a real lmdb.Error) escaped both as a raw
    lmdb.Error, not an ECStoreError."""
    s = _open(tmp_path)
    assert s.put("a", _tensor(1))
    s.wait_committed()
    s.disk.env.close()  # the real environment, closed: env.sync(True) raises lmdb.Error
    with pytest.raises(ECStoreError, match="LMDB error"):
        s.flush()
    with pytest.raises(ECStoreError, match="LMDB error"):
        s.close()


def _blob_file_replaced_by_a_symlink_before_its_sync(s: ecstore.ECStore, monkeypatch) -> None:
    """Put a 1 MiB entry (a blob file of its own) into ``s``; between its
    commit and its file's sync, replace that file by a symlink to a copy:
    the real sync then fails (``O_NOFOLLOW``: ELOOP), a real OS error."""
    real_sync = s.disk.files.sync
    gate = threading.Event()

    def gated_sync(names, **kw):
        assert gate.wait(BOUND_S), "the gate was never opened"
        real_sync(names, **kw)

    monkeypatch.setattr(s.disk.files, "sync", gated_sync)
    assert s.put("a", torch.randn(512, 512))  # 1 MiB
    s.wait_committed()  # committed; the writer waits at its file's sync
    (blob,) = Path(s.disk.files.dir).glob("*.ecb")
    moved = blob.with_suffix(".moved")
    blob.rename(moved)
    blob.symlink_to(moved)
    gate.set()


def test_a_failed_blob_file_sync_is_a_sync_error_raised_by_flush_not_a_write_error(tmp_path, monkeypatch):
    """A blob file's sync after its commit failing counted len(names) into
    write_errors, for puts already reported stored (and committed). It is a
    sync error now: StoreStats.sync_errors, raised by flush()."""
    s = _open(tmp_path / "s")
    try:
        _blob_file_replaced_by_a_symlink_before_its_sync(s, monkeypatch)
        with pytest.raises(ECStoreError) as raised:
            s.flush()
        st = s.stats()
        assert (st.write_errors, getattr(st, "sync_errors", None)) == (0, 1)
        assert "not made durable" in str(raised.value)
    finally:
        s.close()


def test_a_failed_blob_file_sync_at_close_is_reported_by_close(tmp_path, monkeypatch, caplog):
    """close() flushes; a sync failure there was only the writer's own log
    line, and the error itself stayed in the closed handle, untaken. close()
    logs, not raises (its contract, as for failed writes): one line at close
    naming the errors no flush() took."""
    s = _open(tmp_path / "s")
    _blob_file_replaced_by_a_symlink_before_its_sync(s, monkeypatch)
    with caplog.at_level("ERROR", logger="ecstore"):
        s.close()
    closing = [r.getMessage() for r in caplog.records if "closing" in r.getMessage()]
    assert len(closing) == 1 and "1 write error(s)" in closing[0] and "not made durable" in closing[0], closing


def test_a_commit_does_not_wait_for_the_previous_batchs_blob_file_sync(tmp_path, monkeypatch):
    """Visible first, durable next, on two threads: a batch's blob files are
    synced on the writer's sync thread, so the next batch is written and
    committed (wait_committed returns: visible to other processes) while the
    previous batch's sync is still running. Before, the writer synced inline
    before its next batch: wait_committed of the second put waited for the
    first put's fdatasync (here held: it never returned before the gate).
    flush() still waits for both files' sync."""
    s = _open(tmp_path / "s")
    real_sync = s.disk.files.sync
    gate = threading.Event()
    in_sync = threading.Event()
    synced: list[str] = []

    def held_sync(names, **kw):  # the first sync waits for the gate; every name recorded
        names = list(names)
        in_sync.set()
        assert gate.wait(BOUND_S), "the gate was never opened"
        real_sync(names, **kw)
        synced.extend(names)

    monkeypatch.setattr(s.disk.files, "sync", held_sync)
    try:
        assert s.put("a", torch.randn(512, 512))  # 1 MiB: a blob file of its own
        s.wait_committed()
        assert in_sync.wait(BOUND_S)  # a's sync has begun and is held
        assert s.put("b", torch.randn(512, 512))
        committed = threading.Event()
        th = threading.Thread(target=lambda: (s.wait_committed(), committed.set()))
        th.start()
        th.join(BOUND_S)
        assert committed.is_set(), "b's commit waited for a's blob file sync"
        assert _committed(tmp_path / "s", ["a", "b"], "a")[0] == [True, True]  # visible to another process
        w = s._writer
        assert w is not None
        with w.cv:
            assert w.syncing_since is not None  # a's sync still held: not durable yet
        returned = threading.Event()
        fth, errors = _flush_in_thread(s, returned)
        with w.cv:  # the flush waits in the writer's drain, for a's sync
            assert w.cv.wait_for(lambda: w.drainers == 1, timeout=BOUND_S)
            assert not returned.is_set()
        gate.set()
        fth.join(BOUND_S)
        assert returned.is_set() and not errors, errors
        files = {f.name for f in Path(s.disk.files.dir).glob("*.ecb")}
        assert len(files) == 2 and set(synced) == files, (files, synced)
        assert s.stats().sync_errors == 0
    finally:
        gate.set()
        s.close()


# -- deferred puts (ECStore.put(defer_write=True): the connector's saves of a step) --------------

def test_a_deferred_put_does_not_wake_the_writer_until_start_writes(tmp_path):
    """A save does not pay for waking the writer's thread, and a step's small
    saves go in one transaction: ``put(defer_write=True)`` queues without a
    notify (readable in this process at once); ``start_writes()`` wakes the
    writer, and the entry is then committed for other processes."""
    path = tmp_path / "s"
    s = _open(path)
    try:
        w = s._writer
        slept = writer_asleep(w)
        assert s.put("a", _tensor(1), defer_write=True)
        assert s.put("b", _tensor(2), defer_write=True)
        assert asleep_since(w, slept), "a deferred put woke the writer"
        assert s.contains("a") and s.contains("b")  # read-your-writes (no LRU touch: that would wake it)
        s.start_writes()
        assert batch_done_since(w, slept), "start_writes did not wake the writer"
        s.wait_committed()
        assert _committed(path, ["a", "b"], "a")[0] == [True, True]
    finally:
        s.close()


def test_a_notify_for_something_else_does_not_start_deferred_puts(tmp_path):
    """The writer's condition is shared (its sync thread, drains and puts
    notify it): a notify that is not a reason to write (here the test's own)
    wakes it, and it goes back to sleep with the deferred puts still queued,
    so that a step's saves are not taken one by one mid-step."""
    path = tmp_path / "s"
    s = _open(path)
    try:
        w = s._writer
        slept = writer_asleep(w)
        assert s.put("a", _tensor(1), defer_write=True)
        with w.cv:
            w.cv.notify_all()
        assert writer_asleep(w) == slept, "a foreign notify made the writer write the deferred puts"
        assert s.put("b", _tensor(2), defer_write=True)
        s.start_writes()
        assert batch_done_since(w, slept)
        s.wait_committed()
        assert _committed(path, ["a", "b"], "a")[0] == [True, True]
    finally:
        s.close()


def test_a_drain_is_not_held_up_by_a_deferred_put_made_while_it_waits(tmp_path):
    """A drain writes the deferred puts made before it even when another
    deferred put comes while it waits: before, that put turned the
    deferral back on and the drain (wait_committed, flush) waited for ever
    for a writer asleep over the puts it waited for. The writer is held in
    a batch while the drain begins and the second deferred put comes."""
    path = tmp_path / "s"
    s = _open(path)
    try:
        with _held_in_batch_of_a(s, 1 << 20) as (in_batch, go, _):
            assert s.put("a", _tensor(0))
            assert in_batch.wait(BOUND_S)
            assert s.put("b", _tensor(1), defer_write=True)
            returned = threading.Event()
            th, errors = _flush_in_thread(s, returned)
            w = s._writer
            with w.cv:  # the drain has begun
                assert w.cv.wait_for(lambda: w.drainers == 1, timeout=BOUND_S)
            assert s.put("c", _tensor(2), defer_write=True)
            go.set()
            assert returned.wait(BOUND_S), "flush() waited for ever for a deferred put made before it"
            th.join(BOUND_S)
            assert not errors
        assert _committed(path, ["a", "b"], "a")[0] == [True, True]
    finally:
        s.close()


def test_a_put_that_does_not_defer_is_written_though_a_deferred_put_follows(tmp_path):
    """A put that does not defer is written without a start or a drain, even
    when a deferred put comes before the writer takes it (the writer busy):
    before, the later deferred put kept the writer asleep over both."""
    path = tmp_path / "s"
    s = _open(path)
    try:
        w = s._writer
        with _held_in_batch_of_a(s, 1 << 20) as (in_batch, go, batches):
            assert s.put("a", _tensor(0))
            assert in_batch.wait(BOUND_S)
            assert s.put("x", _tensor(1))
            assert s.put("d", _tensor(2), defer_write=True)
            go.set()
            key = s.key("x")
            with w.cv:
                written = w.cv.wait_for(lambda: w.puts.get(key) is None, timeout=BOUND_S)
            assert written, "a put that did not defer waited behind a deferred one"
        assert _committed(path, ["x"], "x")[0] == [True]
    finally:
        s.close()


def test_deferred_puts_wake_the_writer_once_a_few_mib_are_deferred(tmp_path, monkeypatch):
    """Deferred puts do not pile up without bound: once DEFER_BYTES of them
    are queued the writer is woken (as by a put that does not defer)."""
    monkeypatch.setattr(writer_mod, "DEFER_BYTES", 100)  # bytes; each tensor below holds 64
    path = tmp_path / "s"
    s = _open(path)
    try:
        w = s._writer
        slept = writer_asleep(w)
        assert s.put("a", _tensor(1), defer_write=True)
        assert asleep_since(w, slept)
        assert s.put("b", _tensor(2), defer_write=True)  # 128 deferred bytes
        assert batch_done_since(w, slept)
    finally:
        s.close()


def test_a_put_waiting_for_room_wakes_a_writer_asleep_over_deferred_puts(tmp_path):
    """Deferred puts fill the write queue while the writer sleeps: the next
    put must wake it and be admitted once they are written, not wait for
    room for ever (the thread joins; the bound only catches a hang)."""
    path = tmp_path / "s"
    s = _open(path)
    try:
        w = s._writer
        w.max_bytes = 1024  # bytes; each tensor below holds 800
        slept = writer_asleep(w)
        assert s.put("a", torch.ones(200, 1), defer_write=True)
        assert asleep_since(w, slept)
        th, settled, seen = _put_noting_wait(s, "b", torch.ones(200, 1))
        assert settled.wait(BOUND_S)
        th.join(BOUND_S)
        assert not th.is_alive(), "a put waited for room behind deferred puts the writer never took"
        assert seen == ["waited", "True"]
        s.wait_committed()
        assert _committed(path, ["a", "b"], "a")[0] == [True, True]
    finally:
        s.close()


def test_deferred_puts_are_written_by_wait_committed_flush_and_close(tmp_path):
    """Nothing deferred is left behind: wait_committed and flush write what
    was deferred before them, and close everything else."""
    path = tmp_path / "s"
    s = _open(path)
    try:
        assert s.put("a", _tensor(1), defer_write=True)
        s.wait_committed()
        assert _committed(path, ["a"], "a")[0] == [True]
        assert s.put("b", _tensor(2), defer_write=True)
        s.flush()
        assert _committed(path, ["b"], "b")[0] == [True]
        assert s.put("c", _tensor(3), defer_write=True)
    finally:
        s.close()
    assert _committed(path, ["a", "b", "c"], "a")[0] == [True, True, True]


def _x_stored_in_a_file(tmp_path) -> tuple[Path, ecstore.ECStoreConfig, torch.Tensor]:
    """A store at ``tmp_path/s`` whose every blob goes to a file, holding
    "x" (committed and flushed by another handle, now closed): (path, its
    config, x's tensor)."""
    path = tmp_path / "s"
    cfg = ecstore.ECStoreConfig(local_cpu=False, local_disk=str(path), max_local_disk_size=0.05,
                                min_file_blob_size=0.0)
    first = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    with ecstore.ECStore(cfg, model="m", dtype=torch.float32) as other:
        assert other.put("x", first)
        other.flush()
    return path, cfg, first


def test_a_put_known_absent_of_an_entry_another_handle_stored_writes_no_blob_file(tmp_path):
    """``put(known_absent=True)`` skips the LMDB lookup before the copy (the
    connector: vLLM encoded the item because the scheduler's lookup missed).
    When another process stored the entry meanwhile, the writer finds it
    before writing a blob file: the stored entry stays as it was, its file
    the only one, and no second file is written and thrown away."""
    path, cfg, first = _x_stored_in_a_file(tmp_path)
    files_before = sorted(p.name for p in (path / "blobs").iterdir())
    assert len(files_before) == 1
    with ecstore.ECStore(cfg, model="m", dtype=torch.float32) as s:
        written: list[int] = []
        real = s.disk.files.write

        def counting(blob, **kw):
            written.append(len(memoryview(blob).cast("B")))
            return real(blob, **kw)

        s.disk.files.write = counting
        assert s.put("x", first.clone(), known_absent=True)  # True all the same (documented)
        s.flush()
        assert written == [], "a blob file was written for an entry already stored"
        assert s.puts_found_stored() == (1, first.numel() * 4)
        assert torch.equal(s.get("x"), first)
    assert sorted(p.name for p in (path / "blobs").iterdir()) == files_before


def test_an_entry_seen_stored_before_the_files_and_gone_by_the_transaction_is_stored(tmp_path):
    """The batch reads which entries are stored before writing blob files
    (none written for those), but the transaction decides: an entry evicted
    or deleted in between (here by another handle, right after that read) is
    stored, its file written then, not reported present and lost."""
    path, cfg, first = _x_stored_in_a_file(tmp_path)
    with ecstore.ECStore(cfg, model="m", dtype=torch.float32) as s:
        real = s.disk._write_files

        def then_deleted(todo, sync=True):
            if any(p.seen_stored for p in todo):
                with ecstore.ECStore(cfg, model="m", dtype=torch.float32) as deleter:
                    assert deleter.delete("x")
            return real(todo, sync)

        s.disk._write_files = then_deleted
        assert s.put("x", first.clone(), known_absent=True)
        s.flush()
        assert s.puts_found_stored() == (0, 0)
    with ecstore.ECStore(cfg, model="m", dtype=torch.float32) as s:
        assert torch.equal(s.get("x"), first)
        assert s.verify("x")  # record, file, header and checksum
    assert len(list((path / "blobs").glob("*.ecb"))) == 1
