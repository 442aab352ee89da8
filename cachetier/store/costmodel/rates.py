"""Measured speeds of the tiers' reads and of an engine's copies of what they read."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Weight of a new sample in a tier's moving averages: a link whose speed changed is trusted
# again after two or three reads, one odd read does not flip decisions.
_ALPHA = 0.5


def _log_average(old: float | None, sample: float) -> float:
    """One step of a moving average in log space (``sample`` alone where there is no ``old``)."""
    if not old:
        return sample
    return math.exp(math.log(old) + _ALPHA * (math.log(sample) - math.log(old)))


@dataclass(frozen=True, slots=True)
class TierRate:
    """What one tier's reads cost, as measured.

    Args:
        latency_s: moving average of one round trip (a lookup).
        seconds_per_byte: moving (geometric) average of read time per payload byte, latency
            taken out.
        num_reads: reads that fed ``seconds_per_byte``.
        last_read_s: when the last read was seen (``time.monotonic``); 0 for never.
    """

    latency_s: float
    seconds_per_byte: float | None
    num_reads: int
    last_read_s: float

    def read_s(self, nbytes: int, calls: int = 1) -> float | None:
        """Estimated seconds to read ``nbytes`` in ``calls`` round trips (``None``: no reads
        measured yet)."""
        if self.seconds_per_byte is None:
            return None
        return calls * self.latency_s + nbytes * self.seconds_per_byte

    def snapshot(self) -> dict[str, Any]:
        spb = self.seconds_per_byte
        return {
            "latency_ms": round(1e3 * self.latency_s, 4),
            "read_gbps": round(1e-9 / spb, 4) if spb else None,
            "reads": self.num_reads,
        }


class TierRates:
    """Moving averages of every tier's latency and read speed. Thread-safe.

    Args:
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._rates: dict[str, TierRate] = {}

    def observe_latency(self, tier: str, seconds: float) -> None:
        """One metadata round trip to ``tier`` took ``seconds``."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        with self._lock:
            old = self._rates.get(tier)
            if old is None:
                self._rates[tier] = TierRate(seconds, None, 0, 0.0)
            else:
                latency = old.latency_s + _ALPHA * (seconds - old.latency_s)
                self._rates[tier] = TierRate(
                    latency, old.seconds_per_byte, old.num_reads, old.last_read_s
                )

    def observe_read(self, tier: str, nbytes: int, seconds: float, calls: int = 1) -> None:
        """A read of ``nbytes`` payload from ``tier`` in ``calls`` round trips took
        ``seconds``. Reads that returned nothing teach nothing about bandwidth and are ignored."""
        if nbytes <= 0 or not (math.isfinite(seconds) and seconds >= 0):
            return
        with self._lock:
            old = self._rates.get(tier) or TierRate(0.0, None, 0, 0.0)
            # What the round trips do not explain is transfer; never below a tenth of the read,
            # so a latency estimate a little too high cannot make a tier look infinitely fast.
            transfer = max(seconds - calls * old.latency_s, 0.1 * seconds, 1e-12)
            sample = transfer / nbytes
            # Averaged in log space: speeds span orders of magnitude (a thin link is 100x a
            # fast one), and a plain mean of seconds per byte would let one slow read outweigh
            # many fast ones long after the link recovered.
            spb = _log_average(old.seconds_per_byte, sample)
            self._rates[tier] = TierRate(old.latency_s, spb, old.num_reads + 1, self._clock())

    def get(self, tier: str) -> TierRate | None:
        with self._lock:
            return self._rates.get(tier)

    def measured(self) -> dict[str, TierRate]:
        """Every tier with at least one measured read, by name (to hand to another process)."""
        with self._lock:
            return {k: v for k, v in self._rates.items() if v.seconds_per_byte is not None}

    def adopt(self, tier: str, rate: TierRate) -> None:
        """Take another process's measurement of ``tier`` (the process that reads it), as read
        now by this process's clock."""
        if rate.seconds_per_byte is None or not (
            math.isfinite(rate.latency_s) and math.isfinite(rate.seconds_per_byte)
        ):
            return
        with self._lock:
            self._rates[tier] = TierRate(
                max(rate.latency_s, 0.0),
                max(rate.seconds_per_byte, 0.0),
                rate.num_reads,
                self._clock(),
            )

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per tier: ``latency_ms``, ``read_gbps`` (``None`` until a read) and ``reads``."""
        with self._lock:
            rates = dict(self._rates)
        return {name: rate.snapshot() for name, rate in sorted(rates.items())}


class CopyRate:
    """Seconds per byte of an engine's copies of restored blocks into its KV memory, as a
    moving (geometric) average of the copies it times. A tier that reads straight into that
    memory (the disk tier into a CPU pool) copies nothing, and the estimate stays ``None``:
    no cost. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spb: float | None = None
        self._count = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        """A copy of ``nbytes`` took ``seconds``."""
        if nbytes <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        sample = seconds / nbytes
        with self._lock:
            self._spb = _log_average(self._spb, sample)
            self._count += 1

    @property
    def seconds_per_byte(self) -> float | None:
        with self._lock:
            return self._spb

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            spb, count = self._spb, self._count
        return {"copy_gbps": round(1e-9 / spb, 4) if spb else None, "copies": count}
