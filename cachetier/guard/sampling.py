"""Which restores the guard verifies: the first hits of each tier and namespace, then a few.

The first hits after a process starts are where a new model, an upgraded engine or another
layout shows first, so each of them is checked before the tier is trusted with the namespace;
after that a small random fraction keeps checking at a cost the serving path does not feel
(each verified request computes its prefix instead of loading it).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """How the guard samples restores.

    Args:
        enabled: verify sampled restores at all (off: every hit is loaded unchecked).
        first_hits: hits verified per tier and namespace after the process starts.
        fraction: the share of later hits verified, at random.
        seed: seeds the random draw (tests); ``None`` draws from the system.
    """

    enabled: bool = True
    first_hits: int = 3
    fraction: float = 0.001
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be a bool, got {self.enabled!r}")
        if isinstance(self.first_hits, bool) or not isinstance(self.first_hits, int):
            raise ValueError(f"first_hits must be an int, got {self.first_hits!r}")
        if self.first_hits < 0:
            raise ValueError(f"first_hits must be at least 0, got {self.first_hits}")
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)):
            raise ValueError(f"fraction must be a number, got {self.fraction!r}")
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction must be within [0, 1], got {self.fraction!r}")


class GuardSampler:
    """Draws which hits to verify; thread-safe.

    Args:
        config: the sampling settings.
    """

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._hits: dict[tuple[str, str], int] = {}
        self._rng = random.Random(config.seed)

    def should_verify(self, tier: str, namespace: str) -> bool:
        """Whether a hit of ``namespace`` in ``tier`` is verified (counts it as seen).

        Args:
            tier: the tier the hit is in.
            namespace: the storage namespace of the hit.

        Returns:
            True for the first ``first_hits`` hits of the pair, then with ``fraction`` chance.
        """
        if not self.config.enabled:
            return False
        with self._lock:
            seen = self._hits.get((tier, namespace), 0)
            self._hits[(tier, namespace)] = seen + 1
            if seen < self.config.first_hits:
                return True
            return self._rng.random() < self.config.fraction

    def should_verify_hit(self, tiers: Iterable[str], namespace: str) -> bool:
        """Whether a hit spread over ``tiers`` is verified: a draw for each of its tiers (each
        counts the hit as seen), verified if any draws it."""
        drawn = [self.should_verify(tier, namespace) for tier in sorted(set(tiers))]
        return any(drawn)
