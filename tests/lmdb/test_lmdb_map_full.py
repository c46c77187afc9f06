"""A full LMDB map under concurrent writers (write_batch's MAP_FULL retries).

When a write finds the map full, LMDBTier evicts and retries. The defect:
with other writers active, a write gave up with StoreFullError ("map ... is
full and nothing more can be evicted") after three rounds in which it found
nothing to evict -- although in each round *other* writers had committed:
their evictions had already removed what this writer would have evicted,
and their puts consumed the pages those evictions freed. The store was
healthy; every write of every other process succeeded.

The interleaving is driven deterministically: a second handle on the same
store (a real LMDB writer; LMDB serialises it with the first exactly as it
serialises processes) commits between the first handle's attempts, through
hooks on the first handle's retry steps. No timing is involved.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
from helpers.fault_fs import find_all as fc_find_all
from helpers.tensors import assert_same

from ecstore import StoreFullError
from ecstore.format import PendingPut, PutOutcome
from ecstore.key import make_key
from ecstore.lmdb import BatchPut, LMDBTier
from ecstore.testing import faults as fc

MiB = 1 << 20
KiB = 1 << 10
#: A map of 4 MiB under a cap of 64 MiB: only the map limits what fits.
MAP = 4 * MiB
CAP = 64 * MiB
#: These tests fill the LMDB map: every blob stays inside it (none in a file).
INLINE = 1 << 62
#: Each blob is ~2.5 MiB: one fits in the map, two never do.
ROWS = 2560


def key(idx: int) -> str:
    return make_key(fc.MODEL, f"{idx:016x}", "bfloat16")


def name(idx: int) -> str:
    return f"{0:032x}/img-{idx}"


def _put(tier: LMDBTier, idx: int, rows: int = ROWS) -> BatchPut:
    """Put entry ``idx`` (``rows`` KiB: by default a ~2.5 MiB blob) through
    ``tier.write_batch``."""
    req = BatchPut(PendingPut(key(idx), name(idx), fc.entry_tensor(idx, rows)), fc.MODEL)
    tier.write_batch([req])
    return req


def _exhaust_the_map(tier: LMDBTier) -> int:
    """Commit namespace descriptions of halving sizes (1 MiB down to 1 byte)
    until not one more page can be allocated; returns how many. With a reader
    pinning the pages freed meanwhile, no write transaction can then commit
    anything (not even a delete: copy-on-write needs a fresh page)."""
    n, size = 0, MiB
    while size >= 1:
        try:
            with tier._write_txn() as txn:  # raw: fails at once when no page is left
                txn.put(f"pad{n}".encode(), bytes(size), db=tier._dbs.namespaces)
            n += 1
        except lmdb.MapFullError:
            size //= 2
    return n


def test_write_keeps_retrying_while_other_writers_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Six rounds in a row, handle A's put finds the map full (B's entry
    fills it) and nothing to evict (B removed its entry just before A's
    eviction, as another process's eviction would), and B then puts a new
    entry into the pages that removal freed. A must keep retrying while B
    commits, and store its entry once B stops: before the fix it raised
    StoreFullError after the fourth such round."""
    path = str(tmp_path / "s")
    a = LMDBTier(path, CAP, map_size_bytes=MAP, file_blobs_from=INLINE)
    b = LMDBTier(path, CAP, map_size_bytes=MAP, file_blobs_from=INLINE)
    rounds = 6
    seen = {"attempts": 0, "emptied": 0}
    b_keys: list[str] = []

    def b_puts() -> None:  # B's writer: a new entry (it reuses the pages B's removal freed)
        idx = 100 + len(b_keys)
        assert _put(b, idx).outcome is PutOutcome.STORED
        b_keys.append(key(idx))

    real_write_once, real_evict_to = a._write_once, a._evict_to

    def write_once(todo, touches, *rest):  # A's attempt, after B committed a put
        seen["attempts"] += 1
        if seen["attempts"] <= rounds:
            b_puts()
        return real_write_once(todo, touches, *rest)

    def evict_to(target, extra=0):  # A's eviction, after another writer emptied the store
        if seen["emptied"] < rounds and b_keys and b.identifier_at(b_keys[-1]) is not None:
            assert b.delete(b_keys[-1])
            seen["emptied"] += 1
        return real_evict_to(target, extra)

    monkeypatch.setattr(a, "_write_once", write_once)
    monkeypatch.setattr(a, "_evict_to", evict_to)
    try:
        req = _put(a, 1)
        assert req.outcome is PutOutcome.STORED, req.error
        assert seen["emptied"] == rounds and seen["attempts"] > rounds  # the interleaving happened
        assert_same(a.get(key(1), name(1)), fc.entry_tensor(1, ROWS))
        assert a.total_bytes() == len(req.encoded)
        fc.audit(path, CAP, tier=a).check()
    finally:
        a.close()
        b.close()


def test_live_data_filling_the_map_still_fails_clearly(tmp_path: Path):
    """The other side of the same rule: with the map full of pinned (leased)
    live data and no other writer committing, a put that cannot fit fails
    with StoreFullError, without waiting for the patience deadline, and
    loses nothing."""
    path = str(tmp_path / "s")
    a = LMDBTier(path, CAP, map_size_bytes=MAP, file_blobs_from=INLINE)
    try:
        assert _put(a, 7).outcome is PutOutcome.STORED
        a.lease([key(7)], ttl_s=3600)
        with pytest.raises(StoreFullError, match="full and nothing more can be evicted"):
            _put(a, 8)
        assert a.identifier_at(key(8)) is None
        assert_same(a.get(key(7), name(7)), fc.entry_tensor(7, ROWS))
        a.release([key(7)])
        req = _put(a, 8)  # evicts the no longer pinned entry
        assert req.outcome is PutOutcome.STORED, req.error
        fc.audit(path, CAP, tier=a).check()
    finally:
        a.close()


@contextlib.contextmanager
def _exhausted_by_a_reader(b: LMDBTier, big: int) -> Iterator[contextlib.ExitStack]:
    """A reader of the snapshot holding B's entry ``big``; B deletes that
    entry (its pages: freed, but pinned by the reader) and exhausts the rest
    of the map. Yields the stack holding the reader: ``close()`` ends it,
    after which the next commits reuse the pages."""
    with contextlib.ExitStack() as reader:
        reader.enter_context(b.snapshot())
        assert b.delete(key(big))
        assert _exhaust_the_map(b) > 0
        yield reader


def _end_reader_at_first_retry(a: LMDBTier, reader: contextlib.ExitStack,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """End ``reader`` (its call returns) right after A's first retry commit,
    so A's wait for older readers finds it gone and the retry can proceed."""
    real_commit_nothing = a._commit_nothing

    def commit_nothing() -> None:
        real_commit_nothing()
        reader.close()

    monkeypatch.setattr(a, "_commit_nothing", commit_nothing)


def test_delete_while_a_reader_pins_the_free_pages_waits_for_it(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch):
    """A delete needs fresh pages too (copy-on-write). With the map exhausted
    while a reader pins the pages freed by other writers, it used to fail
    with StoreOpenError ("the store may be damaged"); now it waits for the
    reader (ended here at the first commit of the retry) and deletes."""
    path = str(tmp_path / "s")
    a = LMDBTier(path, CAP, map_size_bytes=MAP, file_blobs_from=INLINE)
    b = LMDBTier(path, CAP, map_size_bytes=MAP, file_blobs_from=INLINE)
    try:
        assert _put(b, 100).outcome is PutOutcome.STORED
        assert _put(b, 101, rows=4).outcome is PutOutcome.STORED
        with _exhausted_by_a_reader(b, 100) as reader:
            _end_reader_at_first_retry(a, reader, monkeypatch)
            assert a.delete(key(101))
        assert a.identifier_at(key(101)) is None and a.total_bytes() == 0
        fc.audit(path, CAP, tier=a).check()
    finally:
        a.close()
        b.close()


def test_namespace_recorded_while_a_reader_pins_the_free_pages(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch):
    """Recording a new encoder identity (namespace) needs fresh pages too.
    With the map exhausted while a reader pins the pages freed by another
    writer, it failed with StoreOpenError; now it waits for the reader, as a
    delete does, and records the namespace."""
    path = str(tmp_path / "s")
    a = LMDBTier(path, CAP, map_size_bytes=MAP, file_blobs_from=INLINE)
    b = LMDBTier(path, CAP, map_size_bytes=MAP, file_blobs_from=INLINE)
    try:
        assert _put(b, 100).outcome is PutOutcome.STORED
        with _exhausted_by_a_reader(b, 100) as reader:
            _end_reader_at_first_retry(a, reader, monkeypatch)
            a.register_namespace("ns-new", b'{"model": "m"}')
        assert a.namespace_descriptions()["ns-new"] == b'{"model": "m"}'
        fc.audit(path, CAP, tier=a).check()
    finally:
        a.close()
        b.close()


def test_open_with_a_smaller_cap_while_the_map_is_exhausted_opens(tmp_path: Path):
    """Opening a handle with a smaller cap evicts down to it (best effort).
    When that eviction's own transaction met MDB_MAP_FULL (a reader pinning
    the free pages), the open failed with StoreOpenError; now it logs, the
    handle opens, and its next put evicts down to the cap."""
    path = str(tmp_path / "s")
    b = LMDBTier(path, CAP, map_size_bytes=MAP, file_blobs_from=INLINE)
    small_cap = 6 * KiB
    try:
        assert _put(b, 100).outcome is PutOutcome.STORED
        assert _put(b, 101, rows=8).outcome is PutOutcome.STORED  # ~8 KiB: over the small cap
        with _exhausted_by_a_reader(b, 100):
            small = LMDBTier(path, small_cap, file_blobs_from=INLINE)
        try:
            assert small.total_bytes() > small_cap  # could not evict at open
            req = _put(small, 102, rows=4)  # ~4 KiB: evicts 101 to fit
            assert req.outcome is PutOutcome.STORED, req.error
            assert small.identifier_at(key(101)) is None
            assert small.total_bytes() <= small_cap
            fc.audit(path, small_cap, tier=small).check()
        finally:
            small.close()
    finally:
        b.close()


def test_eviction_that_finds_the_map_exhausted_waits_instead_of_failing(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    """Handle A's put finds the map full; before A evicts, another writer B
    deletes its large entry while a reader of an older snapshot still pins
    those pages, and fills the rest of the map: A's eviction transaction
    itself then fails with MDB_MAP_FULL (no page for its copy-on-write).
    The reader ends right after. Before the fix, that MapFullError (not even
    an ECStoreError) escaped write_batch and the put failed; now the round
    counts as one without progress, the retry reuses the pages the reader
    released, and the put is stored."""
    path = str(tmp_path / "s")
    a = LMDBTier(path, CAP, map_size_bytes=MAP, file_blobs_from=INLINE)
    b = LMDBTier(path, CAP, map_size_bytes=MAP, file_blobs_from=INLINE)
    reader = contextlib.ExitStack()
    seen = {"evict_map_full": 0, "pads": 0}
    try:
        assert _put(b, 100).outcome is PutOutcome.STORED  # X: ~2.5 MiB, A's entry cannot fit beside it
        assert _put(b, 101, rows=4).outcome is PutOutcome.STORED  # Z: small, evictable
        real_evict_to = a._evict_to

        def evict_to(target, extra=0):
            if seen["pads"] == 0:  # X's pages: freed, but pinned by the reader
                seen["pads"] = 1
                reader.enter_context(_exhausted_by_a_reader(b, 100))
            try:
                return real_evict_to(target, extra)
            except Exception as e:
                seen["evict_map_full"] += "MDB_MAP_FULL" in str(e)
                raise
            finally:
                reader.close()  # the reader's call ends

        monkeypatch.setattr(a, "_evict_to", evict_to)
        req = _put(a, 1, rows=ROWS - 160)  # a little smaller than X: fits in X's pages
        assert req.outcome is PutOutcome.STORED, req.error
        assert seen["evict_map_full"] == 1 and seen["pads"] > 0  # the interleaving happened
        assert_same(a.get(key(1), name(1)), fc.entry_tensor(1, ROWS - 160))
        fc.audit(path, CAP, tier=a).check()
    finally:
        reader.close()
        a.close()
        b.close()


def test_damaged_page_met_by_the_map_full_eviction_is_an_ecstore_error(tmp_path: Path):
    """write_batch finds the map full and evicts to make room; that eviction
    walks the LRU index, whose leaf page is damaged (its page type made
    invalid, as in test_faults' damaged-page test). LMDB answers
    MDB_CORRUPTED there, and write_batch -- not wrapped like the other tier
    methods -- let that lmdb.CorruptedError escape to the caller. Every error
    ecstore raises is an ECStoreError: StoreOpenError, saying the store may
    be damaged; the put fails with it and nothing is written."""
    from ecstore import ECStoreError, StoreOpenError

    path = str(tmp_path / "s")
    a = LMDBTier(path, CAP, map_size_bytes=MAP, file_blobs_from=INLINE)
    assert _put(a, 0).outcome is PutOutcome.STORED
    seq = a.record(key(0)).lru_seq
    a.close()
    data_file = Path(path) / "data.mdb"
    hits = fc_find_all(data_file.read_bytes(), struct.pack(">Q", seq) + key(0).encode())
    assert len(hits) == 1  # the LRU row of entry 0, in the LRU index's only leaf page
    with open(data_file, "r+b") as fh:
        fh.seek(hits[0] // 4096 * 4096 + 10)  # mp_flags of that page's header
        fh.write(b"\xff\x7f")
    a = LMDBTier(path, CAP, map_size_bytes=MAP, file_blobs_from=INLINE)
    try:
        req = BatchPut(PendingPut(key(1), name(1), fc.entry_tensor(1, ROWS)), fc.MODEL)
        with pytest.raises(ECStoreError) as info:
            a.write_batch([req])  # the map holds one such blob: full, so it evicts
        assert isinstance(info.value, StoreOpenError) and "damaged" in str(info.value), info.value
        assert req.outcome is PutOutcome.FAILED and req.error is info.value
        assert not a.contains(key(1), name(1))
    finally:
        a.close()


def _nested_txn_while_another_thread_adopts_a_grown_map(path: str) -> list[str]:
    """Worker: this thread holds a read transaction (a tooling snapshot)
    while another process grows the map; a second thread then meets
    MDB_MAP_RESIZED and waits to adopt the new size until no transaction of
    this process is open; this thread then begins a second transaction."""
    import subprocess
    import sys
    import threading

    from ecstore import ECStoreError

    helpers = Path(__file__).resolve().parents[1] / "helpers"
    out: list[str] = []
    t = LMDBTier(path, 1 * MiB, file_blobs_from=INLINE)
    try:
        assert _put(t, 0, rows=64).outcome is PutOutcome.STORED
        gate = t._shared.gate
        with t.snapshot():
            cp = subprocess.run([sys.executable, str(helpers / "grow_store.py"), path, "8"], capture_output=True,
                                text=True, timeout=300)
            assert cp.returncode == 0, cp.stderr
            other = threading.Thread(target=lambda: out.append(f"thread {t.contains(key(0), name(0))}"))
            other.start()
            with gate._cv:  # until the other thread waits to adopt the new size (for our transaction)
                while not gate._resizing:
                    gate._cv.wait(0.01)
            try:
                out.append(f"nested {t.contains(key(0), name(0))}")
            except ECStoreError as e:
                out.append(f"nested {type(e).__name__}: {e}")
        other.join()
        out.append(f"after {t.contains(key(0), name(0))}")
    finally:
        t.close()
    return out


def test_nested_transaction_while_another_thread_adopts_a_grown_map_does_not_deadlock(tmp_path: Path):
    """_TxnGate: a thread holding a transaction that begins another while a
    second thread waits to adopt a map another process grew deadlocked (the
    second thread waits for the first one's transaction to end; the first
    waited for the resize). No production path nests transactions in one
    thread (tooling does: a ``snapshot()`` or ``iter_records()`` loop calling
    the tier). The nested begin now goes ahead (the resize cannot happen
    while a transaction is open) and, meeting MDB_MAP_RESIZED itself, raises
    a StoreOpenError saying to retry; everything works once it ended."""
    from ecstore.testing.faults import run_forked

    res = run_forked(_nested_txn_while_another_thread_adopts_a_grown_map, str(tmp_path / "s"), timeout=120)
    out = res.ok()
    assert out[0].startswith("nested StoreOpenError") and "retry" in out[0], out
    assert out[1:] == ["thread True", "after True"], out
