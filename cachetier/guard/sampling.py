"""Which restores the guard verifies: the first hits of each tier and namespace and of each
writer, then a few.

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
        self._writer_hits: dict[tuple[str, str, str], int] = {}
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

    def should_verify_writer(self, tier: str, namespace: str, writer: str) -> bool:
        """Whether a restore of ``writer``'s records of ``namespace`` in ``tier`` is verified
        in full: the first ``first_hits`` of each writer are, so a new or buggy writer is
        checked on its first records even where other writers' were checked before. Counts
        the hit as seen; later ones are left to ``should_verify``'s fraction."""
        if not self.config.enabled:
            return False
        with self._lock:
            seen = self._writer_hits.get((tier, namespace, writer), 0)
            if seen >= self.config.first_hits:
                return False
            self._writer_hits[(tier, namespace, writer)] = seen + 1
            return True

    def credit_writer(self, tier: str, namespace: str, writer: str) -> None:
        """Count a clean verification of ``writer``'s records that a namespace's draw made
        (``should_verify``) as one of the writer's first hits, so a restart's first hits are
        not verified twice, once per namespace and once per writer."""
        with self._lock:
            key = (tier, namespace, writer)
            self._writer_hits[key] = self._writer_hits.get(key, 0) + 1

    def should_verify_hit(self, tiers: Iterable[str], namespace: str) -> bool:
        """Whether a hit spread over ``tiers`` is verified: a draw for each of its tiers (each
        counts the hit as seen), verified if any draws it."""
        drawn = [self.should_verify(tier, namespace) for tier in sorted(set(tiers))]
        return any(drawn)
