"""How wrong the prefill model's estimates of refused loads turned out, and the margin a
refusal needs because of it."""

from __future__ import annotations

import math
import threading
from typing import Any

# Weight of a new outcome in the moving average of the error: one estimate that was far off
# moves the margin at once (a 13x miss lifts it from nothing to above 2), a run of good ones
# brings it down over ten or so.
_ERROR_ALPHA = 0.2
# The margin is this many mean absolute log errors: for errors spread like a normal law the
# mean absolute value is 0.8 sigma, so two of them are about 1.6 sigma, a gain that one
# estimate in twenty would fail to reach.
_ERROR_SPREAD = 2.0


class EstimateError:
    """A moving average of ``|ln(actual / estimated)|`` over refusals' recompute estimates, and
    the margin a refusal's gain must clear because of it. Thread-safe.

    Until ``min_outcomes`` outcomes are known the margin is at least ``default_margin``: a
    model fitted only from the steps it happened to see is not trusted by default.

    Args:
        default_margin: margin while few outcomes are known (1.0: a refusal's recompute,
            doubled, must still beat the load).
        min_outcomes: outcomes to see before the measured error alone sets the margin.
    """

    def __init__(self, *, default_margin: float = 1.0, min_outcomes: int = 4) -> None:
        if not (math.isfinite(default_margin) and default_margin >= 0):
            raise ValueError(f"default_margin must be >= 0, got {default_margin}")
        if min_outcomes < 0:
            raise ValueError(f"min_outcomes must be >= 0, got {min_outcomes}")
        self._default = default_margin
        self._min_outcomes = min_outcomes
        self._lock = threading.Lock()
        self._mean_abs_log: float | None = None
        self._count = 0

    def observe(self, estimated_s: float, actual_s: float) -> float | None:
        """A recompute estimated at ``estimated_s`` took ``actual_s``.

        Args:
            estimated_s: the estimate the decision was made on.
            actual_s: the time measured once the work was done.

        Returns:
            ``actual_s / estimated_s``, or ``None`` where either is not a positive number
            (nothing is learnt then).
        """
        if not (estimated_s > 0 and actual_s > 0):
            return None
        if not (math.isfinite(estimated_s) and math.isfinite(actual_s)):
            return None
        error = abs(math.log(actual_s / estimated_s))
        with self._lock:
            old = self._mean_abs_log
            self._mean_abs_log = error if old is None else old + _ERROR_ALPHA * (error - old)
            self._count += 1
        return actual_s / estimated_s

    @property
    def num_outcomes(self) -> int:
        with self._lock:
            return self._count

    @property
    def margin(self) -> float:
        """The fraction by which a refusal's added recompute, so inflated, must still beat the
        load it saves."""
        with self._lock:
            mean, count = self._mean_abs_log, self._count
        measured = 0.0 if mean is None else math.exp(_ERROR_SPREAD * mean) - 1
        if count < self._min_outcomes:
            return max(self._default, measured)
        return measured

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            mean, count = self._mean_abs_log, self._count
        return {
            "outcomes": count,
            "mean_abs_log_error": None if mean is None else round(mean, 4),
            "margin": round(self.margin, 4),
        }
