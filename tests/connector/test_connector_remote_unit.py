"""ECStoreConnector with a remote tier, one connector call at a time.

Like tests/connector/test_connector_unit.py (real ``VllmConfig``, connectors made by
vLLM's ``ECConnectorFactory``, real ``Request``/``SchedulerOutput`` objects,
real stores on temporary directories), with a real redis-server on 127.0.0.1
(``redis_server`` fixture) as the remote tier. Another "node" (its own
``local_disk``, same Redis) seeds the remote.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import HEALTHY_REMOTE_TIMEOUT_S
from helpers import vllm_objects as vo
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput

from ecstore import ECStore
from ecstore.connector import ECStoreConnector, ECStoreConnectorMetadata, ECStoreWorkerMetadata
from ecstore.testing.redis_server import RedisServer

pytestmark = pytest.mark.vllm

A = "a1" * 32  # shaped like a vLLM content hash (64 hex digits)
SHAPE = (vo.EMBEDS_PER_IMAGE, vo.EMBED_WIDTH)


def embedding(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*SHAPE, generator=g, dtype=torch.float32)


@pytest.fixture(autouse=True)
def _no_outside_config(no_lmcache_env):
    """Only the test's ec_connector_extra_config configures the connector."""


def other_node(conn: ECStoreConnector, tmp_path: Path) -> ECStore:
    """A store of another node: same identity and Redis, its own local disk."""
    cfg = replace(conn.config, local_cpu=False, local_disk=str(tmp_path / "other-node"))
    return ECStore(cfg, model=conn._vllm_config.model_config.model, dtype=torch.float32,
                   identity=conn.identity)


def own_store(conn: ECStoreConnector) -> ECStore:
    """This node's store, without the remote tier (reads the lease file)."""
    cfg = replace(conn.config, local_cpu=False, remote_url=None)
    return ECStore(cfg, model=conn._vllm_config.model_config.model, dtype=torch.float32,
                   identity=conn.identity)


def leases_on(conn: ECStoreConnector, identifier: str) -> int:
    """How many live leases the lease file holds on ``identifier``'s entry."""
    with own_store(conn) as st:
        leases = st.disk._leases
        assert leases is not None
        with leases.env.begin() as txn:
            raw = txn.get(st.disk._k(st.key(identifier)))
    return 0 if raw is None else len(raw) // 12


def worker_step(worker: ECStoreConnector, meta: ECStoreConnectorMetadata, cache: dict) -> ECStoreWorkerMetadata:
    worker.bind_connector_metadata(meta)
    worker.start_load_caches(cache)
    wm = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    assert isinstance(wm, ECStoreWorkerMetadata)
    return wm


def test_remote_yes_releases_no_lease_it_never_took(connectors, tmp_path: Path,
                                                    redis_server: RedisServer) -> None:
    """A remote "yes" is not pinned, so reporting its load must release
    nothing: with async scheduling r2 may pin the entry (promoted to the
    local disk by r1's load) before r1's load is reported, and dropping "one
    lease of this process" on r1's report dropped r2's pin, leaving r2's
    pending load open to eviction by any process."""
    sched, worker = connectors("ec_both", {"local_disk": str(tmp_path / "ec"), "max_local_disk_size": 0.01,
                                           "lease_seconds": 600, "remote_url": redis_server.url,
                                           "remote_timeout_seconds": HEALTHY_REMOTE_TIMEOUT_S})
    with other_node(sched, tmp_path) as node:
        assert node.put(A, embedding(1))
        node.wait_committed()
    r1, r2 = vo.make_request("r1", [A]), vo.make_request("r2", [A])

    assert sched.has_cache_item(A)  # the remote holds it; nothing local to pin
    sched.update_state_after_alloc(r1, 0)
    meta1 = sched.build_connector_meta(SchedulerOutput.make_empty())
    cache: dict[str, torch.Tensor] = {}
    wm1 = worker_step(worker, meta1, cache)  # fetched from the remote, promoted to the local disk
    assert wm1.loaded == [("r1", A)] and torch.equal(cache[A], embedding(1))
    worker.worker_side.store.flush()

    # Step 2 was scheduled before step 1's report arrived (async scheduling).
    assert sched.has_cache_item(A)  # now local: pinned for r2
    sched.update_state_after_alloc(r2, 0)
    meta2 = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert [s.req_id for s in meta2.loads] == ["r2"]
    assert leases_on(sched, A) == 1

    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm1))
    assert leases_on(sched, A) == 1  # r2's pin survives r1's report
    wm2 = worker_step(worker, meta2, {})
    assert wm2.loaded == [("r2", A)]
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wm2))
    assert leases_on(sched, A) == 0


def test_unallocated_remote_yes_releases_no_lease(connectors, tmp_path: Path, redis_server: RedisServer) -> None:
    """A remote "yes" that vLLM did not allocate (no KV space this step) is
    let go at the step's end: that must not drop a pin some other pending
    load of the same entry holds."""
    sched, worker = connectors("ec_both", {"local_disk": str(tmp_path / "ec"), "max_local_disk_size": 0.01,
                                           "lease_seconds": 600, "remote_url": redis_server.url,
                                           "remote_timeout_seconds": HEALTHY_REMOTE_TIMEOUT_S})
    with other_node(sched, tmp_path) as node:
        assert node.put(A, embedding(1))
        node.wait_committed()
    assert sched.has_cache_item(A)  # remote: not pinned; r0 is then not allocated
    # Meanwhile the entry became local (promoted by an earlier load) and a
    # pending load holds a lease on it (taken the way has_cache_item pins).
    assert worker.worker_side.store.get(A) is not None
    worker.worker_side.store.flush()
    assert sched.scheduler_side.store.pin_if_present(A)
    assert leases_on(sched, A) == 1
    sched.build_connector_meta(SchedulerOutput.make_empty())
    assert leases_on(sched, A) == 1


def test_overlong_client_uuid_with_a_remote_is_a_miss(connectors, tmp_path: Path,
                                                      redis_server: RedisServer) -> None:
    """With share_client_uuids a client names items by any string; one that
    is no valid identifier (e.g. longer than 4096 bytes) is a miss, not an
    exception out of has_cache_item into vLLM's scheduler (the remote lookup
    built its key outside the guarded local lookup)."""
    uuid = "u" * 5000
    for extra in ({"local_disk": str(tmp_path / "ec"), "max_local_disk_size": 0.01},
                  {"local_cpu": True, "max_local_cpu_size": 0.01}):
        sched, _ = connectors("ec_both", {**extra, "share_client_uuids": True, "remote_url": redis_server.url,
                                              "remote_timeout_seconds": HEALTHY_REMOTE_TIMEOUT_S})
        assert sched.has_cache_item(uuid) is False
