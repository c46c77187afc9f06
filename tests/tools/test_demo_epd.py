"""End-to-end: ``tools/demo_epd.py --smallest`` with two real vLLM servers.

Runs the E -> PD demo in its CI form (an encoder-only ``ec_producer`` server, an
``ec_consumer`` server, the proxy, one image through the proxy and one straight
to PD) and checks its JSON against independent evidence: the servers' logs (E
logged one ``EC put`` per image it computed, PD none), the store read here
(exactly the images E computed), the per-request counter deltas the demo read
from ``/metrics``, and that every server process is gone. No timing is asserted.
About 1.5 minutes on 2 CPU cores (two server starts, concurrently).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ecstore import ECStore, ECStoreConfig
from ecstore.testing.procs import group_members

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "tools" / "demo_epd.py"

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def _group_gone(pgid: int) -> bool:
    return not group_members(pgid)


def test_demo_epd_smallest(tmp_path: Path, no_lmcache_env):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(DEMO), "--smallest", "--out", str(out)],
                          capture_output=True, text=True, timeout=850, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "computed on E, loaded on PD" in proc.stdout
    res = json.loads((out / "demo_epd.json").read_text())
    assert all(res["checks"].values()), res["checks"]

    proxied, direct = res["rows"]
    assert proxied["route"] == "proxy" and direct["route"] == "PD only"
    assert proxied["source"] == "computed on E, loaded on PD"
    assert proxied["e_counters"].get("saves") == 1 and proxied["e_counters"].get("saved_bytes", 0) > 0
    assert proxied["pd_counters"].get("loads") == 1 and not proxied["pd_counters"].get("misses")
    assert direct["source"] == "computed on PD" and direct["pd_counters"].get("misses") == 1
    assert proxied["e_ms"] is not None and proxied["ttft_ms"] > 0 and len(proxied["token_ids"]) > 0

    # Independent evidence: logs and the store itself.
    e_log = (out / "logs" / "E.log").read_text()
    pd_log = (out / "logs" / "PD.log").read_text()
    assert e_log.count("EC put: stored") == 2  # the warm-up image and the proxied one
    assert "EC put:" not in pd_log
    assert re.search(r"EC Transfer metrics: .*\bsaves=[12]\b", e_log)  # E's stats line shows its saves
    cfg = ECStoreConfig(local_cpu=False, local_disk=str(out / "work" / "store"), max_local_disk_size=0.01)
    with ECStore(cfg, model="reader", dtype=torch.float32, readonly=True) as st:
        assert st.disk.entry_count() == 2  # what E computed; PD's own computation is not stored
    for p in res["processes"]:
        assert _group_gone(p["pgid"]), p
