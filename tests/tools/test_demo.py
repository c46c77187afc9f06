"""End-to-end: ``tools/demo.py --smallest`` against the real vLLM server.

Runs the demo as a subprocess in its CI form (one image, one server restart, ecstore
only) and checks its JSON against independent evidence: the after-restart request was
served from ecstore (the ``vllm:ec_store_*`` counters on ``/metrics``, vLLM's
``EC Transfer metrics`` log line, and no ``EC put`` for that image after the restart),
the cold request stored exactly one entry (``ecstore-dump list --json`` run here on the
kept store), greedy outputs are identical, and every server process is gone.
No timing is asserted. About 1.5 minutes on 2 CPU cores (two server starts).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ecstore.testing.procs import group_members

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "tools" / "demo.py"

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(480)]

EC_PUT = re.compile(r"EC put: stored (\d+) bytes for mm_hash=(\S+)")


def _ecstore_dump(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from ecstore.cli import main; sys.exit(main())",
                           *args], capture_output=True, text=True, timeout=120)


def _group_gone(pgid: int) -> bool:
    return not group_members(pgid)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    out = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items()
           if k != "LMCACHE_CONFIG_FILE" and not k.startswith("LMCACHE_EC_")}
    proc = subprocess.run([sys.executable, str(DEMO), "--smallest", "--keep", "--out", str(out)],
                          cwd=str(REPO), env=env, capture_output=True, text=True, timeout=450)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"demo failed with status {proc.returncode}:\n{tail}"
    result = json.loads((out / "demo.json").read_text())
    return proc, result, out


def test_settings_are_the_smallest_form(demo_run):
    _, res, _ = demo_run
    st = res["settings"]
    assert st["mode"] == "smallest"
    assert st["connectors"] == ["ecstore"]
    assert st["image_counts"] == [1] and st["reps"] == 1
    assert st["prefix_caching"] is False
    runs = res["connectors"]["ecstore"]["runs"]
    assert [r["name"] for r in runs] == ["first start", "after restart"]
    phases = [[q["phase"] for q in r["requests"]] for r in runs]
    assert phases == [["cold", "warm"], ["restart"]]


def test_cold_request_stored_exactly_one_entry(demo_run):
    _, res, out = demo_run
    ec = res["connectors"]["ecstore"]
    first = ec["runs"][0]
    # the server log of the first start, read here (not the demo's parse of it)
    puts = EC_PUT.findall(Path(first["log"]).read_text(errors="replace"))
    assert len(puts) == 1, puts
    nbytes, mm_hash = int(puts[0][0]), puts[0][1]
    assert nbytes == 32 * 128 * 4  # BLIP-2 encoder output [32, 128] float32
    # the kept store, listed here with ecstore-dump
    store = Path(ec["store"])
    assert store.is_relative_to(out)
    p = _ecstore_dump("list", str(store), "--json")
    assert p.returncode == 0, p.stderr
    entries = json.loads(p.stdout)["entries"]
    assert [e["identifier"] for e in entries] == [mm_hash]
    assert entries[0]["shape"] == [32, 128] and entries[0]["dtype"] == "float32"
    # /metrics on the first server after the cold request: one miss, one save
    after_cold = first["prom"]["after_cold"]
    assert after_cold["misses"] == 1 and after_cold["saves"] == 1 and after_cold["hits"] == 0


def test_after_restart_request_was_an_ecstore_hit(demo_run):
    _, res, _ = demo_run
    ec = res["connectors"]["ecstore"]
    first, second = ec["runs"]
    # /metrics of the restarted server: one lookup, answered from the store and loaded
    counters = second["prom"]["after_restart"]
    assert counters["hits"] == 1 and counters["loads"] == 1
    assert counters["misses"] == 0 and counters["saves"] == 0
    assert counters.get("load_failures", 0) == 0
    log2 = Path(second["log"]).read_text(errors="replace")
    # no EC put after the restart (nothing was computed) ...
    assert EC_PUT.findall(log2) == []
    # ... and vLLM's periodic EC metrics line counted the hit
    lines = re.findall(r"EC Transfer metrics: (.*)", log2)
    assert lines, "no 'EC Transfer metrics' line in the restarted server's log"
    hits = sum(int(m) for line in lines for m in re.findall(r"\bhits=(\d+)", line))
    loads = sum(int(m) for line in lines for m in re.findall(r"\bloads=(\d+)", line))
    assert hits == 1 and loads == 1
    # the store's own hit count moved too
    p = _ecstore_dump("list", ec["store"], "--json")
    assert json.loads(p.stdout)["entries"][0]["hits"] == 1


def test_greedy_outputs_identical(demo_run):
    _, res, _ = demo_run
    reqs = [q for r in res["connectors"]["ecstore"]["runs"] for q in r["requests"]]
    ids = {q["phase"]: q["token_ids"] for q in reqs}
    assert set(ids) == {"cold", "warm", "restart"}
    assert len(ids["cold"][0]) == res["settings"]["max_tokens"]
    assert ids["cold"] == ids["warm"] == ids["restart"]
    assert res["outputs"]["identical"] is True


def test_report_and_cleanup(demo_run):
    proc, res, out = demo_run
    assert res["checks"]["passed"] is True
    assert (out / "demo.png").stat().st_size > 0
    text = proc.stdout
    for needle in ("EC put: stored", "EC Transfer metrics:", "vllm:ec_store_hits_total=1",
                   "ecstore-dump list", "after restart"):
        assert needle in text, needle
    # every server the demo started is gone (process group checked, not just the leader)
    assert len(res["processes"]) == 2
    for p in res["processes"]:
        assert p["stopped"] is True
        assert _group_gone(p["pgid"]), f"process group {p['pgid']} still has live processes"
