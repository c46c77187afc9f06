"""A remote hit's promotion into the local LMDB never makes ``get`` wait.

A real redis-server (``redis_server``) is the remote; a real second process
(tests/helpers/lmdb_lock_holder.py) holds the local store's LMDB write lock,
as a long commit, a stopped process or a map-full retry of another process
does. The background writer is stuck behind that lock with a full queue: a
remote hit must still be returned at once, its promotion skipped (counted),
not queued behind the lock.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import torch
from conftest import gib
from helpers.tensors import make_tensor, same_tensor

from ecstore import ECStore
from ecstore.config import ECStoreConfig
from ecstore.testing.redis_server import RedisServer

MODEL = "org/tiny-vlm"
DTYPE = torch.bfloat16
HELPERS = Path(__file__).parents[1] / "helpers"


def open_store(path: Path | None, url: str, **kw) -> ECStore:
    cfg = ECStoreConfig(local_disk=None if path is None else str(path),
                        max_local_disk_size=gib(64 << 20) if path else 0, remote_url=url, **kw)
    return ECStore(cfg, model=MODEL, dtype=DTYPE)


def test_a_remote_hit_is_served_while_another_process_holds_the_write_lock(
        tmp_path: Path, redis_server: RedisServer) -> None:
    """The promotion of a remote hit went through the writer's blocking
    ``submit``: with the queue full behind another process's write lock,
    ``get`` waited as long as that lock was held (for ever here: the holder
    lets go only after the get). Now it is skipped and counted."""
    entry, filler = make_tensor(1, rows=64, cols=512), make_tensor(2, rows=64, cols=512)  # 64 KiB each
    with open_store(None, redis_server.url) as a:  # another node
        assert a.put("img", entry)
        a.flush()
    # Room for one 64 KiB tensor in B's write queue.
    b = open_store(tmp_path / "b", redis_server.url, max_write_queue_size=gib(96 << 10))
    holder = subprocess.Popen([sys.executable, str(HELPERS / "lmdb_lock_holder.py"), str(tmp_path / "b")],
                              text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    got: dict[str, torch.Tensor | None] = {}
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "locked"
        assert b.put("filler", filler)  # admitted; its commit waits for the holder's lock
        assert b.stats().pending_bytes == filler.numel() * filler.element_size()
        reader = threading.Thread(target=lambda: got.setdefault("img", b.get("img")), daemon=True)
        reader.start()
        reader.join(timeout=120)  # a hang guard: the get needs milliseconds
        assert not reader.is_alive(), "get waited for another process's write lock"
        assert holder.poll() is None  # the lock was held all along
        assert same_tensor(got["img"], entry)
        s = b.stats()
        assert (s.remote_hits, s.remote_promotions_skipped) == (1, 1)
    finally:
        assert holder.stdin is not None
        holder.stdin.write("go\n")
        holder.stdin.flush()
        holder.wait(timeout=60)
    b.flush()  # the filler is committed now
    assert b.disk is not None
    assert b.disk.contains(b.key("filler"), b.stored_name("filler"))
    assert not b.disk.contains(b.key("img"), b.stored_name("img"))  # skipped, not queued
    assert same_tensor(b.get("img"), entry)  # served again (memory tier); a later hit may promote it
    b.close()


def test_a_remote_hit_is_promoted_when_the_writer_has_room(tmp_path: Path, redis_server: RedisServer) -> None:
    """With room in the queue the promotion is queued as before (not skipped)."""
    entry = make_tensor(3, rows=64, cols=512)
    with open_store(None, redis_server.url) as a:
        assert a.put("img", entry)
        a.flush()
    with open_store(tmp_path / "b", redis_server.url, max_write_queue_size=gib(96 << 10)) as b:
        assert same_tensor(b.get("img"), entry)
        b.flush()
        assert b.stats().remote_promotions_skipped == 0
        assert b.disk is not None and b.disk.contains(b.key("img"), b.stored_name("img"))
