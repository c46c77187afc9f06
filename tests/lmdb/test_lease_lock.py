"""A process stopped inside a lease write transaction never makes another
process's ``pin_if_present`` (the vLLM scheduler's step) wait.

The other process is real (``helpers/lease_txn_stopper.py``): it begins a
lease write transaction through the tier's own code, says so, and stops
itself (SIGSTOP); this process waits until the kernel reports it stopped
(``waitpid(WUNTRACED)``), so the interleaving is fixed, not timed. LMDB's
own write lock has no try or timeout: a pin used to wait until SIGCONT.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ecstore.format import PendingPut
from ecstore.key import make_key
from ecstore.lmdb import BatchPut, LMDBTier
from ecstore.testing import faults as fc

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
CAP = 64 << 20


def key(idx: int) -> str:
    return make_key(fc.MODEL, f"{idx:016x}", "bfloat16")


def name(idx: int) -> str:
    return f"{0:032x}/img-{idx}"


@contextmanager
def stopped_inside_a_lease_write(path: Path) -> Iterator[subprocess.Popen[str]]:
    """A real process stopped inside a lease write transaction of ``path``'s
    store for the duration of the block; continued and reaped after."""
    proc = subprocess.Popen([sys.executable, str(HELPERS / "lease_txn_stopper.py"), str(path), str(CAP), key(99)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "inside"
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        yield proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.strip() == "leased"


def call_with_hang_guard(fn):
    """``fn()`` on a thread, joined with a generous hang guard (it needs
    microseconds): (finished, result)."""
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    t.start()
    t.join(timeout=60)
    return (not t.is_alive()), (result[0] if result else None)


def test_pin_if_present_is_a_miss_while_another_process_is_stopped_in_a_lease_write(tmp_path: Path) -> None:
    path = tmp_path / "s"
    tier = LMDBTier(str(path), CAP)
    try:
        tier.write_batch([BatchPut(PendingPut(key(1), name(1), fc.entry_tensor(1, 4)), fc.MODEL)])
        assert tier.pin_if_present(key(1), name(1), 60)  # a free lease file: pinned as before
        tier.release([key(1)])
        with stopped_inside_a_lease_write(path) as other:
            finished, answer = call_with_hang_guard(lambda: tier.pin_if_present(key(1), name(1), 60))
            assert finished, "pin_if_present waited for a stopped process's lease write"
            assert answer is False  # a miss (Pin.BUSY): nothing leased
            finished, released = call_with_hang_guard(lambda: tier.release([key(1)], wait=False))
            assert finished and released is False
            assert other.poll() is None  # still stopped in its transaction all along
        # Continued (it committed its lease and exited): nothing of ours was
        # left leased by the miss, and pins work again.
        assert tier._leases is not None
        assert tier._leases.leased_keys() == set()
        assert tier.pin_if_present(key(1), name(1), 60)
        assert tier.release([key(1)], wait=False)
    finally:
        tier.close()


@pytest.mark.vllm
def test_the_scheduler_step_neither_waits_to_pin_nor_to_release(connectors, tmp_path: Path, no_lmcache_env) -> None:
    """The vLLM scheduler's step (``has_cache_item``, and the release of pins
    vLLM did not allocate in ``build_connector_meta``) while another process
    is stopped inside a lease write: a miss, and the release kept for the
    next step, which makes it once the lock is free."""
    from dataclasses import replace

    import torch
    from helpers import vllm_objects as vo

    from ecstore import ECStore

    store_dir = tmp_path / "ec"
    sched, _ = connectors("ec_both", {"local_disk": str(store_dir), "max_local_disk_size": 0.01,
                                      "lease_seconds": 600})
    side = sched.scheduler_side
    assert side is not None and side.store is not None and side.store.disk is not None
    a, b = "a1" * 32, "b2" * 32
    with ECStore(replace(sched.config, local_cpu=False), model=sched._vllm_config.model_config.model,
                 dtype=torch.float32, identity=sched.identity) as producer:
        for i, ident in enumerate((a, b)):
            assert producer.put(ident, torch.full((vo.EMBEDS_PER_IMAGE, vo.EMBED_WIDTH), float(i)))
        producer.flush()
    key_a = side.store.key(a).encode()
    assert sched.has_cache_item(a)  # pinned; vLLM does not allocate it this step
    assert key_a in side.store.disk.leased_keys()
    with stopped_inside_a_lease_write(store_dir):
        finished, answer = call_with_hang_guard(lambda: sched.has_cache_item(b))
        assert finished and answer is False  # a miss, not a wait
        finished, _ = call_with_hang_guard(lambda: sched.build_connector_meta(vo.SchedulerOutput.make_empty()))
        assert finished, "the scheduler's step waited to release a lease"
        assert key_a in side.store.disk.leased_keys()  # not released yet: kept for the next step
    sched.build_connector_meta(vo.SchedulerOutput.make_empty())  # the next step releases it
    assert key_a not in side.store.disk.leased_keys()


@pytest.mark.vllm
def test_loads_vllm_could_encode_go_ahead_unpinned_while_the_lease_file_is_busy(
        connectors, tmp_path: Path, no_lmcache_env) -> None:
    """The step's end leases its allocated yeses (items vLLM could encode)
    while another process is stopped inside a lease write: it does not wait;
    the load goes ahead unpinned (counted as ``lease_busy``; the worker reads
    what is there, checked as always) and nothing stays leased."""
    from dataclasses import replace

    import torch
    from helpers import vllm_objects as vo

    from ecstore import ECStore

    store_dir = tmp_path / "ec"
    sched, _ = connectors("ec_both", {"local_disk": str(store_dir), "max_local_disk_size": 0.01,
                                      "lease_seconds": 600})
    side = sched.scheduler_side
    assert side is not None and side.store is not None and side.store.disk is not None
    a = "a1" * 32
    with ECStore(replace(sched.config, local_cpu=False), model=sched._vllm_config.model_config.model,
                 dtype=torch.float32, identity=sched.identity) as producer:
        assert producer.put(a, torch.full((vo.EMBEDS_PER_IMAGE, vo.EMBED_WIDTH), 1.0))
        producer.flush()
    req = vo.make_request("r1", [a])  # vLLM holds its inputs
    with stopped_inside_a_lease_write(store_dir):
        assert sched.ensure_cache_available(req, 0) and sched.has_cache_item(a)  # no lease write yet
        sched.update_state_after_alloc(req, 0)
        finished, meta = call_with_hang_guard(lambda: sched.build_connector_meta(vo.SchedulerOutput.make_empty()))
        assert finished, "the scheduler's step waited to lease its loads"
        assert [s.identifier for s in meta.loads] == [a]  # type: ignore[attr-defined]
    assert side.store.disk.leased_keys() == set()
    assert sched.get_ec_connector_stats().reduce()["lease_busy"] == 1


def test_pins_in_a_row_while_the_lock_stays_held_make_one_bounded_wait(tmp_path: Path, monkeypatch) -> None:
    """A scheduler step asks about many items: while another process is
    stopped inside a lease write, only the first pin polls the lock (up to
    LEASE_LOCK_WAIT_S); the next ones, within LEASE_BUSY_HOLD_S of it, try it
    once each and answer BUSY (they used to poll 20 ms each). Counted in
    flock attempts, not time; the hold window is made long so a slow machine
    cannot end it mid-test. Once the lock is free a single try takes it."""
    import fcntl

    from ecstore.lmdb import leases
    from ecstore.lmdb.leases import Pin

    monkeypatch.setattr(leases, "LEASE_BUSY_HOLD_S", 600.0)
    path = tmp_path / "s"
    tier = LMDBTier(str(path), CAP)
    attempts = [0]
    real_flock = fcntl.flock

    def counting_flock(fd, op):
        if op & fcntl.LOCK_NB:
            attempts[0] += 1
        return real_flock(fd, op)

    try:
        tier.write_batch([BatchPut(PendingPut(key(i), name(i), fc.entry_tensor(i, 4)), fc.MODEL) for i in range(8)])
        with stopped_inside_a_lease_write(path):
            monkeypatch.setattr(leases.fcntl, "flock", counting_flock)
            finished, first = call_with_hang_guard(lambda: tier.pin(key(0), name(0), 60))
            assert finished and first is Pin.BUSY
            polled = attempts[0]
            assert polled >= 1
            finished, rest = call_with_hang_guard(lambda: [tier.pin(key(i), name(i), 60) for i in range(1, 8)])
            assert finished and rest == [Pin.BUSY] * 7
            finished, released = call_with_hang_guard(lambda: tier.release([key(0)], wait=False))
            assert finished and released is False
            assert attempts[0] == polled + 8  # one try each, no second wait
        assert tier.pin(key(1), name(1), 60) is Pin.HELD  # free again: taken at the first try
        assert attempts[0] == polled + 9
        assert tier.pin(key(99), name(99), 60) is Pin.ABSENT  # not stored: no lock touched
        assert tier.release([key(1)], wait=False)
    finally:
        tier.close()


def test_a_forked_child_does_not_keep_a_dead_parents_lease_lock(tmp_path: Path) -> None:
    """A process forks (no exec) and then dies (SIGKILL) inside a lease write
    while its child lives on. The child's inherited copy of the lock
    descriptor shared the parent's flock, so the lock stayed held while the
    child lived: every pin was BUSY and every waiting lease write blocked.
    Now a forked child closes that copy (os.register_at_fork): the flock
    dies with the parent and pins work."""
    from ecstore.lmdb.leases import Pin

    path = tmp_path / "s"
    tier = LMDBTier(str(path), CAP)
    proc = subprocess.Popen([sys.executable, str(HELPERS / "lease_txn_stopper.py"), str(path), str(CAP), key(99),
                             "fork"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        tier.write_batch([BatchPut(PendingPut(key(1), name(1), fc.entry_tensor(1, 4)), fc.MODEL)])
        assert proc.stdout is not None and proc.stdin is not None
        lines = dict((proc.stdout.readline().split() + [""])[:2] for _ in range(2))
        assert set(lines) == {"child", "inside"}
        child = int(lines["child"])
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        os.kill(proc.pid, signal.SIGKILL)  # dies inside its lease write transaction
        proc.wait(timeout=120)
        os.kill(child, 0)  # the forked child still lives (else ProcessLookupError) while this process pins
        finished, answer = call_with_hang_guard(lambda: tier.pin(key(1), name(1), 60))
        assert finished and answer is Pin.HELD
        assert tier.release([key(1)], wait=False)
        proc.stdin.close()  # the child exits
        assert proc.stdout.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=120)
        if proc.stdin is not None and not proc.stdin.closed:
            proc.stdin.close()
        tier.close()


@pytest.mark.vllm
def test_a_metadata_only_request_is_deferred_not_failed_while_the_lease_file_is_busy(
        tiny_qwen2_5_vl_dir, engines, tmp_path: Path, no_lmcache_env) -> None:
    """An EPD consumer's request whose item vLLM holds no inputs for
    (metadata-only, ``inputs=False``), stored, while another process is
    stopped inside a lease write: the pin cannot be taken, and such an item
    cannot be computed instead. The request used to be failed ("not
    available") although the store held the entry; it is now deferred (not
    scheduled, not failed; counted as ``lease_busy``) and loaded once the
    other process went on."""
    import torch
    from helpers import vllm_objects as vo
    from helpers.connector_store import open_store
    from helpers.scheduler_engine import encoder_output
    from vllm.v1.engine import FinishReason

    a = "a" * 64
    store_dir = tmp_path / "ec"
    eng = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_both",
                                 {"local_disk": str(store_dir), "max_local_disk_size": 0.01, "lease_seconds": 600}))
    with open_store(eng.connector) as st:
        st.put(a, encoder_output(a))
        st.flush()
    with stopped_inside_a_lease_write(store_dir):
        eng.scheduler.add_request(vo.make_request("r1", [a], max_tokens=1, inputs=False))
        for _ in range(2):  # a failed request is finished (ERROR) at the step after the failure
            finished, out = call_with_hang_guard(eng.step)
            assert finished
            assert "r1" not in out.num_scheduled_tokens and out.ec_connector_metadata.loads == []
        assert "r1" not in eng.finished
        assert eng.totals().get("lease_busy", 0) >= 1
    eng.run()
    assert eng.finished == {"r1": FinishReason.LENGTH}
    assert torch.equal(eng.encoder_cache[a], encoder_output(a))  # loaded, bit-exact
    assert eng.totals()["loads"] == 1


def test_a_pins_cleanup_does_not_wait_for_a_busy_lease_file(tmp_path: Path, monkeypatch) -> None:
    """The pin leased an entry, then found it gone (step (c): evicted or
    deleted by another process in between): it drops its lease again. If
    another process has begun a lease write in between (and is stopped in
    it), that cleanup used to wait for it (``release`` with wait=True): the
    scheduler's step hung. It now gives up at once (ABSENT; the lease is
    left to its expiry). The only hook orders real events: right after this
    process's real lease, the entry is deleted and the other process is
    started and seen stopped inside its lease write."""
    from ecstore.lmdb.leases import Pin

    path = tmp_path / "s"
    tier = LMDBTier(str(path), CAP)
    table = tier._leases
    assert table is not None
    try:
        tier.write_batch([BatchPut(PendingPut(key(1), name(1), fc.entry_tensor(1, 4)), fc.MODEL)])
        with contextlib.ExitStack() as stack:
            real_try_pin = table.try_pin

            def lease_then_gone_and_other_process_enters(*args):
                taken = real_try_pin(*args)
                assert tier.delete(key(1))
                stack.enter_context(stopped_inside_a_lease_write(path))
                return taken

            monkeypatch.setattr(table, "try_pin", lease_then_gone_and_other_process_enters)
            finished, answer = call_with_hang_guard(lambda: tier.pin(key(1), name(1), 60))
            assert finished, "the pin's cleanup waited for another process's lease write"
            assert answer is Pin.ABSENT
        assert table.leased_keys() == {key(1).encode()}  # ours, left to expire (60 s)
    finally:
        tier.close()


def test_an_entry_being_evicted_is_not_leased_at_all(tmp_path: Path) -> None:
    """A live eviction marker (tombstone) is checked in the pin's own lease
    write transaction: the pin answers ABSENT and leaves no lease behind
    (it used to lease first, then find the marker and release again)."""
    from ecstore.lmdb.leases import Pin

    tier = LMDBTier(str(tmp_path / "s"), CAP)
    table = tier._leases
    assert table is not None
    try:
        tier.write_batch([BatchPut(PendingPut(key(1), name(1), fc.entry_tensor(1, 4)), fc.MODEL)])
        table.mark_evicting([key(1).encode()])
        assert tier.pin(key(1), name(1), 60) is Pin.ABSENT
        assert table.leased_keys() == set()
        table.clear_tombstones()
        assert tier.pin(key(1), name(1), 60) is Pin.HELD
        assert table.leased_keys() == {key(1).encode()}
    finally:
        tier.close()
