"""The store's side of the restore guard: compare what a tier holds with what the engine just
computed for the same keys, and quarantine the tier for that namespace on a mismatch.

An engine that samples a hit for verification (``cachetier.guard.GuardSampler``) computes the
request as a miss and hands its computed records here as it saves them. Each is compared with
the record the tier holds under the same key; the request was served from its own computation,
so a bad record never reached an answer. On a mismatch:

- the writer of each record that differed is quarantined in that tier and namespace (its
  records are refused as they are read, ``record_guard``), while other writers keep serving;
- the records that differed are deleted from that tier;
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
from cachetier.record import KVBlock, writer_name
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
        quarantined: True if this verification began a writer's quarantine in the tier.
        clean_writers: the writers of the records that matched (``writer_name``).
        bad_writers: the writers of the records that differed.
    """

    tier: str
    compared: int
    mismatches: tuple[BlockMismatch, ...]
    quarantined: bool
    clean_writers: tuple[str, ...] = ()
    bad_writers: tuple[str, ...] = ()

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

    def refuses(self, tier: str, namespace: str, block: KVBlock) -> bool:
        """Whether ``block`` is of a writer quarantined in ``tier`` (counted if so)."""
        if not self.quarantines.holds_writer(tier, namespace, writer_name(block.writer)):
            return False
        self.count_quarantined_lookup(tier)
        return True

    def count_quarantined_lookup(self, tier: str) -> None:
        with self._lock:
            _bump(self.stats.quarantined_lookups, tier)

    def verify(
        self,
        tier: Tier,
        namespace: str,
        computed: Sequence[KVBlock],
        writer: str = "",
        all_tiers: Sequence[str] = (),
    ) -> Verdict:
        """Compare ``tier``'s records of ``computed``'s keys with ``computed``.

        Args:
            tier: the tier the hit was found in.
            namespace: the storage namespace.
            computed: records the engine computed for keys the tier was seen to hold.
            writer: what the namespace's writers claim to be (``Namespace.describe``), for
                the log line.
            all_tiers: every tier of the store: a writer found bad is quarantined in each
                (a read promotes its records into faster tiers), ``tier`` alone if empty.

        Returns:
            What was compared and found; a key the tier no longer holds is not compared.
        """
        held = tier.get_many(namespace, [b.key for b in computed])
        pairs = [(r, c) for r, c in zip(held, computed) if r is not None]
        compared = [(r, compare_blocks(r, c)) for r, c in pairs]
        found = tuple(m for _, m in compared if m is not None)
        bad = [r for r, m in compared if m is not None]
        clean = tuple(dict.fromkeys(writer_name(r.writer) for r, m in compared if m is None))
        with self._lock:
            _bump(self.stats.verified_blocks, tier.name, len(pairs))
            _bump(self.stats.mismatched_blocks, tier.name, len(found))
        if not found:
            return Verdict(tier.name, len(pairs), (), False, clean)
        tier.delete(namespace, [r.key for r in bad])
        writers = tuple(dict.fromkeys(writer_name(r.writer) for r in bad))
        tiers = all_tiers or (tier.name,)
        began = self._quarantine(tier.name, tiers, namespace, writers, found[0].describe())
        if began:  # a tier shared through a server tells it, for its other clients
            for name in writers:
                tier.report_quarantine(namespace, found[0].describe(), name)
        log.warning(
            "cachetier guard: tier %s served KV that does not match a recomputation in "
            "namespace %s%s (%d of %d blocks differ; %s); the records of writer %s quarantined "
            "in every tier, those that differ deleted. Lift with `cachetier quarantine lift`.",
            tier.name,
            namespace[:16],
            f" [{writer}]" if writer else "",
            len(found),
            len(pairs),
            found[0].describe(),
            ", ".join(writers),
        )
        return Verdict(tier.name, len(pairs), found, began, clean, writers)

    def _quarantine(
        self,
        found_in: str,
        tiers: Sequence[str],
        namespace: str,
        writers: Sequence[str],
        reason: str,
    ) -> bool:
        """Quarantine each of ``writers``' records in ``tiers``; whether any began now (counted
        for ``found_in``, the tier the bad records were found in)."""
        began = False
        for name in writers:
            began = quarantine_writer(self.quarantines, tiers, namespace, name, reason) or began
        if began:
            with self._lock:
                _bump(self.stats.quarantines, found_in)
        return began


def quarantine_writer(
    quarantines: QuarantineList, tiers: Sequence[str], namespace: str, writer: str, reason: str
) -> bool:
    """Quarantine ``writer``'s records of ``namespace`` in each of ``tiers``; whether any of
    those quarantines is new. A full list is logged, not raised: the guard goes on."""
    began = False
    for tier in tiers:
        try:
            began = quarantines.add(tier, namespace, reason, writer) or began
        except QuarantineLimitError as exc:
            log.error("cachetier guard: tier %s not quarantined: %s", tier, exc)
    return began


def _bump(counts: dict[str, int], name: str, by: int = 1) -> None:
    counts[name] = counts.get(name, 0) + by
