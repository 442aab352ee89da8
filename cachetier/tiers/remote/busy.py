"""A server that says "not now": 429 or 503 with ``Retry-After`` over HTTP, ``BUSY`` on the
transfer port (past this tenant's share, or the server's bytes in flight are full).

It is up and answering, so this is no outage: the call is a miss now, the circuit breaker is
not told of a failure, and calls until the hinted time (or, without a hint, the next delay of
the tier's backoff) are misses made without calling (``deferred`` in stats).
"""

from __future__ import annotations

import re
import threading

from cachetier.errors import TierUnavailableError
from cachetier.util.backoff import Clock, ExponentialBackoff

# The server ends the message of a refusal past a share with its wait (server.fairness).
_WAIT = re.compile(r"retry after ([0-9]+(?:\.[0-9]+)?) s\s*$")
MAX_HOLD_S = 10.0  # the longest a hint may stop calls: a bad one cannot silence the tier


class ServerBusyError(TierUnavailableError):
    """The server answered busy (429/503 with ``Retry-After``, or ``BUSY``).

    Args:
        message: what it said.
        retry_after_s: the wait it asked for, in seconds, or ``None`` when it named none.
    """

    def __init__(self, message: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def wait_in(message: str) -> float | None:
    """The wait a transfer port's ``BUSY`` message names (``retry after <s> s``), if any."""
    found = _WAIT.search(message)
    return float(found.group(1)) if found else None


def retry_after_s(header: str | None) -> float | None:
    """Seconds of a ``Retry-After`` header given as a number (a date is taken as none)."""
    try:
        return max(0.0, float(header)) if header is not None else None
    except ValueError:
        return None


class BusyHold:
    """When the tier may call the server again after a busy answer. Thread-safe.

    Args:
        backoff: the tier's backoff: without a hint, busy answers in a row wait its delays.
        clock: time source in seconds.
    """

    def __init__(self, backoff: ExponentialBackoff, clock: Clock) -> None:
        self._backoff = backoff
        self._clock = clock
        self._lock = threading.Lock()
        self._until = 0.0
        self._in_row = 0
        self.num_busy = 0  # busy answers
        self.num_deferred = 0  # calls not made while holding

    def note(self, exc: ServerBusyError) -> None:
        """The server answered busy: hold calls for its hint, or the next backoff delay."""
        with self._lock:
            now = self._clock()
            if now > self._until + self._backoff.cap_s:
                self._in_row = 0  # the last busy answer is long past: start over
            delay = max(exc.retry_after_s or 0.0, self._backoff.delay_s(self._in_row))
            self._until = now + min(delay, MAX_HOLD_S)
            self._in_row += 1
            self.num_busy += 1

    def holding(self) -> bool:
        """Whether calls wait now; counts the call as deferred when they do."""
        with self._lock:
            if self._clock() >= self._until:
                return False
            self.num_deferred += 1
            return True

    def snapshot(self) -> dict[str, int]:
        """``busy`` (answers) and ``deferred`` (calls not made)."""
        with self._lock:
            return {"busy": self.num_busy, "deferred": self.num_deferred}
