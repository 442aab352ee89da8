"""What a tier may no longer serve, because a restore from it did not match its check.

A quarantine is of one writer's records in one namespace of one tier (``writer``: the id its
records name, ``cachetier.record.writer``), or of the whole namespace in that tier (``writer``
empty: an operator's, or one reported to a sidecar). The other writers, the other tiers and the
tier's other namespaces (other models, other tenants) keep serving. A whole namespace's hits are
misses with cause ``quarantined`` at lookup; a writer's records are refused as they are read
(``cachetier.store.record_guard``), since a lookup does not read which process wrote a record.
A quarantine lasts until an operator lifts it or the process ends; a restarted process verifies
the first hits of every namespace and writer again (``GuardSampler``), so a tier still holding
bad records is caught again before it is trusted.

Quarantines a sidecar's tenants report have an owner, and each owner a quota of its own
(``add_everywhere``): they are taken in every tier at once or not at all, and never count
against ``max_entries``, which bounds the others (the guard's, an operator's). So no owner can
take another's places, and a report never leaves a namespace quarantined in some tiers only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cachetier.errors import QuarantineLimitError, QuarantineQuotaError


@dataclass(frozen=True, slots=True)
class Quarantine:
    """One quarantined namespace of one tier.

    Args:
        tier: the tier's name.
        namespace: the storage namespace.
        reason: what differed (``BlockMismatch.describe``).
        since_unix_s: when it began.
        writer: the writer whose records it holds back (``writer_name``); empty for all.
    """

    tier: str
    namespace: str
    reason: str
    since_unix_s: float
    writer: str = ""


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
        self._held: dict[tuple[str, str, str], Quarantine] = {}
        self._num_writers = 0  # entries of one writer's records
        self._owner_of: dict[tuple[str, str, str], str] = {}  # owned entries only
        # owner -> (namespace, writer) -> tiers holding it: an owner's quota counts reports
        self._owned: dict[str, dict[tuple[str, str], int]] = {}

    def add(self, tier: str, namespace: str, reason: str, writer: str = "") -> bool:
        """Quarantine ``writer``'s records of ``namespace`` in ``tier`` (all of them if
        ``writer`` is empty).

        Returns:
            True if it was not quarantined already (the first reason is kept).

        Raises:
            QuarantineLimitError: ``max_entries`` quarantines are held already.
        """
        with self._lock:
            if (tier, namespace, writer) in self._held:
                return False
            unowned = len(self._held) - len(self._owner_of)
            if unowned >= self.max_entries:
                raise QuarantineLimitError(
                    f"{unowned} quarantines are held (max_entries): lift some first"
                )
            self._put_locked(Quarantine(tier, namespace, reason, time.time(), writer))
            return True

    def add_everywhere(
        self,
        tiers: Sequence[str],
        namespace: str,
        reason: str,
        writer: str,
        owner: str,
        quota: int,
    ) -> list[Quarantine]:
        """Quarantine ``writer``'s records of ``namespace`` in every one of ``tiers`` on behalf
        of ``owner``, or in none.

        Args:
            tiers: the tier names.
            namespace: the storage namespace.
            reason: what differed.
            writer: the writer (empty: every writer).
            owner: who reports it (a tenant); its entries count against its ``quota`` only.
            quota: most (namespace, writer) pairs ``owner`` may hold quarantined at once.

        Returns:
            The quarantines this call began (none when every tier held it already).

        Raises:
            QuarantineQuotaError: ``owner`` holds ``quota`` others already; nothing was added.
        """
        with self._lock:
            now = time.time()
            new = [t for t in tiers if (t, namespace, writer) not in self._held]
            mine = self._owned.setdefault(owner, {})
            if new and (namespace, writer) not in mine and len(mine) >= quota:
                raise QuarantineQuotaError(
                    f"{owner} holds {len(mine)} quarantines, its quota (quarantine_quota "
                    f"{quota}): an operator must lift one of them first"
                )
            added = [Quarantine(t, namespace, reason, now, writer) for t in new]
            for held in added:
                self._put_locked(held)
                self._owner_of[(held.tier, namespace, writer)] = owner
            if added:
                mine[(namespace, writer)] = mine.get((namespace, writer), 0) + len(added)
            return added

    def num_owned(self, owner: str) -> int:
        """(namespace, writer) pairs ``owner`` holds quarantined, against its quota."""
        with self._lock:
            return len(self._owned.get(owner, {}))

    def _put_locked(self, held: Quarantine) -> None:
        self._held[(held.tier, held.namespace, held.writer)] = held
        self._num_writers += bool(held.writer)

    @property
    def has_writers(self) -> bool:
        """Whether any quarantine is of one writer's records (read without the lock: a
        reader that misses one just added refuses from its next read on)."""
        return self._num_writers > 0

    def holds(self, tier: str, namespace: str) -> bool:
        """Whether the whole of ``namespace`` is quarantined in ``tier``."""
        return (tier, namespace, "") in self._held  # a dict lookup is atomic under the GIL

    def holds_writer(self, tier: str, namespace: str, writer: str) -> bool:
        """Whether ``writer``'s records of ``namespace`` are quarantined in ``tier`` (by their
        writer's quarantine or the whole namespace's)."""
        held = self._held
        return (tier, namespace, writer) in held or (tier, namespace, "") in held

    def tiers_of(self, namespace: str) -> frozenset[str]:
        """The tiers in which the whole of ``namespace`` is quarantined."""
        with self._lock:
            return frozenset(t for t, ns, w in self._held if ns == namespace and not w)

    def lift(self, namespace: str, tier: str | None = None) -> list[Quarantine]:
        """End the quarantines of ``namespace`` (in ``tier`` only, if given).

        Returns:
            The quarantines lifted.
        """
        with self._lock:
            gone = [
                q for (t, ns, _), q in self._held.items() if ns == namespace and tier in (None, t)
            ]
            for q in gone:
                slot = (q.tier, q.namespace, q.writer)
                del self._held[slot]
                self._num_writers -= bool(q.writer)
                owner = self._owner_of.pop(slot, None)
                if owner is not None:
                    mine = self._owned[owner]
                    mine[(q.namespace, q.writer)] -= 1
                    if not mine[(q.namespace, q.writer)]:  # no tier holds it: a place freed
                        del mine[(q.namespace, q.writer)]
            return gone

    def entries(self) -> list[Quarantine]:
        """Every quarantine held, oldest first."""
        with self._lock:
            return sorted(self._held.values(), key=lambda q: q.since_unix_s)
