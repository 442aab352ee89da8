"""Replay a trace through a CPU tier over a disk tier with an admission policy on the disk.

What an operator weighs before choosing a policy (``cachetier.admission``): the hit rate it
keeps and the writes it saves the lower tier, at the lower tier's capacity. Each request is
looked up as ``TieredStore.lookup`` does (``cachetier.report.lookup``: the longest leading run
held by either tier), then its
blocks are put as the store puts them: all into the CPU tier (a cheap tier takes everything),
their sightings recorded with the policy, and into the disk tier those it already holds (a
use, not a write) and those the policy admits. Both tiers are ``ReplayCache``s
(``cachetier.report.replay_cache``: what a ``CPUTier`` holds, without its serving costs; a
``DiskTier`` writes a file per block, too slow for a full trace); writes are counted by the
tiers themselves.

A trace block is ``block_size`` tokens (512 in Mooncake traces), a stored record
``record_tokens`` (16): the policy remembers ``admission_tracked_keys`` records, so the replay
gives it ``admission_tracked_keys * record_tokens / block_size`` trace blocks, the same tokens.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from cachetier.admission import AdmissionConfig, AdmissionPolicy, make_admission_policy
from cachetier.primitives.kv_format import DEFAULT_RECORD_TOKENS
from cachetier.record import KVBlock
from cachetier.report.lookup import leading_spans
from cachetier.report.replay import HitRatios, ReplayTrace, usable_hit
from cachetier.report.replay_cache import ReplayCache
from cachetier.util.checks import positive_int

CHEAP_TIER, FILTERED_TIER = "cpu", "disk"


@dataclass(frozen=True, slots=True)
class AdmissionReplay(HitRatios):
    """Hits and writes of one replay with one admission policy.

    Args:
        admission: the policy's name (``cachetier.admission.ADMISSION_POLICIES``).
        cpu_blocks: capacity of the CPU tier, in blocks.
        disk_blocks: capacity of the disk tier, in blocks.
        tracked_keys: trace blocks the policy remembered (scaled from its setting).
        num_blocks: block references of the trace.
        num_hit_blocks: leading blocks the lookups found, in either tier.
        hit_blocks: of those, by the tier that served them.
        num_tokens: prompt tokens of the trace.
        num_hit_tokens: prompt tokens served from whole hit blocks.
        blocks_written: blocks each tier stored (a block it held already is not a write).
        admission_stats: the policy's decisions for the disk tier (``AdmissionStats.as_dict``).
        memory_bytes: bytes of the policy's memory of recent keys.
        elapsed_s: wall time of the replay.
    """

    admission: str
    cpu_blocks: int
    disk_blocks: int
    tracked_keys: int
    num_blocks: int
    num_hit_blocks: int
    hit_blocks: dict[str, int]
    num_tokens: int
    num_hit_tokens: int
    blocks_written: dict[str, int]
    admission_stats: dict[str, int]
    memory_bytes: int
    elapsed_s: float


def replay_tracked_keys(
    admission: AdmissionConfig, block_size: int, record_tokens: int = DEFAULT_RECORD_TOKENS
) -> int:
    """The trace blocks a policy remembers: as many tokens as its ``admission_tracked_keys``
    records hold.

    Args:
        admission: the settings.
        block_size: tokens per trace block.
        record_tokens: tokens per stored record.

    Returns:
        At least 1.
    """
    return max(1, admission.admission_tracked_keys * record_tokens // block_size)


def replay_admission(
    trace: ReplayTrace,
    admission: AdmissionConfig,
    *,
    cpu_blocks: int,
    disk_blocks: int,
    policy: str = "lru",
    record_tokens: int = DEFAULT_RECORD_TOKENS,
) -> AdmissionReplay:
    """Replay ``trace`` through a CPU tier over a disk tier that ``admission`` filters.

    Args:
        trace: the keyed trace.
        admission: the admission settings (``admission_tracked_keys`` in records).
        cpu_blocks: capacity of the CPU tier, in blocks.
        disk_blocks: capacity of the disk tier, in blocks.
        policy: eviction policy of both tiers.
        record_tokens: tokens per stored record, to scale the policy's memory.

    Returns:
        The hits and the writes.
    """
    positive_int("cpu_blocks", cpu_blocks)
    positive_int("disk_blocks", disk_blocks)
    tracked = replay_tracked_keys(admission, trace.block_size, record_tokens)
    filter_ = replay_filter(admission, tracked, cpu_blocks, disk_blocks)
    run = run_admission(trace, filter_, cpu_blocks, disk_blocks, policy)
    hit_blocks = dict.fromkeys((CHEAP_TIER, FILTERED_TIER), 0)
    for spans in run.spans:
        for index, first, end in spans:
            hit_blocks[(CHEAP_TIER, FILTERED_TIER)[index]] += end - first
    size = trace.block_size
    num_hit_tokens = sum(
        usable_hit(request, hit, size)[0] * size for request, hit in zip(trace.requests, run.hits)
    )
    return AdmissionReplay(
        admission=admission.admission_policy,
        cpu_blocks=cpu_blocks,
        disk_blocks=disk_blocks,
        tracked_keys=tracked,
        num_blocks=sum(len(keys) for keys in trace.keys),
        num_hit_blocks=sum(run.hits),
        hit_blocks=hit_blocks,
        num_tokens=sum(r.input_length for r in trace.requests),
        num_hit_tokens=num_hit_tokens,
        blocks_written=run.blocks_written,
        admission_stats=run.admission_stats,
        memory_bytes=run.memory_bytes,
        elapsed_s=run.elapsed_s,
    )


@dataclass(frozen=True, slots=True)
class AdmissionRun:
    """What one run of the replay loop counted (of whatever references it was given).

    Args:
        hits: per request, the leading run of its keys either tier held.
        spans: per request, ``(tier index, start, end)`` of that run by the tier that held it.
        blocks_written: payload bytes each tier stored (blocks, for the trace's 1-byte ones).
        admission_stats: the policy's decisions for the disk tier.
        memory_bytes: bytes of the policy's memory of recent keys.
        elapsed_s: wall time of the loop.
    """

    hits: tuple[int, ...]
    spans: tuple[tuple[tuple[int, int, int], ...], ...]
    blocks_written: dict[str, int]
    admission_stats: dict[str, int]
    memory_bytes: int
    elapsed_s: float


def replay_filter(
    admission: AdmissionConfig, tracked: int, cpu_blocks: int, disk_blocks: int
) -> AdmissionPolicy:
    """The policy a replay of the whole trace filters its disk tier with.

    Args:
        admission: the admission settings.
        tracked: keys the policy remembers, in the trace's blocks.
        cpu_blocks: capacity of the CPU tier, in blocks.
        disk_blocks: capacity of the disk tier, in blocks.

    Returns:
        A new policy; ``adaptive`` simulates the disk tier under the CPU tier, counting both
        in the trace's 1-byte blocks.
    """
    return make_admission_policy(
        dataclasses.replace(admission, admission_tracked_keys=tracked),
        tier_bytes={CHEAP_TIER: cpu_blocks, FILTERED_TIER: disk_blocks},  # 1-byte blocks
        block_bytes=1,
    )


def run_admission(
    trace: ReplayTrace,
    filter_: AdmissionPolicy,
    cpu_blocks: int,
    disk_blocks: int,
    policy: str,
) -> AdmissionRun:
    """The replay loop of ``replay_admission`` (also run on a sample of the keys).

    Args:
        trace: the keyed trace (or its sample).
        filter_: the admission policy of the disk tier (``replay_filter``), new.
        cpu_blocks: capacity of the CPU tier, in blocks (bytes of the trace's blocks).
        disk_blocks: capacity of the disk tier, likewise.
        policy: eviction policy of both tiers.

    Returns:
        The counts.
    """
    cpu, disk = (ReplayCache(c, policy) for c in (cpu_blocks, disk_blocks))
    ns = trace.namespace.id
    hits: list[int] = []
    spans: list[tuple[tuple[int, int, int], ...]] = []
    start = time.perf_counter()
    tiers = (cpu, disk)
    for keys, blocks in zip(trace.keys, trace.blocks):
        num_hit, hit_spans = leading_spans(tiers, ns, keys)
        hits.append(num_hit)
        spans.append(hit_spans)  # both tiers are of one class: named by place
        cpu.put_many(ns, blocks)
        filter_.record(keys)
        disk.put_many(ns, [b for b in blocks if _held_or_admitted(disk, b, filter_)])
    elapsed = time.perf_counter() - start
    disk_stats = filter_.stats().get(FILTERED_TIER)
    return AdmissionRun(
        hits=tuple(hits),
        spans=tuple(spans),
        blocks_written={CHEAP_TIER: cpu.bytes_in, FILTERED_TIER: disk.bytes_in},
        admission_stats=disk_stats.as_dict() if disk_stats else {},
        memory_bytes=filter_.nbytes,
        elapsed_s=elapsed,
    )


def _held_or_admitted(disk: ReplayCache, block: KVBlock, filter_: AdmissionPolicy) -> bool:
    """A block the tier holds is put again (a use, which refreshes it; not a write); one it
    does not hold is written if the policy admits it."""
    if block.key in disk:
        return True
    return filter_.admit(block.key, tier=FILTERED_TIER, nbytes=block.nbytes)
