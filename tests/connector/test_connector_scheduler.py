"""ECStoreConnector inside vLLM's real Scheduler (vllm/v1/core/sched/scheduler.py).

The Scheduler is built as EngineCore builds it (real VllmConfig for the tiny
BLIP-2, a minimal KVCacheConfig, StructuredOutputManager) and creates the
SCHEDULER connector itself from ``ec_transfer_config``. Each step the test
plays the model runner: the real WORKER connector loads/saves around a
stand-in encoder (``ECConnectorModelRunnerMixin``'s call order), and the
step's ``ModelRunnerOutput`` goes back through ``update_from_output``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from helpers import vllm_objects as vo
from helpers.connector_store import damage_blob, open_store
from helpers.scheduler_engine import SHAPE, encoder_output
from vllm.v1.engine import FinishReason

from ecstore.connector import ECStoreConnector

pytestmark = pytest.mark.vllm

A, B, C, D = (f"{c}" * 64 for c in "abcd")  # shaped like vLLM content hashes (64 hex digits)


@pytest.fixture(autouse=True)
def _no_outside_config(no_lmcache_env):
    """Only the test's ec_connector_extra_config configures the connector."""


@pytest.fixture
def disk_extra(tmp_path: Path) -> dict:
    return {"local_disk": str(tmp_path / "ec"), "max_local_disk_size": 0.01, "lease_seconds": 600}


def load_specs(out) -> list[tuple]:
    """(request, identifier, rows, width) of each load a step's metadata announces."""
    return [(s.req_id, s.identifier, s.num_embeds, s.width) for s in out.ec_connector_metadata.loads]


def leased(conn: ECStoreConnector, *identifiers: str) -> set[str]:
    with open_store(conn) as st:
        keys = st.disk.leased_keys()
        return {i for i in identifiers if st.key(i).encode() in keys}


def test_present_item_is_loaded_absent_item_is_computed(tiny_model_dir, disk_extra, engines):
    cfg = vo.vllm_config(tiny_model_dir, "ec_both", disk_extra)
    eng = engines(cfg)
    with open_store(eng.connector) as st:  # another process stored A earlier
        st.put(A, encoder_output(A))
        st.flush()

    eng.scheduler.add_request(vo.make_request("r1", [A]))
    eng.scheduler.add_request(vo.make_request("r2", [B]))
    first = eng.step()
    # A: external load, announced to the worker; B: computed by the encoder.
    assert first.scheduled_encoder_inputs == {"r2": [0]}
    assert load_specs(first) == [("r1", A, *SHAPE)]
    assert first.num_scheduled_tokens == {"r1": vo.EMBEDS_PER_IMAGE + 3, "r2": vo.EMBEDS_PER_IMAGE + 3}
    assert torch.equal(eng.encoder_cache[A], encoder_output(A))  # loaded, bit-exact
    assert leased(eng.connector, A, B) == set()  # released once the worker reported the load
    eng.run()
    assert eng.finished == {"r1": FinishReason.LENGTH, "r2": FinishReason.LENGTH}
    assert eng.tokens == {"r1": [7, 7, 7], "r2": [7, 7, 7]}
    tot = eng.totals()  # scheduler + worker counters, via SchedulerStats
    assert (tot["hits"], tot["misses"], tot["loads"], tot["saves"]) == (1, 1, 1, 1)
    assert tot.get("load_failures", 0) == 0

    # B was saved: after a restart (new scheduler, worker, encoder cache) it loads.
    eng.close()
    eng2 = engines(cfg)
    eng2.scheduler.add_request(vo.make_request("r3", [B]))
    out = eng2.step()
    assert out.scheduled_encoder_inputs == {}
    assert load_specs(out) == [("r3", B, *SHAPE)]
    assert torch.equal(eng2.encoder_cache[B], encoder_output(B))
    eng2.run()
    assert eng2.finished == {"r3": FinishReason.LENGTH}


def test_repeat_in_same_process_is_served_by_vllms_own_cache(tiny_model_dir, disk_extra, engines):
    """vLLM asks the connector only after its own encoder cache missed."""
    eng = engines(vo.vllm_config(tiny_model_dir, "ec_both", disk_extra))
    eng.scheduler.add_request(vo.make_request("r1", [A]))
    eng.run()
    eng.scheduler.add_request(vo.make_request("r2", [A]))
    out = eng.step()
    assert out.scheduled_encoder_inputs == {} and out.ec_connector_metadata.loads == []
    eng.run()
    tot = eng.totals()
    assert (tot["misses"], tot.get("hits", 0), tot["saves"]) == (1, 0, 1)


def test_consumer_computes_absent_and_stores_nothing(tiny_model_dir, disk_extra, engines):
    eng = engines(vo.vllm_config(tiny_model_dir, "ec_consumer", disk_extra))
    eng.scheduler.add_request(vo.make_request("r1", [A]))
    out = eng.step()
    assert out.scheduled_encoder_inputs == {"r1": [0]} and out.ec_connector_metadata.loads == []
    eng.run()
    eng.worker.worker_side.store.flush()
    with open_store(eng.connector) as st:
        assert st.stats().disk_entries == 0


def test_an_item_vllm_can_encode_again_is_encoded_when_its_entry_is_corrupt(tiny_model_dir, disk_extra, engines):
    """A corrupt entry of an item vLLM holds inputs for is announced (the
    damage shows only when read) and encoded by the worker in the same
    step: the request never sees a stand-in, and a good copy replaces the
    corrupt one."""
    eng = engines(vo.vllm_config(tiny_model_dir, "ec_both", disk_extra))
    with open_store(eng.connector) as st:
        st.put(A, encoder_output(A))
        st.flush()
    damage_blob(eng.connector, A)
    eng.scheduler.add_request(vo.make_request("r1", [A], max_tokens=5))
    first = eng.step()
    assert load_specs(first) == [("r1", A, *SHAPE)]
    assert torch.equal(eng.encoder_cache[A], encoder_output(A))  # encoded in the step
    eng.run()
    assert eng.finished == {"r1": FinishReason.LENGTH}
    tot = eng.totals()
    assert (tot["load_failures"], tot["recomputed"], tot.get("loads", 0)) == (1, 1, 0)
    eng.worker.worker_side.store.flush()
    with open_store(eng.connector) as st:
        assert torch.equal(st.get(A), encoder_output(A))
    assert leased(eng.connector, A) == set()


def test_a_corrupt_entry_of_an_item_vllm_cannot_encode_fails_its_request_before_any_token(
        tiny_qwen2_5_vl_dir, disk_extra, engines):
    """An item vLLM holds no inputs for (an EPD consumer's metadata-only
    request) whose entry is corrupt: the scheduler verifies such entries
    before it says yes, so the request is failed before it is scheduled,
    instead of running on a zero stand-in (a failed load is reported to
    vLLM only after the step's tokens: a request ending in that step used
    to end normally, on zeros). The corrupt entry is dropped."""
    eng = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_both", disk_extra))
    with open_store(eng.connector) as st:
        st.put(A, encoder_output(A))
        st.flush()
    damage_blob(eng.connector, A)
    eng.scheduler.add_request(vo.make_request("r1", [A], max_tokens=1, inputs=False))
    out = eng.step()
    assert "r1" not in out.num_scheduled_tokens and load_specs(out) == []
    eng.step()
    assert eng.finished == {"r1": FinishReason.ERROR} and not eng.tokens.get("r1")
    with open_store(eng.connector) as st:
        assert not st.contains(A)  # dropped as corrupt
    assert leased(eng.connector, A) == set()
    # A good entry of such an item is loaded (verified once, then remembered).
    with open_store(eng.connector) as st:
        st.put(A, encoder_output(A))
        st.flush()
    for rid in ("r2", "r3"):
        eng.scheduler.add_request(vo.make_request(rid, [A], max_tokens=1, inputs=False))
        eng.run()
        assert eng.finished[rid] == FinishReason.LENGTH
    assert eng.totals()["loads"] >= 1


def test_an_item_vllm_cannot_encode_is_verified_off_the_scheduler_thread_its_request_waiting_a_step(
        tiny_qwen2_5_vl_dir, disk_extra, engines):
    """Verifying an entry before the yes reads the whole blob (8.6 ms at
    34 MB): that ran inside ensure_cache_available / has_cache_item, on
    vLLM's scheduler thread, holding up every request of the step. It runs
    on the scheduler side's verification thread now: the request waits one
    step (vLLM asks again, as for a remote fetch), then its verified entry
    is pinned and loaded; a corrupt one is dropped there and its request
    failed before any token, never loaded."""
    eng = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_both", disk_extra))
    with open_store(eng.connector) as st:
        st.put(A, encoder_output(A))
        st.put(B, encoder_output(B))
        st.flush()
    damage_blob(eng.connector, B)
    side = eng.connector.scheduler_side
    readers: list[int] = []  # the threads that read a blob to verify it
    real_verify = side.store.verify

    def verify(mm_hash: str) -> bool:
        readers.append(threading.get_ident())
        return real_verify(mm_hash)

    side.store.verify = verify
    eng.scheduler.add_request(vo.make_request("r1", [A], max_tokens=1, inputs=False))
    eng.scheduler.add_request(vo.make_request("r2", [B], max_tokens=1, inputs=False))
    out = eng.step()
    assert out.num_scheduled_tokens == {} and load_specs(out) == [] and eng.finished == {}  # both wait
    assert len(readers) == 2 and threading.get_ident() not in readers  # verified off the scheduler thread
    out = eng.step()
    assert load_specs(out) == [("r1", A, *SHAPE)] and "r2" not in out.num_scheduled_tokens
    assert torch.equal(eng.encoder_cache[A], encoder_output(A))
    eng.run()
    assert eng.finished == {"r1": FinishReason.LENGTH, "r2": FinishReason.ERROR} and not eng.tokens.get("r2")
    assert threading.get_ident() not in readers
    with open_store(eng.connector) as st:
        assert st.contains(A) and not st.contains(B)  # the corrupt one dropped
    assert leased(eng.connector, A, B) == set()


def test_with_tensor_parallelism_a_corrupt_entry_is_a_miss_and_encoded_not_a_stand_in(
        tiny_model_dir, disk_extra, engines):
    """With tensor parallelism the worker cannot encode an item whose load
    failed (its ranks would disagree), so it used to put a zero stand-in,
    and a request ending in that step (max_tokens=1: a P/D prefill) ended
    normally on zeros. The scheduler now verifies such entries before its
    yes: a corrupt one is a miss, and vLLM encodes the item on every rank.
    The check runs off the scheduler thread: the request waits one step
    for it. (``_can_recompute`` is what both sides compute for
    tensor_parallel_size > 1; the tiny model runs on one rank here.)"""
    eng = engines(vo.vllm_config(tiny_model_dir, "ec_both", disk_extra))
    eng.connector.scheduler_side._can_recompute = False
    eng.worker.worker_side._can_recompute = False
    with open_store(eng.connector) as st:
        st.put(A, encoder_output(A))
        st.flush()
    damage_blob(eng.connector, A)
    eng.scheduler.add_request(vo.make_request("r1", [A], max_tokens=1))
    out = eng.step()
    assert "r1" not in out.num_scheduled_tokens  # waits while its entry is verified
    out = eng.step()
    assert load_specs(out) == [] and out.scheduled_encoder_inputs == {"r1": [0]}
    assert torch.equal(eng.encoder_cache[A], encoder_output(A))
    eng.run()
    assert eng.finished == {"r1": FinishReason.LENGTH}
    assert eng.totals().get("load_failures", 0) == 0


def test_an_item_vllm_cannot_encode_and_nobody_stored_fails_its_request_not_the_engine(
        tiny_qwen2_5_vl_dir, disk_extra, engines):
    """A metadata-only item the store does not hold (never stored, or
    evicted before the request came): vLLM would schedule it for encoding,
    have nothing to encode and stop the engine ("Encoder cache miss"). The
    request is failed instead, before any token; other requests go on."""
    eng = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_both", disk_extra))
    eng.scheduler.add_request(vo.make_request("r1", [A], max_tokens=2, inputs=False))
    eng.scheduler.add_request(vo.make_request("r2", [B], model=vo.QWEN2_5_VL, max_tokens=2))
    eng.run()
    assert eng.finished == {"r1": FinishReason.ERROR, "r2": FinishReason.LENGTH}


def test_after_vllm_resets_its_encoder_cache_a_lost_item_vllm_cannot_encode_fails_its_request(
        tiny_qwen2_5_vl_dir, disk_extra, engines):
    """The scheduler side trusts vLLM's encoder cache for items it allocated
    and vLLM did not free; vLLM's reset_encoder_cache (weights updated)
    frees without telling. The worker reports the loaded entries gone from
    vLLM's cache, so a later metadata-only request whose entry the store
    lost is failed before any token instead of stopping the engine ("Encoder
    cache miss"). (Within the one step before that report reaches the
    scheduler, the old answer stands: see correctness.md.)"""
    eng = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_both", disk_extra))
    with open_store(eng.connector) as st:
        st.put(A, encoder_output(A))
        st.flush()
    eng.scheduler.add_request(vo.make_request("r0", [A], max_tokens=1, inputs=False))
    eng.run()
    assert eng.finished["r0"] == FinishReason.LENGTH
    eng.scheduler.reset_encoder_cache()  # weights updated: vLLM drops its encoder cache
    eng.encoder_cache.clear()
    with open_store(eng.connector) as st:  # the store lost A meanwhile
        assert st.delete(A)
        st.flush()
    eng.scheduler.add_request(vo.make_request("r1", [B], model=vo.QWEN2_5_VL, max_tokens=1))  # a step: the worker
    # reports
    eng.run()
    eng.scheduler.add_request(vo.make_request("r2", [A], max_tokens=1, inputs=False))
    eng.run()
    assert eng.finished["r2"] == FinishReason.ERROR and not eng.tokens.get("r2")


def test_an_entry_damaged_after_it_was_verified_fails_its_request_and_its_stand_in_is_never_served(
        tiny_qwen2_5_vl_dir, disk_extra, engines):
    """The last resort: an entry the scheduler verified earlier goes bad
    before a load of an item vLLM cannot encode. The worker's zero stand-in
    keeps the step alive and the Scheduler fails the request
    (FinishReason.ERROR). vLLM's encoder cache keeps the stand-in under A;
    a later request for A must fail too rather than be served zeros, until
    vLLM evicts A - then A is looked up afresh."""
    # max_num_batched_tokens=64: vLLM's encoder cache holds a few images
    # (the model's largest item sizes it: 3 of these); as many others push A out.
    cfg = vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_both", dict(disk_extra, local_cpu=False),
                         max_num_batched_tokens=64)
    eng = engines(cfg)
    fits = eng.scheduler.encoder_cache_manager.cache_size // vo.EMBEDS_PER_IMAGE
    assert fits >= 2
    others = [f"{c}" * 64 for c in "cdef"[:fits]]
    with open_store(eng.connector) as st:
        st.put(A, encoder_output(A))
        st.flush()
    eng.scheduler.add_request(vo.make_request("r0", [A], max_tokens=1, inputs=False))
    eng.run()  # loaded: the scheduler verified A
    for i, other in enumerate(others):
        eng.scheduler.add_request(vo.make_request(f"r3.{i}", [other], model=vo.QWEN2_5_VL))
    freed = [h for o in eng.run() for h in o.free_encoder_mm_hashes]
    assert A in freed and A not in eng.encoder_cache
    damage_blob(eng.connector, A)  # after the verification, record unchanged

    eng.scheduler.add_request(vo.make_request("r1", [A], max_tokens=5, inputs=False))
    first = eng.step()
    assert load_specs(first) == [("r1", A, *SHAPE)]
    assert not eng.encoder_cache[A].any()  # the stand-in
    eng.step()
    assert eng.finished["r1"] == FinishReason.ERROR

    eng.scheduler.add_request(vo.make_request("r2", [A], model=vo.QWEN2_5_VL))
    out = eng.step()
    assert "r2" not in out.num_scheduled_tokens  # never runs on the stand-in
    assert eng.finished["r2"] == FinishReason.ERROR

    # Other images push A out of vLLM's encoder cache.
    for i, other in enumerate(others):
        eng.scheduler.add_request(vo.make_request(f"r5.{i}", [other], model=vo.QWEN2_5_VL))
    freed = [h for o in eng.run() for h in o.free_encoder_mm_hashes]
    assert A in freed and A not in eng.encoder_cache

    eng.scheduler.add_request(vo.make_request("r7", [A], model=vo.QWEN2_5_VL))
    out = eng.step()
    assert out.scheduled_encoder_inputs == {"r7": [0]}  # corrupt entry was dropped: computed
    assert torch.equal(eng.encoder_cache[A], encoder_output(A))
    eng.run()
    assert eng.finished["r7"] == FinishReason.LENGTH
    assert eng.totals()["load_failures"] == 1
    eng.worker.worker_side.store.flush()
    with open_store(eng.connector) as st:  # a good copy replaced the corrupt one
        assert torch.equal(st.get(A), encoder_output(A))
    assert leased(eng.connector, A, *others) == set()


def test_a_failed_load_fails_no_request_that_has_read_the_item_already(tiny_qwen2_5_vl_dir, disk_extra, engines):
    """r3 loaded a good copy of A and decodes (A is in its KV cache; vLLM
    no longer needs A for it, and evicts it). Then r6's load of A fails
    (the entry went bad after the scheduler verified it; neither request
    has inputs vLLM could encode): r6 fails, and vLLM's encoder cache holds
    the stand-in under A; r3 must go on. ensure_cache_available failed every
    request with A among its items, so a healthy decoding request was
    failed too."""
    eng = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_both", dict(disk_extra, local_cpu=False),
                                 max_num_batched_tokens=64))
    fits = eng.scheduler.encoder_cache_manager.cache_size // vo.EMBEDS_PER_IMAGE  # images it holds
    with open_store(eng.connector) as st:
        st.put(A, encoder_output(A))
        st.flush()
    eng.scheduler.add_request(vo.make_request("r3", [A], max_tokens=20, inputs=False))  # verified
    assert "r3" not in eng.step().num_scheduled_tokens  # waits a step: A is verified off the scheduler thread
    out = eng.step()
    assert [s.req_id for s in out.ec_connector_metadata.loads] == ["r3"]
    assert torch.equal(eng.encoder_cache[A], encoder_output(A))
    for i, other in enumerate(f"{c}" * 64 for c in "cdef"[:fits]):  # push A out
        eng.scheduler.add_request(vo.make_request(f"r4.{i}", [other], model=vo.QWEN2_5_VL, max_tokens=1))
    freed = [h for _ in range(4) for h in eng.step().free_encoder_mm_hashes]
    assert A in freed and "r3" not in eng.finished
    with open_store(eng.connector) as st:  # A's stored entry goes bad
        key = st.key(A)
        blob = bytearray(st.disk.blob_bytes(key))
        blob[-1] ^= 0xFF
        with st.disk.env.begin(write=True) as txn:
            txn.put(key.encode(), bytes(blob), db=st.disk._dbs.blobs)
    eng.scheduler.add_request(vo.make_request("r6", [A], max_tokens=3, inputs=False))
    out = eng.step()
    assert [s.req_id for s in out.ec_connector_metadata.loads] == ["r6"]
    eng.run()
    assert eng.finished["r6"] == FinishReason.ERROR
    assert eng.finished["r3"] == FinishReason.LENGTH, eng.finished
    assert len(eng.tokens["r3"]) == 20


def test_an_item_vllm_evicts_while_scheduling_its_request_is_served_the_tensor_vllm_kept(
        tiny_qwen2_5_vl_dir, disk_extra, engines):
    """Regression (it stopped the engine): ensure_cache_available passed a
    request's item A, which vLLM cannot encode, because vLLM's encoder cache
    held it; making room for the request's other item D evicted A in the same
    scheduling pass, has_cache_item then missed (A had left the store), and
    vLLM scheduled A to be encoded with no inputs: the model runner raised.
    A is announced as a load instead; vLLM kept the worker's tensor of A (an
    entry it evicts and allocates again in one pass), which the request reads."""
    eng = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_consumer", dict(disk_extra, local_cpu=False),
                                 max_num_batched_tokens=64))
    held = [A, B, C]  # vLLM's encoder cache holds three of these images
    with open_store(eng.connector) as st:
        for h in (*held, D):
            st.put(h, encoder_output(h))
        st.flush()
    for i, h in enumerate(held):  # loaded (verified first), then freeable in vLLM's cache, A the oldest
        eng.scheduler.add_request(vo.make_request(f"r{i}", [h], max_tokens=1, inputs=False))
        eng.run()
    assert list(eng.scheduler.encoder_cache_manager.freeable) == held
    with open_store(eng.connector) as st:  # A leaves the store (another process's eviction, a delete)
        assert st.delete(A)
    eng.scheduler.add_request(vo.make_request("r9", [D, A], max_tokens=3, inputs=False))
    assert "r9" not in eng.step().num_scheduled_tokens  # waits a step: D is verified off the scheduler thread
    out = eng.step()  # room for D evicts A (and B, which is freed)
    assert out.scheduled_encoder_inputs == {}, "vLLM was left to encode an item it holds no inputs for"
    assert sorted((r, i) for r, i, *_ in load_specs(out)) == [("r9", A), ("r9", D)]
    assert out.free_encoder_mm_hashes == [B]
    assert torch.equal(eng.encoder_cache[A], encoder_output(A))
    eng.run()
    assert eng.finished["r9"] == FinishReason.LENGTH
    assert eng.totals().get("load_failures", 0) == 0
    assert leased(eng.connector, A, B, C, D) == set()


def test_a_tensor_vllm_kept_of_another_size_is_not_served_for_an_item_it_evicted_while_scheduling(
        tiny_qwen2_5_vl_dir, disk_extra, engines):
    """Regression (review of the fix above): the identifier A comes back with
    half the rows (a client uuid reused for a smaller image) while vLLM's
    encoder cache holds the earlier A; D evicts A in the scheduling pass. The
    worker served the tensor vLLM kept (the wrong image: its first rows) as a
    good load. It is not served: the stored A does not fit either, so the
    load fails and fails the request, and the engine goes on."""
    eng = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_consumer", dict(disk_extra, local_cpu=False),
                                 max_num_batched_tokens=64))
    held = [A, B, C]
    with open_store(eng.connector) as st:
        for h in (*held, D):
            st.put(h, encoder_output(h))
        st.flush()
    for i, h in enumerate(held):
        eng.scheduler.add_request(vo.make_request(f"r{i}", [h], max_tokens=1, inputs=False))
        eng.run()
    assert list(eng.scheduler.encoder_cache_manager.freeable) == held
    half = SHAPE[0] // 2
    eng.scheduler.add_request(vo.make_request("r9", [D, A], max_tokens=3, inputs=False, rows={A: half}))
    assert "r9" not in eng.step().num_scheduled_tokens  # waits a step: D is verified off the scheduler thread
    out = eng.step()
    assert out.scheduled_encoder_inputs == {}
    assert sorted((r, i, n) for r, i, n, _ in load_specs(out)) == [("r9", A, half), ("r9", D, SHAPE[0])]
    assert not eng.encoder_cache[A].any() and eng.encoder_cache[A].shape[0] == half  # a stand-in, not A's rows
    eng.run()
    assert eng.finished["r9"] == FinishReason.ERROR
    assert eng.totals()["load_failures"] == 1


def test_after_vllm_resets_its_encoder_cache_an_item_it_held_and_the_store_lost_fails_its_request(
        tiny_qwen2_5_vl_dir, disk_extra, engines):
    """After ``reset_encoder_cache`` (weights updated) the scheduler side
    still counts A as held by vLLM (vLLM tells the connector nothing) and
    passes a request that needs A without asking the store; A has left the
    store meanwhile. vLLM asked has_cache_item, the lookup missed and vLLM
    scheduled A to be encoded with no inputs: the engine stopped. Now A's
    load is announced, fails on the worker and fails the request."""
    eng = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_consumer", dict(disk_extra, local_cpu=False)))
    with open_store(eng.connector) as st:
        st.put(A, encoder_output(A))
        st.flush()
    eng.scheduler.add_request(vo.make_request("r0", [A], max_tokens=1, inputs=False))
    eng.run()
    eng.scheduler.reset_encoder_cache()
    eng.encoder_cache.clear()  # as the model runner's reset_encoder_cache
    with open_store(eng.connector) as st:
        assert st.delete(A)
    eng.scheduler.add_request(vo.make_request("r2", [A], max_tokens=3, inputs=False))
    out = eng.step()
    assert out.scheduled_encoder_inputs == {}, "vLLM was left to encode an item it holds no inputs for"
    eng.run()
    assert eng.finished["r2"] == FinishReason.ERROR
    eng.scheduler.add_request(vo.make_request("r3", [A], max_tokens=3, inputs=False))
    eng.run()
    assert eng.finished["r3"] == FinishReason.ERROR  # failed before any token: A is neither held nor stored
    assert "r3" not in eng.tokens or eng.tokens["r3"] == []


def test_a_request_served_a_failed_load_in_the_same_step_fails_with_it(tiny_qwen2_5_vl_dir, disk_extra, engines):
    """Regression: r1 and r2 both need A, which vLLM cannot encode, in the
    same step; r1's load of A fails on the worker (the entry went bad after
    its verification), and vLLM serves r2 the same allocation: the zero
    stand-in. Only r1 was failed; r2 ran to its end on zeros. Every request
    that read the failed load fails with it."""
    eng = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_consumer", dict(disk_extra, local_cpu=False),
                                 max_num_batched_tokens=256))
    with open_store(eng.connector) as st:
        st.put(A, encoder_output(A))
        st.flush()
    for r in ("r1", "r2"):
        eng.scheduler.add_request(vo.make_request(r, [A], max_tokens=4, inputs=False))
    assert not eng.step().num_scheduled_tokens  # both wait a step: A is verified off the scheduler thread
    damage_blob(eng.connector, A)  # after the verification, record unchanged
    out = eng.step()
    assert set(out.num_scheduled_tokens) == {"r1", "r2"} and len(load_specs(out)) == 1
    assert not eng.encoder_cache[A].any()  # the stand-in, read by both
    eng.run()
    assert eng.finished == {"r1": FinishReason.ERROR, "r2": FinishReason.ERROR}
    assert leased(eng.connector, A) == set()


def test_entry_whose_record_is_damaged_past_its_identifier_is_computed_and_not_left_leased(
        tiny_model_dir, disk_extra, engines, caplog):
    """A record whose identifier still reads (so ``pin_if_present`` leases
    the entry and says yes) but whose rest does not: the shape check then
    raised CorruptEntryError, has_cache_item treated that as a miss, and the
    lease stayed until lease_seconds ran out (pinning a corrupt entry against
    eviction). The damaged entry is a miss: dropped, the pin let go, the
    item computed (and saved again)."""
    from ecstore.errors import CorruptEntryError
    eng = engines(vo.vllm_config(tiny_model_dir, "ec_both", disk_extra))
    with open_store(eng.connector) as st:
        st.put(A, encoder_output(A))
        st.flush()
        key = st.key(A).encode()
        assert st.disk is not None
        with st.disk.env.begin(write=True) as txn:
            raw = txn.get(key, db=st.disk._dbs.entries)
            txn.put(key, raw + b"\x00", db=st.disk._dbs.entries)  # identifier intact, length wrong
        assert st.contains(A)
        with pytest.raises(CorruptEntryError):
            st.disk.record(st.key(A))

    eng.scheduler.add_request(vo.make_request("r1", [A]))
    out = eng.step()
    assert out.scheduled_encoder_inputs == {"r1": [0]} and load_specs(out) == []
    assert leased(eng.connector, A) == set(), "the pin on the corrupt entry was kept"
    assert any("corrupt entry" in r.getMessage() and "removed" in r.getMessage() for r in caplog.records)
    eng.run()
    assert eng.finished == {"r1": FinishReason.LENGTH}
    tot = eng.totals()
    assert (tot["misses"], tot.get("hits", 0), tot.get("rejected", 0)) == (1, 0, 0)
    eng.worker.worker_side.store.flush()
    with open_store(eng.connector) as st:  # the damaged entry was replaced by a good copy
        assert torch.equal(st.get(A), encoder_output(A))
