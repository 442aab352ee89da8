"""What a report is built from and the settings of its figures."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from cachetier.admission import ADMISSION_POLICIES
from cachetier.report.replay import BLOCK_SIZE as TRACE_BLOCK_SIZE
from cachetier.report.sampled import DEFAULT_MAX_ERROR
from cachetier.store.config import StoreConfig
from cachetier.tiers.eviction import POLICIES

# The report turns hit tokens into saved prefill time with this rate when it is given none: the
# smallest deployment the project runs, SmolLM2-135M-Instruct in fp32 on two CPU cores (the
# restart benchmark's cold prefill). Any real server should pass its own.
PREFILL_TOKENS_PER_S = 114.0
PREFILL_SOURCE = (
    "the default, about 114 tokens/s: SmolLM2-135M-Instruct in fp32 on two CPU cores (the "
    "restart benchmark's cold prefill). A GPU server prefills orders of magnitude faster: give "
    "its own figure with --prefill-tokens-per-s."
)

DEFAULT_NUM_WORKERS = (
    len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
)
"""Processes replaying the capacity curve: one per core."""

DEFAULT_POLICY = StoreConfig().policy
"""The eviction policy a store gets when none is named."""


def log_capacities(low: int = 1_000, high: int = 100_000, num: int = 8) -> tuple[int, ...]:
    """``num`` log-spaced capacities from ``low`` to ``high`` blocks, to two significant digits.

    Args:
        low: smallest capacity in blocks.
        high: largest capacity in blocks.
        num: number of points.

    Returns:
        The capacities, ascending and distinct.
    """
    if not 0 < low <= high or num < 1:
        raise ValueError(f"need 0 < low <= high and num >= 1, got {low}, {high}, {num}")
    out = set()
    for value in np.geomspace(low, high, num):
        digits = max(int(math.floor(math.log10(value))) - 1, 0)
        out.add(int(round(value / 10**digits)) * 10**digits)
    return tuple(sorted(out))


def with_capacities(points: tuple[int, ...], *extra: int) -> tuple[int, ...]:
    """``points`` and ``extra`` ascending, where an extra capacity replaces a point within 10%
    of it (a replay that close adds time, not information).

    Args:
        points: capacities in blocks.
        extra: capacities that must be on the curve.

    Returns:
        The capacities, ascending and distinct.
    """
    kept = {p for p in points if all(abs(p - e) > 0.1 * e for e in extra)}
    return tuple(sorted(kept | set(extra)))


HEADLINE_CAPACITIES = (10_000, 50_000)
"""The capacities the project quotes figures for (README, benchmarks.policies)."""

CURVE_CAPACITIES = with_capacities(log_capacities(), *HEADLINE_CAPACITIES)
"""The capacity curve's points: 8 log-spaced ones from 1,000 to 100,000 blocks, with 10,000
and 50,000 in place of the ones near them (52,000)."""


@dataclass(frozen=True, slots=True)
class ReportConfig:
    """Inputs and settings of one report.

    Args:
        trace: a Mooncake-format ``.jsonl`` trace to replay through real tiers; or
        events: an event log (``cachetier.report.events``) of a running engine or server.
        stats: tier counters: a file holding ``GET /v1/stats`` JSON (or ``TieredStore.stats()``),
            or the server's ``http(s)://host:port`` (``/v1/stats`` is added).
        cpu_blocks: trace replay: blocks of the fast tier of the modelled store.
        disk_blocks: trace replay: blocks of the large tier below it.
        block_size: trace replay: tokens per hash id of the trace (512 in Mooncake's).
        pool_blocks: trace replay: the engine's own KV pool above the tiers, in blocks (0: not
            modelled; its hits are then the CPU tier's).
        guard_first_hits: trace replay: the restore guard's first hits per tier, computed
            rather than loaded as an engine with the guard on does (engines' default: 1;
            0: not modelled).
        in_flight: trace replay with a pool: requests an engine serves at once. While a
            request is looked up and stored, the blocks of the ``in_flight - 1`` sent before it
            stay held in the pool (a running request's blocks cannot be evicted), so the
            pool's cache is what they leave.
        policy: trace replay: eviction policy of both tiers.
        num_tenants: trace replay: synthetic tenants the requests are split into by conversation.
        capacities: trace replay: capacities of the capacity curve, in blocks (the two tier
            capacities are added).
        curve_policies: trace replay: eviction policies drawn on the capacity curve.
        admission_policies: trace replay: admission policies (``cachetier.admission``) replayed
            against store-all at each disk capacity of the curve; empty for none.
        prefill_tokens_per_s: prefill speed that turns hit tokens into seconds saved.
        bin_s: width of the time bins of the over-time plots; ``None`` picks about 60 bins.
        num_workers: trace replay: processes running the capacity curve, this one included.
        exact: trace replay: the curve and the admission replays replay every key; by default
            they replay a hashed sample of keys sized for ``max_error``
            (``cachetier.report.sampled``).
        max_error: trace replay: the error bound the sample is sized for (block hit ratio,
            absolute, at any point of the curve).
        quiet: no progress bar.
    """

    trace: str | None = None
    events: str | None = None
    stats: str | None = None
    cpu_blocks: int = 10_000
    disk_blocks: int = 50_000
    block_size: int = TRACE_BLOCK_SIZE
    pool_blocks: int = 0
    guard_first_hits: int = 0
    in_flight: int = 1
    policy: str = DEFAULT_POLICY
    num_tenants: int = 1
    capacities: tuple[int, ...] = CURVE_CAPACITIES
    curve_policies: tuple[str, ...] = tuple(POLICIES)
    admission_policies: tuple[str, ...] = ADMISSION_POLICIES
    prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S
    bin_s: float | None = None
    num_workers: int = DEFAULT_NUM_WORKERS
    exact: bool = False
    max_error: float = DEFAULT_MAX_ERROR
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.trace and self.events:
            raise ValueError("give --trace or --events, not both: a report covers one run")
        if not (self.trace or self.events or self.stats):
            raise ValueError("nothing to report on: give --trace, --events or --stats")
        if self.cpu_blocks <= 0 or self.disk_blocks <= 0:
            raise ValueError(
                f"--cpu-blocks and --disk-blocks must be positive, got {self.cpu_blocks}, "
                f"{self.disk_blocks}"
            )
        for name in (self.policy, *self.curve_policies):
            if name not in POLICIES:
                raise ValueError(f"eviction policy {name!r} is not one of {sorted(POLICIES)}")
        for name in self.admission_policies:
            if name not in ADMISSION_POLICIES:
                raise ValueError(
                    f"admission policy {name!r} is not one of {', '.join(ADMISSION_POLICIES)} "
                    "(or 'none')"
                )
        if self.pool_blocks < 0 or self.guard_first_hits < 0:
            raise ValueError(
                f"--pool-blocks and --guard-first-hits must be >= 0, got {self.pool_blocks}, "
                f"{self.guard_first_hits}"
            )
        if self.in_flight < 1:
            raise ValueError(f"--in-flight must be >= 1, got {self.in_flight}")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.num_workers < 1:
            raise ValueError(f"--jobs must be >= 1, got {self.num_workers}")
        if not 0 < self.max_error < 1:
            raise ValueError(f"max_error must be in (0, 1), got {self.max_error!r}")
        if self.num_tenants < 1:
            raise ValueError(f"--tenants must be >= 1, got {self.num_tenants}")
        if not self.capacities or min(self.capacities) <= 0:
            raise ValueError("--capacities must be positive block counts")
        if not (self.prefill_tokens_per_s > 0 and math.isfinite(self.prefill_tokens_per_s)):
            raise ValueError(
                f"--prefill-tokens-per-s must be a positive number, got {self.prefill_tokens_per_s}"
            )
        if self.bin_s is not None and not (self.bin_s > 0 and math.isfinite(self.bin_s)):
            raise ValueError(f"--bin-s must be a positive number of seconds, got {self.bin_s}")

    @property
    def curve_capacities(self) -> tuple[int, ...]:
        """The capacity curve's points: ``capacities`` and the two tier capacities, ascending
        (a point within 10% of a tier capacity gives way to it)."""
        return with_capacities(self.capacities, self.cpu_blocks, self.disk_blocks)
