"""Contract tests of :class:`ecstore.store.tiers.Tier`, shipped with the package.

In the style of zarr's ``StoreTests``: subclass :class:`TierTests` in a test
module (name it ``Test...``) and implement the hooks:

* ``make_tier(tmp_path)`` -> a new, empty tier (closed by ``close_tier``);
* ``insert(tier, key, identifier, tensor)`` -> put one entry in (the
  back door: each tier is written differently);
* for tiers that keep entries on a medium (add :class:`DamageTests` to the
  bases): ``damage(tier, key)`` -> damage the entry in place (the memory
  tier holds tensors by reference: nothing there can be damaged).

``tests/store/test_tier_contract.py`` runs it against the memory and LMDB tiers.
The class name does not start with ``Test``: pytest collects it only through
subclasses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ecstore.key import make_key
from ecstore.store.tiers import Tier

KEY_A = make_key("org/model", "0123456789abcdef", "bfloat16")
KEY_B = make_key("org/model", "fedcba9876543210", "bfloat16")
NAME_A = "0" * 32 + "/img-a"
NAME_B = "0" * 32 + "/img-b"


def tensor(seed: int, rows: int = 4, cols: int = 8) -> torch.Tensor:
    """A bf16 tensor whose values identify ``seed``."""
    return (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) / 16 + seed).to(torch.bfloat16)


class TierTests:
    """The contract; see the module docstring for the hooks."""

    # ------------------------------------------------------------- hooks
    def make_tier(self, tmp_path: Path) -> Any:
        raise NotImplementedError

    def close_tier(self, tier: Any) -> None:
        """Release the tier (default: nothing to do)."""

    def insert(self, tier: Any, key: str, identifier: str, t: torch.Tensor) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------- fixture
    @pytest.fixture
    def tier(self, tmp_path: Path) -> Any:
        t = self.make_tier(tmp_path)
        yield t
        self.close_tier(t)

    # ------------------------------------------------------------ tests
    def test_is_a_tier(self, tier: Any) -> None:
        assert isinstance(tier, Tier)

    def test_empty_tier_misses(self, tier: Any) -> None:
        assert tier.get(KEY_A, NAME_A) is None
        assert not tier.contains(KEY_A, NAME_A)
        assert tier.identifier_at(KEY_A) is None
        assert tier.delete(KEY_A) is False

    def test_inserted_entry_reads_back_exactly(self, tier: Any) -> None:
        t = tensor(1)
        self.insert(tier, KEY_A, NAME_A, t)
        got = tier.get(KEY_A, NAME_A)
        assert got is not None and got.dtype == t.dtype and torch.equal(got, t)
        assert tier.contains(KEY_A, NAME_A)
        assert tier.identifier_at(KEY_A) == NAME_A

    def test_another_name_under_the_key_is_a_miss(self, tier: Any) -> None:
        """A 64-bit collision or another identity: never the other entry's tensor."""
        self.insert(tier, KEY_A, NAME_A, tensor(1))
        assert tier.get(KEY_A, NAME_B) is None
        assert not tier.contains(KEY_A, NAME_B)
        assert tier.identifier_at(KEY_A) == NAME_A  # the entry itself is untouched
        assert torch.equal(tier.get(KEY_A, NAME_A), tensor(1))

    def test_keys_are_independent(self, tier: Any) -> None:
        self.insert(tier, KEY_A, NAME_A, tensor(1))
        self.insert(tier, KEY_B, NAME_B, tensor(2))
        assert torch.equal(tier.get(KEY_A, NAME_A), tensor(1))
        assert torch.equal(tier.get(KEY_B, NAME_B), tensor(2))
        assert tier.delete(KEY_A) is True
        assert tier.get(KEY_A, NAME_A) is None
        assert torch.equal(tier.get(KEY_B, NAME_B), tensor(2))

    def test_delete_removes_whatever_name(self, tier: Any) -> None:
        self.insert(tier, KEY_A, NAME_A, tensor(1))
        assert tier.delete(KEY_A) is True
        assert tier.delete(KEY_A) is False
        assert tier.identifier_at(KEY_A) is None
        assert not tier.contains(KEY_A, NAME_A)


class DamageTests(TierTests):
    """Contract of tiers whose entries live on a medium that can be damaged
    (all of :class:`TierTests`, plus): a damaged entry is a miss, the others
    are untouched."""

    def damage(self, tier: Any, key: str) -> None:
        raise NotImplementedError

    def test_damaged_entry_is_a_miss(self, tier: Any) -> None:
        self.insert(tier, KEY_A, NAME_A, tensor(1))
        self.insert(tier, KEY_B, NAME_B, tensor(2))
        self.damage(tier, KEY_A)
        assert tier.get(KEY_A, NAME_A) is None
        assert tier.get(KEY_A, NAME_A) is None  # and stays one
        assert torch.equal(tier.get(KEY_B, NAME_B), tensor(2))  # the others are untouched
