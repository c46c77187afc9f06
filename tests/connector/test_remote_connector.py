"""Two "nodes" sharing a Redis, inside vLLM's real Scheduler.

Engine A and engine B (each a real vLLM Scheduler plus the worker connector,
see tests/connector/test_connector_scheduler.py) have their own ``local_disk`` and the
same ``remote_url``. What A's encoder computed, B loads from the remote
without running its encoder; with the remote down B computes, and nothing
fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import HEALTHY_REMOTE_TIMEOUT_S
from helpers import vllm_objects as vo
from helpers.connector_store import open_store
from helpers.scheduler_engine import SHAPE, encoder_output
from vllm.v1.engine import FinishReason

from ecstore import ECStore, ECStoreConfig
from ecstore.connector import LoadSpec

pytestmark = pytest.mark.vllm

A, B = "a" * 64, "b" * 64  # shaped like vLLM content hashes (sha256 hex)


@pytest.fixture(autouse=True)
def _no_outside_config(no_lmcache_env):
    """Only the test's ec_connector_extra_config configures the connector."""


def node(tmp_path: Path, name: str, url: str) -> dict:
    return {"local_disk": str(tmp_path / name), "max_local_disk_size": 0.01, "remote_url": url,
            "remote_timeout_seconds": HEALTHY_REMOTE_TIMEOUT_S}


def test_node_b_loads_what_node_a_computed(tiny_model_dir, tmp_path, redis_server, engines):
    a = engines(vo.vllm_config(tiny_model_dir, "ec_both", node(tmp_path, "a", redis_server.url)))
    a.scheduler.add_request(vo.make_request("a1", [A]))
    first = a.step()
    assert first.scheduled_encoder_inputs == {"a1": [0]}  # computed on A
    a.run()
    a.worker.worker_side.store.flush()  # A's write-behind reached the remote
    assert a.worker.worker_side.store.stats().remote_puts == 1

    b = engines(vo.vllm_config(tiny_model_dir, "ec_both", node(tmp_path, "b", redis_server.url)))
    b.scheduler.add_request(vo.make_request("b1", [A]))
    out = b.step()
    assert out.scheduled_encoder_inputs == {}  # B never ran its encoder
    assert out.ec_connector_metadata.loads == [LoadSpec("b1", A, *SHAPE, index=0, recomputable=True,
                                                                 modality="image")]  # a remote yes: no record read
    assert torch.equal(b.encoder_cache[A], encoder_output(A))  # bit-exact from A
    b.run()
    assert b.finished == {"b1": FinishReason.LENGTH}
    tot = b.totals()
    assert (tot["hits"], tot["remote_lookup_hits"], tot["remote_hits"], tot["loads"]) == (1, 1, 1, 1)
    assert tot.get("load_failures", 0) == 0
    store = b.worker.worker_side.store
    store.flush()
    assert store.disk.contains(store.key(A), store.stored_name(A))  # promoted to B's LMDB


def test_an_item_node_b_cannot_encode_is_fetched_verified_and_pinned_before_the_yes(
        tiny_qwen2_5_vl_dir, tmp_path, redis_server, engines):
    """A metadata-only request on node B (an EPD consumer: vLLM holds no
    inputs to encode the item) for an entry only the remote holds: a remote
    yes holds no lease, and the remote may lose the value before the
    worker's load (then only a zero stand-in was left). B's scheduler
    fetches and verifies it first, commits it to B's LMDB and pins it there;
    the worker loads the pinned local entry. Without a remote copy the
    request is failed before any token."""
    a = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_both", node(tmp_path, "a", redis_server.url)))
    a.scheduler.add_request(vo.make_request("a1", [A], model=vo.QWEN2_5_VL))
    a.run()
    a.worker.worker_side.store.flush()
    b = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_both", node(tmp_path, "b", redis_server.url)))
    b.scheduler.add_request(vo.make_request("b1", [A], max_tokens=1, inputs=False))
    out = b.step()
    assert "b1" not in out.num_scheduled_tokens  # deferred while A is fetched (off the scheduler thread)
    assert b.connector.scheduler_side._fetches.wait_idle(60)
    out = b.step()
    assert out.ec_connector_metadata.loads == [LoadSpec("b1", A, *SHAPE, index=0, recomputable=False,
                                                                 stored_width=SHAPE[1], modality="image")]
    assert torch.equal(b.encoder_cache[A], encoder_output(A))
    b.run()
    assert b.finished == {"b1": FinishReason.LENGTH}
    store = b.worker.worker_side.store
    assert store.stats().disk_hits == 1 and store.stats().remote_hits == 0  # read the pinned local entry
    b.scheduler.add_request(vo.make_request("b2", [B], max_tokens=1, inputs=False))  # nobody stored B
    b.run()
    assert b.finished["b2"] == FinishReason.ERROR
    assert not b.tokens.get("b2")


def test_remote_down_node_b_computes_and_nothing_fails(tiny_model_dir, tmp_path, redis_server, engines):
    b = engines(vo.vllm_config(tiny_model_dir, "ec_both", node(tmp_path, "b", redis_server.url)))
    redis_server.kill()
    b.scheduler.add_request(vo.make_request("b1", [A]))
    b.scheduler.add_request(vo.make_request("b2", [B]))
    out = b.step()
    assert out.scheduled_encoder_inputs == {"b1": [0], "b2": [0]}  # misses: computed
    b.run()
    assert b.finished == {"b1": FinishReason.LENGTH, "b2": FinishReason.LENGTH}
    tot = b.totals()
    assert tot["remote_errors"] >= 1 and tot.get("load_failures", 0) == 0
    # The local tiers still work: a restart of B loads A from its LMDB.
    b.worker.worker_side.store.flush()
    b.close()
    b2 = engines(vo.vllm_config(tiny_model_dir, "ec_both", node(tmp_path, "b", redis_server.url)))
    b2.scheduler.add_request(vo.make_request("b3", [A]))
    out = b2.step()
    assert out.scheduled_encoder_inputs == {}
    assert torch.equal(b2.encoder_cache[A], encoder_output(A))
    b2.run()
    assert b2.finished == {"b3": FinishReason.LENGTH}


def test_password_of_the_remote_never_reaches_the_logs(tiny_model_dir, tmp_path, engines, caplog):
    from ecstore.testing.redis_server import RedisServer

    secret = "Pw-of-node-B-42"
    server = RedisServer(tmp_path / "redis", password=secret)
    server.workdir.mkdir()
    server.start()
    try:
        b = engines(vo.vllm_config(tiny_model_dir, "ec_both", node(tmp_path, "b", server.url)))
        b.scheduler.add_request(vo.make_request("b1", [A]))
        b.run()
        b.worker.worker_side.store.flush()
        assert b.worker.worker_side.store.stats().remote_puts == 1  # authenticated
        server.kill()
        b.scheduler.add_request(vo.make_request("b2", [B]))
        b.run()  # remote errors get logged, masked
        assert "remote=redis://:***@127.0.0.1" in caplog.text
        assert secret not in caplog.text
    finally:
        server.kill()


def test_a_remote_entry_the_local_store_cannot_take_is_loaded_from_the_remote(
        tiny_qwen2_5_vl_dir, tmp_path, redis_server, engines):
    """Node B's local disk is smaller than A's entry: the fetched, verified
    entry cannot be committed and pinned there. The metadata-only request is
    then served as before the fetch existed (an unpinned remote yes, the
    worker loads from the remote), not failed."""
    a = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_both", node(tmp_path, "a", redis_server.url)))
    a.scheduler.add_request(vo.make_request("a1", [A], model=vo.QWEN2_5_VL))
    a.run()
    a.worker.worker_side.store.flush()
    tiny = dict(node(tmp_path, "b", redis_server.url), max_local_disk_size=0.00001)  # ~10 KiB < A's 16 KiB
    b = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_both", tiny))
    b.scheduler.add_request(vo.make_request("b1", [A], max_tokens=1, inputs=False))
    b.step()
    assert b.connector.scheduler_side._fetches.wait_idle(60)
    b.run()
    assert b.finished == {"b1": FinishReason.LENGTH}
    assert torch.equal(b.encoder_cache[A], encoder_output(A))


def test_the_remote_fetch_never_holds_the_scheduler_while_another_process_writes(
        tiny_qwen2_5_vl_dir, tmp_path, redis_server, qwen_connectors):
    """docs/disaggregation.md: a PD instance never waits for the store's
    write lock. Fetching a remote entry into the local store needs a commit;
    while another process (an encoder instance committing) holds the lock,
    ensure_cache_available defers the request instead of waiting (a fetch
    on the scheduler thread waited until the lock was released)."""
    import subprocess
    import sys
    import threading

    src = node(tmp_path, "src", redis_server.url)
    s_src, _ = qwen_connectors("ec_both", src)
    with open_store(s_src) as st:
        st.put(A, encoder_output(A))
        st.flush()
    pd = node(tmp_path, "pd", redis_server.url)
    sched, _ = qwen_connectors("ec_consumer", pd)
    helper = Path(__file__).parents[1] / "helpers" / "lmdb_lock_holder.py"
    holder = subprocess.Popen([sys.executable, str(helper), pd["local_disk"]],
                              text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    answers: list[bool] = []
    asked = threading.Thread(target=lambda: answers.append(
        sched.ensure_cache_available(vo.make_request("r1", [A], inputs=False), 0)), daemon=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        asked.start()
        asked.join(timeout=60)  # a hang detector: the old code waited for the lock
        assert not asked.is_alive(), "the scheduler waited for another process's write lock"
        assert answers == [False]  # deferred (fetching), not failed
        assert "r1" not in sched.scheduler_side.take_unavailable_requests()
    finally:
        holder.stdin.write("go\n")
        holder.stdin.flush()
        holder.wait(timeout=60)
    assert sched.scheduler_side._fetches.wait_idle(60)
    assert sched.ensure_cache_available(vo.make_request("r1", [A], inputs=False), 0) is True


def _foreign_value_under_a(tmp_path, redis_server, connectors):
    """B stored through a producer, and its (valid) remote value copied under
    A's key: every fetch of A then fails (a value of another identifier,
    kept on the remote on purpose). (producer connector, redis client, A's
    remote key)."""
    import redis

    from ecstore.remote.backend import KEY_PREFIX

    s_src, _ = connectors("ec_both", node(tmp_path, "src", redis_server.url))
    with open_store(s_src) as st:
        st.put(B, encoder_output(B))
        st.flush()
        ka, kb = st.key(A), st.key(B)
    r = redis.Redis.from_url(redis_server.url)
    r.set(KEY_PREFIX + ka, r.get(KEY_PREFIX + kb))
    return s_src, r, KEY_PREFIX + ka


def test_a_fetch_that_fails_fails_its_request_instead_of_deferring_it_forever(
        tiny_qwen2_5_vl_dir, tmp_path, redis_server, qwen_connectors):
    """The remote answers "yes" for A (EXISTS) but its value belongs to
    another identifier (kept there on purpose: a foreign value), so every
    fetch fails. has_cache_item restarted the failed fetch at every step
    and the request was deferred forever, the value downloaded again each
    time; now the request is failed once its fetch failed."""
    _foreign_value_under_a(tmp_path, redis_server, qwen_connectors)
    sched, _ = qwen_connectors("ec_consumer", node(tmp_path, "pd", redis_server.url))
    side = sched.scheduler_side
    answers = []
    for _ in range(3):
        answers.append(sched.ensure_cache_available(vo.make_request("r1", [A], inputs=False), 0))
        assert side._fetches.wait_idle(60)
        side.build_connector_meta(vo.SchedulerOutput.make_empty())
        if "r1" in side.take_unavailable_requests():
            break
    else:
        raise AssertionError(f"never failed, deferred at every step: {answers}")
    # Failed at once (the fetch ended before the lookup's caller looked) or
    # the step after, never later.
    assert len(answers) <= 2


def test_closing_the_fetcher_leaves_no_fetch_running(tmp_path):
    """close() drops the fetches still queued: none stays "running" (a
    request waiting for one would be deferred forever)."""
    import threading

    from ecstore.connector.availability import Fetch, RemoteFetches, VerifiedEntries

    cfg = ECStoreConfig(local_disk=str(tmp_path / "s"), max_local_disk_size=0.01, local_cpu=False)
    with ECStore(cfg, model="m", dtype=torch.float32) as store:
        entered, release = threading.Event(), threading.Event()
        real_get = store.get

        def held_get(identifier, *args, **kwargs):
            if identifier == "x":
                entered.set()
                assert release.wait(60)
            return real_get(identifier, *args, **kwargs)

        store.get = held_get  # type: ignore[method-assign]
        fetches = RemoteFetches(store, VerifiedEntries(store))
        fetches.start("x")
        assert entered.wait(60)
        fetches.start("y")  # queued behind x
        closer = threading.Thread(target=fetches.close)
        closer.start()
        release.set()
        closer.join(60)
        assert not closer.is_alive()
        assert fetches.state("x") == Fetch.FAILED and fetches.state("y") is None
        assert fetches.wait_idle(0)



def test_with_tensor_parallelism_a_failed_fetch_is_tried_again_later(
        tiny_model_dir, tmp_path, redis_server, connectors):
    """With tensor parallelism an item with inputs whose entry only the
    remote holds is fetched into the local store in the background (vLLM
    encodes it meanwhile). A fetch that failed was never tried again (its
    result stuck until 4096 later fetches pushed it out), so that item was
    never served from the remote again; now it is, FETCH_RETRY_S later."""
    from ecstore.connector.availability import FETCH_RETRY_S, Fetch

    s_src, r, a_key = _foreign_value_under_a(tmp_path, redis_server, connectors)
    sched, _ = connectors("ec_consumer", node(tmp_path, "pd", redis_server.url))
    side = sched.scheduler_side
    side._can_recompute = False  # what tensor_parallel_size > 1 gives
    now = [1000.0]
    side._fetches.clock = lambda: now[0]

    def step() -> bool:
        assert sched.ensure_cache_available(vo.make_request("r", [A]), 0)  # inputs: never deferred
        found = sched.has_cache_item(A)
        side.build_connector_meta(vo.SchedulerOutput.make_empty())
        return found

    assert step() is False  # fetch started; vLLM encodes A meanwhile
    assert side._fetches.wait_idle(60) and side._fetches.state(A) == Fetch.FAILED
    assert step() is False and side._fetches.wait_idle(0)  # not fetched again at once
    r.delete(a_key)
    with open_store(s_src) as st:  # a good value of A reaches the remote
        st.put(A, encoder_output(A))
        st.flush()
    now[0] += FETCH_RETRY_S + 1
    assert step() is False  # fetched again
    assert side._fetches.wait_idle(60) and side._fetches.state(A) == Fetch.LOCAL
    assert step() is True  # served from the pinned local copy


def test_a_fetch_that_ends_before_its_request_looks_defers_it_not_fails_it(
        tiny_qwen2_5_vl_dir, tmp_path, redis_server, engines):
    """A fast fetch can bring the entry into the local store before
    ensure_cache_available looks at it: the request must wait for the next
    step (which pins the local copy), not be failed because the fetch is no
    longer "running". Forced here: the fetch is waited for right after it
    starts."""
    a = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_both", node(tmp_path, "a", redis_server.url)))
    a.scheduler.add_request(vo.make_request("a1", [A], model=vo.QWEN2_5_VL))
    a.run()
    a.worker.worker_side.store.flush()
    b = engines(vo.vllm_config(tiny_qwen2_5_vl_dir, "ec_both", node(tmp_path, "b", redis_server.url)))
    fetches = b.connector.scheduler_side._fetches
    real_start = fetches.start

    def start_and_finish(identifier: str) -> None:
        real_start(identifier)
        assert fetches.wait_idle(60)

    fetches.start = start_and_finish
    b.scheduler.add_request(vo.make_request("b1", [A], max_tokens=1, inputs=False))
    b.run()
    assert b.finished == {"b1": FinishReason.LENGTH}
    assert torch.equal(b.encoder_cache[A], encoder_output(A))

