"""Weak references to the buffers the process's pool hands out, to check
that none stays referenced once its put is written (or failed)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def record_pool_buffers(pool: Any, set_attr: Callable[[Any, str, Any], None] = setattr) -> list[weakref.ref]:
    """Wrap ``pool.typed_buffer`` (with ``set_attr``: pytest's
    ``monkeypatch.setattr`` to undo it after the test); the returned list
    gets a weak reference to each buffer handed out from then on."""
    bufs: list[weakref.ref] = []
    typed_buffer = pool.typed_buffer

    def recorded(*args: Any, **kwargs: Any) -> Any:
        buf, tensor = typed_buffer(*args, **kwargs)
        bufs.append(weakref.ref(buf))
        return buf, tensor

    set_attr(pool, "typed_buffer", recorded)
    return bufs
