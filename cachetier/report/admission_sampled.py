"""The admission replays on a stratified hashed sample of keys (``cachetier.report.sampled``).

The replay loop (``cachetier.report.admission_replay.run_admission``) runs on the sample's
references, whose blocks weigh what they stand for, through tiers of the whole trace's
capacities in bytes; its counts are read back as the whole trace's by weight: hits as in the
capacity curve, writes and decisions in bytes. The policies' memory of keys shrinks with the
share of what it counts that the sample keeps (``_memory_share``). At rate 1 this is
``replay_admission`` exactly.
"""

from __future__ import annotations

from cachetier.admission import AdmissionConfig
from cachetier.report.admission_replay import (
    CHEAP_TIER,
    FILTERED_TIER,
    AdmissionReplay,
    replay_admission,
    replay_tracked_keys,
    run_admission,
)
from cachetier.report.sampled import SampledTrace, estimate_hits, weight_of


def _memory_share(sampled: SampledTrace, policy: str) -> float:
    """The share of a policy's memory of keys its sampled replay keeps: ``tinylfu`` ages its
    sketch every so many sightings (references); the ghost queue of ``second_hit`` (which
    ``adaptive`` mostly admits as, where a filter wins) holds so many distinct keys."""
    if policy == "tinylfu":
        return sampled.num_kept_refs / sampled.num_refs
    return sampled.num_kept_keys / sampled.num_keys


def replay_admission_sampled(
    sampled: SampledTrace,
    admission: AdmissionConfig,
    *,
    cpu_blocks: int,
    disk_blocks: int,
    policy: str = "lru",
) -> AdmissionReplay:
    """``replay_admission`` of the whole trace, estimated from its sample.

    Args:
        sampled: the sampled trace.
        admission: the admission settings.
        cpu_blocks: capacity of the CPU tier, in blocks.
        disk_blocks: capacity of the disk tier, in blocks.
        policy: eviction policy of both tiers.

    Returns:
        The estimated hits and writes (exact at rate 1).
    """
    trace = sampled.trace
    if sampled.weight == 1:
        return replay_admission(
            trace, admission, cpu_blocks=cpu_blocks, disk_blocks=disk_blocks, policy=policy
        )
    tracked = replay_tracked_keys(admission, trace.block_size)
    run = run_admission(
        trace,
        admission,
        max(1, round(tracked * _memory_share(sampled, admission.admission_policy))),
        cpu_blocks,
        disk_blocks,
        policy,
        block_bytes=sampled.weight,
    )
    hit_blocks, hit_tokens = estimate_hits(sampled, run.hits)
    by_tier = dict.fromkeys((CHEAP_TIER, FILTERED_TIER), 0)
    for request, spans in enumerate(run.spans):
        for index, first, end in spans:
            by_tier[(CHEAP_TIER, FILTERED_TIER)[index]] += weight_of(sampled, request, first, end)
    held = sum(by_tier.values())
    stats = run.admission_stats
    return AdmissionReplay(
        admission=admission.admission_policy,
        cpu_blocks=cpu_blocks,
        disk_blocks=disk_blocks,
        tracked_keys=tracked,
        num_blocks=sampled.num_refs,
        num_hit_blocks=round(hit_blocks),
        hit_blocks={t: round(n / held * hit_blocks) if held else 0 for t, n in by_tier.items()},
        num_tokens=sampled.num_tokens,
        num_hit_tokens=round(hit_tokens),
        blocks_written=run.blocks_written,  # bytes: a kept block weighs what it stands for
        admission_stats={
            "admitted": stats.get("bytes_admitted", 0),
            "refused": stats.get("bytes_refused", 0),
            "bytes_admitted": stats.get("bytes_admitted", 0),
            "bytes_refused": stats.get("bytes_refused", 0),
        },
        memory_bytes=run.memory_bytes,
        elapsed_s=run.elapsed_s,
    )
