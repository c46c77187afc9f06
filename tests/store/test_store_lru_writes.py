"""When LRU updates from reads (recency, hit counts) reach the LMDB file.

Reads do not commit on their own (each commit is an fsync): their touches
ride along with the next batch of puts, go alone after TOUCH_DELAY_S, are
forced by flush()/close(), or by write_lru_soon() (the connector calls it
once per step that loaded entries; at most one such commit per
TOUCH_SOON_GAP_S).
"""

from __future__ import annotations

import torch

import ecstore
from ecstore.store import writer as writer_mod


def _store(tmp_path):
    cfg = ecstore.ECStoreConfig(local_cpu=True, max_local_cpu_size=0.01, local_disk=str(tmp_path),
                                max_local_disk_size=0.01)
    return ecstore.ECStore(cfg, model="m", dtype=torch.float32)


def _hits(store, mm_hash):
    return store.disk.record(store.key(mm_hash)).hits


def _writer_idle(store) -> None:
    w = store._writer
    with w.cv:  # wait on the writer's own condition (no sleeps), bounded
        assert w.cv.wait_for(lambda: not (w.touches or w.busy or w.puts.queued or w.puts.taken), timeout=60)


def test_write_lru_soon_records_hits_without_a_flush(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod, "TOUCH_DELAY_S", 3600.0)  # never by time in this test
    with _store(tmp_path) as s:
        s.put("a", torch.ones(4, 4))
        s.flush()
        assert s.get("a") is not None and s.get("a") is not None
        assert _hits(s, "a") == 0  # not written yet: no commit per read
        s.write_lru_soon()
        _writer_idle(s)
        assert _hits(s, "a") == 2


def test_write_lru_soon_waits_the_gap_after_the_previous_touch_commit(tmp_path, monkeypatch):
    """Once per engine step is too often for a commit of its own: a step's
    load ran beside the commit the previous step asked for (1 MB connector
    loads back to back: 190 µs instead of 90). The first request writes at
    once; one within TOUCH_SOON_GAP_S of that commit waits for the gap (or a
    put or flush); nothing is lost."""
    monkeypatch.setattr(writer_mod, "TOUCH_DELAY_S", 3600.0)
    monkeypatch.setattr(writer_mod, "TOUCH_SOON_GAP_S", 3600.0)
    with _store(tmp_path) as s:
        s.put("a", torch.ones(4, 4))
        s.flush()
        s.get("a")
        s.write_lru_soon()  # no touch commit before: at once
        _writer_idle(s)
        assert _hits(s, "a") == 1
        s.get("a")
        s.write_lru_soon()
        due = s._writer.touches_due()
        assert due is not None and due > s._writer.touches_written_at + 3000, "written again at once"
        assert _hits(s, "a") == 1
        s.flush()  # a flush writes them regardless
        assert _hits(s, "a") == 2


def test_touches_ride_along_with_the_next_put(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod, "TOUCH_DELAY_S", 3600.0)
    with _store(tmp_path) as s:
        s.put("a", torch.ones(4, 4))
        s.flush()
        s.get("a")
        s.put("b", torch.zeros(4, 4))
        _writer_idle(s)
        assert _hits(s, "a") == 1
        # the read came before the put: a is less recently used than b
        assert s.disk.lru_keys() == [s.key("a"), s.key("b")]


def test_close_writes_pending_touches(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod, "TOUCH_DELAY_S", 3600.0)
    with _store(tmp_path) as s:
        s.put("a", torch.ones(4, 4))
        s.flush()
        s.get("a")
    with _store(tmp_path) as s:
        assert _hits(s, "a") == 1


def test_touches_of_an_idle_store_are_written_after_the_delay(tmp_path, monkeypatch):
    """With no put, no flush and no write_lru_soon, a read still reaches the
    file once TOUCH_DELAY_S has passed (the writer starts the timer)."""
    monkeypatch.setattr(writer_mod, "TOUCH_DELAY_S", 0.05)
    with _store(tmp_path) as s:
        s.put("a", torch.ones(4, 4))
        s.flush()
        s.get("a")
        _writer_idle(s)  # waits on the writer's condition until the touch is written
        assert _hits(s, "a") == 1
