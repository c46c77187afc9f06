"""ecstore.pool: LMDB-tier hits are copied into reused, already-faulted
memory, and a tensor handed out is never overwritten while
anything still references it (the tensor, a view of it, or its storage).
"""

from __future__ import annotations

import gc
import threading
import weakref

import torch
from conftest import gib
from helpers.tensors import assert_same, make_tensor

from ecstore import ECStore, ECStoreConfig
from ecstore.config import load_config
from ecstore.format import codec
from ecstore.pool import POOL, BufferPool, size_class

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
ROWS, COLS = 64, 1024  # 128 KiB of bfloat16: above the pool's minimum, so hits come from the pool


def _disk_only(path) -> ECStore:
    cfg = ECStoreConfig(local_disk=str(path), max_local_disk_size=gib(64 << 20), local_cpu=False,
                        max_local_cpu_size=0.0)
    return ECStore(cfg, model=MODEL, dtype=torch.bfloat16)


def test_lmdb_hits_stay_private_while_referenced(tmp_path) -> None:
    a, b = make_tensor(1, ROWS, COLS), make_tensor(2, ROWS, COLS)
    with _disk_only(tmp_path / "s") as st:
        st.put("a" * 64, a)
        st.put("b" * 64, b)
        st.flush()
        held = st.get("a" * 64)
        view = st.get("a" * 64)[1:]  # only a view of this hit survives
        storage_only = st.get("a" * 64)
        storage = storage_only.untyped_storage()
        ptr = storage_only.data_ptr()
        del storage_only
        reused_before = POOL.reused
        for _ in range(8):  # later hits, scribbled on and dropped: their memory is recycled
            t = st.get("b" * 64)
            assert_same(t, b)
            t.fill_(7)
            u = st.get("a" * 64)
            assert_same(u, a)
            u.fill_(-3)
            del t, u
        assert POOL.reused > reused_before  # the dropped hits' memory was reused
        assert_same(held, a)
        assert_same(view, a[1:])
        assert ptr == storage.data_ptr()
        assert_same(torch.empty(0, dtype=torch.bfloat16).set_(storage, 0, (ROWS, COLS)), a)


def test_memory_comes_back_only_after_the_last_reference() -> None:
    pool = BufferPool(idle_bytes=8 << 20, min_bytes=1024)
    t = pool.empty((256, 1024), torch.bfloat16)
    assert t.shape == (256, 1024) and t.dtype == torch.bfloat16 and t.is_contiguous()
    ptr = t.data_ptr()
    v = t[10:20]
    del t
    other = pool.empty((256, 1024), torch.bfloat16)  # v still holds the first slab
    assert other.data_ptr() != ptr and pool.reused == 0
    del v
    again = pool.empty((256, 1024), torch.bfloat16)
    assert again.data_ptr() == ptr and pool.reused == 1
    del other, again
    gc.collect()
    assert pool.idle_bytes == 2 * size_class(256 * 1024 * 2)


def test_idle_memory_is_bounded() -> None:
    cls = size_class(1 << 20)
    pool = BufferPool(idle_bytes=cls, min_bytes=1024)
    ts = [pool.empty((1 << 20,), torch.uint8) for _ in range(3)]
    del ts
    assert pool.idle_bytes == cls  # one slab kept, two freed
    pool.clear()
    assert pool.idle_bytes == 0


def test_small_requests_bypass_the_pool() -> None:
    pool = BufferPool(idle_bytes=1 << 20, min_bytes=4096)
    t = pool.empty((8, 8), torch.float32)
    assert t.untyped_storage().resizable()  # plain torch.empty memory
    del t
    assert pool.idle_bytes == 0 and pool.fresh == 0


def test_size_classes_hold_the_request_with_at_most_a_quarter_spare() -> None:
    for n in list(range(1, 5000)) + [1_003_520, 34_296_320, 130_801_664, (1 << 27) + 1]:
        c = size_class(n)
        assert n <= c, n
        assert n <= 4 or c * 4 <= n * 5 + 4 * 8, (n, c)


def test_prefault_leaves_a_spare_slab_for_the_next_request() -> None:
    pool = BufferPool(idle_bytes=8 << 20, min_bytes=1024)
    t = pool.empty((1 << 20,), torch.uint8)
    pool.prefault_soon(1 << 20)
    assert pool.wait_prefaulted(timeout_s=120)
    assert pool.prefaulted == 1 and pool.idle_bytes == size_class(1 << 20)
    u = pool.empty((1 << 20,), torch.uint8)  # served by the spare, not by t's slab (still held)
    assert pool.reused == 1 and u.data_ptr() != t.data_ptr()
    pool.prefault_soon(1 << 20)  # the spare was taken: another one is faulted in (the cap counts idle slabs)
    assert pool.wait_prefaulted(timeout_s=120)
    assert pool.prefaulted == 2
    del t, u
    assert pool.idle_bytes <= 8 << 20


def test_saves_build_their_blobs_in_the_pool(tmp_path) -> None:
    """A put's blob comes from the pool (the ``pooled_blobs`` setting, on by
    default) and goes back to it once nothing references it."""
    cfg = ECStoreConfig(local_disk=str(tmp_path / "s"), max_local_disk_size=gib(64 << 20), local_cpu=False,
                        max_local_cpu_size=0.0)
    assert cfg.pooled_blobs
    fresh, reused = POOL.fresh, POOL.reused
    with ECStore(cfg, model=MODEL, dtype=torch.bfloat16) as st:
        for i in range(4):
            st.put(f"{i}" * 64, make_tensor(i, ROWS, COLS))
            st.flush()
            POOL.wait_prefaulted(timeout_s=120)
        assert POOL.fresh + POOL.reused >= fresh + reused + 4
        assert POOL.reused > reused  # later blobs reuse slabs (earlier blobs' or the prefaulted spare)


def test_a_store_keeps_what_its_write_queue_may_hold_faulted(tmp_path, monkeypatch) -> None:
    """Regression (issue 30, back-to-back saves): once a burst's blobs were
    written, those beyond the pool's idle cap went back to the system, so the
    next burst copied into fresh memory (page faults: 7-10x a memcpy). A store
    with a writer raises the process pool's idle cap to its write queue's
    bound, never lowering it: the second burst reuses a slab for every save.
    The first burst's writer is held until all its blobs exist, so that burst
    holds as many slabs at once as the second can ever need (a fast writer
    would otherwise let it make do with fewer: CI, under load)."""
    monkeypatch.setattr(POOL, "idle_cap", 2 * size_class(ROWS * COLS * 2 + 4096))  # room for two slabs
    queue = 32 << 20
    cfg = ECStoreConfig(local_disk=str(tmp_path / "s"), max_local_disk_size=gib(64 << 20), local_cpu=False,
                        max_local_cpu_size=0.0, max_write_queue_size=gib(queue))
    src = [make_tensor(60 + i, ROWS, COLS) for i in range(8)]
    with ECStore(cfg, model=MODEL, dtype=torch.bfloat16) as st:
        assert POOL.idle_cap == queue
        real_write, all_put = st.disk.write_batch, threading.Event()

        def held_write(*args, **kwargs):
            all_put.wait(120)  # a bound for a broken build only
            return real_write(*args, **kwargs)

        for burst in range(2):
            POOL.wait_prefaulted(timeout_s=120)
            fresh = POOL.fresh
            st.disk.write_batch = held_write if burst == 0 else real_write
            for i, t in enumerate(src):
                assert st.put(f"{burst}{i}" * 32, t)
            all_put.set()
            st.flush()
            gc.collect()
            if burst:
                assert POOL.fresh == fresh  # every blob of the second burst in a kept slab
        for burst in range(2):
            for i, t in enumerate(src):
                assert_same(st.get(f"{burst}{i}" * 32), t)
    assert POOL.idle_cap == queue  # closing the store does not lower it


def test_a_closed_store_holds_no_tensor_of_its_memory_tier(tmp_path) -> None:
    """Regression: ``close`` left the memory tier's tensors referenced by the
    handle, so a closed store that something still referenced (an engine's
    shut-down connector) kept its blobs' memory out of the pool for good."""
    cfg = ECStoreConfig(local_disk=str(tmp_path / "s"), max_local_disk_size=gib(64 << 20),
                        max_local_cpu_size=gib(64 << 20))
    st = ECStore(cfg, model=MODEL, dtype=torch.bfloat16)
    src = make_tensor(70, ROWS, COLS)
    assert st.put("7" * 64, src)
    held = weakref.ref(st.get("7" * 64))  # the memory tier's own tensor
    assert held() is not None
    st.close()
    gc.collect()
    assert held() is None  # released though ``st`` is still referenced
    with ECStore(cfg, model=MODEL, dtype=torch.bfloat16) as again:
        assert_same(again.get("7" * 64), src)  # it is on disk


def test_pooled_blobs_off_from_the_environment_keeps_saves_out_of_the_pool(tmp_path) -> None:
    """``LMCACHE_EC_POOLED_BLOBS=0`` reaches the store through load_config: its
    puts build their blobs in fresh memory (the pool serves nothing and
    faults in no spare), and the entries read back the same."""
    cfg = load_config(env={"LMCACHE_EC_POOLED_BLOBS": "0", "LMCACHE_EC_LOCAL_DISK": str(tmp_path / "s"),
                           "LMCACHE_EC_MAX_LOCAL_DISK_SIZE": str(gib(64 << 20)), "LMCACHE_EC_LOCAL_CPU": "no"})
    assert cfg.pooled_blobs is False and cfg.source_of("pooled_blobs") == "env LMCACHE_EC_POOLED_BLOBS"
    src = [make_tensor(20 + i, ROWS, COLS) for i in range(4)]
    with ECStore(cfg, model=MODEL, dtype=torch.bfloat16) as st:
        POOL.wait_prefaulted(timeout_s=120)  # nothing of an earlier test still in flight
        before = (POOL.fresh, POOL.reused, POOL.prefaulted)
        for i, t in enumerate(src):
            assert st.put(f"{i}" * 64, t)
        st.flush()
        assert POOL.wait_prefaulted(timeout_s=120)
        assert (POOL.fresh, POOL.reused, POOL.prefaulted) == before
        for i, t in enumerate(src):
            assert_same(st.get(f"{i}" * 64), t)


def test_blobs_of_puts_are_private_while_the_memory_tier_holds_them(tmp_path) -> None:
    """Saves build their blobs in pooled memory: an entry in the memory tier (and
    a tensor a caller got from it) is never overwritten by later saves,
    evictions or hits."""
    cfg = ECStoreConfig(local_disk=str(tmp_path / "s"), max_local_disk_size=gib(64 << 20),
                        max_local_cpu_size=gib(3 * ROWS * COLS * 2 + 4096))
    src = [make_tensor(10 + i, ROWS, COLS) for i in range(8)]
    with ECStore(cfg, model=MODEL, dtype=torch.bfloat16) as st:
        st.put("0" * 64, src[0])
        held = st.get("0" * 64)  # the memory tier's own tensor (a view of the blob)
        for i in range(1, 8):  # evicts entry 0 from the memory tier, recycles blobs
            st.put(f"{i}" * 64, src[i])
            st.flush()
            got = st.get(f"{i}" * 64)
            assert_same(got, src[i])
        assert_same(held, src[0])
        assert_same(st.get("0" * 64), src[0])


LAYOUT = (64, torch.bfloat16, (100, 512))  # (offset, dtype, shape): a blob's data after its header
NBYTES = 64 + 100 * 512 * 2


def test_prefault_with_a_layout_hands_the_next_request_of_it_a_ready_tensor() -> None:
    pool = BufferPool(idle_bytes=8 << 20, min_bytes=1024)
    pool.prefault_soon(NBYTES, LAYOUT)
    assert pool.wait_prefaulted(timeout_s=120)
    assert pool.prefaulted == 1 and pool.idle_bytes == size_class(NBYTES)
    buf, t = pool.typed_buffer(NBYTES, *LAYOUT)
    assert pool.reused == 1 and pool.fresh == 0 and pool.idle_bytes == 0
    assert len(buf) == NBYTES and t.shape == (100, 512) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() == buf.ctypes.data + 64
    ptr = buf.ctypes.data
    t.fill_(3)
    del buf  # the tensor alone keeps the slab
    other = pool.buffer(NBYTES)
    assert other.ctypes.data != ptr
    assert bool((t == 3).all())
    del t
    assert pool.idle_bytes == size_class(NBYTES)  # back once nothing references it
    assert pool.buffer(NBYTES).ctypes.data == ptr


def test_a_ready_slab_serves_a_request_of_another_layout_and_clear_drops_it() -> None:
    pool = BufferPool(idle_bytes=8 << 20, min_bytes=1024)
    spare = pool.buffer(NBYTES)
    ptr = spare.ctypes.data
    del spare  # a free slab: the layout is made ready in it, nothing new is faulted in
    pool.prefault_soon(NBYTES, LAYOUT)
    assert pool.wait_prefaulted(timeout_s=120)
    assert pool.prefaulted == 0 and pool.idle_bytes == size_class(NBYTES)
    pool.prefault_soon(NBYTES, LAYOUT)  # already ready: nothing to do
    assert pool.wait_prefaulted(timeout_s=120) and pool.prefaulted == 0
    buf, t = pool.typed_buffer(NBYTES, 64, torch.float16, (100, 512))  # same size class, another layout
    assert (t.dtype, t.shape, t.data_ptr()) == (torch.float16, (100, 512), ptr + 64) and buf.ctypes.data == ptr
    assert pool.fresh == 1 and pool.idle_bytes == 0  # (the first buffer() was the one fresh slab)
    del buf, t
    pool.prefault_soon(NBYTES, LAYOUT)
    assert pool.wait_prefaulted(timeout_s=120)
    pool.clear()
    assert pool.idle_bytes == 0
    buf, t = pool.typed_buffer(NBYTES, *LAYOUT)
    assert pool.fresh == 2 and t.shape == (100, 512)


def test_a_free_slab_being_made_ready_is_never_out_of_reach(monkeypatch) -> None:
    """Regression (CI, the second burst of a store's saves faulted one fresh
    slab): the pool thread took a free slab off its list, then built the
    ready tensor over it outside the lock, so a request in that window found
    neither a free nor a ready slab and faulted a new one. Another thread
    that looks while the tensor is being built must find the pool locked."""
    from ecstore import pool as pool_mod

    pool = BufferPool(idle_bytes=8 << 20, min_bytes=1024)
    pool.buffer(NBYTES)  # dropped at once: one free slab, which the prefault makes ready
    seen: list[tuple[int, bool]] = []  # (free slabs of the class, ready) seen by another thread
    tensor_over = pool_mod._tensor_over

    def look_from_another_thread() -> None:
        if pool._lock.acquire(blocking=False):
            try:
                seen.append((len(pool._free.get(size_class(NBYTES), [])), size_class(NBYTES) in pool._ready))
            finally:
                pool._lock.release()

    def watched(*args, **kwargs):
        if threading.current_thread().name == "ecstore-pool":
            t = threading.Thread(target=look_from_another_thread)
            t.start()
            t.join()
        return tensor_over(*args, **kwargs)

    monkeypatch.setattr(pool_mod, "_tensor_over", watched)
    pool.prefault_soon(NBYTES, LAYOUT)
    assert pool.wait_prefaulted(timeout_s=120)
    assert seen == [], f"another thread found the slab in neither place: {seen}"
    buf, t = pool.typed_buffer(NBYTES, *LAYOUT)
    assert pool.fresh == 1 and pool.prefaulted == 0 and t.shape == (100, 512)


def test_saves_of_one_shape_take_the_slab_the_writer_had_made_ready(tmp_path) -> None:
    """The writer has the pool make a slab ready for the layout of the put it
    takes; the next put of that shape copies into that very tensor."""
    cfg = ECStoreConfig(local_disk=str(tmp_path / "s"), max_local_disk_size=gib(64 << 20),
                        max_local_cpu_size=gib(8 * ROWS * COLS * 2 + 4096))
    src = [make_tensor(40 + i, ROWS, COLS) for i in range(4)]
    with ECStore(cfg, model=MODEL, dtype=torch.bfloat16) as st:
        cls = size_class(len(codec.blob_head(src[0].shape, torch.bfloat16, st.stored_name("0" * 64), MODEL))
                         + ROWS * COLS * 2)
        for i, t in enumerate(src):
            ready = POOL._ready.get(cls)
            assert st.put(f"{i}" * 64, t)
            if i:
                assert ready is not None and st.get(f"{i}" * 64).data_ptr() == ready[2].data_ptr()
            del ready
            st.flush()
            POOL.wait_prefaulted(timeout_s=120)
        for i, t in enumerate(src):
            assert_same(st.get(f"{i}" * 64), t)  # each in its own memory


def test_a_returning_slab_of_another_size_replaces_the_oldest_kept_ones() -> None:
    """Regression: with the idle cap filled by slabs of one size (two 128 MiB
    blobs of a video, say), every slab of another size that came back was
    freed, so each later hit or save of that size faulted in fresh memory
    (the benchmark's hits ran at 10x memcpy after its write section). The
    least recently returned slabs now make room."""
    big = size_class(3 << 20)
    pool = BufferPool(idle_bytes=2 * big, min_bytes=1024)
    a, b = pool.buffer(3 << 20), pool.buffer(3 << 20)
    del a, b
    gc.collect()
    assert pool.idle_bytes == 2 * big  # the cap is full of big slabs
    s = pool.buffer(1 << 20)
    del s
    gc.collect()
    assert pool.idle_bytes <= 2 * big
    for _ in range(3):  # the small size is reused from now on
        before = pool.reused
        s = pool.buffer(1 << 20)
        assert pool.reused == before + 1
        del s
        gc.collect()
    t = pool.buffer(3 << 20)  # one big slab is still kept
    assert pool.reused == 4 and pool.fresh == 3
    del t


def test_slabs_made_ready_for_saves_of_other_sizes_give_way_to_a_returning_slab() -> None:
    """Regression: slabs made ready for the next save of each size (one per
    class) count as idle; once they held the cap, every slab that came back
    from a hit was freed (the benchmark's 130.8 MB hits: fresh memory each
    time, 9x memcpy). A returning slab now frees ready slabs of other sizes,
    oldest first, when the free ones are not enough."""
    cap = 8 << 20
    pool = BufferPool(idle_bytes=cap, min_bytes=1024)
    for rows in (1536, 1600):  # ready slabs of two other classes: 3 and 3.5 MiB
        pool.prefault_soon(rows * 2048, (0, torch.bfloat16, (rows, 1024)))
        assert pool.wait_prefaulted(60)
    assert len(pool._ready) == 2 and pool.idle_bytes == (3 << 20) + (7 << 19)
    hit = pool.buffer(5 << 20)  # the size of a hit: another class; 6.5 + 5 MiB > the cap
    del hit
    gc.collect()
    for _ in range(3):
        before = pool.reused
        hit = pool.buffer(5 << 20)
        assert pool.reused == before + 1  # the returning slab was kept
        del hit
        gc.collect()
    assert pool.idle_bytes <= cap


def test_anything_made_over_a_buffer_keeps_its_slab() -> None:
    """A slab goes back to the pool when the array ``buffer()`` handed out
    dies. Numpy points the base of a view of a slice at the slab itself, so
    views of the handed-out array (``buf[1:]``, ``np.frombuffer(buf)``, a
    dtype view, a tensor over a slice) did not keep it: the slab was handed
    out again under them, and one reader would see another's bytes."""
    import numpy as np

    n = 1 << 20
    makers = {
        "slice": lambda b: b[1:],
        "np.frombuffer": lambda b: np.frombuffer(b, np.uint8),
        "dtype view": lambda b: b.view(np.float32),
        "torch over a slice": lambda b: torch.from_numpy(b[64:]),
        "torch.frombuffer of a slice": lambda b: torch.frombuffer(b[64:], dtype=torch.uint8),
    }
    for name, make in makers.items():
        pool = BufferPool(idle_bytes=64 * n, min_bytes=1024)
        buf = pool.buffer(n)
        buf[:] = 7
        kept = make(buf)
        del buf
        gc.collect()
        others = [pool.buffer(n) for _ in range(3)]
        for o in others:
            o[:] = 0
        kept_bytes = kept.numpy() if isinstance(kept, torch.Tensor) else kept
        assert (kept_bytes.view(np.uint8) == 7).all(), f"{name}: the slab was handed out again under it"


_EXIT_DURING_A_PREFAULT = """
import sys, threading
import ecstore.pool as pool
started = threading.Event()
make = pool.new_slab
def new_slab(cls, **kw):
    slab = make(cls, **kw)
    started.set()  # the pool thread now faults it in, inside torch with the GIL released
    return slab
pool.new_slab = new_slab
pool.POOL.keep_at_least(2 << 30)
pool.POOL.prefault_soon(1 << 30)
assert started.wait(60)
print("exiting", flush=True)
"""


def test_the_process_exits_cleanly_while_the_pool_thread_faults_a_slab_in() -> None:
    """A process that ends while the pool's thread is inside torch faulting
    a slab in exits normally. It used to abort ("terminate called without
    an active exception", SIGABRT): the interpreter ended that daemon
    thread, as it came back from torch during finalization, with
    ``pthread_exit``, which unwinds through torch's C++ frames."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _EXIT_DURING_A_PREFAULT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout == "exiting\n", (proc.returncode, proc.stdout, proc.stderr)


def test_after_stop_thread_no_prefault_is_waited_for_or_started(monkeypatch) -> None:
    """stop_thread (the pool's end at exit) lets the prefault in progress
    finish, drops the queued ones, and nobody waiting for prefaults is
    left waiting; a prefault asked for afterwards starts nothing."""
    import ecstore.pool as pool_mod

    release, entered = threading.Event(), threading.Event()
    make = pool_mod.new_slab

    def slow_slab(cls: int, **kw):  # the first prefault blocks until released
        entered.set()
        assert release.wait(60)
        return make(cls, **kw)

    monkeypatch.setattr(pool_mod, "new_slab", slow_slab)
    pool = BufferPool(idle_bytes=64 << 20)
    pool.prefault_soon(1 << 20)
    assert entered.wait(60)
    pool.prefault_soon(4 << 20)  # queued behind it
    thread = pool._thread
    assert thread is not None
    pool.stop_thread(timeout_s=0)  # the first still runs
    release.set()
    thread.join(60)
    assert not thread.is_alive()
    assert pool.wait_prefaulted(5)
    assert pool.prefaulted == 1  # the one in progress, not the queued one
    pool.prefault_soon(8 << 20)
    assert pool._thread is None and pool.wait_prefaulted(0)
