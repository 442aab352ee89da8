"""Exponential backoff and a circuit breaker for tiers backed by a remote service.

A tier asks ``CircuitBreaker.allow()`` before each call to its service and reports the outcome
with ``record_success()`` / ``record_failure()``. After ``failure_threshold`` failures in a row
the breaker opens: calls are refused at once (the tier answers with misses) until a backoff
delay has passed, then one trial call is let through (half-open). A successful trial closes the
breaker; a failed one reopens it with the next, doubled, delay.

Time comes from an injectable clock so tests step it instead of sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

Clock = Callable[[], float]
"""Returns seconds from an arbitrary origin that never goes backwards (``time.monotonic``)."""


@dataclass(frozen=True, slots=True)
class ExponentialBackoff:
    """Delays that start at ``base_s`` and double per attempt up to ``cap_s``.

    Args:
        base_s: delay before the first retry, in seconds.
        cap_s: largest delay, in seconds (redis-py caps its own backoff at 0.512 s).
    """

    base_s: float
    cap_s: float

    def __post_init__(self) -> None:
        if not self.base_s > 0:
            raise ValueError(f"backoff base_s must be positive, got {self.base_s!r}")
        if not self.cap_s >= self.base_s:
            raise ValueError(
                f"backoff cap_s must be at least base_s ({self.base_s}), got {self.cap_s!r}"
            )

    def delay_s(self, attempt: int) -> float:
        """Delay before retry number ``attempt``.

        Args:
            attempt: 0 for the first retry, 1 for the second, ...

        Returns:
            ``min(cap_s, base_s * 2**attempt)`` seconds.
        """
        if attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {attempt}")
        # Past 2**64 the product is above any sane cap anyway; this keeps the float finite.
        return min(self.cap_s, self.base_s * 2.0 ** min(attempt, 64))


class BreakerState(str, Enum):
    """Where a ``CircuitBreaker`` is."""

    CLOSED = "closed"  # calls go through
    OPEN = "open"  # calls are refused until the backoff delay has passed
    HALF_OPEN = "half_open"  # one trial call is in flight; others are refused


class CircuitBreaker:
    """Stops calling a failing service, and probes it again after an exponential backoff.

    Thread-safe. Every call that ``allow()`` let through must be reported with exactly one of
    ``record_success()`` / ``record_failure()``.

    Args:
        failure_threshold: consecutive failures that open the breaker.
        backoff: delay before each trial; the n-th reopening in a row waits ``delay_s(n)``.
        clock: time source in seconds (``time.monotonic`` unless a test injects its own).
        trial_timeout_s: if a trial call has not been reported after this long (its thread
            died), another trial is allowed, so a lost report cannot keep the breaker open.
    """

    def __init__(
        self,
        failure_threshold: int,
        backoff: ExponentialBackoff,
        clock: Clock = time.monotonic,
        trial_timeout_s: float = 30.0,
    ) -> None:
        if isinstance(failure_threshold, bool) or not isinstance(failure_threshold, int):
            raise TypeError(f"failure_threshold must be an int, got {failure_threshold!r}")
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if not trial_timeout_s > 0:
            raise ValueError(f"trial_timeout_s must be positive, got {trial_timeout_s!r}")
        self._threshold = failure_threshold
        self._backoff = backoff
        self._clock = clock
        self._trial_timeout_s = trial_timeout_s
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._num_failures = 0  # consecutive, since the last success
        self._num_reopens = 0  # consecutive openings without a success between them
        self._num_opens = 0  # total, for stats
        self._retry_at = 0.0  # clock time a trial is allowed (OPEN) or re-allowed (HALF_OPEN)

    @property
    def state(self) -> BreakerState:
        """The current state (``OPEN`` until a caller actually takes the trial)."""
        with self._lock:
            return self._state

    @property
    def is_open(self) -> bool:
        """Whether ``allow()`` would refuse now; a peek that never takes the trial.

        Lets a caller skip costly preparation (encoding a batch) for a call it cannot make.
        """
        with self._lock:
            return self._state is BreakerState.OPEN and self._clock() < self._retry_at

    def allow(self) -> bool:
        """Whether the caller may call the service now.

        Returns:
            ``True`` when closed, and for the one trial call once the backoff has elapsed;
            ``False`` while open or while another trial is in flight.
        """
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            now = self._clock()
            if now < self._retry_at:
                return False
            self._state = BreakerState.HALF_OPEN
            self._retry_at = now + self._trial_timeout_s
            return True

    def record_success(self) -> None:
        """The service answered: close the breaker and reset the backoff."""
        with self._lock:
            self._state = BreakerState.CLOSED
            self._num_failures = 0
            self._num_reopens = 0

    def record_failure(self) -> None:
        """The service failed (unreachable, timed out): count it, and maybe open the breaker."""
        with self._lock:
            self._num_failures += 1
            if self._state is BreakerState.HALF_OPEN:
                self._open_locked()
            elif self._state is BreakerState.CLOSED and self._num_failures >= self._threshold:
                self._open_locked()
            # Already OPEN: a call that started before the breaker opened has failed late;
            # it must not push the trial further away.

    def _open_locked(self) -> None:
        delay = self._backoff.delay_s(self._num_reopens)
        self._state = BreakerState.OPEN
        self._retry_at = self._clock() + delay
        self._num_reopens += 1
        self._num_opens += 1

    def snapshot(self) -> dict[str, Any]:
        """State and counters, for stats.

        Returns:
            ``state`` (a ``BreakerState`` value), ``num_failures`` (consecutive),
            ``num_opens`` (total times opened) and ``retry_in_s`` (seconds until a trial is
            allowed, 0 when closed).
        """
        with self._lock:
            retry_in = 0.0
            if self._state is BreakerState.OPEN:
                retry_in = max(0.0, self._retry_at - self._clock())
            return {
                "state": self._state.value,
                "num_failures": self._num_failures,
                "num_opens": self._num_opens,
                "retry_in_s": retry_in,
            }
