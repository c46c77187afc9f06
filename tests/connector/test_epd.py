"""Encoder disaggregation (E -> PD) on one node, without an engine.

vLLM 0.32 runs an ``ec_producer``-only instance as an encoder-only engine: the
scheduler asks ``has_cache_item`` for every item (a yes means: do not encode
it), the model runner runs the encoder, calls ``save_caches`` per item and
``build_connector_worker_meta`` at the end of the step, then returns an empty
``ModelRunnerOutput`` (``make_empty_encoder_model_runner_output``: the EC
connector output, worker metadata included, is dropped), and the scheduler
finishes each request whose prompt is consumed: its output leaves the engine.

These tests drive vLLM's real Scheduler and the real worker connector in that
order and check what a PD instance on the same store relies on:
* a producer does not re-encode what the store holds, and loads nothing;
* when a request's output leaves the producer, what it saved is committed
  and visible to another process (checked in a child process, and with the
  LMDB write lock held by a third process to tell "committed" from
  "handed to the background writer");
* the producer's worker counters reach vLLM's scheduler stats.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import vllm_objects as vo
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.v1.outputs import make_empty_encoder_model_runner_output

from ecstore import ECStore
from ecstore.connector import ECStoreConnector

pytestmark = pytest.mark.vllm

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
A, B, C = (f"{c}" * 64 for c in "abc")  # shaped like vLLM content hashes (sha256 hex)
SHAPE = (vo.EMBEDS_PER_IMAGE, vo.EMBED_WIDTH)
NBYTES = SHAPE[0] * SHAPE[1] * 4


def encoder_output(identifier: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, identifier)))
    return torch.randn(*SHAPE, generator=g, dtype=torch.float32)


@pytest.fixture(autouse=True)
def _no_outside_config(no_lmcache_env):
    """Only the test's ec_connector_extra_config configures the connector."""


@pytest.fixture
def disk_extra(tmp_path: Path) -> dict:
    return {"local_disk": str(tmp_path / "ec"), "max_local_disk_size": 0.01, "lease_seconds": 600}


class Reader:
    """Another process on the store: a child answering ``contains``."""

    def __init__(self, store_dir: str, model: str, identity) -> None:
        """``identity``: the connector's encoder identity, which its entries are under."""
        self.proc = subprocess.Popen(
            [sys.executable, str(HELPERS / "store_child.py")], cwd=HELPERS, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.ask({"op": "open", "dir": store_dir, "disk_bytes": 0.01 * 2**30, "model": model,
                  "dtype": "float32", "identity": identity.describe()})

    def ask(self, cmd: dict):
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        assert "error" not in answer, answer
        return answer["result"]

    def contains(self, identifier: str) -> bool:
        return self.ask({"op": "contains", "id": identifier})

    def close(self) -> None:
        self.ask({"op": "close"})
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


class EncoderEngine:
    """vLLM's Scheduler plus the worker connector of an encode-only
    ``ec_producer`` instance, stepped the way vLLM 0.32 steps it."""

    def __init__(self, cfg) -> None:
        assert cfg.is_mm_encoder_only  # vLLM resolved ec_producer to encode-only
        self.scheduler = vo.make_scheduler(cfg)
        self.worker = ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.WORKER)
        self.connector = self.scheduler.ec_connector
        assert isinstance(self.connector, ECStoreConnector)
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.encoded: list[str] = []  # identifiers the "encoder" ran for
        self.ec_stats: dict[str, float] = {}

    def _encode(self, identifier: str) -> torch.Tensor:
        self.encoded.append(identifier)
        return encoder_output(identifier)

    def _worker_step(self, out) -> None:
        """GPUModelRunner.execute_model of an encode-only instance: inside
        ECConnectorModelRunnerMixin's context, run the encoder for the
        scheduled inputs (save_caches after each), nothing else."""
        features = {r.req_id: r.mm_features for r in out.scheduled_new_reqs}
        for ident in out.free_encoder_mm_hashes:  # what vLLM's encoder cache evicted
            self.encoder_cache.pop(ident, None)
        w = self.worker
        w.bind_connector_metadata(out.ec_connector_metadata)
        w.start_save_caches(encoder_cache=self.encoder_cache)
        try:
            for req_id, input_ids in out.scheduled_encoder_inputs.items():
                for i in input_ids:
                    ident = features[req_id][i].identifier
                    self.encoder_cache[ident] = self._encode(ident)
                    w.save_caches(encoder_cache=self.encoder_cache, mm_hash=ident)
        finally:
            w.get_finished(out.finished_req_ids)
            w.build_connector_worker_meta()
            w.clear_connector_metadata()

    def step(self) -> list[str]:
        """One step; returns the ids of requests whose output left the engine."""
        out = self.scheduler.schedule()
        self._worker_step(out)
        # The encode-only model runner drops the EC connector output.
        runner_out = make_empty_encoder_model_runner_output(out)
        finished = []
        for eco in self.scheduler.update_from_output(out, runner_out).values():
            finished += [o.request_id for o in eco.outputs if o.finish_reason is not None]
            stats = eco.scheduler_stats
            if stats is not None and stats.ec_connector_stats:
                for k, v in stats.ec_connector_stats.items():
                    self.ec_stats[k] = self.ec_stats.get(k, 0) + v
        return finished

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


@pytest.fixture
def producer(tiny_model_dir, disk_extra):
    eng = EncoderEngine(vo.vllm_config(tiny_model_dir, "ec_producer", disk_extra))
    yield eng
    eng.close()


def seed(conn: ECStoreConnector, entries: dict[str, torch.Tensor]) -> None:
    cfg = replace(conn.config, local_cpu=False)
    with ECStore(cfg, model=conn._vllm_config.model_config.model, dtype=torch.float32,
                 identity=conn.identity) as st:
        for ident, t in entries.items():
            assert st.put(ident, t)


def test_encode_only_producer_skips_stored_items_and_commits_before_output(producer, disk_extra):
    """vLLM's scheduler does not encode an item the store holds (it used to:
    a producer's has_cache_item always said no); what a finished request
    saved is visible to another process as soon as its output leaves; the
    worker's counters reach the scheduler stats although vLLM drops the
    worker metadata of an encode-only instance."""
    seed(producer.connector, {A: encoder_output(A)})
    model = producer.connector._vllm_config.model_config.model
    reader = Reader(disk_extra["local_disk"], model, producer.connector.identity)
    try:
        producer.scheduler.add_request(vo.make_request("r-a", [A]))
        producer.scheduler.add_request(vo.make_request("r-bc", [B, C]))
        finished: list[str] = []
        visible_at_finish: dict[str, bool] = {}
        for _ in range(10):
            if not producer.scheduler.has_requests():
                break
            for req_id in producer.step():
                finished.append(req_id)
                # The proxy forwards the request to PD now: PD must see it all.
                for ident in {"r-a": [A], "r-bc": [B, C]}[req_id]:
                    visible_at_finish[ident] = reader.contains(ident)
        assert sorted(finished) == ["r-a", "r-bc"]
        assert visible_at_finish == {A: True, B: True, C: True}
        assert sorted(producer.encoded) == [B, C]  # A came from the store: not encoded
        assert producer.encoder_cache.keys() == {B, C}  # and nothing loaded
        s = producer.ec_stats
        assert (s.get("hits"), s.get("misses"), s.get("saves"), s.get("bytes_saved")) == (1, 2, 2, 2 * NBYTES)
        assert s.get("loads", 0) == 0 and s.get("save_skipped", 0) == 0
        assert s["save_seconds"] > 0 and s["commit_seconds"] > 0
    finally:
        reader.close()


def test_step_end_waits_for_the_commit(tiny_model_dir, disk_extra):
    """The end of an encode-only producer's step (build_connector_worker_meta,
    before its output leaves the model runner) returns only once the step's
    saves are committed. Another process holds LMDB's write lock meanwhile:
    the step end must wait for it (it used to return at once, the entry still
    queued in the background writer and invisible to other processes)."""
    cfg = vo.vllm_config(tiny_model_dir, "ec_producer", disk_extra)
    sched = ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.SCHEDULER)
    worker = ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.WORKER)
    reader = Reader(disk_extra["local_disk"], cfg.model_config.model, sched.identity)
    holder = subprocess.Popen([sys.executable, str(HELPERS / "lmdb_lock_holder.py"), disk_extra["local_disk"]],
                              text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    told = False  # the holder was told to release (it exits then: its stdin may be gone)
    try:
        assert holder.stdout.readline().strip() == "locked"
        worker.bind_connector_metadata(sched.build_connector_meta(vo.SchedulerOutput.make_empty()))
        cache = {A: encoder_output(A)}
        worker.save_caches(cache, A)
        ended = threading.Event()
        step_end = threading.Thread(target=lambda: (worker.build_connector_worker_meta(), ended.set()))
        step_end.start()
        # Either the step end is (correctly) still waiting while the lock is
        # held, or it returned: then the entry must already be visible.
        returned_while_locked = ended.wait(timeout=3)
        if returned_while_locked:
            assert reader.contains(A), "step ended with its save not committed"
        holder.stdin.write("go\n")
        holder.stdin.flush()
        told = True
        assert holder.stdout.readline().strip() == "released"
        step_end.join(timeout=120)
        assert ended.is_set()
        assert reader.contains(A)
        worker.clear_connector_metadata()
    finally:
        if not told and holder.poll() is None:  # (a holder told already may be exiting: a write would break)
            holder.stdin.write("go\n")
            holder.stdin.flush()
        holder.wait(timeout=60)
        reader.close()
        sched.shutdown()
        worker.shutdown()


def test_consumer_never_waits_for_a_writer(tiny_model_dir, disk_extra):
    """A PD instance (ec_consumer) looks up, pins and loads without the
    store's write lock: while another process (an encoder instance
    committing, say) holds it, the consumer's whole step completes."""
    cfg = vo.vllm_config(tiny_model_dir, "ec_consumer", disk_extra)
    sched = ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.SCHEDULER)
    worker = ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.WORKER)
    seed(sched, {A: encoder_output(A)})
    holder = subprocess.Popen([sys.executable, str(HELPERS / "lmdb_lock_holder.py"), disk_extra["local_disk"]],
                              text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    cache: dict[str, torch.Tensor] = {}
    answers: dict[str, bool] = {}

    def pd_step() -> None:
        answers["A"], answers["B"] = sched.has_cache_item(A), sched.has_cache_item(B)
        req = vo.make_request("r1", [A, B])
        sched.update_state_after_alloc(req, 0)
        sched.update_state_after_alloc(req, 1)
        worker.bind_connector_metadata(sched.build_connector_meta(vo.SchedulerOutput.make_empty()))
        worker.start_load_caches(cache)
        cache[B] = encoder_output(B)  # computed; a consumer saves nothing
        worker.save_caches(cache, B)
        worker.build_connector_worker_meta()
        worker.clear_connector_metadata()

    try:
        assert holder.stdout.readline().strip() == "locked"
        step = threading.Thread(target=pd_step, daemon=True)
        step.start()
        step.join(timeout=300)  # a hang guard: the step needs milliseconds
        assert not step.is_alive(), "the consumer's step waited for the write lock"
        assert answers == {"A": True, "B": False}
        assert torch.equal(cache[A], encoder_output(A))
    finally:
        holder.stdin.write("go\n")
        holder.stdin.flush()
        holder.wait(timeout=60)
        sched.shutdown()
        worker.shutdown()


def test_item_served_from_vllms_own_cache_is_published_again(producer, disk_extra):
    """An encode-only producer serves a repeat from vLLM's own encoder cache
    without asking the connector or saving (save_caches never fires for it).
    If the store lost the entry meanwhile (evicted by another process), the
    worker stores it again from that cache in start_save_caches (vLLM passes
    the encoder cache for this), so it is visible when the request's output
    leaves. (It used to stay absent: the PD instance then encoded it.)"""
    model = producer.connector._vllm_config.model_config.model
    reader = Reader(disk_extra["local_disk"], model, producer.connector.identity)
    try:
        producer.scheduler.add_request(vo.make_request("r1", [A]))
        assert producer.step() == ["r1"] and reader.contains(A)
        cfg = replace(producer.connector.config, local_cpu=False)
        with ECStore(cfg, model=model, dtype=torch.float32,
                     identity=producer.connector.identity) as st:  # "evicted" by another process
            assert st.delete(A)
        assert not reader.contains(A)
        producer.scheduler.add_request(vo.make_request("r2", [A]))
        assert producer.step() == ["r2"]
        assert producer.encoded == [A]  # encoded once: r2 was served from vLLM's cache
        assert reader.contains(A)  # ...and stored again before r2's output left
        with ECStore(cfg, model=model, dtype=torch.float32, readonly=True,
                     identity=producer.connector.identity) as st:
            assert torch.equal(st.get(A), encoder_output(A))
        assert producer.ec_stats.get("saves") == 2 and producer.ec_stats.get("save_skipped", 0) == 0
        # A third request for A finds it stored: nothing is written again.
        producer.scheduler.add_request(vo.make_request("r3", [A]))
        assert producer.step() == ["r3"]
        assert producer.ec_stats.get("saves") == 2 and producer.encoded == [A]
    finally:
        reader.close()


def test_item_computed_again_after_another_process_evicted_it_is_stored_again(tiny_model_dir, disk_extra):
    """The producer's scheduler answers from the shared file, so once
    another process evicted an entry vLLM encodes it again and save_caches
    fires; the worker's memory tier still held it, put() answered "already
    held", and the entry stayed absent from the file when the step's output
    left the engine (every consumer then missed it). It is stored again,
    and the step end waits for that commit."""
    cfg = vo.vllm_config(tiny_model_dir, "ec_producer", disk_extra)
    sched = ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.SCHEDULER)
    worker = ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.WORKER)
    model = cfg.model_config.model
    reader = Reader(disk_extra["local_disk"], model, sched.identity)

    def step() -> None:  # one producer step that computed A
        worker.bind_connector_metadata(sched.build_connector_meta(vo.SchedulerOutput.make_empty()))
        worker.save_caches({A: encoder_output(A)}, A)
        worker.build_connector_worker_meta()
        worker.clear_connector_metadata()

    try:
        step()
        assert reader.contains(A)
        with ECStore(replace(sched.config, local_cpu=False), model=model, dtype=torch.float32,
                     identity=sched.identity) as st:  # evicted by another process sharing the file
            assert st.delete(A)
        assert not sched.has_cache_item(A)  # so vLLM encodes A again
        step()
        assert reader.contains(A), "computed again, but not stored again"
        with ECStore(replace(sched.config, local_cpu=False), model=model, dtype=torch.float32,
                     identity=sched.identity, readonly=True) as st:
            assert torch.equal(st.get(A), encoder_output(A))
    finally:
        reader.close()
        sched.shutdown()
        worker.shutdown()


def test_bench_epd_runs(tmp_path):
    """tools/bench_epd.py (the cost of the visibility commit) keeps working:
    a small run produces a row per size and batch with every number. No
    timing is asserted."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(HELPERS.parents[1] / "tools" / "bench_epd.py"),
                           "--sizes", "0.05,0.2", "--reps", "2", "--batch", "3", "--encoder-ms", "10,20",
                           "--dir", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [(r["batch"], round(r["mb"], 2)) for r in rows] == [(1, 0.05), (3, 0.05), (1, 0.2), (3, 0.2)]
    for r in rows:
        assert r["reps"] == 2 and r["commit_ms"] >= 0 and r["visible_ms"] >= r["commit_ms"]
        assert r["commit_to_encoder"] >= 0
    assert list(tmp_path.glob("bench-epd-*")) == []  # its store is removed
    assert "commit/encoder" in proc.stdout


def test_shared_counters_leave_no_file(tmp_path):
    """The worker->scheduler counter record of an encode-only producer: the
    second of its two users removes the file name at once (both keep their
    mapping), so nothing is left behind even if the engine is killed; the
    reader gets each counter's growth once."""
    from ecstore.connector.shared_stats import SharedCounters

    path = tmp_path / "ecstore-stats-x-dp0.bin"
    reader = SharedCounters(str(path))  # the scheduler side, at engine start
    assert path.exists()
    writer = SharedCounters(str(path))  # worker rank 0, at its first step
    assert not path.exists()
    writer.add({"saves": 2, "bytes_saved": 100, "commit_seconds": 0.5, "unknown": 7})
    assert reader.take_delta() == {"saves": 2, "bytes_saved": 100, "commit_seconds": 0.5}
    assert reader.take_delta() == {}
    writer.add({"saves": 1})
    assert reader.take_delta() == {"saves": 1}
    again = SharedCounters(str(path))  # a later engine under the same name: a fresh record
    assert path.exists() and again.take_delta() == {}
    reader.close(remove=True)  # not its file any more: left alone
    assert path.exists()
    again.close(remove=True)
    assert not path.exists()
    writer.close()


def test_encode_only_producer_reports_its_remote_writes(tiny_model_dir, disk_extra, redis_server):
    """The remote counters of an encode-only producer reach its stats like the
    others (through the shared record: vLLM drops its worker metadata). They
    used to be added after the step's counters were published, and lost."""
    eng = EncoderEngine(vo.vllm_config(tiny_model_dir, "ec_producer",
                                       {**disk_extra, "remote_url": redis_server.url}))
    try:
        eng.scheduler.add_request(vo.make_request("r1", [A]))
        assert eng.step() == ["r1"]  # the step end waited for the remote write too
        eng.step()  # the next stats interval collects the record
        assert eng.ec_stats.get("saves") == 1
        assert eng.ec_stats.get("remote_bytes_written", 0) > 0
    finally:
        eng.close()


def _pair(model_dir, role: str, extra: dict, **overrides) -> tuple[ECStoreConnector, ECStoreConnector]:
    cfg = vo.vllm_config(model_dir, role, extra, **overrides)
    return (ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.SCHEDULER),
            ECConnectorFactory.create_connector(config=cfg, role=ECConnectorRole.WORKER))


def test_instances_configured_differently_share_rounding_only_settings_and_tell_why_not_the_rest(
        tiny_qwen2_5_vl_dir, disk_extra, caplog):
    """EPD between instances started with other settings, on one store. An
    encoder instance with --mm-encoder-tp-mode data (rounding only) shares
    with its PD instance. One with another server-level processor setting
    (do_normalize=false: another encoder input, so another output) does not:
    the consumer's miss then says once which settings differ, from the two
    identities the store's namespaces table holds. (Qwen2.5-VL: its encoder
    runs data-parallel; BLIP-2's falls back to weights.)"""
    prod, prod_w = _pair(tiny_qwen2_5_vl_dir, "ec_producer", disk_extra, mm_encoder_tp_mode="data")
    other, other_w = _pair(tiny_qwen2_5_vl_dir, "ec_producer", disk_extra, mm_processor_kwargs={"do_normalize": False})
    cons, cons_w = _pair(tiny_qwen2_5_vl_dir, "ec_consumer", disk_extra)
    try:
        assert prod._vllm_config.model_config.multimodal_config.mm_encoder_tp_mode == "data"
        assert prod.identity.namespace == cons.identity.namespace != other.identity.namespace
        seed(prod, {A: encoder_output(A)})
        seed(other, {B: encoder_output(B)})
        caplog.clear()
        assert cons.has_cache_item(A) is True  # rounding-only difference: shared
        assert cons.has_cache_item(B) is False  # stored under the other identity only
        assert cons.has_cache_item(B) is False
        assert cons.has_cache_item(C) is False  # nobody stored C: nothing to tell
        told = [r.getMessage() for r in caplog.records if "another encoder identity" in r.getMessage()]
        assert len(told) == 1, told  # once
        assert B in told[0] and other.identity.namespace[:12] in told[0]
        assert ("settings.model_config.multimodal_config.mm_processor_kwargs: None here, "
                "{'do_normalize': False} there") in told[0]
        assert "tp_mode" not in told[0]
    finally:
        for conn in (prod, prod_w, other, other_w, cons, cons_w):  # every handle closed
            conn.shutdown()
