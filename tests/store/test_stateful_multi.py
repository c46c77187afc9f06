"""Stateful test, several handles on one file: random put/get/contains/
delete/flush/reopen sequences on three handles (two models, two dtypes)
sharing one LMDB store, both tiers enabled, reopened with a different disk
cap now and then; checked against an exact model.

The model is test_store_stateful.py's, keyed by (handle, identifier): one
LRU over every handle's entries (the disk tier is one LRU, whatever model or
dtype wrote an entry), bounded by the sum of blob sizes; a put of a new
entry evicts least recently used entries until it fits; a get hit makes an
entry most recently used. Reopening with a smaller cap evicts LRU entries
down to it. Each handle has its own memory tier (a read may promote an entry
the disk has evicted: reading it returns its exact tensor or None).

Each handle writes to LMDB from its own background thread, so two handles'
writes may commit in either order. To keep the model exact the test uses a
handle only after flushing the one used before (tensor-parallel ranks and
multi-model engines interleave at coarser grain than one put anyway); within
a handle, writes stay asynchronous and entries evicted by a queued put are
"ghosts" until the next flush, exactly as in the single-handle test.

Keys of one identifier under different handles are different entries: the
test uses the same identifiers on every handle and checks they never mix.

Runs 2,000 examples (derandomized, no example database). Stores live on
/dev/shm when it exists (real LMDB files; fsync is free on tmpfs, which is
what lets 2,000 examples fit in CI).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import torch
from conftest import gib
from helpers.tensors import assert_same, make_tensor, same_tensor, stored_name
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ecstore import ECStore, ECStoreConfig
from ecstore.format import codec

HANDLES = [("Qwen/Qwen2.5-VL-7B-Instruct", torch.bfloat16),
           ("Qwen/Qwen2.5-VL-7B-Instruct", torch.float16),
           ("org/vision-encoder@rev2", torch.bfloat16)]
IDS = [f"mm-{c}" for c in "abcde"]
COLS = 16
ROWS = (1, 2, 4)


def blob_size(h: int, ident: str, t: torch.Tensor) -> int:
    return codec.blob_size(t, identifier=stored_name(ident, *HANDLES[h]), model=HANDLES[h][0])


_MAX = max(blob_size(h, IDS[0], make_tensor(0, 4, COLS, HANDLES[h][1])) for h in range(len(HANDLES)))
#: Disk caps a reopen picks from: about 1.5, 2.5 and 4 of the largest entries.
CAPS = (3 * _MAX // 2, 5 * _MAX // 2, 4 * _MAX)
#: Memory tier of each handle: two or three entries' worth of tensor bytes.
CPU_CAP = 2 * 4 * COLS * 2 + 40
SHM = Path("/dev/shm")


class MultiHandleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        base = str(SHM) if SHM.is_dir() and os.access(SHM, os.W_OK) else None
        self.dir = Path(tempfile.mkdtemp(prefix="ecstore-multi-", dir=base))
        self.cap = CAPS[1]
        self.stores: list[ECStore] = []
        self.lru: OrderedDict[tuple[int, str], torch.Tensor] = OrderedDict()  # LRU first
        self.sizes: dict[tuple[int, str], int] = {}
        self.ghosts: dict[tuple[int, str], torch.Tensor] = {}
        self.last: dict[tuple[int, str], torch.Tensor] = {}  # tensor of each entry's last successful put
        self.active: int | None = None  # the handle that may have writes pending

    # ------------------------------------------------------------- plumbing
    def open_all(self) -> None:
        cfg = ECStoreConfig(local_cpu=True, max_local_cpu_size=gib(CPU_CAP), local_disk=str(self.dir),
                            max_local_disk_size=gib(self.cap))
        self.stores = [ECStore(cfg, model=m, dtype=dt) for m, dt in HANDLES]

    @initialize(cap=st.sampled_from(CAPS))
    def start(self, cap: int) -> None:
        self.cap = cap
        self.open_all()

    def teardown(self) -> None:
        for s in self.stores:
            s.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def total(self) -> int:
        return sum(self.sizes[k] for k in self.lru)

    def use(self, h: int) -> ECStore:
        """Handle ``h``, after flushing the handle used before it."""
        if self.active is not None and self.active != h:
            self.stores[self.active].flush()
            self.ghosts.clear()
        self.active = h
        return self.stores[h]

    def evict_until(self, limit: int, ghosts: bool) -> None:
        while self.lru and self.total > limit:
            victim, vt = self.lru.popitem(last=False)
            if ghosts:
                self.ghosts[victim] = vt
            event("eviction")

    def model_put(self, k: tuple[int, str], t: torch.Tensor) -> None:
        size = blob_size(k[0], k[1], t)
        while self.lru and self.total + size > self.cap:
            victim, vt = self.lru.popitem(last=False)
            self.ghosts[victim] = vt
            event("eviction" if victim[0] == k[0] else "eviction of another handle's entry")
        self.lru[k] = t
        self.sizes[k] = size

    def memory_only(self, k: tuple[int, str]) -> bool:
        s = self.stores[k[0]]
        return k not in self.lru and s.memory.contains(s.key(k[1]), s.stored_name(k[1]))

    def check_exact(self) -> None:
        """Everything flushed: LMDB holds exactly the model."""
        self.ghosts.clear()
        s0 = self.stores[0]
        assert s0.disk.lru_keys() == [self.stores[h].key(i) for h, i in self.lru]
        st_ = s0.stats()
        assert st_.disk_bytes == self.total <= self.cap
        assert st_.disk_entries == len(self.lru)
        for h, s in enumerate(self.stores):
            assert s.stats().pending_writes == 0
            for i in IDS:
                assert s.contains(i) == ((h, i) in self.lru or self.memory_only((h, i)))
            keys = {s.key(i): i for i in IDS}
            for k in s.memory.keys():  # memory holds exactly what was put last (or promoted)
                assert_same(s.memory._items[k].tensor, self.last[(h, keys[k])])
        for (h, i), t in self.lru.items():  # straight from LMDB: no LRU effect
            s = self.stores[h]
            assert_same(s.disk.get(s.key(i), s.stored_name(i)), t)

    # ---------------------------------------------------------------- rules
    PUT_ARGS = dict(h=st.integers(0, len(HANDLES) - 1), ident=st.sampled_from(IDS), rows=st.sampled_from(ROWS),
                    seed=st.integers(0, 2))

    @rule(**PUT_ARGS)
    def put(self, h: int, ident: str, rows: int, seed: int) -> None:
        self._put(h, ident, rows, seed)

    @rule(**PUT_ARGS)
    def put_more(self, h: int, ident: str, rows: int, seed: int) -> None:
        """Same as put: a second rule doubles the weight of puts (eviction)."""
        self._put(h, ident, rows, seed)

    def _put(self, h: int, ident: str, rows: int, seed: int) -> None:
        s = self.use(h)
        k = (h, ident)
        t = make_tensor(seed * 100 + rows * 10 + h, rows, COLS, HANDLES[h][1])
        in_memory = self.memory_only(k)
        stored = s.put(ident, t)
        if k in self.lru or in_memory:
            assert stored is False
        elif k in self.ghosts:
            event(f"put of an evicted entry: {stored}")
            if stored:
                del self.ghosts[k]
                self.model_put(k, t)
        else:
            assert stored is True
            self.model_put(k, t)
        if stored:
            self.last[k] = t

    @rule(h=st.integers(0, len(HANDLES) - 1), ident=st.sampled_from(IDS))
    def get(self, h: int, ident: str) -> None:
        s = self.use(h)
        k = (h, ident)
        maybe = k in self.ghosts or self.memory_only(k)
        got = s.get(ident)
        if k in self.lru:
            assert_same(got, self.lru[k])
            self.lru.move_to_end(k)
        elif maybe:
            assert got is None or same_tensor(got, self.last[k])
        else:
            assert got is None

    @rule(h=st.integers(0, len(HANDLES) - 1), ident=st.sampled_from(IDS))
    def contains(self, h: int, ident: str) -> None:
        s = self.use(h)
        k = (h, ident)
        maybe = k in self.ghosts or self.memory_only(k)
        found = s.contains(ident)
        if not maybe:
            assert found == (k in self.lru)

    @rule(h=st.integers(0, len(HANDLES) - 1), ident=st.sampled_from(IDS))
    def delete(self, h: int, ident: str) -> None:
        s = self.use(h)
        s.flush()  # delete acts on LMDB at once: order it after the queued puts
        self.ghosts.clear()
        k = (h, ident)
        present = k in self.lru or self.memory_only(k)
        assert s.delete(ident) == present
        self.lru.pop(k, None)
        self.last.pop(k, None)
        assert s.get(ident) is None and not s.contains(ident)

    @rule()
    def flush(self) -> None:
        if self.active is not None:
            self.stores[self.active].flush()
        self.active = None
        self.check_exact()

    @rule(cap=st.sampled_from(CAPS))
    def reopen(self, cap: int) -> None:
        for s in self.stores:
            s.close()  # flushes
        self.active = None
        self.ghosts.clear()
        if cap != self.cap:
            event("reopen with a smaller cap" if cap < self.cap else "reopen with a larger cap")
        self.cap = cap
        self.evict_until(cap, ghosts=False)  # the first handle opened evicts down to the new cap
        self.open_all()
        self.last = {k: t for k, t in self.last.items() if k in self.lru}  # memory tiers start empty
        self.check_exact()

    @invariant()
    def bounded(self) -> None:
        if self.stores:
            st_ = self.stores[0].stats()
            assert st_.disk_bytes <= self.cap
            for s in self.stores:
                assert s.memory.used_bytes <= s.memory.capacity_bytes


def test_caps_make_eviction_happen():
    assert CAPS[0] < 2 * _MAX and CAPS[-1] >= 4 * _MAX  # from "2 entries overflow" to "several fit"
    assert CPU_CAP < 3 * 4 * COLS * 2  # the memory tiers evict too


TestMultiHandleMachine = MultiHandleMachine.TestCase
TestMultiHandleMachine.settings = settings(
    # ECSTORE_MULTI_EXAMPLES: more (or, while developing, fewer) examples.
    max_examples=int(os.environ.get("ECSTORE_MULTI_EXAMPLES", 2000)), stateful_step_count=12,
    derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
