"""Admission policies: per block and per tier, whether a write is worth its cost.

How a store drives one (one policy per store, shared by every tier and thread):

1. ``record(keys)`` once per request that uses the blocks (when the request's blocks are
   put): these are the sightings the policy counts. A block used by three requests is
   recorded three times, whatever number of tiers it goes to.
2. ``admit(key, tier=..., ...)`` for each block a tier would write, after its sighting is
   recorded, before the write is queued. ``False`` means the tier does not write it.

Cheap tiers (``admission_cheap_tiers``, the CPU tier by default) and pinned blocks are always
admitted; every decision is counted per tier (``stats``). All methods are thread-safe: the
engine's thread records while the store's writer threads ask.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

from cachetier.admission.config import AdmissionConfig
from cachetier.admission.ghost import GhostQueue
from cachetier.admission.sketch import FrequencySketch
from cachetier.admission.stats import AdmissionStats
from cachetier.primitives.keys import BlockHash


class AdmissionPolicy(ABC):
    """Decides which blocks each tier writes, and counts the decisions.

    Args:
        config: the admission settings.
    """

    name: ClassVar[str]

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._cheap = config.cheap_tiers
        self._lock = threading.Lock()
        self._stats: dict[str, AdmissionStats] = {}

    @property
    def nbytes(self) -> int:
        """Bytes the policy's memory of recent keys takes (fixed at construction)."""
        return 0

    def record(self, keys: Iterable[BlockHash]) -> None:
        """Count one sighting of each key (once per request that uses the blocks).

        Args:
            keys: the request's block keys.
        """
        with self._lock:
            for key in keys:
                self._record(key)

    def admit(
        self,
        key: BlockHash,
        *,
        tier: str,
        nbytes: int,
        generated: bool = False,
        pinned: bool = False,
        victim: BlockHash | None = None,
    ) -> bool:
        """Whether ``tier`` writes the block ``key`` (the decision is counted).

        Args:
            key: the block's key (its sighting recorded already).
            tier: the tier's name (``"cpu"``, ``"disk"``, ``"redis"``, ``"remote"``).
            nbytes: the block's payload bytes, for the counts.
            generated: the block holds generated tokens, not only prompt ones.
            pinned: the block belongs to a pinned prefix: always written.
            victim: the key the tier would evict to make room, where it knows one.

        Returns:
            True: write it; False: leave it out of this tier.
        """
        with self._lock:
            if pinned or tier in self._cheap:
                verdict = True
            elif generated and self.config.admission_generated != "filter":
                verdict = self.config.admission_generated == "admit"
            else:
                verdict = self._decide(key, victim, tier, nbytes)
            stats = self._stats.get(tier)
            if stats is None:
                stats = self._stats[tier] = AdmissionStats()
            stats.add(verdict, nbytes)
        return verdict

    def stats(self) -> dict[str, AdmissionStats]:
        """The decisions so far, by tier (a snapshot).

        Returns:
            tier name -> its counts, for the tiers asked about so far.
        """
        with self._lock:
            return {tier: s.copy() for tier, s in self._stats.items()}

    def _record(self, key: bytes) -> None:
        """Count one sighting (under the lock)."""

    @abstractmethod
    def _decide(self, key: bytes, victim: bytes | None, tier: str, nbytes: int) -> bool:
        """The verdict for a filtered tier (under the lock); ``tier`` and ``nbytes`` as given
        to ``admit``."""


class StoreAll(AdmissionPolicy):
    """Every tier writes every block: no filter, no memory."""

    name = "all"

    def _decide(self, key: bytes, victim: bytes | None, tier: str, nbytes: int) -> bool:
        return True


class SecondHit(AdmissionPolicy):
    """A filtered tier writes a block the ghost queue saw before this sighting: one seen twice
    among the last ``admission_tracked_keys`` distinct keys."""

    name = "second_hit"

    def __init__(self, config: AdmissionConfig) -> None:
        super().__init__(config)
        self._ghost = GhostQueue(config.admission_tracked_keys)

    @property
    def nbytes(self) -> int:
        return self._ghost.nbytes

    def _record(self, key: bytes) -> None:
        self._ghost.record(key)

    def _decide(self, key: bytes, victim: bytes | None, tier: str, nbytes: int) -> bool:
        return self._ghost.sightings(key) >= 2


class TinyLFU(AdmissionPolicy):
    """A filtered tier writes a block whose estimated recent sightings reach
    ``admission_threshold`` and, where the tier names the victim it would evict, outnumber the
    victim's (a block no more frequent than what it would push out is not worth the write)."""

    name = "tinylfu"

    def __init__(self, config: AdmissionConfig) -> None:
        super().__init__(config)
        self._sketch = FrequencySketch(config.admission_tracked_keys)

    @property
    def nbytes(self) -> int:
        return self._sketch.nbytes

    def _record(self, key: bytes) -> None:
        self._sketch.record(key)

    def _decide(self, key: bytes, victim: bytes | None, tier: str, nbytes: int) -> bool:
        count = self._sketch.estimate(key)
        if count < self.config.admission_threshold:
            return False
        return victim is None or count > self._sketch.estimate(victim)


FIXED_POLICY_CLASSES: dict[str, type[AdmissionPolicy]] = {
    cls.name: cls for cls in (StoreAll, SecondHit, TinyLFU)
}
"""The policies that decide by a fixed rule (``cachetier.admission.config.FIXED_POLICIES``)."""
