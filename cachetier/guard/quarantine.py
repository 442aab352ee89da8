"""Namespaces a tier may no longer serve, because a verified restore from it did not match.

A quarantine is of one namespace in one tier: the other tiers, and the tier's other namespaces
(other models, other tenants), keep serving. While it holds, the store treats the pair's hits as
misses with cause ``quarantined`` and loads nothing from it. It lasts until an operator lifts it
or the process ends; a restarted process verifies its first hits of every namespace again
(``GuardSampler``), so a tier still holding bad records is caught again before it is trusted.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from cachetier.errors import QuarantineLimitError


@dataclass(frozen=True, slots=True)
class Quarantine:
    """One quarantined namespace of one tier.

    Args:
        tier: the tier's name.
        namespace: the storage namespace.
        reason: what differed (``BlockMismatch.describe``).
        since_unix_s: when it began.
    """

    tier: str
    namespace: str
    reason: str
    since_unix_s: float


class QuarantineList:
    """The quarantines of one process; thread-safe.

    Args:
        max_entries: the most quarantines held at once. A sidecar takes quarantines that
            clients report, one per namespace they name: the bound keeps a client from growing
            the list without end.
    """

    def __init__(self, max_entries: int = 4096) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], Quarantine] = {}

    def add(self, tier: str, namespace: str, reason: str) -> bool:
        """Quarantine ``namespace`` in ``tier``.

        Returns:
            True if it was not quarantined already (the first reason is kept).

        Raises:
            QuarantineLimitError: ``max_entries`` quarantines are held already.
        """
        with self._lock:
            if (tier, namespace) in self._held:
                return False
            if len(self._held) >= self.max_entries:
                raise QuarantineLimitError(
                    f"{len(self._held)} quarantines are held (max_entries): lift some first"
                )
            self._held[(tier, namespace)] = Quarantine(tier, namespace, reason, time.time())
            return True

    def holds(self, tier: str, namespace: str) -> bool:
        """Whether ``namespace`` is quarantined in ``tier``."""
        return (tier, namespace) in self._held  # a dict lookup is atomic under the GIL

    def tiers_of(self, namespace: str) -> frozenset[str]:
        """The tiers in which ``namespace`` is quarantined."""
        with self._lock:
            return frozenset(t for t, ns in self._held if ns == namespace)

    def lift(self, namespace: str, tier: str | None = None) -> list[Quarantine]:
        """End the quarantines of ``namespace`` (in ``tier`` only, if given).

        Returns:
            The quarantines lifted.
        """
        with self._lock:
            gone = [q for (t, ns), q in self._held.items() if ns == namespace and tier in (None, t)]
            for q in gone:
                del self._held[(q.tier, q.namespace)]
            return gone

    def entries(self) -> list[Quarantine]:
        """Every quarantine held, oldest first."""
        with self._lock:
            return sorted(self._held.values(), key=lambda q: q.since_unix_s)
