"""``tools/bench.py --device``: where CUDA is missing a GPU run fails at once
with a clear message, and a GPU run measures the sections whose tensors live
on the device (floor, save, hit, producer, loadread) and refuses the others.

Subprocesses, as a user runs the harness (``bench_core`` sets vLLM's
environment when imported: not in the test process). The GPU run itself is
measured when a machine with a GPU is lent (docs/benchmarks.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "tools" / "bench.py"


def _sections(device: str, sections: str | None) -> subprocess.CompletedProcess:
    code = ("import sys, torch; sys.path.insert(0, 'tools'); import bench_core as c; "
            f"print(','.join(c.device_sections(torch.device({device!r}), {sections!r})))")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA; this one has it")
def test_device_cuda_without_cuda_fails_at_once_saying_why(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cuda", "--quick", "--out", str(out),
                           "--workdir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--device cuda: CUDA is not available here" in proc.stderr, proc.stderr
    assert "use --device cpu" in proc.stderr
    assert not out.exists()  # nothing measured, nothing written


def test_a_gpu_run_measures_the_device_sections_by_default() -> None:
    proc = _sections("cuda", None)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["floor,save,hit,producer,loadread"]


def test_a_gpu_run_refuses_a_section_without_device_tensors() -> None:
    proc = _sections("cuda", "save,contains,sched")
    assert proc.returncode != 0
    assert "measures the sections floor,save,hit,producer,loadread only, not contains,sched" in proc.stderr


def test_a_cpu_run_measures_every_section_or_those_asked_for() -> None:
    everything = _sections("cpu", None)
    assert everything.returncode == 0, everything.stderr
    assert everything.stdout.split() == [
        "floor,save,hit,write,contains,footprint,mixed,burst,producer,loadread,sched"]
    asked = _sections("cpu", "contains, sched,")
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout.split() == ["contains,sched"]
