"""The admission figure: each policy's hit rate against the writes it saves, per disk capacity.

An operator chooses a policy (``cachetier.admission``) by this trade: the blocks the lower tier
no longer writes, against the hits it no longer serves (or, at small capacities, the hits it
gains by keeping one-hit blocks out). Every number is relative to store-all (``"all"``),
replayed at the same capacity in the same run.
"""

from __future__ import annotations

from typing import Any

from cachetier.report.admission_replay import CHEAP_TIER, FILTERED_TIER, AdmissionReplay

BASELINE = "all"


def admission_figure(
    replays: dict[str, tuple[AdmissionReplay, ...]],
    capacities: tuple[int, ...],
    cpu_blocks: int,
    policy: str,
) -> dict[str, Any]:
    """Hit ratios and writes per admission policy and disk capacity.

    Args:
        replays: by admission policy, one replay per capacity (``"all"`` among them).
        capacities: the disk capacities, in blocks, ascending.
        cpu_blocks: the CPU tier's capacity, in blocks.
        policy: the eviction policy of both tiers.

    Returns:
        The figure: per policy, one value per capacity in ``block_hit_ratio``,
        ``token_hit_ratio``, ``hit_rate_delta_vs_all`` (block hit ratio minus store-all's),
        ``blocks_written`` (by tier), ``disk_written_vs_all``, and the disk tier's
        ``admission_stats``; ``memory_bytes`` of each policy's memory of keys.
    """
    base = replays[BASELINE]
    tracked = {name: rs[0].tracked_keys for name, rs in replays.items() if rs}
    return {
        "title": "Admission: hits against writes",
        "how": (
            "Every request of the trace is looked up in a TieredStore of a "
            f"{cpu_blocks:,}-block CPU tier over a disk tier of the given capacity (both "
            f"{policy.upper()}); then its blocks go into the CPU tier, which takes everything, "
            "and into the disk tier where it holds them already or the admission policy admits "
            "them. 'all' writes every block (store-all, the baseline). 'second_hit' writes a "
            "block seen before among the last keys its ghost queue remembers; 'tinylfu' one "
            "its frequency sketch has seen the threshold number of times lately; 'adaptive' "
            "admits as whichever of the three its ghost tiers, on a hashed sample of keys, find "
            "best on recent traffic (it starts as 'all'). Block hit "
            "ratio as on the capacity curve; written = blocks the disk tier stored (a block "
            "it held already is not a write), all blocks of one size, so it is the bytes "
            "written. The policies remember admission_tracked_keys records of "
            "record_tokens tokens, so a trace block of block_size tokens counts as "
            "block_size / record_tokens of them "
            f"({next(iter(tracked.values()), 0):,} trace blocks at the defaults)."
        ),
        "cpu_blocks": cpu_blocks,
        "capacities": list(capacities),
        "policies": list(replays),
        "block_hit_ratio": {n: [r.block_hit_ratio for r in rs] for n, rs in replays.items()},
        "token_hit_ratio": {n: [r.token_hit_ratio for r in rs] for n, rs in replays.items()},
        "hit_rate_delta_vs_all": {
            n: [r.block_hit_ratio - b.block_hit_ratio for r, b in zip(rs, base)]
            for n, rs in replays.items()
        },
        "blocks_written": {
            n: {t: [r.blocks_written[t] for r in rs] for t in (CHEAP_TIER, FILTERED_TIER)}
            for n, rs in replays.items()
        },
        "disk_written_vs_all": {
            n: [
                _ratio(r.blocks_written[FILTERED_TIER], b.blocks_written[FILTERED_TIER])
                for r, b in zip(rs, base)
            ]
            for n, rs in replays.items()
        },
        "admission_stats": {n: [r.admission_stats for r in rs] for n, rs in replays.items()},
        "tracked_keys": tracked,
        "memory_bytes": {n: rs[0].memory_bytes for n, rs in replays.items() if rs},
        "replay_s": {n: sum(r.elapsed_s for r in rs) for n, rs in replays.items()},
    }


def _ratio(value: int, baseline: int) -> float:
    return value / baseline if baseline else 1.0
