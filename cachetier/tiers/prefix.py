"""Where a key list's leading stored blocks are: the answer of a prefix lookup over tiers.

A value object shared by the store that computes it and the remote tier that receives it from
a sidecar's store, so neither layer reaches into the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachetier.record import KVBlock


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Where the leading stored blocks of a key list are.

    Args:
        num_blocks: length of the leading run present in some tier.
        spans: ``(tier index, start, end)`` ranges covering ``[0, num_blocks)`` in order.
        tier_names: names of the store's tiers, indexed like ``spans``.
        quarantined_blocks: blocks past the run that a tier quarantined for the namespace
            holds (``cachetier.store.verify``): misses of cause ``quarantined``.
        verified_blocks: blocks of the run the restore guard drew for verification, which the
            engine computes instead of loading (the hit itself is then reported empty).
        miss_cause: why the key after the run was not served (``cachetier.misses`` causes:
            ``never_stored``, ``evicted``, ``tier_down``...); ``""`` when every key hit.
        miss_tier: the tier the cause concerns (the one that evicted it, is down...), or ``""``.
        miss_detail: the cause in words for logs and answers: how old an evicted block was,
            which part of a mismatched namespace differs; ``""`` where there is nothing to add.
    """

    num_blocks: int
    spans: tuple[tuple[int, int, int], ...]
    tier_names: tuple[str, ...]
    quarantined_blocks: int = 0
    verified_blocks: int = 0
    miss_cause: str = ""
    miss_tier: str = ""
    miss_detail: str = ""

    def blocks_per_tier(self) -> dict[str, int]:
        """How many of the leading blocks each tier holds (tiers with none are left out)."""
        out: dict[str, int] = {}
        for tier, start, end in self.spans:
            name = self.tier_names[tier]
            out[name] = out.get(name, 0) + end - start
        return out


@dataclass(frozen=True, slots=True)
class RestoredPrefix:
    """Blocks restored for the leading keys, and which tier each came from."""

    blocks: tuple[KVBlock, ...]
    sources: tuple[str, ...]

    def blocks_per_tier(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name in self.sources:
            out[name] = out.get(name, 0) + 1
        return out
