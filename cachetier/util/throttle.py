"""``LogThrottle``: say a recurring failure once per interval, not once per call.

A Redis that refuses our password, or a server whose certificate does not verify, fails every
call the same way; a warning per call would bury the log (and cost a format per call). The
first occurrence is logged at once, then at most one line per interval, saying how many there
were since the last.
"""

from __future__ import annotations

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
