"""``LogThrottle``: say a recurring failure once per interval, not once per call; ``DownLog``:
say a service that cannot be reached, loudly once and then once per interval.

A Redis that refuses our password, or a server whose certificate does not verify, fails every
call the same way; a warning per call would bury the log (and cost a format per call). The
first occurrence is logged at once, then at most one line per interval, saying how many there
were since the last.
"""

from __future__ import annotations

import logging
import threading
import time

from cachetier.util.backoff import Clock


class LogThrottle:
    """Counts occurrences of one kind of failure and says when to log one. Thread-safe.

    Args:
        interval_s: least time between two log lines, in seconds.
        clock: time source (tests inject one instead of sleeping).
    """

    def __init__(self, interval_s: float, clock: Clock = time.monotonic) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._num_since = 0
        self.total = 0

    def note(self) -> int | None:
        """Count one occurrence.

        Returns:
            How many occurred since the last line logged (this one included) when a line is
            due now; ``None`` when it is not.
        """
        with self._lock:
            self.total += 1
            self._num_since += 1
            now = self._clock()
            if self._last is not None and now - self._last < self._interval_s:
                return None
            self._last = now
            count, self._num_since = self._num_since, 0
            return count


DOWN_LOG_INTERVAL_S = 60.0


class DownLog:
    """Says that a tier's service cannot be reached: at ERROR the first time, with its URL
    (password masked by the caller) and the reason, then at WARNING at most once per
    ``interval_s`` while calls keep failing, with how many did. A tier that is down answers
    misses, so without these lines an unreachable Redis or sidecar looked like a cold cache.

    Args:
        logger: where the lines go.
        what: the service, as the lines name it (``"Redis"``, ``"the cachetier server"``).
        url: its URL, already masked.
        interval_s: least time between two warnings.
        clock: time source (tests inject one).
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        url: str,
        interval_s: float = DOWN_LOG_INTERVAL_S,
        clock: Clock = time.monotonic,
    ) -> None:
        self._logger = logger
        self._what = what
        self._url = url
        self._throttle = LogThrottle(interval_s, clock)

    def failed(self, reason: str) -> None:
        """Note one call that failed to reach the service (``reason``: masked)."""
        first = self._throttle.total == 0
        count = self._throttle.note()
        if first:
            self._logger.error(
                "cachetier: %s at %s cannot be reached (%s); the tier answers misses and keeps "
                "trying",
                self._what,
                self._url,
                reason,
            )
        elif count is not None:
            self._logger.warning(
                "cachetier: %s at %s still cannot be reached (%s): %d call(s) failed since the "
                "last warning",
                self._what,
                self._url,
                reason,
                count,
            )

    @property
    def total(self) -> int:
        return self._throttle.total
