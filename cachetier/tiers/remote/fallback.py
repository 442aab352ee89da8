"""When the remote tier moves blocks over HTTP because the transfer port failed.

A transfer that fails for the port's sake (refused, reset, timed out, garbage) is done again
over HTTP at once, and the port is left alone for a backoff delay that doubles with each
failed probe up to ``PROBE_CAP_S``; the first call after the delay tries the port again (the
probe), and the tier switches back when it answers. No I/O here: the state only.
"""

from __future__ import annotations

import threading

from cachetier.util.backoff import Clock, ExponentialBackoff

# Longest wait between two probes of a dead port: a probe of a port that drops packets costs
# its call up to connect_timeout_s, so probes stay rare while it is gone.
PROBE_CAP_S = 5.0


class TransferFallback:
    """Whether the transfer port is in use or HTTP stands in for it. Thread-safe.

    Args:
        base_s: wait before the first probe after a failure, in seconds.
        clock: time source in seconds.
    """

    def __init__(self, base_s: float, clock: Clock) -> None:
        self._backoff = ExponentialBackoff(base_s, max(base_s, PROBE_CAP_S))
        self._clock = clock
        self._lock = threading.Lock()
        self._down = False
        self._probe_at = 0.0
        self._num_failed_probes = 0
        self.num_fallbacks = 0  # calls done over HTTP in the port's place
        self.num_port_failures = 0  # transfers that failed for the port's sake

    def usable(self) -> bool:
        """Whether to try the port now: it works, or a probe is due."""
        with self._lock:
            return not self._down or self._clock() >= self._probe_at

    def failed(self) -> None:
        """A transfer failed for the port's sake: HTTP until the next probe."""
        with self._lock:
            delay = self._backoff.delay_s(self._num_failed_probes)
            self._probe_at = self._clock() + delay
            self._num_failed_probes += 1
            self._down = True
            self.num_port_failures += 1

    def fell_back(self) -> None:
        """Count a call done over HTTP in the port's place."""
        with self._lock:
            self.num_fallbacks += 1

    def answered(self) -> None:
        """The port answered: use it again."""
        with self._lock:
            self._down = False
            self._num_failed_probes = 0

    def reset(self) -> None:
        """The server names a new transfer endpoint: try it at once."""
        self.answered()

    def snapshot(self) -> dict[str, int | bool]:
        """``fallbacks`` (calls over HTTP in the port's place), ``transfer_failures`` and
        ``transfer_down`` (HTTP stands in now)."""
        with self._lock:
            return {
                "fallbacks": self.num_fallbacks,
                "transfer_failures": self.num_port_failures,
                "transfer_down": self._down,
            }
