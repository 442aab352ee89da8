"""Where a request's cached tokens came from (the pool, or a tier by name), and the lookup
event that says so in the event log."""

from __future__ import annotations

import time

from cachetier.engine.sequence import Sequence
from cachetier.primitives.keys import BlockHash
from cachetier.report.events import LookupEvent


def account_cached_tokens(
    seq: Sequence, num_pool_blocks: int, sources: list[str], block_size: int
) -> None:
    """Set the sequence's cached tokens, in all and by source, from the pool blocks its lookup
    found and the source tier of each block restored after them."""
    seq.num_cached_tokens = (num_pool_blocks + len(sources)) * block_size
    by_source: dict[str, int] = {}
    if num_pool_blocks:
        by_source["pool"] = num_pool_blocks * block_size
    for name in sources:
        by_source[name] = by_source.get(name, 0) + block_size
    seq.cached_tokens_by_source = by_source


def lookup_event(
    seq: Sequence,
    keys: list[BlockHash],
    restore_s: float,
    block_size: int,
    tenant: str,
) -> LookupEvent:
    """The event of a request's prefix lookup, once its cached tokens are accounted
    (``account_cached_tokens``).

    Args:
        keys: the keys of the full blocks the lookup could use.
        restore_s: seconds its restore from the tiers took.
    """
    by_source = seq.cached_tokens_by_source
    num_hit_blocks = sum(by_source.values()) // block_size
    # Every full block the lookup could use hit: the partial tail is what block alignment
    # cost (a prompt of whole blocks has none, its last block is recomputed for logits).
    lost = seq.num_prompt_tokens % block_size if keys and num_hit_blocks == len(keys) else 0
    return LookupEvent(
        time_s=time.time(),
        tenant=tenant,
        num_tokens=seq.num_prompt_tokens,
        hit_tokens=by_source,
        block_size=block_size,
        num_alignment_lost_tokens=lost,
        restore_s=restore_s,
        origin="engine",
        recomputed_tokens=seq.num_recomputed_hit_tokens,
        est_saved_s=seq.est_saved_s,
        verified_tokens=seq.num_verified_tokens,
        miss_tokens=_misses(seq),
    )


def _misses(seq: Sequence) -> dict[str, int]:
    """Tokens not served, by cause (``MISS_CAUSES``), where the lookup knows one."""
    # A quarantined tier's blocks lie past the hit, so they never overlap the hit's tokens;
    # the last prompt token is always computed, hence the cap.
    room = max(seq.num_prompt_tokens - seq.num_cached_tokens - 1, 0)
    lost = min(seq.num_quarantined_tokens, room)
    return {"quarantined": lost} if lost else {}
