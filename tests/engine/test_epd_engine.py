"""E -> PD on one node with real engines: encode-only ``ec_producer`` and
``ec_consumer`` instances of the tiny BLIP-2 in separate processes sharing
one ``local_disk`` (tests/helpers/epd_engine.py), driven the way vLLM's
disaggregated-encoder proxy drives them: each request goes to a producer,
and the moment its answer is back, to a consumer.

What must hold: a consumer never runs the vision tower for an item a producer
finished (its ``embed_multimodal`` is counted), the embeddings that reach its
language model are bit-identical to a single instance without a connector
(``embed_input_ids`` is wrapped), a producer does not encode what the store
already holds, and the producers' saves show in vLLM's stats lines. Then two
producers and two consumers at once on the same store.

Five engine starts in all, one after the other: the baseline, P1, C1, then P2, C2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers.engine_proc import EngineProcess

from ecstore import ECStore, ECStoreConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "epd_engine.py"
SEEDS = list(range(7))


class Engine(EngineProcess):
    """One engine process (tests/helpers/epd_engine.py)."""

    def __init__(self, model_dir: Path, log: Path, role: str | None = None, extra: dict | None = None):
        cmd = [sys.executable, str(HELPER), "--model", str(model_dir)]
        if role:
            cmd += ["--role", role, "--extra", json.dumps(extra or {})]
        super().__init__(cmd, log)

    def send_images(self, images: list[int]) -> None:
        self.write({"op": "generate", "images": images})

    def answer(self) -> dict:
        res = self.read()
        res["m"] = {k: v for k, v in res.pop("metrics").items()}
        return res

    def generate(self, images: list[int]) -> dict:
        self.send_images(images)
        return self.answer()

    def close(self) -> None:
        super().close()
        assert "Traceback" not in self.log.read_text(), self.log.read_text()[-6000:]


def m(res: dict, key: str) -> float:
    return res["m"].get(key, 0)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("epd")


@pytest.fixture(scope="module")
def extra(work: Path) -> dict:
    # Every encoder output in a blob file of its own (min_file_blob_size 0):
    # producers write files, consumers in other processes read them (the
    # connector and identity engine tests cover blobs inside LMDB).
    return {"local_disk": str(work / "ec"), "max_local_disk_size": 0.01, "min_file_blob_size": 0}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, work, extra):
    """{name: Engine}: the baseline's results first, then P1/C1 (P2/C2 are
    added by the second test)."""
    engines: dict[str, Engine] = {}
    try:
        # One start at a time: engines starting at once can pick the same
        # free port for their distributed init.
        for name, log, role in (("base", "base.log", None), ("P1", "p1.log", "ec_producer"),
                                ("C1", "c1.log", "ec_consumer")):
            engines[name] = Engine(tiny_model_dir, work / log, role, extra)
            engines[name].wait_ready()
        yield engines
    finally:
        for e in engines.values():
            e.kill()


@pytest.fixture(scope="module")
def baseline(cluster) -> dict:
    """A single instance without a connector: the embeddings to match."""
    base = cluster.pop("base")
    res = base.generate(SEEDS)
    base.close()
    assert res["encoded"] == len(SEEDS) and set(res["embeds"]) == {str(s) for s in SEEDS}
    return res


def check_loaded(res: dict, images: list[int], baseline: dict) -> None:
    """A consumer's answer: every image loaded, none encoded, exact embeddings."""
    assert res["encoded"] == 0
    assert (m(res, "hits"), m(res, "loads"), m(res, "misses")) == (len(images), len(images), 0)
    assert m(res, "load_failures") == 0 and m(res, "saves") == 0
    for s in map(str, images):
        assert res["embeds"][s] == baseline["embeds"][s]
        assert res["tokens"][s] == baseline["tokens"][s]


def test_producer_then_consumer_one_request_at_a_time(cluster, baseline):
    """As the proxy does: each request to the producer, and as soon as it
    answers, to the consumer; the consumer loads every item."""
    P, C = cluster["P1"], cluster["C1"]
    for seed in (0, 1):
        p = P.generate([seed])
        assert p["tokens"] == {str(seed): []}  # encode-only: no tokens
        assert p["encoded"] == 1
        # Its worker counters reach vLLM's stats line (vLLM drops the
        # worker metadata of an encode-only instance).
        assert (m(p, "misses"), m(p, "saves"), m(p, "save_skipped")) == (1, 1, 0)
        assert m(p, "MB_saved") > 0 and m(p, "commit_ms") > 0
        check_loaded(C.generate([seed]), [seed], baseline)


def test_two_producers_two_consumers_on_one_store(cluster, baseline, tiny_model_dir, work, extra):
    P1, C1 = cluster["P1"], cluster["C1"]
    cluster["P2"] = P2 = Engine(tiny_model_dir, work / "p2.log", "ec_producer", extra)
    P2.wait_ready()
    cluster["C2"] = C2 = Engine(tiny_model_dir, work / "c2.log", "ec_consumer", extra)
    C2.wait_ready()

    # Both producers at once, different images; then both consumers at once,
    # each taking one image from each producer.
    P1.send_images([2, 3])
    P2.send_images([4, 5])
    p1, p2 = P1.answer(), P2.answer()
    assert (p1["encoded"], m(p1, "saves"), p2["encoded"], m(p2, "saves")) == (2, 2, 2, 2)
    C1.send_images([2, 4])
    C2.send_images([5, 3])
    check_loaded(C1.answer(), [2, 4], baseline)
    check_loaded(C2.answer(), [5, 3], baseline)

    # A producer does not encode what another producer stored.
    p2 = P2.generate([2])
    assert p2["encoded"] == 0
    assert (m(p2, "hits"), m(p2, "misses"), m(p2, "saves"), m(p2, "save_skipped")) == (1, 0, 0, 0)

    # Both producers at once, the same new image: each either finds it stored
    # or encodes it and hands it over (both may, racing); one entry results.
    P1.send_images([6])
    P2.send_images([6])
    p1, p2 = P1.answer(), P2.answer()
    for p in (p1, p2):
        assert m(p, "hits") + m(p, "saves") + m(p, "save_skipped") == 1
        assert p["encoded"] == 1 - m(p, "hits")
    assert p1["encoded"] + p2["encoded"] >= 1
    C1.send_images([6])
    C2.send_images([6, 0])
    check_loaded(C1.answer(), [6], baseline)
    check_loaded(C2.answer(), [6, 0], baseline)
    for name in ("P1", "P2", "C1", "C2"):
        cluster.pop(name).close()
    cfg = ECStoreConfig(local_cpu=False, local_disk=extra["local_disk"], max_local_disk_size=0.01)
    with ECStore(cfg, model="reader", dtype=torch.float32, readonly=True) as st:
        stored = sorted(rec.identifier for _, rec in st.disk.iter_records())
        files = st.disk.referenced_files()
    assert len(stored) == len(SEEDS)  # one entry per image, none twice
    # Each in its own blob file; the racing producers' extra file is gone.
    assert len(files) == len(SEEDS)
    assert {n for n in os.listdir(Path(extra["local_disk"]) / "blobs") if n.endswith(".ecb")} == files
