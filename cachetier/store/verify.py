"""The store's side of the restore guard: compare what a tier holds with what the engine just
computed for the same keys, and quarantine the tier for that namespace on a mismatch.

An engine that samples a hit for verification (``cachetier.guard.GuardSampler``) computes the
request as a miss and hands its computed records here as it saves them. Each is compared with
the record the tier holds under the same key; the request was served from its own computation,
so a bad record never reached an answer. On a mismatch:

- the namespace is quarantined in that tier (the store's lookups stop counting it there);
- the compared records are deleted from that tier;
- one WARNING line says which block, which layers, K or V, and how far off;
- the tier's ``guard`` counters and the caller's event log record it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from cachetier.errors import QuarantineLimitError
from cachetier.guard import BlockMismatch, QuarantineList, compare_blocks
from cachetier.record import KVBlock
from cachetier.tiers.base import Tier

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GuardStats:
    """Counts of the guard's work, per tier name."""

    verified_blocks: dict[str, int] = field(default_factory=dict)
    mismatched_blocks: dict[str, int] = field(default_factory=dict)
    quarantines: dict[str, int] = field(default_factory=dict)
    quarantined_lookups: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            "verified_blocks": dict(self.verified_blocks),
            "mismatched_blocks": dict(self.mismatched_blocks),
            "quarantines": dict(self.quarantines),
            "quarantined_lookups": dict(self.quarantined_lookups),
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one verification found.

    Args:
        tier: the tier whose records were compared.
        compared: keys compared (held by the tier and computed by the engine).
        mismatches: the blocks that differed, first in key order first.
        quarantined: True if this verification began the namespace's quarantine in the tier.
    """

    tier: str
    compared: int
    mismatches: tuple[BlockMismatch, ...]
    quarantined: bool

    @property
    def ok(self) -> bool:
        return not self.mismatches


class Verifier:
    """Compares tiers' records with computed ones and keeps the quarantines.

    Args:
        quarantines: the list lookups honour (shared with the store).
    """

    def __init__(self, quarantines: QuarantineList) -> None:
        self.quarantines = quarantines
        self.stats = GuardStats()
        self._lock = threading.Lock()

    def count_quarantined_lookup(self, tier: str) -> None:
        with self._lock:
            _bump(self.stats.quarantined_lookups, tier)

    def verify(
        self, tier: Tier, namespace: str, computed: Sequence[KVBlock], writer: str = ""
    ) -> Verdict:
        """Compare ``tier``'s records of ``computed``'s keys with ``computed``.

        Args:
            tier: the tier the hit was found in.
            namespace: the storage namespace.
            computed: records the engine computed for keys the tier was seen to hold.
            writer: what the namespace's writers claim to be (``Namespace.describe``): a
                record names no writer, so the log line says what its writer had to agree on.

        Returns:
            What was compared and found; a key the tier no longer holds is not compared.
        """
        held = tier.get_many(namespace, [b.key for b in computed])
        pairs = [(r, c) for r, c in zip(held, computed) if r is not None]
        found = tuple(m for r, c in pairs if (m := compare_blocks(r, c)) is not None)
        with self._lock:
            _bump(self.stats.verified_blocks, tier.name, len(pairs))
            _bump(self.stats.mismatched_blocks, tier.name, len(found))
        if not found:
            return Verdict(tier.name, len(pairs), (), False)
        tier.delete(namespace, [r.key for r, _ in pairs])
        try:
            began = self.quarantines.add(tier.name, namespace, found[0].describe())
        except QuarantineLimitError as exc:
            log.error("cachetier guard: tier %s not quarantined: %s", tier.name, exc)
            began = False
        if began:
            with self._lock:
                _bump(self.stats.quarantines, tier.name)
            tier.report_quarantine(namespace, found[0].describe())
        log.warning(
            "cachetier guard: tier %s served KV that does not match a recomputation in "
            "namespace %s%s (%d of %d blocks differ; %s); namespace quarantined in that tier, "
            "its compared records deleted. Lift with `cachetier quarantine lift`.",
            tier.name,
            namespace[:16],
            f" [{writer}]" if writer else "",
            len(found),
            len(pairs),
            found[0].describe(),
        )
        return Verdict(tier.name, len(pairs), found, began)


def _bump(counts: dict[str, int], name: str, by: int = 1) -> None:
    counts[name] = counts.get(name, 0) + by
