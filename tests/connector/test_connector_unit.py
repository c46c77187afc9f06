"""ECStoreConnector against vLLM's real types, one connector call at a time.

Real ``VllmConfig`` (tiny BLIP-2, ``ECTransferConfig`` naming the connector by
module path), connectors created through vLLM's ``ECConnectorFactory``, real
``Request``/``MultiModalFeatureSpec``/``SchedulerOutput``/``ECConnectorOutput``
objects and a real ``ECStore`` on a temporary directory. The test drives the
calls in the order vLLM makes them (scheduler: has_cache_item ->
update_state_after_alloc -> build_connector_meta; worker: bind ->
start_load_caches -> save_caches -> build_connector_worker_meta; scheduler:
update_connector_output), without an engine.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import gib
from helpers import vllm_objects as vo
from helpers.connector_store import damage_blob, open_store
from helpers.encodes import count_encodes
from helpers.writer_state import asleep_since, batch_done_since, writer_asleep
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorLogging, ECConnectorProm
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput
from vllm.v1.request import RequestStatus

from ecstore import ECStore
from ecstore.connector import (
    ECStoreConnector,
    ECStoreConnectorMetadata,
    ECStoreConnectorStats,
    ECStorePromMetrics,
    ECStoreWorkerMetadata,
    LoadSpec,
)
from ecstore.connector.connector import config_from_vllm

pytestmark = pytest.mark.vllm

A, B, C = ("a1" * 32, "b2" * 32, "c3" * 32)  # shaped like vLLM content hashes (64 hex digits)
SHAPE = (vo.EMBEDS_PER_IMAGE, vo.EMBED_WIDTH)
NBYTES = SHAPE[0] * SHAPE[1] * 4


def embedding(seed: int, shape: tuple[int, int] = SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32)


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True)
def _no_outside_config(no_lmcache_env):
    """Only the test's ec_connector_extra_config configures the connector."""


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "ec"


@pytest.fixture
def disk_extra(store_dir: Path) -> dict:
    return {"local_disk": str(store_dir), "max_local_disk_size": 0.01, "lease_seconds": 600}


def seed_store(sched: ECStoreConnector, entries: dict[str, torch.Tensor]) -> None:
    """Write entries as another process (a producer) would: own handle, no memory tier."""
    cfg = replace(sched.config, local_cpu=False)
    with ECStore(cfg, model=sched._vllm_config.model_config.model, dtype=torch.float32,
                 identity=sched.identity) as st:
        for ident, t in entries.items():
            assert st.put(ident, t)
        st.flush()


def snapshot(conn: ECStoreConnector) -> dict[str, tuple]:
    """identifier -> (checksum, blob size, created) of every disk entry."""
    with open_store(conn) as st:
        return {rec.mm_identifier: (rec.checksum, rec.blob_size, rec.created_ns)
                for _, rec in st.disk.iter_records()}


def leased(conn: ECStoreConnector, *identifiers: str) -> set[str]:
    """Which of ``identifiers`` hold a live lease, read from the lease file."""
    with open_store(conn) as st:
        keys = st.disk.leased_keys()
        return {i for i in identifiers if st.key(i).encode() in keys}


def empty_output(**fields) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    for k, v in fields.items():
        setattr(out, k, v)
    return out


def worker_step(worker: ECStoreConnector, meta: ECStoreConnectorMetadata, cache: dict,
                computed: dict[str, torch.Tensor] | None = None) -> ECStoreWorkerMetadata | None:
    """What the model runner does with the worker connector in one step."""
    worker.bind_connector_metadata(meta)
    if worker.is_consumer:
        worker.start_load_caches(cache)
    for ident, t in (computed or {}).items():
        cache[ident] = t
        worker.save_caches(cache, ident)
    wm = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    return wm


def put_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("EC put:")]


# --------------------------------------------------------------------------- roles
@pytest.mark.parametrize("role,producer,consumer", [
    ("ec_producer", True, False), ("ec_consumer", False, True), ("ec_both", True, True)])
def test_role_flags(connectors, disk_extra, role, producer, consumer):
    sched, worker = connectors(role, disk_extra)
    for conn in (sched, worker):
        assert (conn.is_producer, conn.is_consumer) == (producer, consumer)
    assert sched.role == ECConnectorRole.SCHEDULER and worker.role == ECConnectorRole.WORKER
    assert sched.scheduler_side is not None and sched.worker_side is None
    assert worker.worker_side is not None and worker.scheduler_side is None


def test_both_loads_present_and_saves_computed(qwen_connectors, disk_extra, caplog):
    """The whole cycle for ec_both: the present item is announced, leased,
    loaded bit-exact and released; the absent one is computed and saved."""
    sched, worker = qwen_connectors("ec_both", disk_extra)
    t_a, t_b = embedding(1), embedding(2)
    seed_store(sched, {A: t_a})
    caplog.clear()
    req = vo.make_request("r1", [A, B], inputs=False)

    assert sched.has_cache_item(A) is True
    assert sched.has_cache_item(B) is False
    assert leased(sched, A, B) == {A}  # pinned before vLLM relies on the answer
    sched.update_state_after_alloc(req, 0)
    sched.update_state_after_alloc(req, 1)
    meta = sched.build_connector_meta(empty_output())
    assert isinstance(meta, ECStoreConnectorMetadata)
    assert meta.loads == [LoadSpec("r1", A, vo.EMBEDS_PER_IMAGE, vo.EMBED_WIDTH, index=0,
                                   stored_width=vo.EMBED_WIDTH, modality="image")]

    cache: dict[str, torch.Tensor] = {}
    wm = worker_step(worker, meta, cache, computed={B: t_b})
    assert torch.equal(cache[A], t_a) and cache[A].dtype == torch.float32
    assert isinstance(wm, ECStoreWorkerMetadata)
    assert wm.loaded == [("r1", A)] and wm.failed == [] and wm.saved == {B: NBYTES}
    assert wm.stats["loads"] == 1 and wm.stats["saves"] == 1
    assert wm.stats["bytes_loaded"] == NBYTES and wm.stats["bytes_saved"] == NBYTES

    assert leased(sched, A) == {A}  # held until the worker reports the load
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm))
    assert leased(sched, A, B) == set()

    stats = sched.get_ec_connector_stats()
    assert isinstance(stats, ECStoreConnectorStats)
    red = stats.reduce()
    assert (red["hits"], red["misses"], red["loads"], red["saves"]) == (1, 1, 1, 1)
    assert red["hit_rate"] == 0.5 and red["load_failures"] == 0
    assert red["MB_loaded"] == round(NBYTES / 1e6, 3) == red["MB_saved"]
    assert sched.get_ec_connector_stats() is None  # reset after each report
    assert worker.get_ec_connector_stats() is None  # worker counters travel in the worker meta

    worker.worker_side.store.flush()
    assert put_lines(caplog) == [f"EC put: stored {NBYTES} bytes for mm_hash={B}"]
    with open_store(sched) as st:
        assert torch.equal(st.get(B), t_b)


def test_metadata_is_picklable_and_reset(qwen_connectors, disk_extra):
    sched, worker = qwen_connectors("ec_both", disk_extra)
    seed_store(sched, {A: embedding(1)})
    req = vo.make_request("r1", [A], inputs=False)
    assert sched.has_cache_item(A)
    sched.update_state_after_alloc(req, 0)
    meta = sched.build_connector_meta(empty_output())
    assert pickle.loads(pickle.dumps(meta)) == meta and meta.loads
    again = sched.build_connector_meta(empty_output())  # state reset by the build
    assert again.loads == [] and again.acks == []

    wm = worker_step(worker, meta, {}, computed={B: embedding(2)})
    assert wm is not None and not wm.is_empty()
    copy = pickle.loads(pickle.dumps(wm))
    assert copy == wm and isinstance(copy, ECStoreWorkerMetadata)
    assert worker.build_connector_worker_meta() is None  # reset: nothing new to report


def test_worker_meta_aggregates_across_ranks():
    # Tensor-parallel ranks each report; vLLM aggregates them for the scheduler.
    one = ECStoreWorkerMetadata(saved={A: 1}, loaded=[("r1", A)], stats={"loads": 1, "saves": 1})
    two = ECStoreWorkerMetadata(saved={B: 2}, loaded=[("r1", A), ("r2", B)], evicted=[C],
                                failed=[("r9", C, "bad")], cleared=[B], stats={"loads": 2})
    agg = one.aggregate(two)
    assert agg.saved == {A: 1, B: 2} and agg.loaded == [("r1", A), ("r2", B)]
    assert agg.evicted == [C] and agg.failed == [("r9", C, "bad")] and agg.cleared == [B]
    assert agg.stats == {"loads": 3, "saves": 1}
    assert ECStoreWorkerMetadata().is_empty() and not agg.is_empty()


def test_computed_items_are_not_announced(qwen_connectors, disk_extra):
    """update_state_after_alloc announces only items has_cache_item said yes
    to; an item present in the store that vLLM computes anyway (it never
    asked, or asked before the entry existed) is not loaded on top."""
    sched, _ = qwen_connectors("ec_both", disk_extra)
    req = vo.make_request("r1", [A, B], inputs=False)
    assert sched.has_cache_item(A) is False  # absent at lookup time
    seed_store(sched, {A: embedding(1), B: embedding(2)})  # appears meanwhile
    sched.update_state_after_alloc(req, 0)
    sched.update_state_after_alloc(req, 1)  # never asked
    meta = sched.build_connector_meta(empty_output())
    assert meta.loads == []
    red = sched.get_ec_connector_stats().reduce()
    assert (red["hits"], red["misses"]) == (0, 2)
    assert leased(sched, A, B) == set()


def test_unallocated_yes_is_released(connectors, disk_extra):
    """has_cache_item said yes but vLLM did not allocate (no room this
    step): the pin is dropped when the step's metadata is built."""
    sched, _ = connectors("ec_both", disk_extra)
    seed_store(sched, {A: embedding(1)})
    assert sched.has_cache_item(A) and sched.has_cache_item(A)  # asked twice: one pin
    assert leased(sched, A) == {A}
    meta = sched.build_connector_meta(empty_output())
    assert meta.loads == []
    assert leased(sched, A) == set()


def lease_commits(conn: ECStoreConnector) -> int:
    """The lease file's last committed transaction id (every lease write is one)."""
    side = conn.scheduler_side
    assert side is not None and side.store is not None and side.store.disk is not None
    table = side.store.disk._leases
    assert table is not None
    return int(table.env.info()["last_txnid"])


def test_yeses_vllm_could_encode_are_leased_at_the_steps_end_in_one_commit(qwen_connectors, disk_extra):
    """Items vLLM holds inputs for (it could encode them in the step) are
    not leased at the lookup: the step's end leases the allocated ones,
    together with the step's releases, in one lease-file commit, before the
    loads reach the worker; a yes vLLM does not allocate writes nothing.
    Each load then holds its lease until its report, as before."""
    sched, worker = qwen_connectors("ec_both", disk_extra)
    t_a = embedding(1)
    seed_store(sched, {A: t_a, B: embedding(2), C: embedding(3)})
    # r0's C (metadata-only) is verified first: the request waits a step.
    r0 = vo.make_request("r0", [C], inputs=False)
    assert sched.ensure_cache_available(r0, 0) is False
    sched.build_connector_meta(empty_output())
    side = sched.scheduler_side
    assert side is not None and side._verifications is not None and side._verifications.wait_idle(60)
    # This step r0's yes is pinned at its lookup (by the verifier) but not
    # allocated, so the step's end releases it; r1's A is allocated, its B not.
    assert sched.ensure_cache_available(r0, 0) is True
    assert leased(sched, C) == {C}
    r1 = vo.make_request("r1", [A, B], model=vo.QWEN2_5_VL)
    assert sched.ensure_cache_available(r1, 0) is True
    before = lease_commits(sched)
    assert sched.has_cache_item(A) and sched.has_cache_item(B) and sched.has_cache_item(A)
    assert lease_commits(sched) == before and leased(sched, A, B) == set()  # nothing written yet
    sched.update_state_after_alloc(r1, 0)
    meta = sched.build_connector_meta(empty_output())
    assert lease_commits(sched) == before + 1  # A's lease and C's release: one commit
    assert leased(sched, A, B, C) == {A}
    assert [(s.req_id, s.identifier, s.recomputable) for s in meta.loads] == [("r1", A, True)]
    cache: dict[str, torch.Tensor] = {}
    wm = worker_step(worker, meta, cache)
    assert wm is not None and wm.loaded == [("r1", A)] and torch.equal(cache[A], t_a)
    assert leased(sched, A) == {A}  # held until the worker reports the load
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm))
    assert leased(sched, A, B, C) == set()
    # Two requests allocating the same item in one step hold a lease each.
    r2, r3 = (vo.make_request(r, [B], model=vo.QWEN2_5_VL) for r in ("r2", "r3"))
    for r in (r2, r3):
        assert sched.ensure_cache_available(r, 0) and sched.has_cache_item(B)
        sched.update_state_after_alloc(r, 0)
    sched.build_connector_meta(empty_output())
    r2.status = r3.status = RequestStatus.FINISHED_ABORTED
    sched.request_finished(r2)
    assert leased(sched, B) == {B}  # r3's lease
    sched.request_finished(r3)
    assert leased(sched, B) == set()


def test_an_entry_gone_before_the_steps_end_is_encoded_in_the_step(qwen_connectors, disk_extra, caplog):
    """Between the lookup's yes and the step's end another process deleted
    the entry (an eviction can too): its lease is not taken, the load still
    reaches the worker, which has vLLM encode the item in the step
    (``recomputed``); nothing fails, nothing stays leased."""
    sched, worker = qwen_connectors("ec_both", disk_extra)
    seed_store(sched, {A: embedding(1)})
    r1 = vo.make_request("r1", [A], model=vo.QWEN2_5_VL)
    assert sched.ensure_cache_available(r1, 0) and sched.has_cache_item(A)
    sched.update_state_after_alloc(r1, 0)
    with open_store(sched) as st:
        assert st.delete(A)
    meta = sched.build_connector_meta(empty_output())
    assert leased(sched, A) == set()
    wm = worker_step(worker, meta, {})
    assert wm is not None and wm.recomputed == [("r1", A)] and wm.failed == [] and wm.loaded == []
    assert meta.encoder_inputs == {"r1": [0]}  # vLLM's runner encodes it in this step
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm))
    assert leased(sched, A) == set()
    assert sched.scheduler_side is not None and not sched.scheduler_side.take_unavailable_requests()


def test_producer_never_loads(qwen_connectors, disk_extra, caplog):
    """ec_producer (encode-only): has_cache_item answers from the store, so
    vLLM does not run the encoder for a present item; nothing is announced,
    leased or loaded. (It used to answer no: a present image was encoded
    again and the save skipped.)"""
    sched, worker = qwen_connectors("ec_producer", disk_extra)
    t_a = embedding(1)
    seed_store(sched, {A: t_a})
    before = snapshot(sched)
    caplog.clear()
    req = vo.make_request("r1", [A, B], inputs=False)
    assert sched.has_cache_item(A) is True  # present: vLLM skips its encoder
    assert sched.has_cache_item(B) is False
    assert leased(sched, A) == set()  # nothing to load, nothing pinned
    sched.update_state_after_alloc(req, 0)
    sched.update_state_after_alloc(req, 1)
    meta = sched.build_connector_meta(empty_output())
    assert meta.loads == []
    stats = sched.get_ec_connector_stats()
    assert stats is not None and (stats.data["hits"], stats.data["misses"]) == (1, 1)

    # Even a load announced by someone else is not performed.
    cache: dict[str, torch.Tensor] = {}
    stray = ECStoreConnectorMetadata(loads=[LoadSpec("r1", A, *SHAPE)])
    worker.bind_connector_metadata(stray)
    worker.start_load_caches(cache)
    worker.clear_connector_metadata()
    assert cache == {}

    # It saves what it computes; a present key (stored by another producer
    # in the meantime) is skipped, the entry untouched. Its counters reach
    # the scheduler side's stats although vLLM drops its worker metadata.
    worker_step(worker, meta, cache, computed={A: embedding(7), B: embedding(2)})
    after = snapshot(sched)  # committed by the end of the step: no flush needed
    assert after[A] == before[A] and set(after) == {A, B}
    assert put_lines(caplog) == [f"EC put: stored {NBYTES} bytes for mm_hash={B}"]
    stats = sched.get_ec_connector_stats()
    assert stats is not None
    assert (stats.data["saves"], stats.data["save_skipped"], stats.data["bytes_saved"]) == (1, 1, NBYTES)
    assert stats.data["save_seconds"] > 0 and stats.data["commit_seconds"] > 0


@pytest.mark.parametrize("seeded", [False, True], ids=["empty-store", "existing-store"])
def test_consumer_never_writes(qwen_connectors, disk_extra, caplog, seeded):
    sched, worker = qwen_connectors("ec_consumer", disk_extra)
    t_a = embedding(1)
    if seeded:
        seed_store(sched, {A: t_a})
    before = snapshot(sched)
    caplog.clear()
    req = vo.make_request("r1", [A, B], inputs=False)
    assert sched.has_cache_item(A) is seeded
    assert sched.has_cache_item(B) is False
    sched.update_state_after_alloc(req, 0)
    sched.update_state_after_alloc(req, 1)
    meta = sched.build_connector_meta(empty_output())
    cache: dict[str, torch.Tensor] = {}
    computed = {B: embedding(2)} if seeded else {A: embedding(1), B: embedding(2)}
    wm = worker_step(worker, meta, cache, computed=computed)
    if seeded:
        assert torch.equal(cache[A], t_a) and wm.loaded == [("r1", A)]
    assert wm is None or (wm.saved == {} and "saves" not in wm.stats)
    worker.worker_side.store.flush()
    assert snapshot(sched) == before  # no entry added, none rewritten
    assert put_lines(caplog) == []
    if wm is not None:
        sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm))
    assert leased(sched, A, B) == set()


# --------------------------------------------------------------------------- leases
def test_aborted_request_releases_its_lease(qwen_connectors, disk_extra):
    sched, _ = qwen_connectors("ec_both", disk_extra)
    seed_store(sched, {A: embedding(1)})
    r1, r2 = vo.make_request("r1", [A], inputs=False), vo.make_request("r2", [A], inputs=False)
    assert sched.has_cache_item(A)
    sched.update_state_after_alloc(r1, 0)
    sched.build_connector_meta(empty_output())
    # Next step, before r1's load was reported, r2 needs the same entry.
    assert sched.has_cache_item(A)
    sched.update_state_after_alloc(r2, 0)
    meta = sched.build_connector_meta(empty_output())
    assert [s.req_id for s in meta.loads] == ["r2"]
    assert leased(sched, A) == {A}

    r2.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(r2) == (False, None)
    assert leased(sched, A) == {A}  # r1 still holds its own pin
    r1.status = RequestStatus.FINISHED_ABORTED
    sched.request_finished(r1)
    assert leased(sched, A) == set()
    # A late "loaded" report for them changes nothing.
    sched.update_connector_output(ECConnectorOutput(
        ec_connector_worker_meta=ECStoreWorkerMetadata(loaded=[("r1", A), ("r2", A)])))
    assert leased(sched, A) == set()


def test_each_announced_load_holds_its_own_lease(qwen_connectors, disk_extra):
    """With async scheduling vLLM schedules step N+1 before step N's output
    arrives: r2's load of A may be announced before r1's is reported. r1's
    report must not drop the pin r2's pending load relies on."""
    sched, worker = qwen_connectors("ec_both", disk_extra)
    seed_store(sched, {A: embedding(1)})
    assert sched.has_cache_item(A)
    sched.update_state_after_alloc(vo.make_request("r1", [A], inputs=False), 0)
    meta1 = sched.build_connector_meta(empty_output())
    assert sched.has_cache_item(A)
    sched.update_state_after_alloc(vo.make_request("r2", [A], inputs=False), 0)
    meta2 = sched.build_connector_meta(empty_output())
    wm1 = worker_step(worker, meta1, {})
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm1))
    assert leased(sched, A) == {A}  # r2's load has not run yet
    wm2 = worker_step(worker, meta2, {})
    assert wm2.loaded == [("r2", A)]
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm2))
    assert leased(sched, A) == set()


def seed_damaged_record(sched: ECStoreConnector, identifier: str) -> None:
    """An entry of ``identifier`` whose record is damaged after the
    identifier (one byte appended): the identifier still reads, the rest not."""
    seed_store(sched, {identifier: embedding(1)})
    with open_store(sched) as st:
        k = st.key(identifier).encode()
        with st.disk.env.begin(write=True) as txn:
            txn.put(k, bytes(txn.get(k, db=st.disk._dbs.entries)) + b"\x00", db=st.disk._dbs.entries)
        assert st.disk.contains(st.key(identifier), st.stored_name(identifier))  # the identifier still reads


def test_unreadable_record_is_a_miss_that_keeps_no_lease(connectors, disk_extra):
    """An entry whose identifier reads but whose record does not (damaged
    after the identifier): has_cache_item pins it, then cannot check its
    shape. A miss, and the pin is let go (it was kept for lease_seconds,
    one more per ask, sparing the damaged entry from eviction meanwhile)."""
    sched, _ = connectors("ec_both", disk_extra)
    seed_damaged_record(sched, A)
    assert sched.has_cache_item(A) is False
    assert sched.has_cache_item(A) is False
    assert leased(sched, A) == set()


def test_unreadable_record_is_dropped_so_the_item_can_be_stored_again(connectors, disk_extra):
    """The damaged entry does not keep its key: a put of the item (the
    producer after re-encoding it) would be refused as already held, and the
    item re-encoded on every request until the entry's eviction."""
    sched, _ = connectors("ec_both", disk_extra)
    seed_damaged_record(sched, A)
    assert sched.has_cache_item(A) is False
    with open_store(sched) as st:
        assert not st.disk.contains(st.key(A), st.stored_name(A))  # dropped
        assert st.put(A, embedding(2)) is True  # stored again
        st.flush()
    assert sched.has_cache_item(A) is True


def test_shutdown_releases_pending_leases(qwen_connectors, disk_extra):
    sched, _ = qwen_connectors("ec_both", disk_extra)
    seed_store(sched, {A: embedding(1), B: embedding(2)})
    assert sched.has_cache_item(A) and sched.has_cache_item(B)
    sched.update_state_after_alloc(vo.make_request("r1", [A], inputs=False), 0)
    assert leased(sched, A, B) == {A, B}
    sched.shutdown()
    assert leased(sched, A, B) == set()


def test_a_shut_down_worker_connector_is_not_kept_alive(tiny_qwen2_5_vl_dir, disk_extra):
    """Regression: the worker side registered its shutdown with ``atexit``
    and never unregistered it, so every connector ever made stayed alive
    (with its store and the memory tier's tensors) until the process exited."""
    import gc
    import weakref

    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    cfg = vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_both", disk_extra)
    worker = ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.WORKER)
    assert isinstance(worker, ECStoreConnector)
    worker.save_caches({A: embedding(1)}, A)
    gone = weakref.ref(worker.worker_side)
    worker.shutdown()
    del worker
    gc.collect()
    assert gone() is None


# --------------------------------------------------------------------------- failures
@pytest.mark.parametrize("damage", ["corrupt-blob", "wrong-shape"])
def test_unloadable_entry_gets_stand_in_and_fails_request(qwen_connectors, disk_extra, caplog, damage):
    """An announced entry that cannot be loaded: the worker inserts a zero
    stand-in (vLLM would crash with "Encoder cache miss" otherwise), the
    scheduler side fails the request through take_unavailable_requests, and
    later requests are not served the stand-in from vLLM's encoder cache."""
    sched, worker = qwen_connectors("ec_both", disk_extra)
    if damage == "corrupt-blob":
        seed_store(sched, {A: embedding(1)})
        damage_blob(sched, A)
    else:
        seed_store(sched, {A: embedding(1, (16, vo.EMBED_WIDTH))})
    req = vo.make_request("r1", [A], inputs=False)
    assert sched.has_cache_item(A)  # present; damage shows only when read
    sched.update_state_after_alloc(req, 0)
    meta = sched.build_connector_meta(empty_output())

    cache: dict[str, torch.Tensor] = {}
    wm = worker_step(worker, meta, cache)  # must not raise
    assert cache[A].shape == SHAPE and cache[A].dtype == torch.float32
    assert not cache[A].any()
    assert wm.loaded == [] and [f[:2] for f in wm.failed] == [("r1", A)]
    assert wm.stats["load_failures"] == 1

    assert sched.take_unavailable_requests() == set()
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm))
    assert sched.take_unavailable_requests() == {"r1"}
    assert sched.take_unavailable_requests() == set()
    assert leased(sched, A) == set()
    assert sched.get_ec_connector_stats().reduce()["load_failures"] == 1
    assert any("could not load encoder output" in r.getMessage() for r in caplog.records)

    # vLLM's encoder cache now holds the stand-in under A and would serve it
    # to the next request with A without asking the connector: fail those.
    r2 = vo.make_request("r2", [A], inputs=False)
    assert sched.ensure_cache_available(r2, 0) is False
    assert sched.take_unavailable_requests() == {"r2"}
    assert sched.ensure_cache_available(vo.make_request("r3", [B], model=vo.QWEN2_5_VL), 0) is True
    # Once vLLM frees A (free_encoder_mm_hashes), A is looked up afresh.
    sched.build_connector_meta(empty_output(free_encoder_mm_hashes=[A]))
    assert sched.ensure_cache_available(vo.make_request("r4", [A], model=vo.QWEN2_5_VL), 0) is True
    if damage == "corrupt-blob":
        assert sched.has_cache_item(A) is False  # the corrupt entry was dropped


def test_stand_in_gone_from_vllms_cache_unblocks_the_item(qwen_connectors, disk_extra):
    """vLLM can drop the stand-in without listing it in free_encoder_mm_hashes
    (``reset_encoder_cache`` clears scheduler and runner caches): the worker
    notices it is gone and reports it, and the item is usable again."""
    sched, worker = qwen_connectors("ec_both", disk_extra)
    seed_store(sched, {A: embedding(1)})
    damage_blob(sched, A)
    assert sched.has_cache_item(A)
    sched.update_state_after_alloc(vo.make_request("r1", [A], inputs=False), 0)
    cache: dict[str, torch.Tensor] = {}
    wm = worker_step(worker, sched.build_connector_meta(empty_output()), cache)
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm))
    assert sched.take_unavailable_requests() == {"r1"}

    wm = worker_step(worker, sched.build_connector_meta(empty_output()), cache)
    assert wm is None  # stand-in still in vLLM's cache: nothing to report
    assert sched.ensure_cache_available(vo.make_request("r2", [A], model=vo.QWEN2_5_VL), 0) is False
    cache.clear()  # what the model runner's reset_encoder_cache does
    wm = worker_step(worker, sched.build_connector_meta(empty_output()), cache)
    assert wm.cleared == [A]
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm))
    assert sched.take_unavailable_requests() == {"r2"}
    assert sched.ensure_cache_available(vo.make_request("r3", [A], model=vo.QWEN2_5_VL), 0) is True
    assert sched.take_unavailable_requests() == set()


# --------------------------------------------------------------------------- memory only
def test_memory_only_mirror_limbo_and_acks(qwen_connectors):
    """No local_disk: entries live in the worker's memory tier; the scheduler
    mirrors the worker's saved/evicted reports. An entry evicted after a
    load was announced stays loadable (limbo) until the scheduler acks."""
    extra = {"local_disk": None, "local_cpu": True, "max_local_cpu_size": gib(2 * NBYTES)}
    sched, worker = qwen_connectors("ec_both", extra)
    assert sched.config.local_disk is None and worker.worker_side.store.disk is None
    t_a, t_b, t_c = embedding(1), embedding(2), embedding(3)
    assert sched.has_cache_item(A) is False

    # Step 1: A and B computed and saved; the scheduler learns of them.
    r1 = vo.make_request("r1", [A, B], inputs=False)
    sched.update_state_after_alloc(r1, 0)
    sched.update_state_after_alloc(r1, 1)
    wm1 = worker_step(worker, sched.build_connector_meta(empty_output()), {}, {A: t_a, B: t_b})
    assert wm1.saved == {A: NBYTES, B: NBYTES}
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm1))
    assert sched.has_cache_item(A) and sched.has_cache_item(B)

    # Step 2: r2 needs A -> load announced (meta2).
    sched.update_state_after_alloc(vo.make_request("r2", [A], inputs=False), 0)
    meta2 = sched.build_connector_meta(empty_output())
    assert [s.identifier for s in meta2.loads] == [A]

    # Meanwhile the worker saves C, which evicts A (LRU) from its memory tier.
    wm_c = worker_step(worker, ECStoreConnectorMetadata(), {}, {C: t_c})
    assert wm_c.evicted == [A] and wm_c.stats["evictions"] == 1
    # The announced load still succeeds: A waits in limbo until acked.
    cache: dict[str, torch.Tensor] = {}
    wm2 = worker_step(worker, meta2, cache)
    assert torch.equal(cache[A], t_a) and wm2.loaded == [("r2", A)] and wm2.failed == []

    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm_c))
    # Evicted: no new load of A, even while r2's load is not reported yet
    # (the worker frees A once acked, so a later load would find nothing).
    assert sched.has_cache_item(A) is False and sched.has_cache_item(C) is True
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm2))
    assert sched.has_cache_item(A) is False
    meta3 = sched.build_connector_meta(empty_output())
    assert meta3.acks == [A] and meta3.loads == []
    assert A in worker.worker_side._limbo
    worker_step(worker, meta3, {})
    assert A not in worker.worker_side._limbo  # freed only after the ack

    red = sched.get_ec_connector_stats().reduce()
    assert (red["hits"], red["misses"], red["loads"], red["saves"], red["evictions"]) == (1, 2, 1, 3, 1)


def test_memory_only_producer_keeps_no_evicted_tensors(connectors):
    """A producer never loads, so nothing it evicts is parked for a load."""
    extra = {"local_disk": None, "local_cpu": True, "max_local_cpu_size": gib(2 * NBYTES)}
    sched, worker = connectors("ec_producer", extra)
    computed = {ident: embedding(i) for i, ident in enumerate([A, B, C, "d4" * 32])}
    wm = worker_step(worker, sched.build_connector_meta(empty_output()), {}, computed)
    assert wm.evicted == [A, B]
    assert sched.get_ec_connector_stats().data["evictions"] == 2  # via the shared record
    assert worker.worker_side._limbo == {}
    assert worker.worker_side.store.stats().memory_entries == 2


def test_an_encode_only_producer_with_a_disk_keeps_no_memory_tier(connectors, disk_extra):
    """Nothing reads an encode-only producer's store: with a memory tier
    every saved blob (and its pooled slab) stayed in memory, so each save
    copied into fresh memory (1.8 s for a 130.8 MB save on the benchmark VM).
    Its saves are still committed and visible to other handles."""
    sched, worker = connectors("ec_producer", {**disk_extra, "local_cpu": True})
    ws = worker.worker_side
    assert ws.encode_only and ws.store.config.local_cpu is False
    assert ws.store.config.source_of("local_cpu").startswith("encode-only producer")
    computed = {ident: embedding(i) for i, ident in enumerate([A, B])}
    worker_step(worker, sched.build_connector_meta(empty_output()), {}, computed)
    assert ws.store.stats().memory_entries == 0
    assert all(ws.store.contains(i) for i in computed)
    both, _ = connectors("ec_both", disk_extra)  # a consumer's config keeps its memory tier
    assert both.config.local_cpu is True


def test_an_encode_only_producers_large_save_is_written_from_vllms_tensor(connectors, disk_extra, monkeypatch):
    """An encode-only producer's step waits until its saves are committed,
    and vLLM does not write into an encoder output: a large save hands the
    tensor to the store (no copy in ``save_caches``), and with a spare file
    ready the writer writes the blob file from the tensor's own bytes, so
    no copy of the entry is made at all. The entry is committed when the
    step's report is built and reads back equal elsewhere. A small save,
    and a producer that also reads its store, still copy."""
    from ecstore.connector.worker_side import LEND_FROM

    sched, worker = connectors("ec_producer", {**disk_extra, "max_local_disk_size": 0.1})
    ws = worker.worker_side
    rows = -(-(LEND_FROM + 12345) // (4 * SHAPE[1]))
    first, second = embedding(1, (rows, SHAPE[1])), embedding(2, (rows, SHAPE[1]))
    assert ws._lends(first) and not ws._lends(embedding(3))
    worker_step(worker, sched.build_connector_meta(empty_output()), {}, {A: first})
    assert ws.store.disk.files.wait_spare(60)  # the idle writer made one for the next large blob
    encodes = count_encodes(monkeypatch)
    wm = worker_step(worker, sched.build_connector_meta(empty_output()), {}, {B: second})
    assert encodes == [] and wm is not None and B in wm.saved
    monkeypatch.undo()
    with open_store(sched) as st:  # A went by the encode with no spare ready yet, B from vLLM's tensor
        for ident, t in ((A, first), (B, second)):
            got = st.get(ident)
            assert got is not None and torch.equal(got, t)
    both, both_worker = connectors("ec_both", {**disk_extra, "max_local_disk_size": 0.1})
    assert not both_worker.worker_side._lends(first)  # its memory tier would keep vLLM's tensor


def test_a_steps_saves_are_written_from_the_steps_end(connectors, disk_extra):
    """A save does not wake the store's writer (waking a sleeping thread cost
    about a fifth of a 1 MB save on the benchmark VM, and the writer took the
    step's first save alone): ``build_connector_worker_meta`` starts the
    step's writes, together. The step's entries are then committed for
    other processes."""
    sched, worker = connectors("ec_both", disk_extra)
    ws = worker.worker_side
    w = ws.store._writer
    slept = writer_asleep(w)
    computed = {ident: embedding(i) for i, ident in enumerate([A, B])}
    worker.bind_connector_metadata(sched.build_connector_meta(empty_output()))
    cache: dict[str, torch.Tensor] = {}
    for ident, t in computed.items():
        cache[ident] = t
        worker.save_caches(cache, ident)
    assert asleep_since(w, slept), "a save woke the writer before the step's end"
    assert all(ws.store.contains(i) for i in computed)  # this process reads them at once
    wm = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    assert batch_done_since(w, slept), "the step's end did not start the writes"
    assert wm is not None and set(wm.saved) == {A, B}
    ws.store.wait_committed()
    with open_store(sched) as st:
        assert all(torch.equal(st.get(i), t) for i, t in computed.items())

    # Outside the step's connector context (vLLM's V1 runner encodes
    # encoder-decoder models there) no step's end follows: written at once.
    slept = writer_asleep(w)
    cache["d4" * 32] = embedding(9)
    worker.save_caches(cache, "d4" * 32)
    assert batch_done_since(w, slept), "a save outside a step waits for a step's end that never comes"


def test_a_save_another_process_stored_first_counts_as_skipped_when_the_writer_finds_it(
        connectors, disk_extra):
    """Saves skip the LMDB lookup (the scheduler saw the miss), so an entry
    another process committed between that lookup and the write is found by
    the writer: no second blob file, the entry untouched, and the save
    counted as ``save_skipped``, not as a save. Another producer's writes
    finish after its step's report: the correction comes with a later
    report's saves (here the writer is held inside that batch until the
    first report is built), and the totals come out exact."""
    import threading

    sched, worker = connectors("ec_both", disk_extra)
    ws = worker.worker_side
    seed_store(sched, {A: embedding(1)})
    before = snapshot(sched)
    real_write = ws.store.disk.write_batch
    held, go = threading.Event(), threading.Event()

    def hooked(puts, touches=None, **kw):
        if any(p.put.mm_hash == A for p in puts):
            held.set()
            assert go.wait(60)
        return real_write(puts, touches, **kw)

    ws.store.disk.write_batch = hooked
    try:
        reports = []
        for computed in ({A: embedding(7)}, {B: embedding(2)}):
            wm = worker_step(worker, sched.build_connector_meta(empty_output()), {}, computed)
            reports.append(wm.stats)
            if A in computed:
                assert held.wait(60)  # A's batch is being written: its outcome is not known yet
                go.set()
            ws.store.wait_committed()
    finally:
        go.set()
        ws.store.disk.write_batch = real_write
    assert reports[0].get("saves") == 1 and reports[0].get("save_skipped", 0) == 0
    assert reports[1].get("saves") == 0 and reports[1].get("save_skipped") == 1
    assert reports[1].get("bytes_saved") == 0
    total = {k: sum(r.get(k, 0) for r in reports) for k in ("saves", "save_skipped", "bytes_saved")}
    assert total == {"saves": 1, "save_skipped": 1, "bytes_saved": NBYTES}
    after = snapshot(sched)
    assert after[A] == before[A] and set(after) == {A, B}
    assert ws.store.stats().puts_found_stored == 1


# --------------------------------------------------------------------------- config, stats, metrics
def test_extra_config_and_config_file(connectors, tmp_path):
    yaml_file = tmp_path / "lmcache.yaml"
    yaml_file.write_text(f"chunk_size: 256\nec_local_disk: {tmp_path / 'from-yaml'}\n"
                         "ec_max_local_disk_size: 0.02\nec_lease_seconds: 30\n")
    sched, worker = connectors("ec_both", {"config_file": str(yaml_file), "lease_seconds": 45})
    for conn in (sched, worker):
        cfg = conn.config
        assert cfg.local_disk == str(tmp_path / "from-yaml")
        assert cfg.max_local_disk_size == 0.02 and cfg.lease_seconds == 45
        assert cfg.source_of("lease_seconds") == "override lease_seconds"
        assert cfg.config_file == str(yaml_file)
        # As docs/configuration.md says: the extra config's config_file is an override (was "argument path").
        assert cfg.source_of("config_file") == "override config_file"
    assert config_from_vllm(sched._vllm_config) == sched.config
    assert (tmp_path / "from-yaml" / "data.mdb").exists()


def test_stats_reduce_aggregate_and_vllm_logging(tiny_model_dir, disk_extra):
    data = {"hits": 3, "misses": 1, "loads": 3, "saves": 1, "save_skipped": 2,
            "bytes_loaded": 3 * NBYTES, "bytes_saved": NBYTES, "load_seconds": 0.002,
            "save_seconds": 0.001, "evictions": 4, "load_failures": 0}
    stats = ECStoreConnector.build_ec_connector_stats(data)
    assert isinstance(stats, ECStoreConnectorStats) and not stats.is_empty()
    assert stats.reduce() == {
        "hits": 3, "misses": 1, "hit_rate": 0.75, "loads": 3, "load_failures": 0, "recomputed": 0,
        "rejected": 0, "saves": 1,
        "save_skipped": 2, "MB_loaded": round(3 * NBYTES / 1e6, 3), "MB_saved": round(NBYTES / 1e6, 3),
        "load_ms": 2.0, "save_ms": 1.0, "evictions": 4, "commit_ms": 0.0}
    both = stats.aggregate(ECStoreConnector.build_ec_connector_stats({"hits": 1, "misses": 3}))
    assert (both.reduce()["hits"], both.reduce()["misses"], both.reduce()["hit_rate"]) == (4, 4, 0.5)
    assert stats.data["hits"] == 3  # aggregate does not modify its inputs
    assert ECStoreConnector.build_ec_connector_stats(None).is_empty()
    assert ECStoreConnector.build_ec_connector_stats({}).reduce()["hit_rate"] == 0.0

    # vLLM's own stat-logging path resolves the class by module path.
    cfg = vo.vllm_config(tiny_model_dir, "ec_both", disk_extra)
    logging_ = ECConnectorLogging(cfg.ec_transfer_config)
    logging_.observe(data)
    logging_.observe({"hits": 1, "misses": 3})
    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines and lines[0].startswith("EC Transfer metrics: hits=4, misses=4, hit_rate=0.5, loads=3")
    lines.clear()
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == []  # reset after logging


def test_prometheus_counters(tiny_model_dir, disk_extra):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()

    def bound(cls):
        class Bound(cls):
            def __init__(self, *args, **kwargs):
                kwargs.setdefault("registry", registry)
                super().__init__(*args, **kwargs)
        return Bound

    class Prom(ECConnectorProm):  # vLLM's per-connector Prometheus hook, on our registry
        _gauge_cls, _counter_cls, _histogram_cls = bound(Gauge), bound(Counter), bound(Histogram)

    cfg = vo.vllm_config(tiny_model_dir, "ec_both", disk_extra)
    prom = Prom(cfg, ["model_name", "engine"], {0: ["tiny", "0"], 1: ["tiny", "1"]})
    assert isinstance(prom.prom_metrics, ECStorePromMetrics)
    names = {m.name for m in registry.collect()}
    assert {"vllm:ec_store_hits", "vllm:ec_store_misses", "vllm:ec_store_loads",
            "vllm:ec_store_saves", "vllm:ec_store_loaded_bytes", "vllm:ec_store_evictions"} <= names

    def value(name, engine="0"):
        return registry.get_sample_value(f"vllm:ec_store_{name}_total",
                                         {"model_name": "tiny", "engine": engine})

    assert value("hits") == 0.0
    prom.observe({"hits": 2, "misses": 1, "loads": 2, "bytes_loaded": 2 * NBYTES}, engine_idx=0)
    prom.observe({"hits": 1, "saves": 1, "bytes_saved": NBYTES}, engine_idx=0)
    prom.observe({"hits": 5}, engine_idx=1)
    assert (value("hits"), value("misses"), value("loads"), value("saves")) == (3, 1, 2, 1)
    assert value("loaded_bytes") == 2 * NBYTES and value("saved_bytes") == NBYTES
    prom.observe({"save_skipped": 2, "commit_seconds": 0.25}, engine_idx=0)
    assert (value("save_skipped"), value("commit_seconds")) == (2, 0.25)
    assert value("hits", engine="1") == 5


def test_console_logging_handler_is_attached_once(monkeypatch):
    """Without any logging configured (vLLM's default leaves the root logger
    bare), ecstore attaches one console handler so INFO lines show."""
    from ecstore.connector.logs import ensure_console_logging

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)

    logger, root = logging.getLogger("ecstore"), logging.getLogger()
    saved = (logger.handlers[:], logger.level, logger.propagate, root.handlers[:])
    try:
        logger.handlers[:] = []
        root.handlers[:] = []
        ensure_console_logging()
        ensure_console_logging()
        assert len(logger.handlers) == 1 and logger.level == logging.INFO and not logger.propagate
    finally:
        logger.handlers[:], root.handlers[:] = saved[0], saved[3]
        logger.setLevel(saved[1])
        logger.propagate = saved[2]


def test_consumer_only_trusts_the_stored_width(qwen_connectors, disk_extra):
    """A consumer-only instance has no measured encoder output width (vLLM
    measures it on producers only): the load keeps the stored width and
    checks rows and dtype; a row-count mismatch still fails the request."""
    sched, worker = qwen_connectors("ec_consumer", disk_extra)
    wide = embedding(1, (vo.EMBEDS_PER_IMAGE, vo.EMBED_WIDTH * 3))  # e.g. deepstack outputs
    short = embedding(2, (vo.EMBEDS_PER_IMAGE // 2, vo.EMBED_WIDTH))
    seed_store(sched, {A: wide, B: short})
    req = vo.make_request("r1", [A, B], inputs=False)
    assert sched.has_cache_item(A) and sched.has_cache_item(B)
    sched.update_state_after_alloc(req, 0)
    sched.update_state_after_alloc(req, 1)
    meta = sched.build_connector_meta(empty_output())
    assert [s.width for s in meta.loads] == [None, None]
    cache: dict[str, torch.Tensor] = {}
    wm = worker_step(worker, meta, cache, computed={})
    assert torch.equal(cache[A], wide)
    assert wm.loaded == [("r1", A)]
    assert [(r, i) for r, i, _ in wm.failed] == [("r1", B)]
    assert tuple(cache[B].shape) == (vo.EMBEDS_PER_IMAGE, vo.EMBED_WIDTH)  # stand-in, LM width


def test_a_yes_given_earlier_in_the_step_is_verified_before_a_request_that_needs_it(qwen_connectors, disk_extra):
    """vLLM asked about A for a request with inputs (no verification needed:
    the worker can encode A again) and did not allocate it; a metadata-only
    request for A in the same step must not reuse that unverified yes for a
    corrupt entry (its load would fail onto a zero stand-in): A is verified
    (off the scheduler thread: the request waits a step), dropped, and that
    request failed before any token."""
    sched, _ = qwen_connectors("ec_both", disk_extra)
    seed_store(sched, {A: embedding(1)})
    damage_blob(sched, A)
    assert sched.has_cache_item(A)  # the request with inputs (then not allocated)
    r2 = vo.make_request("r2", [A], inputs=False)
    assert sched.ensure_cache_available(r2, 0) is False  # waits for the verification
    assert sched.scheduler_side.take_unavailable_requests() == set()
    assert leased(sched, A) == set()
    sched.build_connector_meta(empty_output())  # the step ends: the verification thread starts
    assert sched.scheduler_side._verifications.wait_idle(60)
    assert sched.ensure_cache_available(r2, 0) is False
    assert "r2" in sched.scheduler_side.take_unavailable_requests()
    assert leased(sched, A) == set()



def test_a_verification_ending_between_the_lookup_and_its_start_keeps_the_request_waiting(
        qwen_connectors, disk_extra):
    """has_cache_item finds an entry not verified yet and starts its
    verification; the verification thread may finish (passed) in between.
    Starting it again must still answer "wait" (the next lookup is a yes):
    it answered "not started", and a real engine failed the metadata-only
    request of a good entry. A failed verification of the same entry is not
    started again at once (the request fails instead of waiting at every
    step); a new entry under the identifier is verified at once."""
    sched, _ = qwen_connectors("ec_both", disk_extra)
    seed_store(sched, {A: embedding(1)})
    side = sched.scheduler_side
    jobs = side._verifications
    rec = side.store.stored_record(A)
    assert rec is not None
    tag = (rec.checksum, rec.created_ns)
    assert jobs.start(A, tag) and jobs.wait_idle(60) and jobs.state(A) == "passed"
    assert jobs.start(A, tag) is True  # passed just now: the request waits for its yes
    assert side._verified.known(A, rec)
    seed_store(sched, {B: embedding(2)})
    damage_blob(sched, B)
    rec_b = side.store.stored_record(B)
    assert rec_b is not None
    tag_b = (rec_b.checksum, rec_b.created_ns)
    assert jobs.start(B, tag_b) and jobs.wait_idle(60) and jobs.state(B) == "failed"
    assert jobs.start(B, tag_b) is False  # not again at every step
    assert jobs.start(B, ("another", "entry")) is True  # another entry: verified at once
    assert jobs.wait_idle(60)


def test_the_yes_after_a_verification_makes_no_lmdb_call_on_the_scheduler_thread(qwen_connectors, disk_extra):
    """The lookup after a background verification pinned the entry itself,
    on vLLM's scheduler thread: a lease-file commit and two LMDB reads, with
    the CPU caches cold after the verification read the whole blob (250-500 us
    at 34 and 130 MB, most of that item's scheduler time). The verification
    thread now pins the entry it verified and hands the pin to the next
    lookup: that yes makes no store call on the scheduler thread. A pin no
    lookup came for is released at the end of the step after the one it was
    taken in (the lookup then pins as before); shutdown releases the rest."""
    import threading

    sched, _ = qwen_connectors("ec_both", disk_extra)
    seed_store(sched, {A: embedding(1), B: embedding(2), C: embedding(3)})
    side = sched.scheduler_side
    me = threading.get_ident()
    calls: list[str] = []  # store calls made on this (the scheduler) thread
    for name in ("pin_entry", "stored_record", "entry_tag", "verify", "release", "contains"):
        real = getattr(side.store, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            if threading.get_ident() == me:
                calls.append(_name)
            return _real(*args, **kwargs)

        setattr(side.store, name, spy)

    def verified_step(req) -> None:
        assert sched.ensure_cache_available(req, 0) is False  # queued: the request waits a step
        sched.build_connector_meta(empty_output())  # the step ends: the verification thread starts
        assert side._verifications.wait_idle(60)

    r1 = vo.make_request("r1", [A], inputs=False)
    verified_step(r1)
    assert leased(sched, A) == {A}  # pinned by the verification thread, for the next lookup
    calls.clear()
    assert sched.ensure_cache_available(r1, 0) and sched.has_cache_item(A)
    assert calls == []  # no read, no lease write on the scheduler thread
    sched.update_state_after_alloc(r1, 0)
    meta = sched.build_connector_meta(empty_output())
    assert [s.identifier for s in meta.loads] == [A] and leased(sched, A) == {A}  # the load's lease

    r2 = vo.make_request("r2", [B], inputs=False)
    verified_step(r2)  # B verified and pinned; r2 is not asked about again for two steps
    sched.build_connector_meta(empty_output())
    assert leased(sched, B) == {B}
    sched.build_connector_meta(empty_output())
    assert leased(sched, B) == set()  # nobody came for it: released
    calls.clear()
    assert sched.ensure_cache_available(r2, 0) and sched.has_cache_item(B)  # pinned by the lookup
    assert "pin_entry" in calls and leased(sched, B) == {B}
    sched.build_connector_meta(empty_output())  # not allocated: let go
    assert leased(sched, B) == set()

    verified_step(vo.make_request("r3", [C], inputs=False))
    assert leased(sched, C) == {C}
    sched.shutdown()
    assert leased(sched, A, B, C) == set()


def test_a_verified_entry_the_verifier_could_not_pin_is_pinned_by_the_lookup(qwen_connectors, disk_extra):
    """The lease the verification thread takes for the next lookup is an
    optimisation: when taking it fails (an ECStoreError from the lease
    file), the entry still passed; the lookup pins it itself and says yes."""
    import threading

    from ecstore.errors import StoreOpenError

    sched, _ = qwen_connectors("ec_both", disk_extra)
    seed_store(sched, {A: embedding(1)})
    side = sched.scheduler_side
    me = threading.get_ident()
    real_pin = side.store.pin_entry

    def pin_entry(*args, **kwargs):
        if threading.get_ident() != me:
            raise StoreOpenError("cannot lock the lease file")
        return real_pin(*args, **kwargs)

    side.store.pin_entry = pin_entry  # type: ignore[method-assign]
    req = vo.make_request("r1", [A], inputs=False)
    assert sched.ensure_cache_available(req, 0) is False
    sched.build_connector_meta(empty_output())
    assert side._verifications.wait_idle(60) and side._verifications.state(A) == "passed"
    assert leased(sched, A) == set()
    assert sched.ensure_cache_available(req, 0) and sched.has_cache_item(A)
    assert leased(sched, A) == {A} and not side.take_unavailable_requests()


@pytest.mark.parametrize("job", ["verify", "fetch"])
def test_a_background_job_that_raises_ends_failed_logged_and_later_jobs_still_run(tmp_path, caplog, job):
    """A verification or a remote fetch that raises ends FAILED (the request
    waiting for it is a miss, never deferred forever): an ECStoreError is
    logged as a miss, anything else as a defect, and the thread goes on with
    the next job."""
    from ecstore import ECStoreConfig
    from ecstore.connector.availability import Fetch, RemoteFetches, Verifications, VerifiedEntries, Verify
    from ecstore.errors import CorruptEntryError

    cfg = ECStoreConfig(local_disk=str(tmp_path / "s"), max_local_disk_size=0.01, local_cpu=False)
    with ECStore(cfg, model="m", dtype=torch.float32) as store:
        failures = {"x": CorruptEntryError("torn blob"), "y": RuntimeError("a defect")}

        def failing(identifier, *args, **kwargs):
            if identifier in failures:
                raise failures[identifier]
            return None

        verified = VerifiedEntries(store)
        if job == "verify":
            verified.check = failing  # type: ignore[method-assign]
            jobs: Verifications | RemoteFetches = Verifications(verified)
            doing, failed = "verifying", Verify.FAILED
        else:
            store.get = failing  # type: ignore[method-assign]
            jobs = RemoteFetches(store, verified)
            doing, failed = "fetching", Fetch.FAILED
        with caplog.at_level(logging.WARNING, logger="ecstore"):
            for identifier in ("x", "y", "z"):
                assert jobs.start(identifier)
            assert jobs.wait_idle(60)
        jobs.close()
        assert [jobs.state(i) for i in ("x", "y", "z")] == [failed, failed, failed]  # z: plainly not there
        logged = [(r.levelno, r.getMessage()) for r in caplog.records]
        where = " from the remote" if job == "fetch" else ""
        assert (logging.WARNING, f"ecstore: {doing} x{where} failed, treated as a miss: torn blob") in logged
        assert (logging.ERROR, f"ecstore: {doing} y{where} failed: RuntimeError('a defect')") in logged
        assert not any(f"{doing} z" in m for _, m in logged)


def test_a_consumers_stand_in_is_as_wide_as_the_stored_entry(tiny_qwen3_vl_dir, disk_extra):
    """Qwen3-VL's deepstack packs 3 levels on the last dimension: its encoder
    output is 384 wide, its language model 128. A consumer-only instance has
    no measured width, and the stand-in of a load that fails after the yes
    took the LM's hidden size: the model's split of what it reads into
    3 x 128 raised and the engine died. The stand-in now takes the entry's
    width from its record (read at the yes)."""
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    cfg = vo.vllm_config(tiny_qwen3_vl_dir, "ec_consumer", disk_extra)
    sched = ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.SCHEDULER)
    worker = ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.WORKER)
    try:
        wide = vo.PRODUCER_WIDTHS["qwen3_vl"]["image"]
        assert wide == 3 * cfg.model_config.get_inputs_embeds_size()
        seed_store(sched, {A: embedding(1, (vo.EMBEDS_PER_IMAGE, wide))})
        req = vo.make_request("r1", [A], inputs=False, model="qwen3_vl")
        assert sched.has_cache_item(A)
        damage_blob(sched, A)  # after the yes: the load fails
        sched.update_state_after_alloc(req, 0)
        meta = sched.build_connector_meta(empty_output())
        assert [(s.width, s.stored_width) for s in meta.loads] == [(None, wide)]
        cache: dict[str, torch.Tensor] = {}
        wm = worker_step(worker, meta, cache)
        assert [f[:2] for f in wm.failed] == [("r1", A)]
        assert tuple(cache[A].shape) == (vo.EMBEDS_PER_IMAGE, wide) and not cache[A].any()
    finally:
        sched.shutdown()
        worker.shutdown()


def test_unknown_placeholder_metadata_fails_closed(tiny_qwen2_5_vl_dir, disk_extra, monkeypatch, caplog):
    """When the model's placeholder metadata fields cannot be read (its
    multimodal processor does not build), every field used to count as an
    encoder input: a metadata-only item (``image_grid_thw`` only) was "at
    hand", was not verified before a yes, and vLLM would schedule its encoder
    with nothing to encode (the engine stops). It is now not at hand; an item
    with pixels still is. The processor's creation is made to raise (the one
    call that builds it): a real failure the test cannot otherwise cause."""
    from vllm.multimodal import MULTIMODAL_REGISTRY

    from ecstore.connector.features import EncoderInputs

    cfg = vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_consumer", disk_extra)
    metadata_only = vo.feature_template(vo.QWEN2_5_VL, False)[0]  # vLLM's own, built before the failure
    pixels = vo.feature_template(vo.QWEN2_5_VL, True)[0]
    assert EncoderInputs(cfg.model_config).at_hand(metadata_only) is False  # the fields read: the rule

    def fails(*args, **kwargs):
        raise RuntimeError("processor does not build here")

    monkeypatch.setattr(MULTIMODAL_REGISTRY, "create_processor", fails)
    inputs = EncoderInputs(cfg.model_config)
    with caplog.at_level(logging.WARNING, logger="ecstore"):
        assert inputs.at_hand(metadata_only) is False
        assert inputs.at_hand(pixels) is True
    assert inputs.metadata_fields("image") is None
    assert "only known encoder inputs" in caplog.text
