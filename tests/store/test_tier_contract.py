"""The tier contract (ecstore.testing.tier_contract) run directly against
each tier: the memory tier and the LMDB tier (a real LMDB file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ecstore.format import PendingPut, PutOutcome
from ecstore.lmdb import BatchPut, LMDBTier
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
        req = BatchPut(PendingPut(key, identifier, t), "org/model")
        tier.write_batch([req])
        assert req.outcome is PutOutcome.STORED, req.error

    @pytest.mark.parametrize("part", ["record", "blob"])
    def test_damaged_record_or_blob_is_a_miss_and_dropped(self, tier: LMDBTier, part: str) -> None:
        self.damaged_entry_is_dropped(tier, part)

    def damaged_entry_is_dropped(self, tier: LMDBTier, part: str) -> None:
        """An entry damaged in ``part`` (see ``corrupt_entry``) is a miss and
        is dropped by the failed read, accounting included."""
        from ecstore.testing.tier_contract import KEY_A, NAME_A, tensor

        self.insert(tier, KEY_A, NAME_A, tensor(1))
        corrupt_entry(tier, KEY_A, part)
        assert tier.get(KEY_A, NAME_A) is None
        assert tier.identifier_at(KEY_A) is None  # dropped by the failed read
        assert tier.total_bytes() == 0

    def damage(self, tier: LMDBTier, key: str) -> None:
        corrupt_entry(tier, key, "blob")


class TestLMDBTierFileBlobs(TestLMDBTier):
    """The same contract with every blob kept in a file of its own
    (``file_blobs_from=0``), plus the damage only a file can suffer."""

    def make_tier(self, tmp_path: Path) -> LMDBTier:
        return LMDBTier(str(tmp_path / "store"), 16 * MiB, file_blobs_from=0)

    def insert(self, tier: LMDBTier, key: str, identifier: str, t: torch.Tensor) -> None:
        super().insert(tier, key, identifier, t)
        assert tier.referenced_files(), "the blob went into LMDB, not a file"

    @pytest.mark.parametrize("part", ["file", "truncate", "blob"])
    def test_missing_short_or_flipped_file_is_a_miss_and_dropped(self, tier: LMDBTier, part: str) -> None:
        self.damaged_entry_is_dropped(tier, part)
        assert [n for n in os.listdir(tier.files.dir) if n.endswith(".ecb")] == []

    @pytest.mark.parametrize("parts", [("pointer",), ("pointer", "record")])
    def test_a_damaged_pointer_is_a_miss_and_its_file_is_deleted(self, tier: LMDBTier,
                                                                 parts: tuple[str, ...]) -> None:
        """The pointer LMDB keeps to a blob file is damaged (with or without
        its record): the entry is a miss and dropped, and the file it named,
        found through the files index, is deleted with it. It was left on
        disk for good (no pointer named it, yet its writer's token was live
        or the index still held it), and with the record also unreadable
        ``total_bytes`` kept the file's size: the cap shrank for good."""
        from ecstore.testing.faults import audit
        from ecstore.testing.tier_contract import KEY_A, KEY_B, NAME_A, NAME_B, tensor

        self.insert(tier, KEY_A, NAME_A, tensor(1, rows=256, cols=256))
        self.insert(tier, KEY_B, NAME_B, tensor(2, rows=256, cols=256))
        kept = self._file_of(tier, KEY_B)
        for part in parts:
            corrupt_entry(tier, KEY_A, part)
        assert tier.get(KEY_A, NAME_A) is None
        assert tier.identifier_at(KEY_A) is None
        assert {n for n in os.listdir(tier.files.dir) if n.endswith(".ecb")} == {kept}
        assert tier.total_bytes() == os.path.getsize(os.path.join(tier.files.dir, kept))
        audit(tier.path, 16 * MiB, tier=tier).check()
        assert torch.equal(tier.get(KEY_B, NAME_B), tensor(2, rows=256, cols=256))

    @pytest.mark.parametrize("lie", ["shape", "fewer bytes", "more bytes", "dtype", "no element, huge dimensions"])
    def test_a_record_lying_about_the_files_layout_is_a_miss_never_garbage(self, tier: LMDBTier,
                                                                          lie: str) -> None:
        """A small entry's file is read in one go where its record says the
        data starts, into a tensor shaped after the record, before the header
        is checked: a readable record that lies about the layout (another
        shape of the same bytes, fewer or more data bytes in a file of the
        same size, another dtype) must fail that check, a miss and dropped."""
        import dataclasses

        from ecstore.format import pack_record
        from ecstore.testing.tier_contract import KEY_A, KEY_B, NAME_A, NAME_B, tensor

        t = tensor(1, rows=64, cols=64)
        self.insert(tier, KEY_A, NAME_A, t)
        self.insert(tier, KEY_B, NAME_B, tensor(2, rows=64, cols=64))
        rec = tier.record(KEY_A)
        assert rec is not None
        forged = {"shape": dataclasses.replace(rec, shape=(32, 128)),
                  "fewer bytes": dataclasses.replace(rec, shape=(64, 32), nbytes=rec.nbytes // 2),
                  "more bytes": dataclasses.replace(rec, shape=(66, 64), nbytes=rec.nbytes + 256),
                  "dtype": dataclasses.replace(rec, dtype="float16"),
                  # no byte to read, yet torch cannot allocate it (its strides
                  # overflow): RuntimeError escaped get() instead of a miss
                  "no element, huge dimensions": dataclasses.replace(rec, shape=(0, 1 << 47, 1 << 47), nbytes=0)}[lie]
        with tier._write_txn() as txn:
            txn.put(KEY_A.encode(), pack_record(forged), db=tier._dbs.entries)
        assert tier.get(KEY_A, NAME_A) is None
        assert tier.identifier_at(KEY_A) is None
        assert torch.equal(tier.get(KEY_B, NAME_B).view(torch.int16), tensor(2, rows=64, cols=64).view(torch.int16))

    def test_a_damaged_pointer_with_a_damaged_files_index_row_is_a_miss(self, tier: LMDBTier) -> None:
        """A damaged pointer is resolved through the files index; a row of
        that index with a non-ASCII name (damage too) naming the entry made
        the removal raise UnicodeEncodeError out of get(). The row goes, the
        entry is a miss and dropped."""
        from ecstore.testing.tier_contract import KEY_A, NAME_A, tensor

        self.insert(tier, KEY_A, NAME_A, tensor(1, rows=64, cols=64))
        bad_row = b"\xe6" + b"0" * 15 + b"-9.ecb"
        with tier._write_txn() as txn:
            txn.put(bad_row, KEY_A.encode(), db=tier._dbs.files)
        corrupt_entry(tier, KEY_A, "pointer")
        assert tier.get(KEY_A, NAME_A) is None
        assert tier.identifier_at(KEY_A) is None
        with tier.snapshot() as (txn, dbs):
            assert txn.get(bad_row, db=dbs.files) is None
        assert [n for n in os.listdir(tier.files.dir) if n.endswith(".ecb")] == []

    def test_a_fifo_or_directory_in_place_of_the_file_is_a_miss_never_a_hang(self, tier: LMDBTier) -> None:
        from ecstore.testing.tier_contract import KEY_A, KEY_B, NAME_A, NAME_B, tensor

        self.insert(tier, KEY_A, NAME_A, tensor(1))
        self.insert(tier, KEY_B, NAME_B, tensor(2))
        for key, make in ((KEY_A, os.mkfifo), (KEY_B, os.mkdir)):
            path = os.path.join(tier.files.dir, self._file_of(tier, key))
            os.unlink(path)
            make(path)
        assert tier.get(KEY_A, NAME_A) is None and tier.get(KEY_B, NAME_B) is None
        assert tier.identifier_at(KEY_A) is None and tier.identifier_at(KEY_B) is None

    @staticmethod
    def _file_of(tier: LMDBTier, key: str) -> str:
        """The name of the blob file ``key``'s entry points to."""
        from ecstore.lmdb.txn import file_ref

        with tier.snapshot() as (txn, dbs):
            ref = file_ref(txn.get(key.encode(), db=dbs.blobs))
        assert ref is not None
        return ref.name

    def test_delete_and_eviction_remove_the_files(self, tier: LMDBTier) -> None:
        from ecstore.testing.tier_contract import tensor

        for i in range(6):  # 6 x ~2 MiB in a 16 MiB tier... then more than fits
            self.insert(tier, f"org/model@1@0@h{i}@bfloat16", f"ns/h{i}", tensor(i, rows=1024, cols=1024))
        for i in range(6, 12):
            self.insert(tier, f"org/model@1@0@h{i}@bfloat16", f"ns/h{i}", tensor(i, rows=1024, cols=1024))
        assert tier.evictions > 0
        on_disk = {n for n in os.listdir(tier.files.dir) if n.endswith(".ecb")}
        assert on_disk == tier.referenced_files()
        assert sum(os.path.getsize(os.path.join(tier.files.dir, n)) for n in on_disk) == tier.total_bytes()
        assert tier.total_bytes() <= 16 * MiB
        assert tier.delete("org/model@1@0@h11@bfloat16")
        assert {n for n in os.listdir(tier.files.dir) if n.endswith(".ecb")} == tier.referenced_files()
