"""Figures only a trace replay has: the capacity curve, and the infinite-cache ceiling and block
hit ratios beside the lookup figures."""

from __future__ import annotations

from typing import Any

import numpy as np

from cachetier.report.admission_figure import admission_figure
from cachetier.report.config import ReportConfig
from cachetier.report.figures import ratio, time_bins
from cachetier.report.hierarchy_replay import TIER_NAMES, TraceReplays
from cachetier.report.replay import ReplayResult, ReplayTrace


def capacity_curve(
    replays: TraceReplays, config: ReportConfig, default_policy: str
) -> dict[str, Any]:
    """Block hit ratio against cache size for each policy, Belady and the infinite cache.

    Args:
        replays: the curve's replays (``replays.curve``) and the ceiling.
        config: the curve's capacities and the modelled tiers.
        default_policy: the policy a store gets when none is named.

    Returns:
        The figure; ``series`` and ``token_series`` map a name to one ratio per capacity.
    """
    capacities = list(config.curve_capacities)
    series = {name: [r.block_hit_ratio for r in rs] for name, rs in replays.curve.items()}
    default_hits = [r.num_hit_blocks for r in replays.curve.get(default_policy, ())]
    lru_hits = [r.num_hit_blocks for r in replays.curve.get("lru", ())]
    same = default_policy == "lru"
    return {
        "title": "Capacity curve",
        "how": (
            "Every request of the trace is replayed in order through one cache of the given "
            "capacity (blocks of 512 tokens): its hit is the leading run of its blocks the "
            "cache holds, then all its blocks are stored or refreshed. Block hit ratio = hit "
            "blocks / block references, every hash id counting as a block as in the trace's "
            "own figures. Policies run the tiers' own eviction code, holding what a CPUTier "
            "would; Belady's policy evicts the block "
            "used again farthest in the future (with prefix hits a reference point, not a "
            "proven optimum); the infinite cache never evicts, the ceiling for any policy. "
            + _sampling(replays.sample_rate, config.max_error)
            + (
                f"The default policy is {default_policy.upper()} itself, so its line is LRU's."
                if same
                else f"The default policy is {default_policy}."
            )
        ),
        "metric": "block_hit_ratio",
        "capacities": capacities,
        "default_policy": default_policy,
        "series": series,
        "token_series": {n: [r.token_hit_ratio for r in rs] for n, rs in replays.curve.items()},
        "ceiling": replays.ceiling.block_hit_ratio,
        "ceiling_token_hit_ratio": replays.ceiling.token_hit_ratio,
        "tier_capacity_blocks": dict(zip(TIER_NAMES, (config.cpu_blocks, config.disk_blocks))),
        "default_ge_lru_at_every_capacity": (
            bool(default_hits and lru_hits) and all(d >= b for d, b in zip(default_hits, lru_hits))
        ),
        "replay_s": {n: sum(r.elapsed_s for r in rs) for n, rs in replays.curve.items()},
        "sample_rate": replays.sample_rate,
        "max_error": None if replays.sample_rate >= 1 else config.max_error,
    }


def _sampling(rate: float, max_error: float) -> str:
    if rate >= 1:
        return "Every key of the trace is replayed (exact). "
    return (
        "LRU and Belady are replayed on a hashed sample of keys (SHARDS; the other policies on "
        "every key): keys in 16 or more requests are all "
        f"kept, the others one in {round(1 / rate)}, each standing for that many in a tier of "
        f"the full capacity; sized for an error of at most {max_error} in block hit ratio at any "
        "point (--exact replays every key). "
    )


def add_trace_figures(
    figures: dict[str, dict[str, Any]],
    trace: ReplayTrace,
    replays: TraceReplays,
    config: ReportConfig,
    default_policy: str,
) -> None:
    """Add the capacity curve, the admission figure (when admission policies were replayed),
    and the infinite cache and block counts to the lookup figures.

    Args:
        figures: ``lookup_figures`` of ``replays.events``, changed in place.
        trace: the replayed trace.
        replays: its replays.
        config: the modelled tiers and the curve settings.
        default_policy: the policy a store gets when none is named.
    """
    ceiling = replays.ceiling
    over_time = figures["hit_rate_over_time"]
    times = np.array([r.timestamp_ms / 1000 for r in ceiling.records])
    index, num_bins = time_bins(times, over_time["bin_s"])

    def per_bin(values: list[int]) -> np.ndarray:
        return np.bincount(index, weights=np.asarray(values, np.float64), minlength=num_bins)

    blocks = per_bin([r.num_blocks for r in ceiling.records])
    tokens = per_bin([r.num_tokens for r in ceiling.records])
    over_time["ceiling_token_hit_ratio"] = ratio(
        per_bin([r.num_hit_tokens for r in ceiling.records]), tokens
    )
    over_time["block_hit_ratio"] = ratio(per_bin(list(replays.hit_blocks)), blocks)
    over_time["ceiling_block_hit_ratio"] = ratio(
        per_bin([r.num_hit_blocks for r in ceiling.records]), blocks
    )
    over_time["how"] += (
        " The dashed line is the same ratio for an infinite cache: the most any cache could "
        "have served from the trace's own repeats."
    )
    per_tier = figures["per_tier"]
    per_tier["tier_capacity_blocks"] = dict(
        zip(TIER_NAMES, (config.cpu_blocks, config.disk_blocks))
    )
    per_tier["block_hit_ratio"] = sum(replays.hit_blocks) / ceiling.num_blocks
    per_tier["how"] += (
        f" Trace replay: a TieredStore of a {config.cpu_blocks:,}-block tier ('cpu') over a "
        f"{config.disk_blocks:,}-block tier ('disk'), both {config.policy.upper()}, written "
        "through, looked up as TieredStore.lookup looks up. Both hold what a CPUTier holds (a "
        "DiskTier writes a file per block: too slow for a full trace), standing in for a small "
        "fast tier over a large slow one; the hit accounting is the store's own."
    )
    alignment = figures["alignment"]
    alignment["breakdown"]["infinite cache"] = _breakdown(ceiling)
    alignment["how"] += (
        " In a trace replay a partial last block matches only when an earlier request had the "
        "same hash id for it (the same prompt up to its end): the trace hashes whole 512-token "
        "blocks, so a later turn that shares part of that block is not visible to it, and "
        "this figure counts only the matches the trace can show."
    )
    figures["per_tenant"]["how"] += (
        f" The trace has no tenants: requests are spread over {config.num_tenants} synthetic "
        "tenant(s) by a stable hash (CRC-32) of their first two hash ids, which name a "
        "conversation; the cache is shared, so tenants split the accounting only."
    )
    figures["capacity_curve"] = capacity_curve(replays, config, default_policy)
    if replays.admission:
        figures["admission"] = admission_figure(
            replays.admission, replays.admission_capacities, config.cpu_blocks, config.policy
        )


def _breakdown(result: ReplayResult) -> dict[str, int]:
    lost = result.num_alignment_lost_tokens
    return {
        "hit": result.num_hit_tokens,
        "alignment_lost": lost,
        "prefilled": result.num_tokens - result.num_hit_tokens - lost,
    }
