"""The video benchmark in miniature, smallest form: ``tools/demo_video.py --smallest``.

Runs the script as a subprocess (two engine processes on one store: cold, then after
a restart; frames 4 and 16, one video each, plus a warm-up video) and checks its JSON
against the store itself (``ecstore-dump list --json``): every video was stored by the
first engine with the shape the table reports, the second loaded all of them and
stored nothing, and the embeddings that reached its language model equal the first
engine's (checked by the script: it exits 1 otherwise). No timing is asserted. About
1.5 minutes on 2 busy CPU cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


def test_smallest_video_run_loads_every_video_after_the_restart(tmp_path, no_lmcache_env):
    out = tmp_path / "video"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "demo_video.py"), "--smallest", "--out", str(out)],
                          cwd=str(REPO), capture_output=True, text=True, timeout=560)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"demo_video failed with status {proc.returncode}:\n{tail}"
    res = json.loads((out / "video.json").read_text())
    assert res["failures"] == [] and res["frames"] == [4, 16]
    rows = {r["frames"]: r for r in res["rows"]}
    assert {f: r["tokens"] for f, r in rows.items()} == {4: 128, 16: 512}  # 64 tokens per frame pair
    assert all(r["entry_bytes"] == r["tokens"] * 128 * 4 for r in rows.values())
    assert res["ec_warm"]["loads"] == 2 and res["ec_warm"].get("saves", 0) == 0
    assert res["ec_cold"]["saves"] == 2
    assert "speed-up" in proc.stdout and "warm TTFT" in proc.stdout

    p = subprocess.run([sys.executable, "-m", "ecstore.cli", "list", str(out / "store"), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    entries = json.loads(p.stdout)["entries"]
    shapes = sorted(tuple(e["shape"]) for e in entries)
    assert shapes == [(128, 128), (128, 128), (512, 128)]  # the warm-up video (4 frames), then 4 and 16 frames
    assert all(e["dtype"] == "float32" for e in entries)
