"""Where a request's cached tokens came from (the pool, or a tier by name), and the lookup
event that says so in the event log."""

from __future__ import annotations

import time

from cachetier.engine.sequence import Sequence
from cachetier.primitives.keys import BlockHash
from cachetier.report.events import LookupEvent


def account_cached_tokens(
    seq: Sequence,
    num_pool_blocks: int,
    sources: list[str],
    block_size: int,
    num_keys: int | None = None,
) -> None:
    """Set the sequence's cached tokens, in all and by source, from the pool blocks its lookup
    found and the source tier of each block restored after them; and, given the number of
    full blocks its lookup could use (``num_keys``), the tokens it missed by cause."""
    seq.num_cached_tokens = (num_pool_blocks + len(sources)) * block_size
    by_source: dict[str, int] = {}
    if num_pool_blocks:
        by_source["pool"] = num_pool_blocks * block_size
    for name in sources:
        by_source[name] = by_source.get(name, 0) + block_size
    seq.cached_tokens_by_source = by_source
    if num_keys is not None:
        seq.miss_tokens_by_cause = _misses(seq, num_keys, block_size)


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
        miss_tokens=seq.miss_tokens_by_cause,
    )


def _misses(seq: Sequence, num_keys: int, block_size: int) -> dict[str, int]:
    """The prompt tokens not served, by cause (``MISS_CAUSES``): every one has one.

    - ``partial_block``: the tokens past the last full block the lookup could use (a cache of
      whole blocks cannot serve them; a prompt of whole blocks computes its last for logits);
    - ``too_slow``: hit blocks the cost model chose to recompute;
    - the rest of the full blocks: the cause of the tiers' run ending (``PrefixHit``), or
      ``never_stored`` where no tier was asked. A restore that delivered fewer blocks than
      its lookup found counts as ``tier_down``: the tier did not deliver what it held.
    """
    full = num_keys * block_size
    rest = full - seq.num_cached_tokens - seq.num_verified_tokens - seq.num_recomputed_hit_tokens
    held = seq.num_stored_blocks >= num_keys > 0  # the lookup found every full block
    cause = seq.miss_cause or ("tier_down" if held else "never_stored")
    misses = {
        "partial_block": seq.num_prompt_tokens - full,
        "too_slow": seq.num_recomputed_hit_tokens,
        cause: max(rest, 0),
    }
    return {k: v for k, v in misses.items() if v}
