"""The tier contract (ecstore.testing.tier_contract) run directly against
each tier: the memory tier and the LMDB tier (a real LMDB file)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ecstore.lmdb import LMDBTier, PutRequest
from ecstore.memory import MemoryTier
from ecstore.testing.faults import corrupt_entry
from ecstore.testing.tier_contract import DamageTests, TierTests

MiB = 1 << 20


class TestMemoryTier(TierTests):
    def make_tier(self, tmp_path: Path) -> MemoryTier:
        return MemoryTier(MiB)

    def insert(self, tier: MemoryTier, key: str, identifier: str, t: torch.Tensor) -> None:
        assert tier.put(key, identifier, t, t.numel() * t.element_size())


class TestLMDBTier(DamageTests):
    def make_tier(self, tmp_path: Path) -> LMDBTier:
        return LMDBTier(str(tmp_path / "store"), 16 * MiB)

    def close_tier(self, tier: LMDBTier) -> None:
        tier.close()

    def insert(self, tier: LMDBTier, key: str, identifier: str, t: torch.Tensor) -> None:
        req = PutRequest(key, identifier, "org/model", t)
        tier.write_batch([req])
        assert req.result == "stored", req.error

    @pytest.mark.parametrize("part", ["record", "blob"])
    def test_damaged_record_or_blob_is_a_miss_and_dropped(self, tier: LMDBTier, part: str) -> None:
        from ecstore.testing.tier_contract import KEY_A, NAME_A, tensor

        self.insert(tier, KEY_A, NAME_A, tensor(1))
        corrupt_entry(tier, KEY_A, part)
        assert tier.get(KEY_A, NAME_A) is None
        assert tier.identifier_at(KEY_A) is None  # dropped by the failed read
        assert tier.total_bytes() == 0

    def damage(self, tier: LMDBTier, key: str) -> None:
        corrupt_entry(tier, key, "blob")
