"""``ecstore-dump verify`` on a store in use, with blob files: entries
another process removes while verify runs are "vanished", never damage, and
the files-index check compares one snapshot with itself. The other process
is stood in for by a second handle of the directory that commits at the
exact point verify is most exposed (a subclass of the tier calls it there)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from ecstore.format import PendingPut, PutOutcome
from ecstore.lmdb import BatchPut, LMDBTier
from ecstore.maintenance import inspect
from ecstore.maintenance.entries import read_entry
from ecstore.testing.tier_contract import KEY_A, KEY_B, NAME_A, NAME_B, tensor

MiB = 1 << 20


class Interleaved(LMDBTier):
    """A tier that runs ``on_resolve`` (once) when verify reads an entry's
    blob file, ``on_index`` when it reads the files index."""

    on_resolve: Callable[[], None] | None = None
    on_index: Callable[[], None] | None = None

    def resolve_blob(self, value):  # type: ignore[no-untyped-def]
        hook, self.on_resolve = self.on_resolve, None
        if hook is not None:
            hook()
        return super().resolve_blob(value)

    def referenced_files(self) -> set[str]:
        hook, self.on_index = self.on_index, None
        if hook is not None:
            hook()
        return super().referenced_files()


def _put(tier: LMDBTier, key: str, name: str, seed: int) -> None:
    p = BatchPut(PendingPut(key, name, tensor(seed, rows=64, cols=64)), "org/model")
    tier.write_batch([p])
    assert p.outcome is PutOutcome.STORED, p.error


@pytest.fixture
def handles(tmp_path) -> Iterator[tuple[LMDBTier, Interleaved]]:
    """(the other process's handle, verify's handle) on one store, every
    blob in a file; entry A stored."""
    path = str(tmp_path / "store")
    other = LMDBTier(path, 16 * MiB, file_blobs_from=0)
    tier = Interleaved(path, 16 * MiB, file_blobs_from=0)
    try:
        _put(other, KEY_A, NAME_A, 1)
        yield other, tier
    finally:
        tier.close()
        other.close()


def test_an_entry_removed_while_verify_reads_its_file_is_vanished_not_bad(handles):
    other, tier = handles
    tier.on_resolve = lambda: other.remove(KEY_A)  # evicted by "another process" after verify's read
    res = inspect.verify(tier)
    assert res.bad == [], res.bad
    assert res.clean and res.vanished == 1


def test_an_entry_committed_while_verify_checks_the_files_index_is_no_problem(handles):
    other, tier = handles
    put_b = lambda: _put(other, KEY_B, NAME_B, 2)  # noqa: E731  # a put committed during verify
    tier.on_index = tier.on_resolve = put_b
    res = inspect.verify(tier)
    assert res.problems == [], res.problems
    assert tier.on_resolve is None or tier.on_index is None, "nothing was committed during verify"


def test_show_or_export_of_an_entry_removed_while_its_file_is_read_is_absent_not_damaged(handles):
    """``ecstore-dump show``/``export`` read an entry through
    ``maintenance.entries.read_entry``: an entry another process removed
    (its file deleted) right after the snapshot is absent, not damaged."""
    other, tier = handles
    tier.on_resolve = lambda: other.remove(KEY_A)
    assert read_entry(tier, KEY_A) == (None, None, False)
    _put(other, KEY_B, NAME_B, 2)  # a healthy entry reads as before
    rec, blob, present = read_entry(tier, KEY_B)
    assert present and rec is not None and blob is not None and len(blob) == rec.blob_size
