"""Counters and latency summaries every tier keeps (read by reports, the server and tests)."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

COUNTERS = (
    "hits",
    "misses",
    "puts",
    "bytes_in",
    "bytes_out",
    "errors",
    "corrupt",
    "evictions",
    "rejected",
    "skipped_present",
)
"""The counters of ``TierStats``, in the order reports and metrics list them."""

_LATENCY_WINDOW = 2048  # most recent samples kept per tier for percentiles


@dataclass(slots=True)
class TierStats:
    """What one tier did since it was opened.

    Counts are in blocks unless named ``*_bytes``. ``errors`` counts failures of the backing
    service (each one also became a miss); ``corrupt`` counts records that failed a check and
    were deleted; ``rejected`` counts puts that could not be stored (too large, no room);
    ``skipped_present`` counts puts of a key the tier already held, not written again (a
    record under a key is the same KV whoever computed it: the key chains the tokens under a
    namespace of model, layout and tenant).
    """

    hits: int = 0
    misses: int = 0
    puts: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors: int = 0
    corrupt: int = 0
    evictions: int = 0
    rejected: int = 0
    skipped_present: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _latency_s: deque[float] = field(
        default_factory=lambda: deque(maxlen=_LATENCY_WINDOW), repr=False
    )
    _num_ops: int = field(default=0, repr=False)
    _total_s: float = field(default=0.0, repr=False)

    def add(self, **counts: int) -> None:
        """Add to named counters, atomically with respect to ``snapshot``."""
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def observe(self, seconds: float) -> None:
        """Record the latency of one batched operation."""
        with self._lock:
            self._num_ops += 1
            self._total_s += seconds
            self._latency_s.append(seconds)  # the window drops the oldest itself

    def record_get(self, seconds: float, hits: int, misses: int, nbytes: int) -> None:
        """``add(hits=, misses=, bytes_out=)`` and ``observe(seconds)`` under one lock: a
        connector asks for a few blocks per call, so a get's bookkeeping is a real share of
        what it costs (keyword arguments and two lock round trips were about half of a
        one-block CPU get)."""
        with self._lock:
            self.hits += hits
            self.misses += misses
            self.bytes_out += nbytes
            self._num_ops += 1
            self._total_s += seconds
            self._latency_s.append(seconds)

    def snapshot(self) -> dict[str, Any]:
        """A plain dict of every counter plus latency count, mean and p50/p99 (milliseconds)."""
        with self._lock:
            out: dict[str, Any] = {name: getattr(self, name) for name in COUNTERS}
            samples = sorted(self._latency_s)
            out["ops"] = self._num_ops
            out["latency_mean_ms"] = 1e3 * self._total_s / self._num_ops if self._num_ops else 0.0
        out["latency_p50_ms"] = 1e3 * _percentile(samples, 0.50)
        out["latency_p99_ms"] = 1e3 * _percentile(samples, 0.99)
        lookups = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / lookups if lookups else 0.0
        return out


def _percentile(sorted_samples: list[float], q: float) -> float:
    if not sorted_samples:
        return 0.0
    return sorted_samples[min(len(sorted_samples) - 1, int(q * len(sorted_samples)))]
