"""The engine's side of the restore guard: a sampled hit is computed as a miss, and its records
are compared with the tier's as they are saved.

A hit drawn for verification (``cachetier.guard.GuardSampler``: the first hits of each tier and
namespace after start, then a small fraction) is reported to the scheduler as no hit, so the
request computes its prefix and its answer never depends on the records under test. Its keys
are remembered with the tier that held them; when the computed blocks are saved, the tier's
records of those keys are compared with them (``TieredStore.verify``), which quarantines the
namespace in that tier on a mismatch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cachetier.guard import GuardSampler
from cachetier.primitives.keys import BlockHash
from cachetier.record import KVBlock
from cachetier.store.tiered import TieredStore
from cachetier.store.verify import Verdict
from cachetier.tiers.prefix import PrefixHit

# Keys awaiting their computed blocks. A verified request that is aborted before its blocks are
# saved leaves its keys here: the oldest are dropped past this bound.
MAX_PENDING_KEYS = 1 << 16


@dataclass(slots=True)
class ShadowStats:
    verified_requests: int = 0
    verified_blocks: int = 0
    mismatched_blocks: int = 0


class ShadowVerifier:
    """Draws hits to verify and checks their computed records.

    Args:
        store: the store whose tiers are verified (and which keeps the quarantines).
        namespace_id: the engine's storage namespace.
        sampler: which hits to verify.
        writer: what the namespace's records claim to be (``Namespace.describe``), for the
            guard's log line.
    """

    def __init__(
        self, store: TieredStore, namespace_id: str, sampler: GuardSampler, writer: str = ""
    ) -> None:
        self.store = store
        self.namespace_id = namespace_id
        self.writer = writer
        self.sampler = sampler
        self.stats = ShadowStats()
        self.verdicts: list[Verdict] = []  # the mismatches found, for the engine's stats
        self._lock = threading.Lock()
        # key -> (the tier that held it, whether a namespace's draw took it: only those
        # verifications count toward the writers' first hits, ``GuardSampler.credit_writer``)
        self._pending: OrderedDict[BlockHash, tuple[str, bool]] = OrderedDict()

    def take(self, hit: PrefixHit, keys: Sequence[BlockHash]) -> bool:
        """Whether ``hit`` is verified; if so its keys wait for their computed records and the
        caller must treat the hit as a miss.

        Args:
            hit: the store's lookup of ``keys`` (in records).
            keys: the record keys looked up.
        """
        tiers = (hit.tier_names[tier] for tier, _, _ in hit.spans)
        if not self.sampler.should_verify_hit(tiers, self.namespace_id):
            return False
        with self._lock:
            self.stats.verified_requests += 1
            for tier, start, end in hit.spans:
                for key in keys[start:end]:
                    self._pending[key] = (hit.tier_names[tier], True)
            self._bound()
        return True

    def expect(self, keys: Sequence[BlockHash], tiers: Sequence[str]) -> None:
        """Records a restore did not use because their writer is verified first
        (``RecordGuard``): compared with the tier's when their computed blocks are saved."""
        with self._lock:
            self.stats.verified_requests += 1
            for key, tier in zip(keys, tiers):
                self._pending[key] = (tier, False)
            self._bound()

    def _bound(self) -> None:
        while len(self._pending) > MAX_PENDING_KEYS:
            self._pending.popitem(last=False)

    def check(self, records: Sequence[KVBlock]) -> None:
        """Compare the records among ``records`` that a verified hit is waiting for with the
        tier that held them (before they are stored, so the tier's own record is compared)."""
        if not self._pending:
            return
        by_tier: dict[tuple[str, bool], list[KVBlock]] = {}
        with self._lock:
            for record in records:
                pending = self._pending.pop(record.key, None)
                if pending is not None:
                    by_tier.setdefault(pending, []).append(record)
        for (tier, drawn), computed in by_tier.items():
            verdict = self.store.verify(self.namespace_id, tier, computed, self.writer)
            for writer in verdict.clean_writers if drawn else ():
                self.sampler.credit_writer(tier, self.namespace_id, writer)
            with self._lock:
                self.stats.verified_blocks += verdict.compared
                self.stats.mismatched_blocks += len(verdict.mismatches)
                if not verdict.ok:
                    self.verdicts.append(verdict)
