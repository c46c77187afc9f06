"""The write-behind queue's accounting under races: a put replacing a queued
put of the same key is counted once in the queued bytes, and every write
error is reported by exactly one ``flush()``. Real LMDB files, real threads.
"""

from __future__ import annotations

import threading

from helpers.fault_workers import open_store
from helpers.tensors import assert_same, make_tensor

from ecstore import StoreFullError
from ecstore.format import codec


def test_replacing_a_queued_put_keeps_queued_bytes_exact(tmp_path):
    """Two puts of one key both reach the writer queue (two threads passed
    the presence check at once); the second replaces the first, and
    the writer's pending bytes (``puts.bytes``) must count it once and return to zero."""
    from ecstore.format import PendingPut

    with open_store(tmp_path / "s") as s:
        w = s._writer
        t = make_tensor(1)
        nbytes = codec.tensor_nbytes(t)
        key = s.key("dup")
        with s.disk._shared.write_lock:  # the writer cannot commit meanwhile
            s.put("first", make_tensor(0))  # occupies the writer (waits for the lock)
            with w.cv:
                while "first" not in [it.mm_hash for it in w.puts.taken.values()]:
                    w.cv.wait(0.05)  # the writer takes it without notifying
            name = s.stored_name("dup")
            w.submit(PendingPut(key, name, t))
            w.submit(PendingPut(key, name, t.clone()))
            assert s.stats().pending_bytes == 2 * nbytes  # "first" in flight + one "dup"
        s.flush()
        assert s.stats().pending_bytes == 0
        assert s.stats().pending_writes == 0
        assert_same(s.get("dup"), t)


def test_every_write_error_is_reported_by_exactly_one_flush(tmp_path):
    """Errors recorded by the writer while flush() takes them are never lost:
    a thread records 5000 errors the way the writer does while the main
    thread takes them the way flush() does; every one is taken once."""
    import sys

    with open_store(tmp_path / "s") as s:
        w = s._writer
        n = 5000
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            done = threading.Event()

            def record() -> None:
                for i in range(n):
                    w.add_error(StoreFullError(str(i)))
                done.set()

            th = threading.Thread(target=record)
            th.start()
            taken = 0
            while not done.is_set():
                taken += w.take_errors().count
            th.join()
            taken += w.take_errors().count
        finally:
            sys.setswitchinterval(old)
        assert taken == n
