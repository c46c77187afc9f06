"""The in-memory tier: a byte-bounded LRU of CPU tensors, per process.

Values are held by reference, not copied: ``get`` hands back the very tensor
that was stored, so a memory hit costs a dict lookup whatever the tensor's
size. Callers must treat returned tensors as read-only.

Thread-safety: every method takes one internal lock; safe to call from any
thread. Not shared between processes (each process has its own tier).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch


class MemoryItem(NamedTuple):
    identifier: str
    tensor: torch.Tensor
    nbytes: int


class MemoryTier:
    """LRU mapping key -> (identifier, tensor), bounded in tensor bytes.

    ``capacity_bytes`` is the most tensor data held at once; an item larger
    than the capacity is never admitted (``put`` returns False).
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self._items: OrderedDict[str, MemoryItem] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self.evictions = 0
        #: Called as ``on_evict(key, item)`` for each LRU eviction (not for
        #: delete), under the tier's lock: it must be quick and not re-enter.
        self.on_evict: Callable[[str, MemoryItem], None] | None = None

    def put(self, key: str, identifier: str, tensor: torch.Tensor, nbytes: int) -> bool:
        """Insert (or refresh) an item, evicting LRU items to make room.

        Returns False, leaving the tier unchanged, when the item alone exceeds
        the capacity or ``key`` already holds a different identifier (a hash
        collision: the first identifier keeps the slot).
        """
        if nbytes > self.capacity_bytes:
            return False
        with self._lock:
            old = self._items.get(key)
            if old is not None:
                if old.identifier != identifier:
                    return False
                self._items.move_to_end(key)
                return True
            while self._used + nbytes > self.capacity_bytes and self._items:
                vkey, victim = self._items.popitem(last=False)
                self._used -= victim.nbytes
                self.evictions += 1
                if self.on_evict is not None:
                    self.on_evict(vkey, victim)
            self._items[key] = MemoryItem(identifier, tensor, nbytes)
            self._used += nbytes
            return True

    def get(self, key: str, identifier: str) -> torch.Tensor | None:
        with self._lock:
            item = self._items.get(key)
            if item is None or item.identifier != identifier:
                return None
            self._items.move_to_end(key)
            return item.tensor

    def identifier_at(self, key: str) -> str | None:
        with self._lock:
            item = self._items.get(key)
            return None if item is None else item.identifier

    def contains(self, key: str, identifier: str) -> bool:
        with self._lock:
            item = self._items.get(key)
            return item is not None and item.identifier == identifier

    def delete(self, key: str) -> bool:
        with self._lock:
            item = self._items.pop(key, None)
            if item is None:
                return False
            self._used -= item.nbytes
            return True

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._used = 0

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._items)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._items)
