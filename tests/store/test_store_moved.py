"""A store directory moved (renamed) under a running process: its blob files
follow the environment that process opened.

A real second process (``helpers/store_opener.py``) creates a new store at
the old path and opens it again (each open sweeps dead writers' blob files).
The running handle used to keep writing ``data.mdb`` in the moved directory
but blob files by path into the new store's ``blobs/``, which the new store
then deleted as a dead writer's leftovers: the moved store's entries lost
their files.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from ecstore.format import PendingPut
from ecstore.lmdb import BatchPut, LMDBTier
from ecstore.testing import faults as fc
from ecstore.testing.tier_contract import KEY_A, KEY_B, NAME_A, NAME_B, tensor

MiB = 1 << 20
OPENER = str(Path(__file__).parents[1] / "helpers" / "store_opener.py")


def _open_elsewhere(path: Path) -> None:
    out = subprocess.run([sys.executable, OPENER, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "opened", out.stderr


def _get(tier: LMDBTier, key: str, name: str) -> torch.Tensor | None:
    return tier.get(key, name, model="org/model", dtype=torch.bfloat16)


def test_blob_files_follow_a_store_moved_under_a_running_process(tmp_path: Path) -> None:
    path, moved = tmp_path / "store", tmp_path / "moved"
    tier = LMDBTier(str(path), 16 * MiB, file_blobs_from=0)
    try:
        tier.write_batch([BatchPut(PendingPut(KEY_A, NAME_A, tensor(1, rows=256, cols=512)), "org/model")])
        os.rename(path, moved)
        _open_elsewhere(path)  # a new store at the old path
        tier.write_batch([BatchPut(PendingPut(KEY_B, NAME_B, tensor(2, rows=256, cols=512)), "org/model")])
        _open_elsewhere(path)  # the new store opened again: it sweeps dead writers' files
        assert not [n for n in os.listdir(path / "blobs") if n.endswith(".ecb")], \
            "the moved store's blob file went into the new store's blobs/"
        assert torch.equal(_get(tier, KEY_A, NAME_A), tensor(1, rows=256, cols=512))
        assert torch.equal(_get(tier, KEY_B, NAME_B), tensor(2, rows=256, cols=512))
        assert len(tier.referenced_files()) == 2
    finally:
        tier.close()
    assert fc.run_verify_cli(moved).returncode == 0
    a = fc.audit(moved, 16 * MiB).check()
    assert not a.unreferenced_files
