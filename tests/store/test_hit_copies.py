"""A hit is the caller's own tensor: modifying a disk hit (promoted to the
memory tier) does not change later hits. Real LMDB files.
"""

from __future__ import annotations

from helpers.fault_workers import open_store
from helpers.tensors import assert_same, make_tensor

MiB = 1 << 20


def test_modifying_a_disk_hit_does_not_change_later_hits(tmp_path):
    path = tmp_path / "s"
    with open_store(path) as s:
        s.put("e0", make_tensor(0))
    with open_store(path, cpu=8 * MiB) as s:
        got = s.get("e0")  # disk hit, promoted to the memory tier
        assert s.stats().disk_hits == 1
        got.fill_(0)
        again = s.get("e0")
        assert s.stats().memory_hits == 1
        assert_same(again, make_tensor(0))
