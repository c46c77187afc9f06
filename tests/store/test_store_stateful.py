"""Stateful test: random put/get/contains/delete/flush/reopen sequences on a
disk-backed store, checked against an exact model of its contents.

The model is the store's contract in sequential form: an LRU ordered dict of
identifier -> tensor, bounded by the sum of blob sizes (the disk cap), where
a put of a new identifier evicts least recently used entries until it fits,
a get hit makes an entry most recently used, and a put of a present
identifier changes nothing.

A ``corrupt`` rule damages an entry's record or blob on disk: the next
read must be a miss that drops it, and the store must go on exactly.

The store writes to LMDB in the background, so between flushes an entry the
model has evicted may still be readable (the put that evicts it is queued).
The model keeps such entries as "ghosts" until the next flush: reading one
may return None or its exact tensor, nothing else. Everything else is exact,
and after every flush/reopen the LMDB order, bytes and contents must equal
the model's.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import torch
from conftest import gib
from helpers.tensors import assert_same, make_tensor, same_tensor, stored_name
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ecstore import ECStore, ECStoreConfig
from ecstore.format import codec
from ecstore.testing import faults as fc

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
IDS = [f"mm-{c}" for c in "abcdefgh"]  # same length: blob size depends on rows only
COLS = 16
# Blob sizes for 1..4 rows of bf16; the cap holds 2 to 3 entries.
SIZES = {r: codec.blob_size(make_tensor(0, r, COLS), identifier=stored_name(IDS[0], MODEL), model=MODEL)
         for r in range(1, 5)}
CAP = 2 * SIZES[4] + SIZES[1] // 2


class StoreMachine(RuleBasedStateMachine):
    local_cpu = False

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ecstore-stateful-"))
        self.store: ECStore | None = None
        self.lru: OrderedDict[str, torch.Tensor] = OrderedDict()  # least recently used first
        self.sizes: dict[str, int] = {}
        self.ghosts: dict[str, torch.Tensor] = {}
        self.last: dict[str, torch.Tensor] = {}  # tensor of each identifier's last successful put

    # ------------------------------------------------------------- plumbing
    def open(self) -> ECStore:
        cfg = ECStoreConfig(local_cpu=self.local_cpu, max_local_cpu_size=gib(CAP // 16),
                            local_disk=str(self.dir), max_local_disk_size=gib(CAP))
        return ECStore(cfg, model=MODEL, dtype=torch.bfloat16)

    @initialize()
    def start(self) -> None:
        self.store = self.open()

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def total(self) -> int:
        return sum(self.sizes[i] for i in self.lru)

    def model_put(self, ident: str, t: torch.Tensor) -> None:
        size = codec.blob_size(t, identifier=stored_name(ident, MODEL), model=MODEL)
        assert size == len(codec.encode(t, identifier=stored_name(ident, MODEL), model=MODEL))
        while self.lru and self.total + size > CAP:
            victim, vt = self.lru.popitem(last=False)
            self.ghosts[victim] = vt
            event("eviction")
        self.lru[ident] = t
        self.sizes[ident] = size

    def check_exact(self) -> None:
        """After a flush or reopen: LMDB holds exactly the model."""
        self.ghosts.clear()
        s = self.store
        assert s.disk.lru_keys() == [s.key(i) for i in self.lru]
        st_ = s.stats()
        assert st_.disk_bytes == self.total <= CAP
        assert st_.disk_entries == len(self.lru)
        assert st_.pending_writes == 0
        for i in IDS:
            assert s.contains(i) == (i in self.lru or self.memory_only(i))
        for i, t in self.lru.items():  # straight from LMDB: no LRU effect
            assert_same(s.disk.get(s.key(i), s.stored_name(i)), t)
        if s.memory is not None:  # the memory tier only holds what was put last
            keys = {s.key(i): i for i in IDS}
            for k in s.memory.keys():
                assert_same(s.memory._items[k].tensor, self.last[keys[k]])

    def memory_only(self, ident: str) -> bool:
        """Held by the memory tier although the disk model evicted it (a read
        promoted it while the put evicting it was still queued)."""
        s = self.store
        return s.memory is not None and ident not in self.lru and s.memory.contains(s.key(ident), s.stored_name(ident))

    # ---------------------------------------------------------------- rules
    @rule(ident=st.sampled_from(IDS), rows=st.integers(1, 4), seed=st.integers(0, 3))
    def put(self, ident: str, rows: int, seed: int) -> None:
        t = make_tensor(seed * 100 + rows, rows, COLS)
        in_memory = self.memory_only(ident)
        stored = self.store.put(ident, t)
        if ident in self.lru or in_memory:
            assert stored is False
        elif ident in self.ghosts:
            # evicted by a put still queued: refused while it is still there
            event(f"put of an evicted entry: {stored}")
            if stored:
                del self.ghosts[ident]
                self.model_put(ident, t)
        else:
            assert stored is True
            self.model_put(ident, t)
        if stored:
            self.last[ident] = t

    @rule(ident=st.sampled_from(IDS))
    def get(self, ident: str) -> None:
        maybe = ident in self.ghosts or self.memory_only(ident)
        got = self.store.get(ident)
        if ident in self.lru:
            assert_same(got, self.lru[ident])
            self.lru.move_to_end(ident)
        elif maybe:
            event(f"read of an evicted entry: {'miss' if got is None else 'hit'}")
            assert got is None or same_tensor(got, self.last[ident])
        else:
            assert got is None

    @rule(ident=st.sampled_from(IDS))
    def contains(self, ident: str) -> None:
        maybe = ident in self.ghosts or self.memory_only(ident)
        found = self.store.contains(ident)
        if not maybe:
            assert found == (ident in self.lru)

    @rule(ident=st.sampled_from(IDS))
    def delete(self, ident: str) -> None:
        # delete acts on LMDB at once, while earlier puts wait for the
        # writer: flush first so that the model's order of events holds.
        self.store.flush()
        self.ghosts.clear()
        present = ident in self.lru or self.memory_only(ident)
        assert self.store.delete(ident) == present
        self.lru.pop(ident, None)
        self.last.pop(ident, None)
        assert self.store.get(ident) is None
        assert not self.store.contains(ident)

    @rule(ident=st.sampled_from(IDS), part=st.sampled_from(["record", "blob"]))
    def corrupt(self, ident: str, part: str) -> None:
        """Damage an entry on disk (a bad block, a foreign writer): the next
        read is a miss that drops it, with exact accounting, and every later
        put, eviction and reopen goes on (defect: one unreadable record used
        to stop eviction for good)."""
        self.store.flush()
        self.ghosts.clear()
        if ident not in self.lru:
            return
        s = self.store
        if s.memory is not None:
            s.memory.delete(s.key(ident))  # as if the memory tier had evicted it
        fc.corrupt_entry(s.disk, s.key(ident), part)
        event(f"corrupt {part}")
        assert s.get(ident) is None
        assert not s.contains(ident)
        del self.lru[ident]
        self.last.pop(ident, None)
        self.check_exact()

    @rule()
    def flush(self) -> None:
        self.store.flush()
        self.check_exact()

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = None
        self.store = self.open()
        self.check_exact()

    @invariant()
    def bounded(self) -> None:
        if self.store is not None:
            st_ = self.store.stats()
            assert st_.disk_bytes <= CAP
            assert st_.memory_bytes <= st_.memory_capacity_bytes


class CombinedStoreMachine(StoreMachine):
    """Same, with a small memory tier (a sixteenth of the disk cap) above the
    disk tier. An entry the disk evicted may live on in memory: reading it
    returns its exact tensor or None, and a put of it is refused."""

    local_cpu = True


SETTINGS = settings(max_examples=100, stateful_step_count=40, derandomize=True, database=None, deadline=None)


def test_sizes_make_eviction_happen():
    assert 2 * SIZES[4] <= CAP < 4 * SIZES[1]


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = SETTINGS
TestCombinedStoreMachine = CombinedStoreMachine.TestCase
TestCombinedStoreMachine.settings = SETTINGS
