"""PutQueue, the bookkeeping both write-behind queues keep (the store's
writer and the remote's write queue): tickets, bytes pending, batches."""

from __future__ import annotations

import torch

from ecstore.format import PendingPut, PutQueue


def _put(key: str, rows: int = 4) -> PendingPut:
    return PendingPut(key, f"org/model/{key}", torch.ones(rows, 8, dtype=torch.float32))


def test_a_replaced_put_is_requeued_last_and_keeps_the_oldest_ticket_it_stands_for():
    q = PutQueue()
    a, b = _put("a"), _put("b")
    q.add(a)
    q.add(b)
    again = _put("a", rows=2)
    assert q.add(again) is a
    assert list(q.queued) == ["b", "a"]  # re-queued at the end
    assert (again.ticket, again.since) == (3, a.since)  # drains that waited for a wait for it
    assert q.bytes == b.nbytes + again.nbytes  # counted once
    assert q.oldest() == a.since


def test_bytes_stay_pending_until_the_batch_is_done():
    q = PutQueue()
    items = [_put(k) for k in "abc"]
    for it in items:
        q.add(it)
    one = items[0].nbytes
    batch = q.take(2 * one)
    assert batch == items[:2] and list(q.taken) == ["a", "b"] and list(q.queued) == ["c"]
    assert q.bytes == 3 * one  # the batch being written still counts
    assert q.get("a") is items[0] and q.get("c") is items[2]
    q.done(batch)
    assert q.bytes == one and not q.taken and q.oldest() == items[2].since


def test_a_batch_holds_at_least_one_put_and_at_most_max_items():
    q = PutQueue()
    big = _put("big", rows=64)
    q.add(big)
    assert q.take(1) == [big]  # larger than the batch bound: alone
    for k in "abcd":
        q.add(_put(k))
    assert [it.key for it in q.take(1 << 30, max_items=3)] == ["a", "b", "c"]


def test_room_is_always_there_when_nothing_is_pending():
    q = PutQueue()
    big = _put("big", rows=64)
    assert q.room_for(big.nbytes, 1)  # nothing pending: even one over the bound goes in
    q.add(big)
    assert not q.room_for(1, big.nbytes)
    assert q.room_for(0, big.nbytes)
    batch = q.take(big.nbytes)
    assert not q.room_for(1, big.nbytes)  # taken but not written: still pending
    q.done(batch)
    assert q.room_for(1, 1)


def test_removing_and_dropping_forget_queued_puts_only():
    q = PutQueue()
    for k in "abc":
        q.add(_put(k))
    taken = q.take(1)
    assert q.remove("b") is not None and q.remove("b") is None
    assert q.drop_queued() == 1  # c; a is being written
    assert q.bytes == taken[0].nbytes and q.oldest() == taken[0].since
    assert q.clear() == 1 and q.bytes == 0 and q.oldest() is None
