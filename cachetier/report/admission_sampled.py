"""The admission replays on a stratified hashed sample of keys (``cachetier.report.sampled``).

The replay loop (``cachetier.report.admission_replay.run_admission``) runs on the sample's
references, whose blocks weigh what they stand for, through tiers of the whole trace's
capacities in bytes; its counts are read back as the whole trace's by weight: hits as in the
capacity curve, writes and decisions in bytes. The filters' memory of keys shrinks with the
share of what it counts that the sample keeps (``_memory_share``). At rate 1 this is
``replay_admission`` exactly.

``adaptive`` chooses among the fixed policies by its own ghost simulation of the disk tier
(``cachetier.admission.simulation``), on a hashed sample of keys at a rate of its own. Built the
way a store builds it (capacities in the sample's bytes, memory shrunk by the sample's share,
fed the sample's references) it would see the sample's hot keys and cold keys at rates of their
own and misjudge its disk, switching where the exact replay does not. So the replay builds it
as on the whole trace (capacities in blocks, the whole memory) and feeds it each request's keys
of the whole trace (``_WholeTraceSimulation``; the sample's keys where they hold all it keeps):
it then sees what it sees in the exact replay, scores the same and switches at the same
requests, and only the tiers are sampled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence

from cachetier.admission import Adaptive, AdmissionConfig, AdmissionPolicy
from cachetier.admission.sample import KeySample, sample_rate_for
from cachetier.admission.simulation import TierSimulation
from cachetier.report.admission_replay import (
    CHEAP_TIER,
    FILTERED_TIER,
    AdmissionReplay,
    replay_admission,
    replay_filter,
    replay_tracked_keys,
    run_admission,
)
from cachetier.report.sampled import SampledTrace, estimate_hits, weight_of


def _memory_share(sampled: SampledTrace, policy: str) -> float:
    """The share of a filter's memory of keys its sampled replay keeps: ``tinylfu`` ages its
    sketch every so many sightings (references); the ghost queue of ``second_hit`` (and of
    ``adaptive``'s filters, whose ghost queue decides most often) holds so many distinct keys."""
    if policy == "tinylfu":
        return sampled.num_kept_refs / sampled.num_refs
    return sampled.num_kept_keys / sampled.num_keys


class _WholeTraceSimulation(TierSimulation):
    """A simulation fed the whole trace's requests in order, whatever keys it is given: the
    sampled replay's requests are the whole trace's, cut to their sampled keys.

    Args:
        config: the settings, with the whole trace's memory.
        cheap_blocks: the CPU tier's capacity in blocks of the whole trace.
        tier_blocks: the disk tier's, likewise.
        whole_keys: each request's keys in the whole trace, from the first one fed.
    """

    def __init__(
        self,
        config: AdmissionConfig,
        cheap_blocks: int,
        tier_blocks: int,
        whole_keys: Iterator[Sequence[bytes]],
    ) -> None:
        super().__init__(config, cheap_blocks, tier_blocks)
        self._whole_keys = whole_keys

    def request(self, keys: Sequence[bytes]) -> bool:
        return super().request(next(self._whole_keys))


class _SampledAdaptive(Adaptive):
    """``adaptive`` on the sample's references, its disk tier's simulation as on the whole trace.

    Args:
        config: the settings of its full-size filters (their memory shrunk for the sample).
        whole: the settings with the whole trace's memory, for the simulation.
        whole_keys: each request's keys in the whole trace (or in its sample, where that holds
            every key the simulation keeps).
        cpu_blocks: capacity of the CPU tier, in blocks of the whole trace.
        disk_blocks: capacity of the disk tier, likewise.
    """

    def __init__(
        self,
        config: AdmissionConfig,
        whole: AdmissionConfig,
        whole_keys: Sequence[Sequence[bytes]],
        cpu_blocks: int,
        disk_blocks: int,
    ) -> None:
        super().__init__(config)
        self._whole = whole
        self._whole_keys = whole_keys
        self._capacities = (cpu_blocks, disk_blocks)
        self._num_records = 0

    def record(self, keys: Iterable[bytes]) -> None:
        self._num_records += 1
        super().record(keys)

    def _maybe_simulate(self, tier: str, nbytes: int) -> TierSimulation | None:
        if tier != FILTERED_TIER:
            return None
        # In the whole trace the first request asks the disk tier first, and its simulation
        # starts with the next one; a sample's first kept keys may come later: catch up.
        keys = iter(self._whole_keys[1:])
        sim = _WholeTraceSimulation(self._whole, *self._capacities, keys)
        for _ in range(1, self._num_records):
            sim.request(())
        self._sims[tier] = sim
        return sim


def sampled_filter(
    sampled: SampledTrace,
    admission: AdmissionConfig,
    tracked: int,
    cpu_blocks: int,
    disk_blocks: int,
) -> AdmissionPolicy:
    """The policy a replay of ``sampled`` filters its disk tier with.

    Args:
        sampled: the sampled trace (rate below 1).
        admission: the admission settings.
        tracked: keys the policy remembers on the whole trace, in its blocks.
        cpu_blocks: capacity of the CPU tier, in blocks of the whole trace.
        disk_blocks: capacity of the disk tier, likewise.

    Returns:
        A new policy.
    """
    shrunk = max(1, round(tracked * _memory_share(sampled, admission.admission_policy)))
    if admission.admission_policy != Adaptive.name:
        return replay_filter(admission, shrunk, cpu_blocks, disk_blocks)
    # Both samples hash the same bytes of a key, so they nest: where the simulation's rate is
    # the lower, every key it keeps is in the report's sample, which it may read instead.
    rate = sample_rate_for(admission.admission_sample_keys, cpu_blocks + disk_blocks)
    nested = KeySample(rate).threshold <= KeySample(sampled.rate).threshold
    return _SampledAdaptive(
        dataclasses.replace(admission, admission_tracked_keys=shrunk),
        dataclasses.replace(admission, admission_tracked_keys=tracked),
        sampled.trace.keys if nested else sampled.whole.keys,
        cpu_blocks,
        disk_blocks,
    )


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
    filter_ = sampled_filter(sampled, admission, tracked, cpu_blocks, disk_blocks)
    run = run_admission(trace, filter_, cpu_blocks, disk_blocks, policy)
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
