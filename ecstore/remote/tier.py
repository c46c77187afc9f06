"""The remote tier: entries shared across machines through Redis/Valkey.

:class:`RemoteTier`: failure is a miss, never an error. Every call is bounded
by ``timeout_s`` (seconds) as a whole (:mod:`~ecstore.remote.deadline`), goes
through a :class:`CircuitBreaker` and is counted in :class:`RemoteStats`;
nothing raises once constructed. Any thread may call any method; writes go
out on one background thread (``submit`` blocks at most ``timeout_s`` for
``queue_bytes`` of room, then drops). Flows and threading:
docs/architecture.md#remote-calls; behaviour: docs/remote.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch

from ecstore.errors import CorruptEntryError
from ecstore.format import PendingPut, codec
from ecstore.remote import frame
from ecstore.remote.backend import RemoteBackend, RemoteBadReply, RemoteRefused, RemoteUnavailable
from ecstore.remote.breaker import BreakerState, CircuitBreaker, Transition
from ecstore.remote.deadline import deadline
from ecstore.remote.url import mask_secrets
from ecstore.remote.writer import Batch, WriteQueue

log = logging.getLogger("ecstore")
T = TypeVar("T")

#: How long a remote "not there" answer is remembered (seconds).
NEGATIVE_TTL_S = 1.0
#: At most this many remembered misses (oldest forgotten first).
NEGATIVE_MAX = 65536
#: Batches of at least this many tensor bytes ask which keys exist before
#: sending values (SET NX alone would also keep the first value, but only
#: after the bytes crossed the network).
EXISTS_FIRST_BYTES = 1 << 20
#: A refused command (server full...), a foreign or a corrupt value is logged
#: (as a warning) at most once per this many seconds, each kind on its own.
LOG_EVERY_S = 10.0


def _size(parts: list[Any]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


@dataclass
class RemoteStats:
    """Counters of one remote tier (this process). Times in seconds, sizes in bytes."""

    hits: int = 0  # gets answered with a verified value
    misses: int = 0  # gets with no (usable) value
    lookups: int = 0  # contains() calls that reached the server
    lookup_hits: int = 0
    negative_cached: int = 0  # contains() answered by the negative cache
    errors: int = 0  # calls that failed (unreachable, timeout, refused)
    skipped: int = 0  # calls not made because the circuit was open
    puts: int = 0  # values written
    puts_present: int = 0  # not written: the remote already held the key
    puts_dropped: int = 0  # not written: failure, full queue or open circuit
    corrupt_dropped: int = 0  # corrupt values deleted
    foreign: int = 0  # values of another identifier/model/dtype under our key (misses)
    bytes_read: int = 0
    bytes_written: int = 0
    get_seconds: float = 0.0
    put_seconds: float = 0.0
    circuit_opened: int = 0

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class RemoteTier:
    """Args:
        backend: the byte store (e.g. :class:`~ecstore.remote.backend.RedisBackend`).
        model, dtype: what this handle stores (checked on every read).
        timeout_s: the back-pressure wait of ``submit`` and the bound of one
            write batch (seconds; the backend bounds each call by its own
            timeout).
        ttl_s: expiry of written values (0: none; capacity is then the
            server's ``maxmemory`` policy).
        queue_bytes: tensor bytes waiting to be written before ``submit`` waits.
        readonly: never write or delete.
        clock: monotonic seconds for the breaker and the negative cache (tests).
    """

    def __init__(self, backend: RemoteBackend, *, model: str, dtype: torch.dtype, timeout_s: float,
                 ttl_s: float = 0.0, queue_bytes: int = 256 << 20, readonly: bool = False,
                 clock: Callable[[], float] = time.monotonic,
                 breaker: CircuitBreaker | None = None) -> None:
        self.backend = backend
        self.model = model
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self.queue_bytes = max(1, queue_bytes)
        self.readonly = readonly
        self.clock = clock
        self.breaker = breaker or CircuitBreaker(clock=clock)
        self._stats = RemoteStats()
        self._lock = threading.Lock()  # stats, negative cache, log limiter
        self._negative: OrderedDict[str, float] = OrderedDict()  # key -> expiry (clock)
        self._logged: dict[str, tuple[float, int]] = {}  # kind -> (last warning, not logged since)
        self._writes: WriteQueue | None = None
        if not readonly:
            self._writes = WriteQueue(self._write, refusing=self.breaker.refusing,
                                      on_dropped=lambda n: self._count(puts_dropped=n),
                                      max_bytes=queue_bytes, wait_s=timeout_s)

    # ------------------------------------------------------------ plumbing
    def _count(self, **inc: float) -> None:
        with self._lock:
            for k, v in inc.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    def _note(self, t: Transition | None) -> None:
        if t is None:
            return
        if t.after is BreakerState.OPEN:
            self._count(circuit_opened=1)
            log.warning("ecstore: remote tier %s unreachable: serving from the local tiers only, "
                        "next try in %.3g s", self.backend.description, t.backoff_s)
        elif t.after is BreakerState.CLOSED:
            log.info("ecstore: remote tier %s reachable again", self.backend.description)

    def _warn_limited(self, kind: str, msg: str, *args: object) -> None:
        """``log.warning(msg % args)`` at most once per LOG_EVERY_S for each
        ``kind`` (a debug line otherwise); a warning says how many were not
        logged since the previous one. A key read again and again (a foreign
        value stays) must not flood the log."""
        with self._lock:
            now = self.clock()
            last, quiet = self._logged.get(kind, (float("-inf"), 0))
            loud = now - last >= LOG_EVERY_S
            self._logged[kind] = (now, 0) if loud else (last, quiet + 1)
        if not loud:
            log.debug(msg, *args)
        elif quiet:
            log.warning(msg + " (%d more like it not logged in the last %.3g s)", *args, quiet, now - last)
        else:
            log.warning(msg, *args)

    def _call(self, what: str, fn: Callable[[], T],
              on_unavailable: Callable[[], object] | None = None) -> tuple[bool, T | None]:
        """(True, result) or (False, None) when the circuit is open or the
        call failed; ``on_unavailable`` is called when it failed for want of
        the server (unreachable, timed out: what opens the circuit)."""
        if not self.breaker.allow():
            self._count(skipped=1)
            return False, None
        try:
            result = fn()
        except RemoteBadReply as e:  # not a server ecstore can use: a failure, and said
            self._count(errors=1)
            self._warn_limited("bad reply", "ecstore: remote %s failed: %s", what, e)
            self._note(self.breaker.record_failure())
            if on_unavailable is not None:
                on_unavailable()
            return False, None
        except RemoteUnavailable as e:
            self._count(errors=1)
            log.debug("ecstore: remote %s failed: %s", what, e)
            self._note(self.breaker.record_failure())
            if on_unavailable is not None:
                on_unavailable()
            return False, None
        except RemoteRefused as e:  # the server is up: not a reason to open the circuit
            self._count(errors=1)
            self._note(self.breaker.record_success())
            self._warn_limited("refused", "ecstore: remote %s refused: %s", what, e)
            return False, None
        except Exception as e:  # noqa: BLE001  (a backend bug must not fail a request either)
            self._count(errors=1)
            log.warning("ecstore: remote %s failed unexpectedly: %s: %s", what, type(e).__name__,
                        mask_secrets(str(e), getattr(self.backend, "description", "")))
            self._note(self.breaker.record_failure())
            if on_unavailable is not None:
                on_unavailable()
            return False, None
        self._note(self.breaker.record_success())
        return True, result

    def _remember_miss(self, key: str) -> None:
        with self._lock:
            self._negative[key] = self.clock() + NEGATIVE_TTL_S
            self._negative.move_to_end(key)
            while len(self._negative) > NEGATIVE_MAX:
                self._negative.popitem(last=False)

    def _known_missing(self, key: str) -> bool:
        with self._lock:
            expiry = self._negative.get(key)
            if expiry is None:
                return False
            if self.clock() < expiry:
                return True
            del self._negative[key]
            return False

    # ------------------------------------------------------------------ reads
    def contains(self, key: str) -> bool:
        """Does the remote hold ``key``? One EXISTS (bounded), unless a recent
        answer was no (negative cache) or the circuit is open (False)."""
        if self._known_missing(key):
            self._count(negative_cached=1)
            return False
        ok, found = self._call("lookup", lambda: self.backend.exists(key))
        if ok:
            self._count(lookups=1, lookup_hits=1 if found else 0)
            if not found:
                self._remember_miss(key)
        return bool(found)

    def get(self, key: str, identifier: str) -> frame.RemoteEntry | None:
        """The verified entry under ``key`` for ``identifier``, or None (miss).

        A corrupt or unusable value (:func:`frame.check_value` fails) is
        deleted (if still unchanged); a valid value of another identifier,
        model or dtype is left alone. Warnings about either are rate-limited
        (:data:`LOG_EVERY_S`). Never raises.
        """
        t0 = time.perf_counter()
        ok, value = self._call("get", lambda: self.backend.get(key))
        self._count(get_seconds=time.perf_counter() - t0)
        if not ok or value is None:
            self._count(misses=1)
            if ok:
                self._remember_miss(key)
            return None
        self._count(bytes_read=len(value))
        try:
            entry = frame.decode_entry(value, identifier=identifier, model=self.model,
                                       dtype_name=self.dtype_name)
        except frame.ForeignValue as e:
            self._warn_limited("foreign", "ecstore: remote value %s %s, not %r (%s): treated as a miss",
                               key, e, identifier, self.model)
            self._count(misses=1, foreign=1)
            return None
        except CorruptEntryError as e:
            self._warn_limited("corrupt", "ecstore: corrupt remote value %s (%s) at %s: treated as a miss%s",
                               key, e, self.backend.description, "" if self.readonly else ", removed")
            self._count(misses=1)
            if not self.readonly:
                ok, deleted = self._call("delete", lambda: self.backend.delete_if_unchanged(key, value))
                if ok and deleted:
                    self._count(corrupt_dropped=1)
            return None
        except Exception as e:  # noqa: BLE001  (MemoryError...: a miss, the value left alone)
            self._warn_limited("undecodable", "ecstore: remote value %s could not be decoded (%s: %s): "
                               "treated as a miss", key, type(e).__name__, e)
            self._count(misses=1, errors=1)
            return None
        self._count(hits=1)
        return entry

    def delete(self, key: str) -> None:
        """Remove ``key`` from the remote (best effort)."""
        if not self.readonly:
            if self._writes is not None:
                self._writes.cancel(key)
            self._call("delete", lambda: self.backend.delete(key))

    # ----------------------------------------------------------------- writes
    def submit(self, key: str, identifier: str, tensor: torch.Tensor, blob: Any = None) -> bool:
        """Queue a write of ``tensor`` (contiguous CPU, not modified afterwards)
        and its safetensors ``blob`` (None: encoded by the writer). False: dropped
        (read-only, circuit open, or the queue stayed full for ``timeout_s``)."""
        if self._writes is None:
            return False
        queued = self._writes.submit(PendingPut(key, identifier, tensor, blob))
        if queued:
            with self._lock:
                self._negative.pop(key, None)
        return queued

    def drain(self) -> None:
        """Wait until every write queued before the call was sent or dropped."""
        if self._writes is not None:
            self._writes.drain()

    def _write(self, batch: Batch) -> None:
        """Writer thread: one SET NX pipeline (after one EXISTS pipeline for
        big batches), both within ``timeout_s`` from now."""
        with deadline(self.timeout_s):
            self._write_batch(batch)

    def _drop_queued(self) -> None:
        if self._writes is not None:
            self._writes.drop_queued()

    def _write_batch(self, batch: Batch) -> None:
        t0 = time.perf_counter()
        keys = [it.key for it in batch]
        present = [False] * len(batch)
        if sum(it.nbytes for it in batch) >= EXISTS_FIRST_BYTES:
            # Big values: one EXISTS round trip to skip sending what is there.
            ok, there = self._call("lookup", lambda: self.backend.exists_many(keys), self._drop_queued)
            if not ok or there is None:
                self._count(puts_dropped=len(batch))
                return
            present = there
        todo = [it for it, there in zip(batch, present) if not there]
        self._count(puts_present=len(batch) - len(todo))
        values = []
        for it in todo:
            blob = it.blob
            if blob is None:
                blob = codec.encode(it.tensor, identifier=it.identifier, model=self.model)
            values.append((it.key, frame.pack(it.identifier, blob, it.tensor.dtype, tuple(it.tensor.shape))))
        ok, written = self._call("put", lambda: self.backend.set_many(values, self.ttl_s), self._drop_queued)
        if not ok or written is None:
            self._count(puts_dropped=len(todo))
        else:
            n = sum(written)
            self._count(puts=n, puts_present=len(todo) - n,
                        bytes_written=sum(_size(v) for (_, v), w in zip(values, written) if w))
        self._count(put_seconds=time.perf_counter() - t0)

    # --------------------------------------------------------------- lifecycle
    def stats(self) -> RemoteStats:
        with self._lock:
            return RemoteStats(**self._stats.as_dict())  # type: ignore[arg-type]

    @property
    def pending(self) -> int:
        """Writes queued and not yet taken by the writer thread."""
        return 0 if self._writes is None else self._writes.pending

    def close(self) -> None:
        """Send what is queued (bounded by the timeouts), stop, disconnect."""
        if self._writes is not None:
            self._writes.close()
        self.backend.close()
