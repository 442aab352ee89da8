"""Exponential backoff, a circuit breaker, and the guard that runs a call through both.

A tier asks ``CircuitBreaker.allow()`` before each call to its service and reports the outcome
with ``record_success()`` / ``record_failure()``. After ``failure_threshold`` failures in a row
the breaker opens: calls are refused at once (the tier answers with misses) until a backoff
delay has passed, then one trial call is let through (half-open). A successful trial closes the
breaker; a failed one reopens it with the next, doubled, delay.

``Guard`` is the one place that decides what a failed call means: whether it counts against
the breaker, whether it is retried (after an ``ExponentialBackoff`` delay), and what the caller
gets instead of an exception. Its ``call`` and ``acall`` (for coroutines) share that decision.

Time comes from an injectable clock so tests step it instead of sleeping.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from cachetier.util.checks import positive_int

_T = TypeVar("_T")
_F = TypeVar("_F")

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
        positive_int("failure_threshold", failure_threshold)
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


class Fault(str, Enum):
    """What one failed attempt says about the service (``Guard``'s ``classify`` answers it)."""

    DOWN = "down"  # unreachable, timed out, garbage: counts against the breaker, not retried
    TRANSIENT = "transient"  # as DOWN, but a retry may succeed (a refused or reset connection)
    ANSWERED = "answered"  # it answered, with an error or a refusal: it is up; not retried


def _ignore(*_args: object) -> None:
    return None


class Guard:
    """Runs calls to one service through its circuit breaker, with retries after a backoff.

    A call the breaker refuses is not made; a call that fails for good returns the caller's
    ``failed`` value instead of raising. An exception ``classify`` does not know (a bug, a
    cancellation) counts against the breaker and propagates.

    Args:
        breaker: the service's breaker; every attempt's outcome is reported to it.
        classify: the ``Fault`` an exception is, or ``None`` for one that is not the service's.
        on_failure: told of each call that failed for good (after its retries), with the last
            exception and its fault: count an error, log.
        on_skipped: told of each call not made because the breaker was open.
        backoff: delay before retry ``n`` is ``backoff.delay_s(n)``; needed when ``retries``.
        retries: extra attempts after a ``TRANSIENT`` fault.
        on_retry: told of each failed attempt that is retried, with its exception.
    """

    def __init__(
        self,
        breaker: CircuitBreaker,
        classify: Callable[[BaseException], Fault | None],
        *,
        on_failure: Callable[[BaseException, Fault], None] = _ignore,
        on_skipped: Callable[[], None] = _ignore,
        backoff: ExponentialBackoff | None = None,
        retries: int = 0,
        on_retry: Callable[[BaseException], None] = _ignore,
    ) -> None:
        if retries and backoff is None:
            raise ValueError("retries need a backoff")
        self.breaker = breaker
        self._classify = classify
        self._on_failure = on_failure
        self._on_skipped = on_skipped
        self._backoff = backoff
        self._retries = retries
        self._on_retry = on_retry

    def call(self, fn: Callable[[], _T], failed: _F) -> _T | _F:
        """Run ``fn`` unless the breaker is open, retrying as the faults allow.

        Args:
            fn: one attempt.
            failed: what to return when the call is skipped or fails for good.

        Returns:
            ``fn``'s result, or ``failed``.
        """
        for attempt in self._attempts():
            if attempt.delay_s:
                time.sleep(attempt.delay_s)
            with attempt:  # takes a fault of the service; anything else propagates
                return attempt.succeeded(fn())
        return failed

    async def acall(self, fn: Callable[[], Awaitable[_T]], failed: _F) -> _T | _F:
        """``call`` for a coroutine: the waits between attempts do not block the loop.

        Args:
            fn: makes one attempt's awaitable.
            failed: what to return when the call is skipped or fails for good.

        Returns:
            ``fn``'s result, or ``failed``.
        """
        for attempt in self._attempts():
            if attempt.delay_s:
                await asyncio.sleep(attempt.delay_s)
            with attempt:
                return attempt.succeeded(await fn())
        return failed

    def _attempts(self) -> Iterator[_Attempt]:
        """The attempts of one call: none if the breaker refuses it, then one more after
        each failure that is retried."""
        if not self.breaker.allow():
            self._on_skipped()
            return
        number, delay_s = 0, 0.0
        while True:
            attempt = _Attempt(self, number, delay_s)
            yield attempt
            if attempt.next_delay_s is None:
                return
            number, delay_s = number + 1, attempt.next_delay_s

    def _after_fault(self, exc: BaseException, fault: Fault, attempt: int) -> float | None:
        """Account for a failed attempt; the wait before the next one, or ``None`` to stop."""
        if fault is Fault.TRANSIENT and attempt < self._retries:
            assert self._backoff is not None, "checked in __init__"
            self._on_retry(exc)
            return self._backoff.delay_s(attempt)
        if fault is Fault.ANSWERED:
            self.breaker.record_success()
        else:
            self.breaker.record_failure()
        self._on_failure(exc, fault)
        return None


class _Attempt:
    """One attempt of a ``Guard`` call; as a context manager it takes the attempt's fault.

    Args:
        guard: the guard whose call this is.
        number: 0 for the first attempt, 1 for the first retry, ...
        delay_s: how long to wait before making it, in seconds.
    """

    __slots__ = ("_guard", "number", "delay_s", "next_delay_s")

    def __init__(self, guard: Guard, number: int, delay_s: float) -> None:
        self._guard = guard
        self.number = number
        self.delay_s = delay_s
        self.next_delay_s: float | None = None  # set when a fault is retried

    def succeeded(self, result: _T) -> _T:
        """Report the success to the breaker; returns ``result``."""
        self._guard.breaker.record_success()
        return result

    def __enter__(self) -> _Attempt:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> bool:
        if exc is None:
            return False
        fault = self._guard._classify(exc)
        if fault is None:  # cancelled (the caller stopped waiting) or a bug: propagate
            self._guard.breaker.record_failure()
            return False
        self.next_delay_s = self._guard._after_fault(exc, fault, self.number)
        return True
