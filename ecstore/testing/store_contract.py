"""Contract tests of :class:`ecstore.ECStore`, shipped with the package: the
behaviour every tier layout must have, to run against your own configuration.

In the style of zarr's ``StoreTests``: :class:`StoreContract` is a mixin
holding the tests; subclass it in a test module (name the class ``Test...``)
and implement the hooks:

* ``make_store(tmp_path, **caps)`` -> an open :class:`ecstore.ECStore`.
  ``caps``: ``cap_bytes`` (the byte bound of the tier that decides which
  entries survive; default: large), plus any ECStore keyword (``dtype``,
  ``chunk_hasher``, ``model``).
* ``cost(store, identifier, tensor)``: the bytes that tier counts for an entry.
* ``used_bytes(stats)`` / ``tier_entries(store)``: its occupancy and its keys
  from least to most recently used.

``tests/store/test_store_contract.py`` runs it for memory only, LMDB only and
both. The class name does not start with ``Test`` so pytest collects it only
through the subclasses. For pytest's assertion messages, call
``pytest.register_assert_rewrite("ecstore.testing.store_contract")`` in your
``conftest.py`` before importing it. Needs pytest (the ``test`` extra).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

import ecstore
import ecstore.store.handle
from ecstore import ECStore, InvalidEntryError
from ecstore.testing.tensors import assert_same, make_tensor, raw_bytes

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
BIG = 64 << 20  # default cap: nothing gets evicted
PUT_LINE = re.compile(r"^EC put: stored (\d+) bytes for mm_hash=(.*)$")

# 16 hex digits that every identifier maps to when collisions are forced.
COLLIDING = "00c0ffee00c0ffee"


def collide(_identifier: str) -> str:
    return COLLIDING


def put_lines(caplog: pytest.LogCaptureFixture, mm_hash: str | None = None) -> list[tuple[int, str]]:
    """(N, H) of every ``EC put: stored N bytes for mm_hash=H`` INFO record."""
    out = []
    for r in caplog.records:
        if r.name != "ecstore" or r.levelno != logging.INFO:
            continue
        m = PUT_LINE.match(r.getMessage())
        if m and (mm_hash is None or m.group(2) == mm_hash):
            out.append((int(m.group(1)), m.group(2)))
    return out



@contextlib.contextmanager
def ecstore_info_to_caplog(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Let INFO records of the ``ecstore`` logger reach ``caplog`` inside the block."""
    logger = logging.getLogger("ecstore")
    old_level, old_propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = True
    caplog.set_level(logging.INFO, logger="ecstore")
    try:
        yield
    finally:
        logger.setLevel(old_level)
        logger.propagate = old_propagate

class StoreContract:
    """Behaviour every ECStore layout must have. Subclasses set the hooks."""

    # ------------------------------------------------------------------ hooks
    def make_store(self, tmp_path: Path, **caps: Any) -> ECStore:
        raise NotImplementedError

    def cost(self, store: ECStore, identifier: str, tensor: torch.Tensor) -> int:
        raise NotImplementedError

    def used_bytes(self, stats: ecstore.StoreStats) -> int:
        raise NotImplementedError

    def tier_entries(self, store: ECStore) -> list[str]:
        """Keys of the bounding tier, least recently used first."""
        raise NotImplementedError

    # ---------------------------------------------------------------- helpers
    @pytest.fixture(autouse=True)
    def _ecstore_info_logs_to_caplog(self, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
        """The ``EC put:`` line tests read ``caplog``, whatever the caller's logging set-up."""
        with ecstore_info_to_caplog(caplog):
            yield

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[ECStore]:
        s = self.make_store(tmp_path)
        yield s
        s.close()

    def settle(self, store: ECStore) -> None:
        """Make everything done so far visible in every tier (no-op in memory)."""
        store.flush()

    @staticmethod
    def one_batch(store: ECStore) -> AbstractContextManager[Any]:
        """Hold the background writer off while the body runs, so that all
        its puts and reads reach LMDB in one write transaction (the writer's
        condition is re-entrant: put/get still work from this thread)."""
        if store._writer is None:
            return contextlib.nullcontext()
        return store._writer.cv

    def snapshot(self, store: ECStore, ids: list[str]) -> dict[str, Any]:
        """Everything observable about a store, to compare before/after."""
        self.settle(store)
        st = store.stats().as_dict()
        contents = {}
        for h in ids:  # read without touching any LRU order
            if store.contains(h):
                if store.disk is not None:
                    t = store.disk.get(store.key(h), store.stored_name(h))
                else:
                    assert store.memory is not None
                    t = store.memory._items[store.key(h)].tensor
                contents[h] = raw_bytes(t)
        return {
            "stats": st,
            "memory_keys": store.memory.keys() if store.memory is not None else None,
            "disk_keys": store.disk.lru_keys() if store.disk is not None else None,
            "contents": contents,
        }

    def fill(self, store: ECStore, ids: list[str], rows: int = 4, cols: int = 16) -> dict[str, torch.Tensor]:
        tensors = {}
        for i, h in enumerate(ids):
            t = make_tensor(1000 + i, rows, cols, store.dtype)
            assert store.put(h, t) is True
            tensors[h] = t
        return tensors

    # ------------------------------------------------------------- round trip
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32,
                                       torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu])
    def test_round_trip_is_bit_exact(self, tmp_path: Path, dtype: torch.dtype) -> None:
        with self.make_store(tmp_path, dtype=dtype) as store:
            tensors = {f"img-{dtype}-{i}": make_tensor(i, rows, 24, dtype)
                       for i, rows in enumerate([1, 3, 17])}
            for h, t in tensors.items():
                assert store.put(h, t) is True
            for h, t in tensors.items():  # before the writer ran (pending / memory)
                assert_same(store.get(h), t)
            self.settle(store)
            for h, t in tensors.items():
                got = store.get(h, device="cpu")
                assert_same(got, t)
                assert_same(store.get(h, device=torch.device("cpu")), t)
            if store.disk is not None:  # straight from LMDB, bypassing memory and writer
                for h, t in tensors.items():
                    assert_same(store.disk.get(store.key(h), store.stored_name(h)), t)

    def test_nan_and_inf_survive(self, store: ECStore) -> None:
        t = torch.tensor([[float("nan"), float("inf"), float("-inf"), -0.0]], dtype=torch.bfloat16)
        t = torch.cat([t, -t])
        # A NaN with a non-default payload must keep its exact bits.
        t.view(torch.int16)[0, 0] = 0x7FC1
        assert store.put("specials", t)
        self.settle(store)
        got = store.get("specials")
        assert_same(got, t)
        assert got is not None
        assert got.view(torch.int16)[0, 0].item() == 0x7FC1

    def test_put_copies_input_and_accepts_non_contiguous(self, store: ECStore) -> None:
        base = make_tensor(7, 16, 8)
        src = base.t()  # non-contiguous view [8, 16]
        expected = src.contiguous().clone()
        assert store.put("noncontig", src)
        base.zero_()  # the caller reuses its buffer: the store must not see it
        self.settle(store)
        assert_same(store.get("noncontig"), expected)

    # ----------------------------------------------------------- key format
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    def test_key_format(self, tmp_path: Path, dtype: torch.dtype) -> None:
        with self.make_store(tmp_path, dtype=dtype) as store:
            h = "a1b2c3d4" * 8
            key = store.key(h)
            # the chunk hash covers the stored name "<namespace>/<mm identifier>"
            name = f"{store.namespace}/{h}"
            assert store.stored_name(h) == name and re.fullmatch(r"[0-9a-f]{32}", store.namespace)
            assert key == f"{MODEL}@1@0@{xxhash.xxh64_hexdigest(name.encode())}@{str(dtype)[6:]}"
            assert re.fullmatch(re.escape(MODEL) + r"@1@0@[0-9a-f]{16}@" + str(dtype)[6:], key)
            parsed = ecstore.parse_key(key)
            assert (parsed.model, parsed.world_size, parsed.worker_id, parsed.dtype) == (MODEL, 1, 0, str(dtype)[6:])
            assert str(parsed) == key
            assert store.key(h) == key  # stable
            assert store.key(h + "x") != key

    # ------------------------------------------------------ contains/delete
    def test_contains_and_delete(self, store: ECStore) -> None:
        t = make_tensor(1)
        assert not store.contains("a")
        assert store.get("a") is None
        assert store.delete("a") is False
        assert store.put("a", t) is True
        assert store.contains("a")
        self.settle(store)
        assert store.contains("a")
        assert store.delete("a") is True
        assert not store.contains("a")
        assert store.get("a") is None
        assert store.delete("a") is False
        self.settle(store)
        assert not store.contains("a")
        st = store.stats()
        assert st.memory_entries == 0 and st.memory_bytes == 0
        assert st.disk_entries == 0 and st.disk_bytes == 0
        # it can be stored again, with other content
        t2 = make_tensor(2)
        assert store.put("a", t2) is True
        self.settle(store)
        assert_same(store.get("a"), t2)

    def test_delete_before_write_reaches_disk(self, store: ECStore) -> None:
        t = make_tensor(3)
        assert store.put("pending", t)
        assert store.delete("pending") is True  # possibly still queued for the writer
        self.settle(store)
        assert not store.contains("pending")
        assert store.get("pending") is None
        st = store.stats()
        assert st.disk_entries == 0 and st.disk_bytes == 0 and st.memory_entries == 0

    def test_put_twice_returns_false_and_keeps_first(self, store: ECStore) -> None:
        t1, t2 = make_tensor(1), make_tensor(2)
        assert store.put("dup", t1) is True
        assert store.put("dup", t2) is False  # still pending / in memory
        self.settle(store)
        assert store.put("dup", t2) is False  # committed
        assert_same(store.get("dup"), t1)
        assert store.stats().puts == 1

    # ------------------------------------------------------------ eviction
    def _eviction_setup(self, tmp_path: Path, keep: int) -> tuple[ECStore, int, int]:
        probe = self.make_store(tmp_path / "probe")
        t0 = make_tensor(0)
        c = self.cost(probe, "img-0000", t0)
        probe.close()
        cap = keep * c + c // 2
        store = self.make_store(tmp_path / "s", cap_bytes=cap)
        return store, c, cap

    def test_eviction_is_lru_and_bytes_stay_bounded(self, tmp_path: Path) -> None:
        store, c, cap = self._eviction_setup(tmp_path, keep=4)
        with store:
            ids = [f"img-{i:04d}" for i in range(8)]
            ts = {h: make_tensor(i) for i, h in enumerate(ids)}
            for h in ids[:4]:
                assert store.put(h, ts[h])
                assert self.used_bytes(store.stats()) <= cap
            self.settle(store)
            assert self.tier_entries(store) == [store.key(h) for h in ids[:4]]
            assert self.used_bytes(store.stats()) == 4 * c
            # refresh img-0000 and img-0002: img-0001 then img-0003 are next out
            assert_same(store.get(ids[0]), ts[ids[0]])
            assert_same(store.get(ids[2]), ts[ids[2]])
            self.settle(store)
            assert self.tier_entries(store) == [store.key(h) for h in (ids[1], ids[3], ids[0], ids[2])]
            assert store.put(ids[4], ts[ids[4]])
            self.settle(store)
            assert self.used_bytes(store.stats()) <= cap
            assert not store.contains(ids[1]) and store.get(ids[1]) is None
            assert self.tier_entries(store) == [store.key(h) for h in (ids[3], ids[0], ids[2], ids[4])]
            assert store.put(ids[5], ts[ids[5]])
            self.settle(store)
            survivors = [h for h in ids if store.contains(h)]
            assert survivors == [ids[0], ids[2], ids[4], ids[5]]
            for h in survivors:
                assert_same(store.get(h), ts[h])
            st = store.stats()
            assert self.used_bytes(st) == 4 * c <= cap
            assert st.evictions >= 2

    def test_get_then_put_without_flush_keeps_the_entry_just_read(self, tmp_path: Path) -> None:
        """A get refreshes recency even when the put that evicts follows it
        before the writer ran: the entry just read must not be the victim."""
        store, c, cap = self._eviction_setup(tmp_path, keep=3)
        with store:
            ids = [f"img-{i:04d}" for i in range(5)]
            ts = {h: make_tensor(i) for i, h in enumerate(ids)}
            for h in ids[:3]:
                store.put(h, ts[h])
            self.settle(store)
            with self.one_batch(store):
                assert_same(store.get(ids[0]), ts[ids[0]])  # no flush in between
                assert store.put(ids[3], ts[ids[3]])
            self.settle(store)
            assert [h for h in ids if store.contains(h)] == [ids[0], ids[2], ids[3]]
            assert_same(store.get(ids[0]), ts[ids[0]])

    def test_reads_keep_their_place_when_puts_span_several_batches(self, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
        """A read made after a put that the writer commits in a later
        transaction is applied after that put, not before it."""
        monkeypatch.setattr(ecstore.store.handle, "MAX_BATCH_BYTES", 1)  # one put per LMDB transaction
        store, c, cap = self._eviction_setup(tmp_path, keep=3)
        with store:
            ids = [f"img-{i:04d}" for i in range(5)]
            ts = {h: make_tensor(i) for i, h in enumerate(ids)}
            for h in ids[:3]:
                store.put(h, ts[h])
            self.settle(store)
            with self.one_batch(store):
                assert store.put(ids[3], ts[ids[3]])  # evicts img-0000
                assert store.put(ids[4], ts[ids[4]])  # evicts img-0001
                got = store.get(ids[1])  # may still be there: its eviction is queued
                assert got is None or torch.equal(got.view(torch.uint8), ts[ids[1]].view(torch.uint8))
            self.settle(store)
            assert self.tier_entries(store) == [store.key(h) for h in ids[2:]]
            assert self.used_bytes(store.stats()) == 3 * c

    def test_filling_far_past_the_cap_without_flush(self, tmp_path: Path) -> None:
        """Many puts in a row (the writer may commit them in one batch): the
        last ones survive, nothing fails, the bound holds at every step."""
        store, c, cap = self._eviction_setup(tmp_path, keep=4)
        with store:
            ids = [f"img-{i:04d}" for i in range(16)]
            ts = {h: make_tensor(i) for i, h in enumerate(ids)}
            for h in ids[:6]:  # as fast as the writer takes them
                assert store.put(h, ts[h]) is True
                assert self.used_bytes(store.stats()) <= cap
            with self.one_batch(store):  # certainly one LMDB transaction
                for h in ids[6:]:
                    assert store.put(h, ts[h]) is True
                    assert self.used_bytes(store.stats()) <= cap
            self.settle(store)  # raises StoreFullError if a write failed
            st = store.stats()
            assert self.used_bytes(st) == 4 * c <= cap
            assert st.write_errors == 0
            assert self.tier_entries(store) == [store.key(h) for h in ids[-4:]]
            assert [h for h in ids if store.contains(h)] == ids[-4:]
            for h in ids[-4:]:
                assert_same(store.get(h), ts[h])

    def test_unequal_sizes_respect_the_byte_bound(self, tmp_path: Path) -> None:
        store, c, cap = self._eviction_setup(tmp_path, keep=6)
        with store:
            puts = []
            for i in range(30):
                rows = 1 + (i * 7) % 5
                h = f"var-{i:03d}"
                t = make_tensor(500 + i, rows, 16)
                assert store.put(h, t)
                puts.append((h, t, self.cost(store, h, t)))
                if i % 4 == 0:
                    self.settle(store)
                assert self.used_bytes(store.stats()) <= cap
            self.settle(store)
            # expected survivors: the longest suffix of puts that fits
            expected: list[str] = []
            total = 0
            for h, _, size in reversed(puts):
                if total + size > cap:
                    break
                expected.insert(0, h)
                total += size
            assert [h for h, _, _ in puts if store.contains(h)] == expected
            assert self.used_bytes(store.stats()) == total
            for h, t, _ in puts:
                if h in expected:
                    assert_same(store.get(h), t)

    # ---------------------------------------------------------- collisions
    def test_colliding_identifiers_are_never_confused(self, tmp_path: Path) -> None:
        with self.make_store(tmp_path, chunk_hasher=collide) as store:
            first, second = "image-first", "image-second"
            t1, t2 = make_tensor(1), make_tensor(2)
            assert store.key(first) == store.key(second)
            assert store.key(first).split("@")[3] == COLLIDING
            assert store.put(first, t1) is True
            assert store.put(second, t2) is False  # first is pending / in memory
            assert store.get(second) is None
            assert not store.contains(second)
            assert store.delete(second) is False
            self.settle(store)
            for _ in range(2):
                assert store.put(second, t2) is False  # first is committed
                assert store.get(second) is None
                assert not store.contains(second)
                assert store.delete(second) is False
                assert store.contains(first)
                assert_same(store.get(first), t1)
                self.settle(store)
            st = store.stats()
            assert st.puts == 1
            assert st.memory_entries + st.disk_entries >= 1
            if store.disk is not None:
                assert store.disk.lru_keys() == [store.key(first)]
                assert store.disk.record(store.key(first)).identifier == store.stored_name(first)
                assert store.disk.record(store.key(first)).mm_identifier == first

    def test_delete_of_colliding_identifier_keeps_queued_first(self, tmp_path: Path) -> None:
        """delete(second) must not cancel a not-yet-written put of first
        (same key, other identifier)."""

        def hasher(s: str) -> str:
            return COLLIDING if s.endswith(("/first", "/second")) else xxhash.xxh64_hexdigest(s.encode())

        with self.make_store(tmp_path, chunk_hasher=hasher) as store:
            t1 = make_tensor(1)
            writer = store._writer
            if writer is None:  # memory only: nothing is ever queued
                assert store.put("first", t1)
                assert store.delete("second") is False
                assert_same(store.get("first"), t1)
                return
            assert store.disk is not None  # a writer: an LMDB tier
            # Block the writer inside a commit of an unrelated entry, so that
            # "first" is still waiting in the queue when delete("second") runs.
            with store.disk._shared.write_lock:
                assert store.put("blocker", make_tensor(9))
                with writer.cv:
                    while not writer.puts.taken:
                        writer.cv.wait(0.05)
                assert store.put("first", t1)
                with writer.cv:
                    assert store.key("first") in writer.puts.queued
                assert store.delete("second") is False
                assert store.contains("first")
            store.flush()
            assert store.contains("first")
            assert store.disk.contains(store.key("first"), store.stored_name("first"))
            assert_same(store.disk.get(store.key("first"), store.stored_name("first")), t1)
            assert_same(store.get("first"), t1)

    # ------------------------------------------------------- refused inputs
    REFUSED: dict[str, Callable[[torch.dtype], Any]] = {
        "list": lambda dt: [[1.0, 2.0]],
        "numpy": lambda dt: np.zeros((2, 4), dtype=np.float32),
        "scalar": lambda dt: torch.tensor(1.0, dtype=dt),
        "1-D": lambda dt: torch.zeros(16, dtype=dt),
        "3-D": lambda dt: torch.zeros(2, 4, 16, dtype=dt),
        "empty rows": lambda dt: torch.zeros(0, 16, dtype=dt),
        "empty cols": lambda dt: torch.zeros(4, 0, dtype=dt),
        "wrong dtype": lambda dt: torch.zeros(4, 16, dtype=torch.float32),
        "sparse": lambda dt: torch.zeros(4, 16, dtype=dt).to_sparse(),
        "meta": lambda dt: torch.empty(4, 16, dtype=dt, device="meta"),
    }

    @pytest.mark.parametrize("case", sorted(REFUSED))
    def test_invalid_put_raises_and_leaves_store_unchanged(self, tmp_path: Path, case: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
        with self.make_store(tmp_path) as store:
            existing = self.fill(store, ["keep-1", "keep-2"])
            ids = list(existing) + ["bad"]
            before = self.snapshot(store, ids)
            caplog.clear()
            with pytest.raises(InvalidEntryError) as ei:
                store.put("bad", self.REFUSED[case](store.dtype))
            assert isinstance(ei.value, ecstore.ECStoreError)
            assert self.snapshot(store, ids) == before
            assert not store.contains("bad")
            assert put_lines(caplog) == []

    @pytest.mark.parametrize("identifier", ["", "x" * (4096 + 1), "\ud800", 123, None, b"bytes"])
    def test_invalid_identifier_raises_everywhere(self, store: ECStore, identifier: Any) -> None:
        t = make_tensor(1)
        ids = ["keep"]
        store.put("keep", t)
        before = self.snapshot(store, ids)
        for call in (lambda: store.put(identifier, t), lambda: store.get(identifier),
                     lambda: store.contains(identifier), lambda: store.delete(identifier),
                     lambda: store.key(identifier)):
            with pytest.raises(InvalidEntryError):
                call()
        assert self.snapshot(store, ids) == before

    def test_oversized_put_is_refused_with_a_warning(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        with self.make_store(tmp_path, cap_bytes=16 * 1024) as store:
            existing = self.fill(store, ["keep-1", "keep-2"])
            ids = list(existing) + ["huge"]
            before = self.snapshot(store, ids)
            caplog.clear()
            huge = make_tensor(5, 64, 1024)  # 128 KiB of bf16: over every cap
            assert store.put("huge", huge) is False
            after = self.snapshot(store, ids)
            assert after["stats"].pop("puts_refused") == before["stats"].pop("puts_refused") + 1
            assert after == before
            assert not store.contains("huge")
            warnings = [r for r in caplog.records if r.name == "ecstore" and r.levelno == logging.WARNING]
            assert len(warnings) == 1 and "huge" in warnings[0].getMessage()
            assert put_lines(caplog) == []

    def test_entry_that_just_fits_is_stored_and_one_byte_more_is_refused(self, tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
        """The cap is in stored bytes: an entry of exactly the cap fits;
        whatever the identifier's length, one that fits no tier is refused at
        put (False), never accepted and then failed by the writer."""
        t = make_tensor(3, 8, 64)
        nbytes = t.numel() * t.element_size()
        for ident in ("short-id", "long-" + "é" * 1500):
            probe = self.make_store(tmp_path / "probe")
            c = self.cost(probe, ident, t)
            probe.close()
            with self.make_store(tmp_path / f"fits-{len(ident)}", cap_bytes=c) as store:
                assert store.put(ident, t) is True
                self.settle(store)
                assert_same(store.get(ident), t)
                assert self.used_bytes(store.stats()) == c
            with self.make_store(tmp_path / f"over-{len(ident)}", cap_bytes=c - 1) as store:
                caplog.clear()
                in_memory = store.memory is not None and nbytes <= store.memory.capacity_bytes
                assert store.put(ident, t) is in_memory
                self.settle(store)  # must not raise StoreFullError
                st = store.stats()
                assert st.write_errors == 0 and st.disk_entries == 0 and st.disk_bytes == 0
                if in_memory:  # combined, long identifier: held by the memory tier only
                    assert st.puts == 1 and st.memory_entries == 1
                    assert_same(store.get(ident), t)
                    assert put_lines(caplog) == [(nbytes, ident)]
                else:
                    assert not store.contains(ident)
                    assert st.puts_refused == 1 and st.puts == 0
                    assert any(r.levelno == logging.WARNING for r in caplog.records if r.name == "ecstore")
                    assert put_lines(caplog) == []

    # ---------------------------------------------------------- log line
    def test_put_logs_once_per_new_entry(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        with self.make_store(tmp_path) as store:
            t = make_tensor(1, 5, 32)
            caplog.clear()
            assert store.put("logged", t) is True
            if store.disk is None:  # memory only: logged by put itself
                assert put_lines(caplog) == [(t.numel() * t.element_size(), "logged")]
            self.settle(store)
            assert put_lines(caplog) == [(5 * 32 * 2, "logged")]
            rec = [r for r in caplog.records if PUT_LINE.match(r.getMessage())][0]
            assert rec.name == "ecstore" and rec.levelno == logging.INFO
            assert store.put("logged", t) is False
            assert_same(store.get("logged"), t)
            self.settle(store)
            assert store.put("logged", t) is False
            self.settle(store)
            assert put_lines(caplog) == [(5 * 32 * 2, "logged")]
            # another entry gets its own line
            assert store.put("other", make_tensor(2, 3, 32))
            self.settle(store)
            assert put_lines(caplog) == [(320, "logged"), (3 * 32 * 2, "other")]

    # --------------------------------------------------------------- stats
    def test_stats_counters(self, tmp_path: Path) -> None:
        store, c, cap = self._eviction_setup(tmp_path, keep=3)
        with store:
            st = store.stats()
            assert (st.hits, st.misses, st.puts, st.evictions) == (0, 0, 0, 0)
            # identifiers as long as the probe's "img-0000": same blob size c
            ts = self.fill(store, ["stat-s00", "stat-s01"])
            store.put("stat-s00", ts["stat-s00"])  # already present
            assert_same(store.get("stat-s00"), ts["stat-s00"])
            assert_same(store.get("stat-s01"), ts["stat-s01"])
            assert store.get("nope") is None
            self.settle(store)
            st = store.stats()
            assert (st.hits, st.misses, st.puts, st.puts_skipped) == (2, 1, 2, 1)
            assert st.hits == st.memory_hits + st.disk_hits
            nbytes = ts["stat-s00"].numel() * ts["stat-s00"].element_size()
            if store.memory is not None:
                assert st.memory_capacity_bytes == store.config.cpu_capacity_bytes
                assert st.memory_entries == len(store.memory.keys()) >= 1
                assert st.memory_bytes == st.memory_entries * nbytes
            else:
                assert (st.memory_entries, st.memory_bytes, st.memory_capacity_bytes) == (0, 0, 0)
            if store.disk is not None:
                assert st.disk_entries == 2
                assert st.disk_capacity_bytes == cap
                assert st.disk_bytes == sum(len(store.disk.blob_bytes(k)) for k in store.disk.lru_keys())
                assert st.pending_writes == 0 and st.pending_bytes == 0
            else:
                assert (st.disk_entries, st.disk_bytes, st.disk_capacity_bytes) == (0, 0, 0)
            assert self.used_bytes(st) == 2 * c
            self.fill(store, ["stat-s02", "stat-s03", "stat-s04"])
            self.settle(store)
            st = store.stats()
            assert st.evictions >= 2
            assert st.puts == 5
            assert self.used_bytes(st) == 3 * c
            d = st.as_dict()
            assert d["evictions"] == st.memory_evictions + st.disk_evictions

    def test_closed_store_refuses_use(self, tmp_path: Path) -> None:
        store = self.make_store(tmp_path)
        store.put("x", make_tensor(1))
        store.close()
        store.close()  # idempotent
        for call in (lambda: store.get("x"), lambda: store.put("y", make_tensor(2)),
                     lambda: store.contains("x"), lambda: store.stats()):
            with pytest.raises(ecstore.ECStoreError):
                call()
