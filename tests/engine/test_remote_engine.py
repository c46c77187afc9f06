"""Two real vLLM engines on two "nodes" (different local_disk) sharing one Redis.

Engine A (producer) computes the encoder outputs of two images and writes
them through to the remote; engine B (another local_disk, a fresh process)
loads them from the remote and never runs its encoder. The embeddings that
reach B's language model (recorded by wrapping ``embed_input_ids``) are
bit-identical to the tensors A stored, and equal to those of a run without
the connector.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from conftest import HEALTHY_REMOTE_TIMEOUT_S
from helpers.engine_proc import engine_env, run_engine

from ecstore.format import blob_read
from ecstore.remote import frame

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "tests" / "helpers" / "embeds_engine_run.py"
IMAGES = [0, 1]


def run(model_dir: Path, out_dir: Path, name: str, extra: dict | None, role: str = "ec_both",
        timeout: float = 420) -> dict:
    out = out_dir / f"{name}.json"
    cmd = [sys.executable, str(HELPER), "--model", str(model_dir), "--out", str(out), "--role", role,
           "--images", ",".join(map(str, IMAGES))]
    cmd += ["--no-connector"] if extra is None else ["--extra", json.dumps(extra)]
    console = run_engine(cmd, name, REPO, engine_env(log_stats=False), timeout)
    res = json.loads(out.read_text())
    res["console"] = console
    return res


def test_engine_b_on_another_node_loads_engine_a_outputs_from_redis(tiny_model_dir, tmp_path, redis_server):
    def node(name: str) -> dict:
        return {"local_disk": str(tmp_path / name), "max_local_disk_size": 0.01,
                "remote_url": redis_server.url, "remote_timeout_seconds": HEALTHY_REMOTE_TIMEOUT_S}

    a = run(tiny_model_dir, tmp_path, "a", node("a"), role="ec_producer")
    assert a["errors"] == {}
    keys = redis_server.client().keys("ecstore:1:*")
    assert len(keys) == len(IMAGES)  # written through by A

    b = run(tiny_model_dir, tmp_path, "b", node("b"))
    m = b["ec_metrics"]
    assert b["errors"] == {}
    assert (m.get("hits"), m.get("loads"), m.get("misses", 0), m.get("saves", 0)) == (2, 2, 0, 0)
    assert m.get("remote_hits") == 2 and m.get("load_failures", 0) == 0

    # What B's language model got is bit-identical to what A stored in Redis...
    stored = set()
    for key in keys:
        rec, blob = frame.unpack(redis_server.client().get(key))
        t = blob_read.decode(blob, expected_checksum=rec.checksum)
        stored.add(xxhash.xxh3_64_intdigest(t.contiguous().view(torch.uint8).numpy().tobytes()))
    got = {seed: b["embeds"][seed] for seed in map(str, IMAGES)}
    assert all(len(v) == 1 and v[0]["shape"] == [32, 128] for v in got.values())
    assert {v[0]["xxh3"] for v in got.values()} == stored and len(stored) == 2
    # ... and what the encoder computes without any connector.
    control = run(tiny_model_dir, tmp_path, "control", None)
    for seed in map(str, IMAGES):
        (eb,), (ec,) = got[seed], control["embeds"][seed]
        assert ec["shape"] == eb["shape"] and ec["dtype"] == eb["dtype"] == "float32"
        assert ec["sum"] == pytest.approx(eb["sum"], rel=1e-5, abs=1e-4)
