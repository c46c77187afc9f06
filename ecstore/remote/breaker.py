"""A circuit breaker with exponential back-off, driven by an injectable clock.

States: CLOSED (calls go through) -> after ``threshold`` consecutive failures
OPEN (calls are refused without touching the network) -> once the back-off has
passed, HALF_OPEN (exactly one probe call goes through) -> CLOSED on its
success, OPEN again with twice the back-off (up to ``max_backoff_s``) on its
failure. A success resets the back-off.

Thread-safe: every method may be called from any thread.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class Transition:
    """What a ``record_*`` call changed (for logging by the caller)."""

    before: BreakerState
    after: BreakerState
    backoff_s: float  # seconds until the next probe (OPEN), else 0


class CircuitBreaker:
    """Args:
        threshold: consecutive failures that open the circuit.
        base_backoff_s: seconds the circuit stays open the first time.
        max_backoff_s: cap of the doubling back-off.
        clock: monotonic seconds (tests pass a fake clock to drive the back-off).
    """

    def __init__(self, *, threshold: int = 3, base_backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = max(1, threshold)
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max(base_backoff_s, max_backoff_s)
        self.clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._backoff = base_backoff_s
        self._open_until = 0.0
        self._probing = False
        self._probe_since = 0.0
        self.opened = 0  # times the circuit opened (statistics)

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def refusing(self) -> bool:
        """True while the circuit is open and its back-off has not passed
        (calls would be refused; unlike :meth:`allow`, takes no probe)."""
        with self._lock:
            return self._state is BreakerState.OPEN and self.clock() < self._open_until

    def allow(self) -> bool:
        """May a call go to the remote now? (False: treat it as a miss.)"""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self.clock() >= self._open_until:
                self._state = BreakerState.HALF_OPEN
                self._probing = False
            if self._state is BreakerState.HALF_OPEN and (
                    not self._probing or self.clock() - self._probe_since > self.max_backoff_s):
                # One probe at a time; a probe never reported (its thread
                # died) is replaced after max_backoff_s.
                self._probing, self._probe_since = True, self.clock()
                return True
            return False

    def record_success(self) -> Transition | None:
        with self._lock:
            before = self._state
            self._state, self._failures, self._probing = BreakerState.CLOSED, 0, False
            self._backoff = self.base_backoff_s
            return None if before is BreakerState.CLOSED else Transition(before, self._state, 0.0)

    def record_failure(self) -> Transition | None:
        with self._lock:
            before = self._state
            self._failures += 1
            if before is BreakerState.HALF_OPEN:
                self._backoff = min(self._backoff * 2, self.max_backoff_s)
            elif before is BreakerState.OPEN or self._failures < self.threshold:
                return None
            self._state, self._probing = BreakerState.OPEN, False
            self._open_until = self.clock() + self._backoff
            self.opened += 1
            return Transition(before, self._state, self._backoff)
