"""ECStoreConnector under vLLM's Model Runner V2 (the GPU default), on the CPU.

V2 (``vllm/v1/worker/gpu/``) does not start on the CPU build (it requires
Triton), so its EC path is driven at the connector level: vLLM's real
Scheduler (as it runs for V2) and the worker connector inside V2's own
``ActiveECConnector``, ``EncoderCache`` and ``EncoderRunner``
(tests/helpers/v2_runner.py), the encoder replaced by given tensors. What
differs from the V1 mixin and what each test pins is listed in
docs/vllm.md ("Model Runner V2").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import vllm_objects as vo
from helpers.connector_store import damage_blob, open_store
from helpers.scheduler_engine import encoder_output
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import FinishReason

pytestmark = pytest.mark.vllm

A, B, C, D = (f"{c}" * 64 for c in "abcd")  # shaped like vLLM content hashes (64 hex digits)

#: vLLM 0.33's scheduler sends request-local payload updates to V2 workers.
HAS_INPUT_UPDATES = "encoder_input_updates" in SchedulerOutput.__dataclass_fields__


@pytest.fixture(autouse=True)
def _no_outside_config(no_lmcache_env):
    """Only the test's ec_connector_extra_config configures the connector."""


@pytest.fixture
def disk_extra(tmp_path: Path) -> dict:
    return {"local_disk": str(tmp_path / "ec"), "max_local_disk_size": 0.01, "lease_seconds": 600}


def store_entry(conn, identifier: str) -> None:
    with open_store(conn) as st:  # another process stored it earlier
        st.put(identifier, encoder_output(identifier))
        st.flush()


def test_v2_loads_present_items_and_saves_computed_ones_by_key_difference(tiny_model_dir, disk_extra, engines):
    """A stored item is loaded and reaches the language model (V2's gather);
    an absent one is encoded and saved by V2's own save (every key new in
    the encoder cache after the step); the loaded one is not saved again;
    after a restart the saved one loads."""
    cfg = vo.vllm_config(tiny_model_dir, "ec_both", disk_extra)
    eng = engines(cfg, runner="v2")
    store_entry(eng.connector, A)
    eng.scheduler.add_request(vo.make_request("r1", [A]))
    eng.scheduler.add_request(vo.make_request("r2", [B]))
    first = eng.step()
    assert first.scheduled_encoder_inputs == {"r2": [0]}
    assert [s.identifier for s in first.ec_connector_metadata.loads] == [A]
    got = eng.v2.gathered
    assert torch.equal(got["r1"][0], encoder_output(A)) and torch.equal(got["r2"][0], encoder_output(B))
    eng.run()
    assert eng.finished == {"r1": FinishReason.LENGTH, "r2": FinishReason.LENGTH}
    tot = eng.totals()
    assert (tot["hits"], tot["misses"], tot["loads"], tot["saves"]) == (1, 1, 1, 1)
    assert tot.get("save_skipped", 0) == 0  # the loaded A was not offered for saving
    eng.close()

    eng2 = engines(cfg, runner="v2")
    eng2.scheduler.add_request(vo.make_request("r3", [B]))
    out = eng2.step()
    assert out.scheduled_encoder_inputs == {} and [s.identifier for s in out.ec_connector_metadata.loads] == [B]
    assert torch.equal(eng2.v2.gathered["r3"][0], encoder_output(B))
    eng2.run()
    assert eng2.finished == {"r3": FinishReason.LENGTH}


def test_v2_encodes_an_item_whose_load_failed_in_the_same_step(tiny_model_dir, disk_extra, engines):
    """The worker adds an item whose entry is corrupt to the step's
    ``scheduled_encoder_inputs``; V2 reads that dict (the same object) after
    the connector's load, its ``prepare_mm_inputs`` picks the item (payload
    present, not in the encoder cache) and the gather finds it: no "Encoder
    cache miss", the request reads the computed tensor, and V2's key
    difference saves the good copy over the corrupt one."""
    eng = engines(vo.vllm_config(tiny_model_dir, "ec_both", disk_extra), runner="v2")
    store_entry(eng.connector, A)
    damage_blob(eng.connector, A)
    eng.scheduler.add_request(vo.make_request("r1", [A], max_tokens=4))
    first = eng.step()
    assert [s.identifier for s in first.ec_connector_metadata.loads] == [A]
    assert first.scheduled_encoder_inputs == {"r1": [0]}  # added by the worker
    assert torch.equal(eng.v2.gathered["r1"][0], encoder_output(A))
    eng.run()
    assert eng.finished == {"r1": FinishReason.LENGTH}
    tot = eng.totals()
    assert (tot["load_failures"], tot["recomputed"], tot.get("loads", 0), tot["saves"]) == (1, 1, 0, 1)
    eng.worker.worker_side.store.flush()
    with open_store(eng.connector) as st:
        assert torch.equal(st.get(A), encoder_output(A))


def test_v2_an_item_it_cannot_encode_with_a_corrupt_entry_fails_its_request_not_the_engine(
        tiny_qwen2_5_vl_dir, disk_extra, engines):
    """A metadata-only item (no payload: V2's prepare_mm_inputs skips it)
    whose entry is corrupt: failed before any token, the engine goes on.
    (Qwen2.5-VL: BLIP-2 has no metadata-only form.)"""
    eng = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_both", disk_extra), runner="v2")
    store_entry(eng.connector, A)
    damage_blob(eng.connector, A)
    eng.scheduler.add_request(vo.make_request("r1", [A], max_tokens=1, inputs=False))
    eng.scheduler.add_request(vo.make_request("r2", [B], model=vo.QWEN2_5_VL, max_tokens=2))
    eng.run()
    assert eng.finished == {"r1": FinishReason.ERROR, "r2": FinishReason.LENGTH}
    assert not eng.tokens.get("r1")


def test_v2_encode_only_producer_commits_before_output_and_counts_once(tiny_model_dir, disk_extra, engines):
    """V2's encoder-only runner (what an ``ec_producer`` runs) saves by key
    difference and, unlike V1's, hands the EC connector output (worker
    metadata included) back to the scheduler: the producer's counters must
    not be counted twice (they also travel through the shared record), and
    what a request saved is committed when its output leaves."""
    cfg = vo.vllm_config(tiny_model_dir, "ec_producer", disk_extra)
    assert cfg.is_mm_encoder_only
    eng = engines(cfg, runner="v2")
    store_entry(eng.connector, A)
    eng.scheduler.add_request(vo.make_request("r-a", [A]))
    eng.scheduler.add_request(vo.make_request("r-bc", [B, C]))
    eng.run()
    assert set(eng.finished) == {"r-a", "r-bc"}
    assert eng.encoder_cache.keys() == {B, C}  # A came from the store: neither encoded nor loaded
    with open_store(eng.connector) as st:  # committed, without the writer's flush
        assert st.contains(B) and st.contains(C)
    tot = eng.totals()
    assert (tot["hits"], tot["misses"], tot["saves"]) == (1, 2, 2)
    assert tot.get("loads", 0) == 0


@pytest.mark.skipif(not HAS_INPUT_UPDATES, reason="vLLM 0.33's encoder_input_updates: run by tools/vllm033.sh")
def test_v2_033_a_released_payload_is_restored_before_a_load_that_may_need_it(tiny_model_dir, disk_extra, engines):
    """vLLM 0.33's scheduler releases a V2 worker's payload of an item once
    its placeholder is computed (``encoder_input_updates``: None), and
    restores one only for items it schedules for encoding. A running request
    that rewinds (here: KV blocks reported invalid, recomputed) and whose
    item was evicted from vLLM's encoder cache meanwhile is announced a load
    of it; when that load fails the worker schedules the item for encoding,
    but V2 finds no payload, skips it and stops the engine ("Encoder cache
    miss"). The scheduler side now restores the payload with such a load."""
    cfg = vo.vllm_config(tiny_model_dir, "ec_both", dict(disk_extra, local_cpu=False), max_num_batched_tokens=64)
    eng = engines(cfg, runner="v2")
    store_entry(eng.connector, A)
    eng.scheduler.add_request(vo.make_request("r1", [A], max_tokens=12))
    eng.step()
    eng.step()  # r1 decodes: its payload of A is released
    assert eng.v2.encoder_cache.mm_features["r1"][0].data is None
    eng.scheduler.add_request(vo.make_request("r2", [C], max_tokens=1))
    eng.scheduler.add_request(vo.make_request("r3", [D], max_tokens=1))
    freed = [h for _ in range(3) for h in eng.step().free_encoder_mm_hashes]
    assert A in freed and A not in eng.encoder_cache and "r1" not in eng.finished
    damage_blob(eng.connector, A)
    from vllm.v1.outputs import KVConnectorOutput

    block = eng.scheduler.kv_cache_manager.get_block_ids("r1")[0][0]
    eng.kv_output = KVConnectorOutput(invalid_block_ids={block})  # r1's first block failed to load
    eng.step()
    out = eng.step()  # r1 recomputes from token 0: A is loaded, fails, is encoded
    assert [s.identifier for s in out.ec_connector_metadata.loads] == [A]
    assert torch.equal(eng.v2.gathered["r1"][0], encoder_output(A))
    eng.run()
    assert eng.finished["r1"] == FinishReason.LENGTH
    assert eng.totals()["recomputed"] == 1
