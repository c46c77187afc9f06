"""Never a wrong encoder output, on the real engine: ``vllm.LLM``
with the tiny BLIP-2, each run a fresh process (tests/helpers/engine_run.py).

Every check compares the image embeddings that reach the language model
(the model's ``embed_input_ids`` is wrapped) with a run without the
connector: with random weights greedy tokens may not depend on the image.

One private copy of the model (its weights are rewritten in place halfway)
and one store serve the whole sequence; nine engine runs in all:

  base     no connector, default settings: images 0..4
  first    connector: images 0, 1, 2 stored; image 3 sent with uuid "u" is not
           (client uuid); max_tokens=1
  --       the test spoils two entries: image 1's gets 16 rows instead of 32
           (caught before loading), image 2's blob gets a flipped byte (caught
           by the worker's checksum)
  restart  default settings, max_tokens=1: image 0 loaded (hit), 1 and 2
           computed in time, image 4 under the reused uuid "u" computed
  nonorm / nonorm_base   server-level mm_processor_kwargs do_normalize=false
  tuned / tuned_base     same model path, weights rewritten in place
  counter1 / counter2    mm_processor_cache_gb=0: per-process identifiers
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import lmdb
import pytest
import torch
from helpers.engine_proc import engine_env, run_engine

from ecstore import ECStore, ECStoreConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "tests" / "helpers" / "engine_run.py"
PUT_RE = re.compile(r"EC put: stored (\d+) bytes for mm_hash=(\S+)")
ROWS, WIDTH = 32, 128


@dataclass
class Run:
    console: str
    tokens: dict[str, list[int]]
    metrics: dict[str, float]
    errors: dict[str, str]
    embeds: dict[str, torch.Tensor]

    @property
    def puts(self) -> list[str]:
        return [h for _, h in PUT_RE.findall(self.console)]

    def m(self, key: str) -> float:
        return self.metrics.get(key, 0)


def run(model: Path, out_dir: Path, name: str, images: list[int], *, extra: dict | None = None,
        engine_kw: dict | None = None, uuids: dict[int, str] | None = None, max_tokens: int = 2,
        timeout: float = 420) -> Run:
    """One engine process; ``extra`` None: no connector."""
    out = out_dir / f"{name}.json"
    cmd = [sys.executable, str(HELPER), "--model", str(model), "--out", str(out),
           "--images", ",".join(map(str, images)), "--max-tokens", str(max_tokens), "--log-stats",
           "--embeds", "--engine-kw", json.dumps(engine_kw or {}),
           "--uuids", json.dumps({str(k): v for k, v in (uuids or {}).items()})]
    cmd += ["--no-connector"] if extra is None else ["--extra", json.dumps(extra)]
    console = run_engine(cmd, name, REPO, engine_env(log_stats=True), timeout)
    res = json.loads(out.read_text())
    embeds = {k: torch.tensor(v) for k, v in res["embeds"].items()}
    return Run(console, res["tokens"], res["ec_metrics"], res["errors"], embeds)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float noise (a wrong encoder output differs by far more)."""
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def writer_as_engine(store_dir: Path, model: Path) -> ECStore:
    """A handle writing under the one identity registered in the store (the
    engine's). Imports ecstore.identity here so that this file also runs
    against ecstore before identities (to show these tests fail there)."""
    cfg = ECStoreConfig(local_cpu=False, local_disk=str(store_dir), max_local_disk_size=0.01)
    if not hasattr(ECStore, "stored_name"):  # ecstore before identities
        return ECStore(cfg, model=str(model), dtype=torch.float32)
    from ecstore.identity import EncoderIdentity
    env = lmdb.open(str(store_dir), max_dbs=8, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            db = env.open_db(b"namespaces", txn=txn, create=False)
            descs = [json.loads(bytes(v)) for _, v in txn.cursor(db=db)]
    finally:
        env.close()
    assert len(descs) == 1, descs
    ident = EncoderIdentity.from_description(descs[0])
    return ECStore(cfg, model=str(model), dtype=torch.float32, identity=ident)


# --------------------------------------------------------------------------- the sequence
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("identity")


@pytest.fixture(scope="module")
def model(tiny_model_dir, work) -> Path:
    dst = work / "model"
    shutil.copytree(tiny_model_dir, dst)
    return dst


@pytest.fixture(scope="module")
def disk(work) -> dict:
    return {"local_disk": str(work / "ec"), "max_local_disk_size": 0.01}


@pytest.fixture(scope="module")
def base(model, work) -> Run:
    r = run(model, work, "base", [0, 1, 2, 3, 4])
    assert set(r.embeds) == {"0", "1", "2", "3", "4"}
    assert all(e.shape == (ROWS, WIDTH) for e in r.embeds.values())
    assert not same(r.embeds["0"], r.embeds["1"])
    return r


@pytest.fixture(scope="module")
def first(model, work, disk, base) -> Run:
    return run(model, work, "first", [0, 1, 2, 3], extra=disk, uuids={3: "u"}, max_tokens=1)


@pytest.fixture(scope="module")
def restart(model, work, disk, first) -> Run:
    _h0, h1, h2 = first.puts[:3]  # images 0, 1, 2 in order (an older ecstore also stores "u")
    with writer_as_engine(Path(disk["local_disk"]), model) as st:
        assert st.get(h1).shape == (ROWS, WIDTH)
        assert st.delete(h1) and st.put(h1, torch.randn(16, WIDTH))  # a misfit under the same name
        st.flush()
        key = st.key(h2).encode()
    env = lmdb.open(disk["local_disk"], max_dbs=8)
    try:
        blobs = env.open_db(b"blobs")
        with env.begin(write=True) as txn:
            blob = bytearray(txn.get(key, db=blobs))
            blob[-3] ^= 0xFF  # one flipped byte in the tensor data
            txn.put(key, bytes(blob), db=blobs)
    finally:
        env.close()
    return run(model, work, "restart", [0, 1, 2, 4], extra=disk, uuids={4: "u"}, max_tokens=1)


# --------------------------------------------------------------------------- tests
def test_first_run_stores_content_hashes_not_client_uuids(first, base):
    assert first.errors == {}
    assert all(same(first.embeds[k], base.embeds[k]) for k in "0123")
    assert len(first.puts) == 3 and "u" not in first.puts  # images 0, 1, 2
    assert "named by the client (multi_modal_uuids)" in first.console
    assert all(len(t) == 1 for t in first.tokens.values())


def test_restart_loads_and_never_uses_a_bad_entry(restart, base):
    """Default settings: image 0 is loaded from the store (a hit); image 1's
    entry has 16 rows (refused before the load, the encoder runs); image 2's
    blob is corrupt (caught on the worker, encoded in the same step: no token
    from a stand-in, even with max_tokens=1); image 4 reuses uuid "u" and gets
    its own embedding."""
    r = restart
    for k in "0124":
        assert same(r.embeds[k], base.embeds[k]), f"image {k}: not the no-connector embedding"
    assert r.errors == {}
    assert (r.m("hits"), r.m("loads")) == (2, 1), r.metrics  # 0 loaded; 2 announced, then recomputed
    assert (r.m("rejected"), r.m("load_failures"), r.m("recomputed")) == (1, 1, 1), r.metrics
    assert all(len(t) == 1 for t in r.tokens.values())
    assert {k: r.tokens[k] for k in "0124"} == {k: base.tokens[k][:1] for k in "0124"}


def test_server_processor_kwargs_change_is_a_miss(model, work, disk, restart, base):
    kw = {"mm_processor_kwargs": {"do_normalize": False}}
    ref = run(model, work, "nonorm_base", [0], engine_kw=kw)
    assert not same(ref.embeds["0"], base.embeds["0"])  # the setting changes the encoder output
    r = run(model, work, "nonorm", [0], extra=disk, engine_kw=kw)
    assert same(r.embeds["0"], ref.embeds["0"])
    assert r.errors == {} and (r.m("hits"), r.m("misses")) == (0, 1)


def test_weights_changed_in_place_is_a_miss(tiny_model_dir, model, work, disk, restart, base):
    from ecstore.testing import tiny_model

    other = tiny_model.build_tiny_blip2(work / "seed1", seed=1)
    old = (model / "model.safetensors").stat().st_size
    shutil.copyfile(other / "model.safetensors", model / "model.safetensors")  # a "fine-tune"
    assert (model / "model.safetensors").stat().st_size == old  # same shapes, same size
    ref = run(model, work, "tuned_base", [0, 1])
    assert not same(ref.embeds["0"], base.embeds["0"])
    r = run(model, work, "tuned", [0], extra=disk)
    # Per-process identifiers (mm_processor_cache_gb=0, prefix caching off):
    # never stored, so a restart's image 1, named like the first run's image
    # 0, is computed.
    kw = {"mm_processor_cache_gb": 0}
    c1 = run(model, work, "counter1", [0], extra=disk, engine_kw=kw)
    c2 = run(model, work, "counter2", [1], extra=disk, engine_kw=kw)
    wrong = [name for name, got, want in [("weights rewritten in place", r.embeds["0"], ref.embeds["0"]),
                                          ("per-process id, first run", c1.embeds["0"], ref.embeds["0"]),
                                          ("per-process id, restart", c2.embeds["1"], ref.embeds["1"])]
             if not same(got, want)]
    assert wrong == [], f"not the no-connector embedding: {wrong}"
    assert r.errors == {} and (r.m("hits"), r.m("misses")) == (0, 1)
    assert c1.puts == [] and "per-process counter" in c1.console
    assert c2.errors == {} and c2.puts == [] and c2.m("hits") == 0
