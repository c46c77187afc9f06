"""``ECStore.close()`` against calls running in other threads (ecstore/store/calls.py).

Interleavings are forced with events and hooks around real code (real LMDB
underneath), never with sleeps; BOUND_S only keeps a broken build from
hanging the suite. Scenarios that could crash the interpreter run in a child
process, so a segfault is a failed test, not a dead pytest.

* A ``get`` held inside its LMDB read transaction (copying out of the
  memory-mapped blob) while another thread closes the store: close must wait
  for it; the get returns the tensor; later calls raise "store is closed".
* ``close()`` from within a call of the same handle (a callback) must not
  deadlock: the store closes when that call returns.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import ecstore
from ecstore.errors import ECStoreError

#: Safety bound (s) on every wait: reached only by a broken build.
BOUND_S = 60.0


def _config(path) -> ecstore.ECStoreConfig:
    return ecstore.ECStoreConfig(local_cpu=False, local_disk=str(path), max_local_disk_size=0.05)


def _run_child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=BOUND_S * 2)


_HELD_GET = """
    import sys, threading, torch, ecstore
    from ecstore.format import blob_read
    from ecstore.errors import ECStoreError

    BOUND_S = 60.0
    cfg = ecstore.ECStoreConfig(local_cpu=False, local_disk=sys.argv[1], max_local_disk_size=0.05)
    s = ecstore.ECStore(cfg, model="m", dtype=torch.float32)
    want = torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256)
    s.put("a", want)
    s.flush()

    real_read = blob_read.read_entry
    inside, go = threading.Event(), threading.Event()

    def held_read(*args, **kwargs):  # inside the read transaction, the blob a view of the map
        inside.set()
        assert go.wait(BOUND_S)
        return real_read(*args, **kwargs)

    blob_read.read_entry = held_read
    outcome = []

    def reader():
        try:
            outcome.append(s.get("a"))
        except ECStoreError as e:
            outcome.append(e)
        except BaseException as e:
            outcome.append(f"FOREIGN {type(e).__name__}: {e}")

    th = threading.Thread(target=reader)
    th.start()
    assert inside.wait(BOUND_S)
    closer = threading.Thread(target=s.close)
    closer.start()
    gate = getattr(s, "_calls", None)
    if gate is None:  # a build without a call gate: close() does not wait for the get
        closer.join(BOUND_S)
    else:  # close() began: it refuses new calls and waits for the running get
        with gate._cv:
            assert gate._cv.wait_for(lambda: gate.closing, BOUND_S)
    go.set()  # the read continues
    th.join(BOUND_S)
    closer.join(BOUND_S)
    assert not closer.is_alive()
    res = outcome[0]
    if isinstance(res, torch.Tensor):
        print("GOT", bool(torch.equal(res, want)))
    else:
        print("RESULT", res)
    try:
        s.get("a")
        print("AFTER returned")
    except ECStoreError as e:
        print("AFTER", e)
"""


def test_close_waits_for_a_get_inside_its_read_transaction(tmp_path):
    """The get held inside its LMDB read transaction must finish on the open
    map (before: close released the environment under it, the copy out of
    the unmapped blob crashed the process or the get raised a foreign
    error), and a call after close raises "store is closed"."""
    r = _run_child(_HELD_GET, str(tmp_path / "s"))
    assert r.returncode == 0, f"child died (rc {r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}"
    assert r.stdout.split("\n")[:2] == ["GOT True", "AFTER store is closed"], r.stdout + r.stderr[-3000:]


def test_close_from_within_a_call_closes_when_the_call_returns(tmp_path):
    """``close()`` called by a callback of a running call (here the
    ``chunk_hasher`` of a ``get``, in the calling thread) cannot wait for
    that call: it must return (no deadlock), the call run to its end, and
    the store close when it returns (flushed: a new handle sees the put)."""
    from ecstore.key import chunk_hash

    holder: list[ecstore.ECStore] = []

    def hasher(name: str) -> str:
        if name.endswith("/bye") and holder:
            holder[0].close()
        return chunk_hash(name)

    s = ecstore.ECStore(_config(tmp_path / "s"), model="m", dtype=torch.float32, chunk_hasher=hasher)
    holder.append(s)
    assert s.put("a", torch.ones(4, 4))
    assert s.get("bye") is None  # closed from within: still answered (a miss)
    assert s._calls.closed
    with pytest.raises(ECStoreError, match="store is closed"):
        s.get("a")
    s.close()  # idempotent
    with ecstore.ECStore(_config(tmp_path / "s"), model="m", dtype=torch.float32) as s2:
        assert torch.equal(s2.get("a"), torch.ones(4, 4))


def test_two_threads_closing_at_once_tear_down_once(tmp_path):
    """Two threads call ``close()`` on one handle while another handle of
    the same directory is open in this process. Exactly one performs the
    teardown; the other waits for it and returns without error (before:
    both passed the closed check, and the second flushed a handle the first
    had closed: StoreOpenError out of close). The shared environment is
    released once, so the other handle keeps working."""
    import threading

    path = tmp_path / "s"
    s1 = ecstore.ECStore(_config(path), model="m", dtype=torch.float32)
    s2 = ecstore.ECStore(_config(path), model="m", dtype=torch.float32)
    shared = s1.disk._shared
    assert shared is s2.disk._shared and shared.refs == 2
    assert s1.put("a", torch.ones(4, 4))
    w, real_drain = s1._writer, s1._writer.drain
    cv = threading.Condition()
    in_drain = 0
    go, a_done = threading.Event(), threading.Event()

    def held_drain(durable: bool = False) -> None:
        # the first closer holds here, mid-teardown; a second one until the first is done
        nonlocal in_drain
        with cv:
            in_drain += 1
            first = in_drain == 1
            cv.notify_all()
        assert (go if first else a_done).wait(BOUND_S)
        real_drain(durable)

    w.drain = held_drain
    errors: list[BaseException] = []

    def closer(done: threading.Event | None = None) -> None:
        try:
            s1.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            if done is not None:
                done.set()

    a, b = threading.Thread(target=closer, args=(a_done,)), threading.Thread(target=closer)
    try:
        a.start()
        with cv:
            assert cv.wait_for(lambda: in_drain == 1, BOUND_S)
        b.start()
        gate = getattr(s1, "_calls", None)
        if gate is None:  # a build without a call gate: the second closer gets into the teardown too
            with cv:
                assert cv.wait_for(lambda: in_drain == 2, BOUND_S)
        else:  # the second closer waits for the first one's teardown
            with gate._cv:
                assert gate._cv.wait_for(lambda: gate.waiting_closers == 1, BOUND_S)
            assert in_drain == 1
    finally:
        go.set()
        a.join(BOUND_S)
        a_done.set()
        if b.ident is not None:
            b.join(BOUND_S)
    try:
        assert not errors, errors
        assert shared.refs == 1  # released once: s2's reference stands
        assert torch.equal(s2.get("a"), torch.ones(4, 4))  # s1's close flushed; s2 reads the open map
        with pytest.raises(ECStoreError, match="store is closed"):
            s1.get("a")
    finally:
        s2.close()
