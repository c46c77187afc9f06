"""_TxnGate without a lock on its fast path: a pending resize still holds
new transactions back until it is done, and waits for the open ones."""

from __future__ import annotations

import threading
from pathlib import Path

import lmdb

from ecstore.lmdb.txngate import _TxnGate


class _RecordingEnv:
    """A real environment whose set_mapsize (the resize) is recorded."""

    def __init__(self, path: Path, events: list[str]) -> None:
        self.env = lmdb.open(str(path), map_size=1 << 20)
        self.events = events

    def set_mapsize(self, size: int) -> None:
        self.env.set_mapsize(size)
        self.events.append("resized")


def test_a_transaction_begun_while_a_resize_waits_enters_only_after_it(tmp_path: Path) -> None:
    gate = _TxnGate()
    events: list[str] = []
    env = _RecordingEnv(tmp_path / "env", events)
    try:
        gate.enter()  # this thread's transaction: the resize waits for it
        resizer = threading.Thread(target=lambda: gate.adopt_new_size(env, str(tmp_path)))  # type: ignore[arg-type]
        resizer.start()
        with gate._cv:
            while not gate._resizing:
                gate._cv.wait(0.01)

        def reader() -> None:
            gate.enter()
            events.append("reader in")
            gate.leave()

        r = threading.Thread(target=reader)
        r.start()
        with gate._cv:  # until the reader waits too (or, were it not held back, went in)
            while len(gate._cv._waiters) < 2 and "reader in" not in events:  # type: ignore[attr-defined]
                gate._cv.wait(0.01)
        events.append("first out")
        gate.leave()
        resizer.join()
        r.join()
        assert events == ["first out", "resized", "reader in"]
        assert gate._active == 0 and not gate._resizing
    finally:
        env.env.close()


def test_transactions_of_many_threads_leave_the_gate_empty() -> None:
    gate = _TxnGate()

    def work() -> None:
        for _ in range(20_000):
            gate.enter()
            gate.leave()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert gate._active == 0
