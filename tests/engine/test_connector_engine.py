"""The real engine: ``vllm.LLM`` serving the tiny BLIP-2 on the CPU with the
ecstore connector, each run in a fresh process (tests/helpers/engine_run.py),
as a restart would be.

What a run reports: its console output (where ecstore's ``EC put: stored N
bytes for mm_hash=H`` lines must show with vLLM's default logging, and
vLLM's ``EC Transfer metrics`` lines with stat logging on), the greedy token
ids per image, and the connector counters summed from the metrics lines.
The store itself is read afterwards with a read-only ``ECStore``.

Six engine processes in all; they share one store where that is the point
(restart, consumer, multi-process), on a copy where a test would change it.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers.engine_proc import engine_env
from helpers.engine_proc import run_engine as run_engine_process

from ecstore import ECStore, ECStoreConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "tests" / "helpers" / "engine_run.py"
PUT_RE = re.compile(r"EC put: stored (\d+) bytes for mm_hash=(\w+)")
METRICS = "EC Transfer metrics"
EMBED_BYTES = 32 * 128 * 4  # one tiny BLIP-2 image: [32, 128] float32
MAX_TOKENS = 6


@dataclass
class EngineRun:
    console: str
    tokens: dict[str, list[int]]
    metrics: dict[str, float]
    metrics_lines: int
    errors: dict[str, str]

    @property
    def puts(self) -> list[tuple[int, str]]:
        """(bytes, mm_hash) of every ``EC put`` line, in order."""
        return [(int(n), h) for n, h in PUT_RE.findall(self.console)]

    def m(self, key: str) -> float:
        return self.metrics.get(key, 0)


def run_engine(model_dir: Path, out_dir: Path, name: str, *, extra: dict, images: list[int],
               role: str = "ec_both", multiprocess: bool = False, encoder_cache_budget: int = 0,
               timeout: float = 420) -> EngineRun:
    out = out_dir / f"{name}.json"
    cmd = [sys.executable, str(HELPER), "--model", str(model_dir), "--out", str(out),
           "--role", role, "--extra", json.dumps(extra), "--images", ",".join(map(str, images)),
           "--max-tokens", str(MAX_TOKENS), "--log-stats"]
    if multiprocess:
        cmd.append("--multiprocess")
    if encoder_cache_budget:
        cmd += ["--encoder-cache-budget", str(encoder_cache_budget)]
    console = run_engine_process(cmd, name, REPO, engine_env(log_stats=True), timeout)
    res = json.loads(out.read_text())
    return EngineRun(console, res["tokens"], res["ec_metrics"], res["ec_metrics_lines"], res["errors"])


def entries(store_dir: Path) -> dict[str, tuple]:
    """identifier -> (checksum, blob size, created) of every entry, read-only."""
    cfg = ECStoreConfig(local_cpu=False, local_disk=str(store_dir), max_local_disk_size=0.01)
    with ECStore(cfg, model="reader", dtype=torch.float32, readonly=True) as st:
        return {rec.mm_identifier: (rec.checksum, rec.blob_size, rec.created_ns)
                for _, rec in st.disk.iter_records()}


# --------------------------------------------------------------------------- shared runs
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine")


@pytest.fixture(scope="module")
def store_dir(work: Path) -> Path:
    return work / "ec"


@pytest.fixture(scope="module")
def disk_extra(store_dir: Path) -> dict:
    return {"local_disk": str(store_dir), "max_local_disk_size": 0.01}


@pytest.fixture(scope="module")
def first_run(tiny_model_dir, work, disk_extra) -> EngineRun:
    """ec_both on an empty store: computes and stores images 0 and 1."""
    return run_engine(tiny_model_dir, work, "first", extra=disk_extra, images=[0, 1])


@pytest.fixture(scope="module")
def first_entries(first_run, store_dir) -> dict[str, tuple]:
    return entries(store_dir)


# --------------------------------------------------------------------------- tests
def test_first_run_computes_and_stores(first_run, first_entries):
    run = first_run
    assert run.errors == {}
    assert [n for n, _ in run.puts] == [EMBED_BYTES, EMBED_BYTES]
    hashes = {h for _, h in run.puts}
    assert len(hashes) == 2 and set(first_entries) == hashes
    assert METRICS in run.console and run.metrics_lines >= 1
    assert (run.m("misses"), run.m("saves"), run.m("hits"), run.m("loads")) == (2, 2, 0, 0)
    assert all(len(t) == MAX_TOKENS for t in run.tokens.values())
    assert run.tokens["0"] != run.tokens["1"]  # the model tells the images apart


def test_restart_loads_from_store_with_same_tokens(tiny_model_dir, work, disk_extra, store_dir,
                                                    first_run, first_entries):
    run = run_engine(tiny_model_dir, work, "restart", extra=disk_extra, images=[0, 1])
    assert run.errors == {}
    assert run.puts == []  # nothing computed, nothing stored
    assert (run.m("hits"), run.m("loads"), run.m("misses"), run.m("saves")) == (2, 2, 0, 0)
    assert run.m("load_failures") == 0
    assert run.tokens == first_run.tokens  # loaded embedding == computed one
    assert entries(store_dir) == first_entries


def test_consumer_loads_and_never_writes(tiny_model_dir, work, disk_extra, store_dir,
                                         first_run, first_entries):
    """ec_consumer: loads images 0 and 1, computes the new image 2 and does
    not store it; stored entries are not rewritten (consumer reads do
    refresh the entries' LRU position and hit counts, by design)."""
    before = entries(store_dir)
    run = run_engine(tiny_model_dir, work, "consumer", extra=disk_extra, images=[0, 1, 2],
                     role="ec_consumer")
    assert run.errors == {}
    assert run.puts == []
    assert (run.m("hits"), run.m("loads"), run.m("misses"), run.m("saves")) == (2, 2, 1, 0)
    assert {k: run.tokens[k] for k in ("0", "1")} == first_run.tokens
    assert entries(store_dir) == before == first_entries


def test_producer_writes_and_skips_present(tiny_model_dir, work, store_dir, first_entries):
    """ec_producer (vLLM runs it as an encode-only instance: no tokens):
    stores the new image 2, skips image 0 which the store already holds."""
    copy = work / "ec-producer"
    shutil.copytree(store_dir, copy)
    extra = {"local_disk": str(copy), "max_local_disk_size": 0.01}
    run = run_engine(tiny_model_dir, work, "producer", extra=extra, images=[0, 2], role="ec_producer")
    assert run.errors == {}
    assert run.tokens == {"0": [], "2": []}
    assert len(run.puts) == 1
    (nbytes, new_hash), = run.puts
    assert nbytes == EMBED_BYTES and new_hash not in first_entries
    after = entries(copy)
    assert set(after) == set(first_entries) | {new_hash}
    assert {k: after[k] for k in first_entries} == first_entries  # present ones untouched


def test_multiprocess_engine_gets_hits(tiny_model_dir, work, store_dir, first_run, first_entries):
    """Default mode: the engine core (scheduler side) and the worker run in
    processes of their own, apart from the LLM front end; metadata and
    worker reports are pickled between them. The worker process's EC put
    line reaches the console too."""
    copy = work / "ec-multiprocess"
    shutil.copytree(store_dir, copy)
    extra = {"local_disk": str(copy), "max_local_disk_size": 0.01}
    run = run_engine(tiny_model_dir, work, "multiprocess", extra=extra, images=[0, 1, 2],
                     multiprocess=True)
    assert run.errors == {}
    assert (run.m("hits"), run.m("loads"), run.m("misses"), run.m("saves")) == (2, 2, 1, 1)
    assert {k: run.tokens[k] for k in ("0", "1")} == first_run.tokens
    assert len(run.puts) == 1
    (nbytes, new_hash), = run.puts
    assert nbytes == EMBED_BYTES and set(entries(copy)) == set(first_entries) | {new_hash}


def test_memory_only_serves_what_vllms_cache_dropped(tiny_model_dir, work, first_run):
    """No local_disk: with vLLM's own encoder cache sized for two images,
    images 1..3 push image 0 out of it; the repeat of image 0 is then a
    connector hit served from ecstore's memory tier in the same process."""
    run = run_engine(tiny_model_dir, work, "memory", extra={"local_disk": None},
                     images=[0, 1, 2, 3, 0], encoder_cache_budget=64)
    assert run.errors == {}
    assert len(run.puts) == 4 and {n for n, _ in run.puts} == {EMBED_BYTES}
    assert (run.m("hits"), run.m("loads"), run.m("misses")) == (1, 1, 4)
    assert (run.m("saves"), run.m("save_skipped"), run.m("load_failures")) == (4, 0, 0)
    assert run.tokens["0#1"] == run.tokens["0"] == first_run.tokens["0"]
    assert run.tokens["1"] == first_run.tokens["1"]
