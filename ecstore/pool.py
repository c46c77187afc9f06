"""Reused, already-faulted CPU memory for the tensors ecstore copies out
(LMDB-tier hits) and for the blobs it builds (saves).

:class:`BufferPool` (one per process: :data:`POOL`) hands out tensors over
kept slabs (four size classes per power of two; under ``min_bytes``:
``torch.empty``); a slab returns only when nothing references the tensor, so
it is as private as fresh memory. At most ``idle_cap`` bytes are kept
unused: 256 MiB, or the largest write queue of a store opened in the process.
Thread-safe; after ``fork`` the child starts empty. Design:
docs/architecture.md#pooled-memory.
"""

from __future__ import annotations

import atexit
import math
import os
import queue
import threading
import weakref
from collections import OrderedDict
from typing import cast

import numpy as np
import torch

MiB = 1 << 20

#: Unused slabs kept for reuse, bytes (per process). Two slabs of the largest
#: benchmarked entry (130.8 MB, class 128 MiB).
DEFAULT_IDLE_BYTES = 256 * MiB
#: Requests below this many bytes come from ``torch.empty``.
DEFAULT_MIN_BYTES = 64 * 1024


#: Every slab starts at a multiple of this many bytes: a blob built in one
#: (it starts at its slab's start) can be written with ``O_DIRECT``
#: (:mod:`ecstore.lmdb.blobfiles`), which needs block-aligned memory.
SLAB_ALIGN = 4096


def new_slab(cls: int, *, pinned: bool = False) -> np.ndarray:
    """A new uint8 slab of ``cls`` bytes starting at a multiple of
    :data:`SLAB_ALIGN` (not written: its pages are faulted in by whoever
    writes it first)."""
    if pinned:
        # Page-locked memory starts at a page boundary already; torch's host
        # allocator rounds pinned requests up to a power of two, so padding
        # would double a power-of-two class.
        raw = torch.empty(cls, dtype=torch.uint8, pin_memory=True).numpy()
        if raw.ctypes.data % SLAB_ALIGN == 0:
            return raw
    raw = torch.empty(cls + SLAB_ALIGN, dtype=torch.uint8, pin_memory=pinned).numpy()
    pad = -raw.ctypes.data % SLAB_ALIGN
    return raw[pad:pad + cls]


def size_class(nbytes: int) -> int:
    """The slab size for a request of ``nbytes`` (> 0): the smallest
    ``m * 2**k`` (m in 4..8) that holds it."""
    if nbytes <= 4:
        return 4
    k = max(0, (nbytes - 1).bit_length() - 3)
    m = -(-nbytes // (1 << k))  # ceil: 4 < m <= 8
    return m << k


class BufferPool:
    """Size-classed free lists of already-written CPU buffers; the lifetime
    guarantee: docs/architecture.md#pooled-memory. Thread-safe."""

    def __init__(self, idle_bytes: int = DEFAULT_IDLE_BYTES, min_bytes: int = DEFAULT_MIN_BYTES) -> None:
        self.idle_cap = idle_bytes
        self.min_bytes = min_bytes
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.RLock()  # a finalizer may run inside our own critical section (GC)
        self._done = threading.Condition(self._lock)
        self._free: dict[int, list[np.ndarray]] = {}
        self._pinned_free: dict[int, list[np.ndarray]] = {}  # page-locked slabs (CUDA staging)
        self._idle = 0
        #: The kept (free) slabs, least recently returned first: id -> (class, pinned).
        #: When a returning slab does not fit under the idle cap, the oldest
        #: ones make room for it: the sizes in use now stay hot.
        self._order: OrderedDict[int, tuple[int, bool]] = OrderedDict()
        #: Weak references to the buffers handed out, by id: (ref, slab, pinned).
        self._live: dict[int, tuple[weakref.ReferenceType[np.ndarray], np.ndarray, bool]] = {}
        self.reused = 0  # requests served from a kept slab
        self.fresh = 0  # requests that allocated a new slab
        self.prefaulted = 0  # spare slabs faulted in by the background thread
        self._wanted: set[int] = set()  # classes queued for prefault
        self._jobs: queue.SimpleQueue[tuple[int, Layout | None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = False  # see stop_thread: no prefault from then on
        #: Per size class, at most one slab made ready by the pool thread for a
        #: :meth:`typed_buffer` request of one layout: (layout, buffer, tensor).
        #: Counted in ``_idle``; its buffer is registered in ``_live``.
        self._ready: dict[int, tuple[Layout, np.ndarray, torch.Tensor]] = {}
        #: ids of ready slabs dropped to make room: not kept when their buffer dies.
        self._dropped: set[int] = set()

    def keep_at_least(self, nbytes: int) -> None:
        """Raise the idle cap to ``nbytes`` if it is lower (never lowers it).
        A store's writer may hold ``max_write_queue_size`` of blobs at once;
        keeping that much idle lets the next burst of saves reuse them
        instead of faulting fresh memory. :meth:`clear` frees them."""
        with self._lock:
            self.idle_cap = max(self.idle_cap, int(nbytes))

    @property
    def idle_bytes(self) -> int:
        """Bytes of slabs kept unused right now."""
        return self._idle

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, *, pinned: bool = False) -> torch.Tensor:
        """An uninitialized contiguous CPU tensor of ``shape`` and ``dtype``
        that nothing else references (like ``torch.empty``), its memory reused
        from the pool when a slab of its class is free. ``pinned``: page-locked
        memory (``pin_memory=True``; needs CUDA), the staging buffer of
        ``non_blocking`` copies to and from a GPU; kept in its own free lists."""
        n = 1
        for d in shape:
            n *= d
        nbytes = n * dtype.itemsize
        if nbytes < self.min_bytes:
            return torch.empty(shape, dtype=dtype, pin_memory=pinned)
        # One torch call: a tensor of ``dtype`` straight over the buffer (it
        # holds the buffer until its storage is freed).
        out = torch.frombuffer(self.buffer(nbytes, pinned=pinned), dtype=dtype, count=n)
        return out.view(shape) if len(shape) != 1 else out

    def buffer(self, nbytes: int, *, pinned: bool = False) -> np.ndarray:
        """A writable uint8 numpy array of ``nbytes`` (> 0) that nothing else
        references, its memory a slab of the pool when one of its class is
        free (else a new slab; below ``min_bytes`` plain ``torch.empty``
        memory). The slab returns to the pool once this array is gone:
        anything made over it keeps it alive (numpy views, ``np.frombuffer``,
        ``torch.frombuffer``/``from_numpy`` tensors and their views,
        memoryviews). ``pinned`` as in :meth:`empty`."""
        if nbytes < self.min_bytes:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).numpy()
        cls = size_class(nbytes)
        slab = None
        with self._lock:
            free = (self._pinned_free if pinned else self._free).get(cls)
            if free:
                slab = free.pop()
                self._order.pop(id(slab), None)
                self._idle -= cls
                self.reused += 1
            else:
                self.fresh += 1
        if slab is None:
            slab = new_slab(cls, pinned=pinned)
        with self._lock:
            return self._hand_out(slab, nbytes, pinned)

    def _hand_out(self, slab: np.ndarray, nbytes: int, pinned: bool) -> np.ndarray:
        """The first ``nbytes`` of ``slab`` as a new array whose death returns
        the slab to the pool. Holds ``_lock``."""
        # Over a memoryview, not a slice of ``slab``: numpy points the base of
        # any view derived from a slice at ``slab`` itself, so such views
        # (``buf[1:]``, ``np.frombuffer(buf)``, ``.view(dtype)``) would not keep
        # this array alive, and the slab would be handed out again under them.
        # A view of this array keeps this array (its base is not an ndarray).
        view = np.frombuffer(memoryview(slab)[:nbytes], dtype=np.uint8)  # type: ignore[arg-type]  # ndarray: a buffer
        # A plain weak reference with a callback (kept alive in ``_live``
        # until it fires): a few times cheaper than ``weakref.finalize``.
        ref = weakref.ref(view, self._on_dead)
        self._live[id(ref)] = (ref, slab, pinned)
        return view

    def typed_buffer(self, nbytes: int, offset: int, dtype: torch.dtype, shape: tuple[int, ...], *,
                     pinned: bool = False) -> tuple[np.ndarray, torch.Tensor]:
        """:meth:`buffer` of ``nbytes``, and a C-contiguous tensor of ``dtype``
        and ``shape`` (non-empty) over it from byte ``offset`` (it keeps the
        buffer alive). When the pool thread made a slab ready for exactly this
        layout (:meth:`prefault_soon` with ``layout``), both come from it: the
        caller's thread then only takes them (no slicing, no tensor creation)."""
        layout = (nbytes, offset, dtype, tuple(shape))
        if not pinned:
            cls = size_class(nbytes)
            with self._lock:
                ready = self._ready.pop(cls, None)
                if ready is not None:
                    self._idle -= cls
                    if ready[0] == layout:
                        self.reused += 1
                        return ready[1], ready[2]
            # Made ready for another layout: dropping it returns its slab to
            # the free list (its buffer dies), where buffer() takes it.
            del ready
        buf = self.buffer(nbytes, pinned=pinned)
        return buf, _tensor_over(buf, offset, dtype, layout[3])

    def prefault_soon(self, nbytes: int, layout: tuple[int, torch.dtype, tuple[int, ...]] | None = None) -> None:
        """Have a background thread fault in one spare slab of ``nbytes``' class
        unless one is already free or it would exceed the idle cap, so that
        the next request of that size finds memory that is already faulted.
        ``layout`` = (offset, dtype, shape): also make that slab ready for a
        :meth:`typed_buffer` request of ``nbytes`` with that layout (a free
        slab of the class is used if there is one). Returns at once; the
        faulting (one write per page, GIL released) runs on the pool's daemon
        thread, off the caller's path."""
        if nbytes < self.min_bytes:
            return
        cls = size_class(nbytes)
        want = None if layout is None else (nbytes, layout[0], layout[1], tuple(layout[2]))
        with self._lock:
            if cls in self._wanted or self._stopped:
                return
            ready = self._ready.get(cls)
            if want is None or (ready is not None and ready[0] == want):
                if self._free.get(cls) or ready is not None or self._idle + cls > self.idle_cap:
                    return
            self._wanted.add(cls)
            if self._thread is None:
                self._thread = threading.Thread(target=self._prefault_loop, name="ecstore-pool", daemon=True)
                self._thread.start()
        self._jobs.put((cls, want))

    def stop_thread(self, timeout_s: float = 30.0) -> None:
        """Let a prefault in progress finish, then end the pool's thread; no
        prefault from then on. At the interpreter's exit (``atexit``, before
        finalization): a daemon thread that comes back from torch (GIL
        released) during finalization is ended with ``pthread_exit``, which
        aborts the process as it unwinds through C++ frames ("terminate
        called without an active exception")."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stopped = True
            self._wanted.clear()  # jobs not run now: nobody waits for them (wait_prefaulted)
            self._done.notify_all()
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout_s)

    def _prefault_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self._stopped:
                return
            cls, want = job
            try:
                self._prefault(cls, want)
            finally:
                with self._lock:
                    self._wanted.discard(cls)
                    self._done.notify_all()

    def _prefault(self, cls: int, want: Layout | None) -> None:
        """Pool thread: fault in a spare slab of class ``cls`` (into the free
        list), or with ``want`` make one ready for that layout. A free slab
        made ready moves from the free list to ``_ready`` in one critical
        section: a request never finds it in neither (and faults a fresh one)."""
        with self._lock:
            free = self._free.get(cls)
            if want is not None and free:
                self._make_ready(free.pop(), cls, want)  # stays counted in _idle
                return
            if free or self._idle + cls > self.idle_cap:
                return
        fresh = new_slab(cls)
        torch.from_numpy(fresh).fill_(0)  # faults every page in (torch releases the GIL)
        with self._lock:
            if self._idle + cls > self.idle_cap:
                return
            self._idle += cls
            self.prefaulted += 1
            if want is None:
                self._free.setdefault(cls, []).append(fresh)
                self._order[id(fresh)] = (cls, False)
            else:
                self._make_ready(fresh, cls, want)

    def _make_ready(self, slab: np.ndarray, cls: int, want: Layout) -> None:
        """Put ``slab`` (counted in ``_idle``, in no free list) in ``_ready``
        for ``want``, replacing what was ready for its class. Holds ``_lock``."""
        self._order.pop(id(slab), None)
        nbytes, offset, dtype, shape = want
        buf = self._hand_out(slab, nbytes, False)
        old = self._ready.pop(cls, None)
        self._ready[cls] = (want, buf, _tensor_over(buf, offset, dtype, shape))
        if old is not None:
            self._idle -= cls  # its buffer dies below: _on_dead counts its slab again
        del old

    def wait_prefaulted(self, timeout_s: float | None = None) -> bool:
        """Block until no prefault is queued or running; False on timeout."""
        with self._done:
            return self._done.wait_for(lambda: not self._wanted, timeout_s)

    def _on_dead(self, ref: weakref.ReferenceType[np.ndarray]) -> None:
        # Runs when the last reference to a handed-out buffer is gone (any
        # thread, possibly inside our own critical section: the lock is an
        # RLock). After fork the child's ``_live`` is empty: nothing inherited
        # comes back to its pool.
        with self._lock:
            entry = self._live.pop(id(ref), None)
            if entry is None or entry[0] is not ref:
                return
            _, slab, pinned = entry
            self._keep(slab, len(slab), pinned)

    def _keep(self, slab: np.ndarray, cls: int, pinned: bool) -> None:
        """Keep a returned slab for reuse, freeing the least recently
        returned kept slabs (any class), then slabs made ready for saves of
        other classes (oldest first), if the idle cap needs the room; a slab
        larger than the cap is freed. Holds ``_lock``."""
        if cls > self.idle_cap:
            return
        if id(slab) in self._dropped:  # a ready slab freed to make room: not kept
            self._dropped.discard(id(slab))
            return
        while self._idle + cls > self.idle_cap and self._order:
            sid, (c, p) = self._order.popitem(last=False)
            kept = (self._pinned_free if p else self._free).get(c, [])
            for i, s in enumerate(kept):
                if id(s) == sid:
                    del kept[i]
                    self._idle -= c
                    break
        for c in [c for c in self._ready if c != cls]:
            if self._idle + cls <= self.idle_cap:
                break
            _, buf, _ = self._ready.pop(c)
            self._idle -= c
            slab_of_buf = cast(memoryview, buf.base).obj  # see _hand_out
            self._dropped.add(id(slab_of_buf))  # its death (below, or its taker's) frees it
        if self._idle + cls <= self.idle_cap:
            (self._pinned_free if pinned else self._free).setdefault(cls, []).append(slab)
            self._order[id(slab)] = (cls, pinned)
            self._idle += cls

    def clear(self) -> None:
        """Free every kept slab (tensors handed out are unaffected)."""
        with self._lock:
            ready, self._ready = self._ready, {}
            ready.clear()  # their buffers die: their slabs go to the free lists, cleared next
            self._free.clear()
            self._pinned_free.clear()
            self._order.clear()
            self._idle = 0


#: What :meth:`BufferPool.typed_buffer` hands out: (buffer bytes, offset, dtype, shape).
Layout = tuple[int, int, torch.dtype, tuple[int, ...]]


def _tensor_over(buf: np.ndarray, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over ``buf`` from byte ``offset``
    (it holds ``buf``). ``view(*shape)``: ints parse faster than a tuple."""
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape), offset=offset).view(*shape)


#: The process's pool: LMDB-tier hits are copied into it (``blob_read.copy_out``)
#: and new blobs are built in it (``codec.encode``).
POOL = BufferPool()
os.register_at_fork(after_in_child=POOL._reset)
atexit.register(POOL.stop_thread)
