"""A trace replayed through the store's own admission path, over a real disk tier.

``cachetier.report.admission_replay`` models the disk with a keys-only cache
(``cachetier.report.replay_cache``) and decides the disk's puts itself; this replay runs what a
user runs: a ``TieredStore`` of a ``CPUTier`` over a
``DiskTier`` (one record file per block in a folder) with the admission policy given to the
store. Each request is looked up with ``TieredStore.lookup``, then all its blocks are put with
``TieredStore.put_many`` (the CPU tier takes them at once; the store's writer thread writes
those the policy admits to the disk, where a record already held is refreshed, not rewritten),
and ``flush`` waits for the disk before the next request, so the replay does not depend on how
fast this machine's disk is.

Capacities count blocks: the disk tier's budget is ``disk_blocks`` records of the trace's
one-byte blocks (every record has the same size), and it keeps no spare files (they would
count against the budget). Records are not fsynced: a flush to the platter changes neither
hits nor the bytes written, only the time it takes.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from cachetier.admission import AdmissionConfig, AdmissionPolicy, make_admission_policy
from cachetier.record import KVBlock, encode_parts
from cachetier.report.admission_replay import (
    CHEAP_TIER,
    FILTERED_TIER,
    AdmissionReplay,
    replay_tracked_keys,
)
from cachetier.report.replay import ReplayTrace, usable_hit
from cachetier.store.tiered import TieredStore
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from cachetier.util.checks import positive_int

FLUSH_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class DiskReplay:
    """One replay through the real tiers: what the report's replay says, and the disk's bytes.

    Args:
        replay: hits and blocks written, as ``cachetier.report.admission_replay`` counts them.
        record_bytes: bytes of one record file (header and payload) of the trace's blocks.
        disk_bytes_written: record bytes the disk tier wrote (its ``bytes_in``).
        disk_refreshed: puts of records the disk held already (refreshed, not written).
        disk_evictions: records the disk tier evicted (0: its capacity never bound, so any
            larger capacity replays the same).
        writes_dropped: blocks the store's write queue dropped (0 when every write landed).
    """

    replay: AdmissionReplay
    record_bytes: int
    disk_bytes_written: int
    disk_refreshed: int
    disk_evictions: int
    writes_dropped: int


def record_bytes(block: KVBlock) -> int:
    """Bytes of ``block``'s record file (uncompressed), what the disk tier's budget counts."""
    return sum(memoryview(part).nbytes for part in encode_parts(block))


def _policy(
    admission: AdmissionConfig, tracked: int, cpu_bytes: int, disk_bytes: int
) -> AdmissionPolicy:
    """The store's policy, remembering ``tracked`` trace blocks; ``adaptive`` is told the
    tiers' capacities in payload bytes (it counts blocks of the payload it is asked about)."""
    return make_admission_policy(
        dataclasses.replace(admission, admission_tracked_keys=tracked),
        tier_bytes={CHEAP_TIER: cpu_bytes, FILTERED_TIER: disk_bytes},
    )


def replay_on_disk(
    trace: ReplayTrace,
    admission: AdmissionConfig,
    folder: Path,
    *,
    cpu_blocks: int,
    disk_blocks: int,
    policy: str = "lru",
) -> DiskReplay:
    """Replay ``trace`` through a store of a CPU tier over a disk tier in ``folder``.

    Args:
        trace: the keyed trace (its blocks all of one size).
        admission: the store's admission settings (``admission_tracked_keys`` in records of
            16 tokens, scaled to trace blocks as the report scales them).
        folder: an empty folder on a disk, for the disk tier.
        cpu_blocks: capacity of the CPU tier, in blocks.
        disk_blocks: capacity of the disk tier, in blocks.
        policy: eviction policy of both tiers.

    Returns:
        The hits, the writes and the bytes.
    """
    positive_int("cpu_blocks", cpu_blocks)
    positive_int("disk_blocks", disk_blocks)
    first = trace.blocks[0][0]
    size = record_bytes(first)
    tracked = replay_tracked_keys(admission, trace.block_size)
    filter_ = _policy(admission, tracked, cpu_blocks * first.nbytes, disk_blocks * first.nbytes)
    cpu = CPUTier(CPUTierConfig(cpu_blocks * first.nbytes, policy=policy))
    disk = DiskTier(
        DiskTierConfig(str(folder), disk_blocks * size, policy=policy, fsync=False, spare_bytes=0)
    )
    ns, block_size = trace.namespace.id, trace.block_size
    hit_blocks = dict.fromkeys((CHEAP_TIER, FILTERED_TIER), 0)
    num_hit = num_hit_tokens = 0
    start = time.perf_counter()
    # writer_nice 0: at the default (19) a loaded machine's other work starves the writer the
    # replay waits for at every request.
    with TieredStore([cpu, disk], admission=filter_, writer_nice=0) as store:
        for request, keys, blocks in zip(trace.requests, trace.keys, trace.blocks):
            hit = store.lookup(ns, keys)
            num_hit += hit.num_blocks
            num_hit_tokens += usable_hit(request, hit.num_blocks, block_size)[0] * block_size
            for index, begin, end in hit.spans:
                hit_blocks[(CHEAP_TIER, FILTERED_TIER)[index]] += end - begin
            store.put_many(ns, blocks)
            if not store.flush(timeout=FLUSH_TIMEOUT_S):
                raise RuntimeError(f"the disk tier took over {FLUSH_TIMEOUT_S:.0f} s to write")
        elapsed = time.perf_counter() - start
        stats = store.stats()
    tiers = stats["tiers"]
    decisions = filter_.stats().get(FILTERED_TIER)
    replay = AdmissionReplay(
        admission=admission.admission_policy,
        cpu_blocks=cpu_blocks,
        disk_blocks=disk_blocks,
        tracked_keys=tracked,
        num_blocks=sum(len(keys) for keys in trace.keys),
        num_hit_blocks=num_hit,
        hit_blocks=hit_blocks,
        num_tokens=sum(r.input_length for r in trace.requests),
        num_hit_tokens=num_hit_tokens,
        blocks_written={name: tiers[name]["puts"] for name in (CHEAP_TIER, FILTERED_TIER)},
        admission_stats=decisions.as_dict() if decisions else {},
        memory_bytes=filter_.nbytes,
        elapsed_s=elapsed,
    )
    return DiskReplay(
        replay=replay,
        record_bytes=size,
        disk_bytes_written=tiers[FILTERED_TIER]["bytes_in"],
        disk_refreshed=tiers[FILTERED_TIER]["skipped_present"],
        disk_evictions=tiers[FILTERED_TIER]["evictions"],
        writes_dropped=stats["rejected"],
    )
