"""A non-editable install ships every module of the checkout.

The suite runs against an editable install, which imports from the
checkout and so cannot notice a subpackage missing from pyproject's
package list (``ecstore.maintenance`` and ``ecstore.lmdb`` once were).
This builds the real wheel and compares its files with the source tree.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_wheel_holds_every_module_migration_and_marker(tmp_path: Path) -> None:
    # Build from a copy: setuptools would reuse a stale build/ of the checkout.
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", "bench-results",
        "demo-results", ".cache", ".mypy_cache", ".ruff_cache"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-q", "-w", str(tmp_path), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = tmp_path.glob("ecstore-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {p.relative_to(REPO).as_posix() for p in (REPO / "ecstore").rglob("*.py")}
    assert any(n.startswith("ecstore/lmdb/migrations/v0001_") for n in want)
    want.add("ecstore/py.typed")
    assert not want - names, f"missing from the wheel: {sorted(want - names)}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "ecstore-dump = ecstore.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
