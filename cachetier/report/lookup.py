"""A prefix lookup over the replays' tiers: the leading run of keys held by any of them.

What ``TieredStore.lookup`` computes (each tier's ``contains_prefix`` in turn from where the
run stands, the upper tier first), without what a serving store adds around it: latency
measurements, quarantines and the why-miss ledger, whose eviction listener costs more than
the replayed tiers themselves. A replay has no quarantine and no outage, so the runs and
spans are the same; ``tests/cachetier/report`` checks them against ``TieredStore.lookup``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cachetier.primitives.keys import BlockHash


class PrefixHolder(Protocol):
    """What a lookup asks of a tier (``CPUTier``, ``ReplayCache``)."""

    def contains_prefix(self, namespace: str, keys: Sequence[BlockHash]) -> int: ...


def leading_spans(
    tiers: Sequence[PrefixHolder], namespace: str, keys: Sequence[BlockHash]
) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    """The leading run of ``keys`` held by any tier, and which tier holds which part.

    Args:
        tiers: the tiers, fastest first.
        namespace: storage namespace.
        keys: block keys in sequence order.

    Returns:
        ``(run length, ((tier index, start, end), ...))`` as in ``PrefixHit``.
    """
    spans: list[tuple[int, int, int]] = []
    pos, num_keys = 0, len(keys)
    while pos < num_keys:
        rest = keys[pos:]
        for index, tier in enumerate(tiers):
            found = tier.contains_prefix(namespace, rest)
            if found:
                spans.append((index, pos, pos + found))
                pos += found
                break
        else:
            break
    return pos, tuple(spans)
