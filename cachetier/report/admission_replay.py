"""Replay a trace through a CPU tier over a disk tier with an admission policy on the disk.

What an operator weighs before choosing a policy (``cachetier.admission``): the hit rate it
keeps and the writes it saves the lower tier, at the lower tier's capacity. Each request is
looked up with ``TieredStore.lookup`` (the longest leading run held by either tier), then its
blocks are put as the store puts them: all into the CPU tier (a cheap tier takes everything),
their sightings recorded with the policy, and into the disk tier those it already holds (a
use, not a write) and those the policy admits. Both tiers are ``CPUTier`` (as in
``cachetier.report.hierarchy_replay``: a ``DiskTier`` writes a file per block, too slow for a
full trace); writes are counted by the tiers themselves.

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
from cachetier.report.replay import ReplayTrace, usable_hit
from cachetier.store.tiered import TieredStore
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.util.checks import positive_int

CHEAP_TIER, FILTERED_TIER = "cpu", "disk"


@dataclass(frozen=True, slots=True)
class AdmissionReplay:
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

    @property
    def block_hit_ratio(self) -> float:
        """Hit blocks over all block references (0.0 for an empty trace)."""
        return self.num_hit_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        """Tokens served from whole hit blocks over all prompt tokens."""
        return self.num_hit_tokens / self.num_tokens if self.num_tokens else 0.0


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
    filter_ = make_admission_policy(dataclasses.replace(admission, admission_tracked_keys=tracked))
    cpu, disk = (CPUTier(CPUTierConfig(c, policy=policy)) for c in (cpu_blocks, disk_blocks))
    ns, size = trace.namespace.id, trace.block_size
    hit_blocks = dict.fromkeys((CHEAP_TIER, FILTERED_TIER), 0)
    num_hit = num_hit_tokens = 0
    start = time.perf_counter()
    with TieredStore([cpu, disk]) as store:
        for request, keys, blocks in zip(trace.requests, trace.keys, trace.blocks):
            hit = store.lookup(ns, keys)
            num_hit += hit.num_blocks
            num_hit_tokens += usable_hit(request, hit.num_blocks, size)[0] * size
            for index, first, end in hit.spans:  # both tiers are CPUTiers: named by place
                hit_blocks[(CHEAP_TIER, FILTERED_TIER)[index]] += end - first
            cpu.put_many(ns, blocks)
            filter_.record(keys)
            disk.put_many(ns, [b for b in blocks if _held_or_admitted(disk, ns, b, filter_)])
    elapsed = time.perf_counter() - start
    disk_stats = filter_.stats().get(FILTERED_TIER)
    return AdmissionReplay(
        admission=admission.admission_policy,
        cpu_blocks=cpu_blocks,
        disk_blocks=disk_blocks,
        tracked_keys=tracked,
        num_blocks=sum(len(keys) for keys in trace.keys),
        num_hit_blocks=num_hit,
        hit_blocks=hit_blocks,
        num_tokens=sum(r.input_length for r in trace.requests),
        num_hit_tokens=num_hit_tokens,
        blocks_written={CHEAP_TIER: cpu.stats()["puts"], FILTERED_TIER: disk.stats()["puts"]},
        admission_stats=disk_stats.as_dict() if disk_stats else {},
        memory_bytes=filter_.nbytes,
        elapsed_s=elapsed,
    )


def _held_or_admitted(disk: CPUTier, ns: str, block: KVBlock, filter_: AdmissionPolicy) -> bool:
    """A block the tier holds is put again (a use, which refreshes it; not a write); one it
    does not hold is written if the policy admits it."""
    if disk.contains_prefix(ns, [block.key]):
        return True
    return filter_.admit(block.key, tier=FILTERED_TIER, nbytes=block.nbytes)
