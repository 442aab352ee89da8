"""The load / recompute plan of one request's tier hit."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from cachetier.store.costmodel.prefill import PrefillModel
from cachetier.store.costmodel.rates import CopyRate, TierRates

log = logging.getLogger(__name__)

# Within this fraction of the best estimate, or this many seconds of it, the plan loads more
# rather than less: a recompute costs compute other requests could use, and a gain smaller
# than the estimates' own noise (a millisecond: one scheduler tick on a busy host) is no
# reason to spend it. Only while the time a load adds is less than the compute it frees: on a
# thin link one block can take longer to fetch than to recompute, and 2% of a long prompt's
# TTFT is worth many such blocks (a 16-token block over a slow link takes several times its
# recompute, and would be paid on every request over that link).
_PREFER_LOAD = 0.02
_PREFER_LOAD_S = 0.001


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What to do with one request's tier hit: load blocks ``[load_start, load_end)`` of it,
    recompute the others.

    Blocks before ``load_start`` are recomputed first (they attend to little context, so they
    are the cheapest to compute), while the loaded ones are read where the engine can do both
    at once, then everything after ``load_end`` is computed with the prompt's suffix.

    Args:
        num_hit_blocks: leading blocks the tiers hold (after the pool's own hit).
        load_start: first hit block to load.
        load_end: one past the last hit block to load.
        reason: ``model`` (estimates decided), ``unmeasured`` (a side had no measurement yet:
            load all), ``unmeasured_length`` (recomputing would need steps longer than the
            prefill model measured: load all), ``within_error`` (a recompute won on paper by
            less than the estimates' measured error: load all), ``disabled`` (always load),
            ``probe`` (a stale tier read to refresh it).
        est_ttft_s: estimated seconds to first token for the chosen plan (``None`` unmeasured).
        est_load_all_s: the same estimate had everything been loaded.
        est_recompute_all_s: the same had nothing been loaded (what a miss would cost).
        est_compute_s: estimated seconds of the forward steps the chosen plan computes the
            prompt in (recomputed hit blocks and the suffix): what ``CostModel.observe_outcome``
            compares with the steps' real time.
        margin: the margin the plan was held to (``EstimateError.margin``).
    """

    num_hit_blocks: int
    load_start: int
    load_end: int
    reason: str
    est_ttft_s: float | None = None
    est_load_all_s: float | None = None
    est_recompute_all_s: float | None = None
    est_compute_s: float | None = None
    margin: float | None = None

    @classmethod
    def load_all(cls, num_hit_blocks: int, reason: str) -> LoadPlan:
        return cls(num_hit_blocks, 0, num_hit_blocks, reason)

    @property
    def num_load_blocks(self) -> int:
        return self.load_end - self.load_start

    @property
    def num_recompute_blocks(self) -> int:
        return self.num_hit_blocks - self.num_load_blocks

    @property
    def refused(self) -> bool:
        """Whether the plan recomputes hit blocks it could have loaded."""
        return self.num_recompute_blocks > 0

    @property
    def choice(self) -> str:
        """``load_all``, ``recompute_all`` or ``partial`` (some blocks of each): what a
        dashboard counts the plans by."""
        if self.num_recompute_blocks == 0:
            return "load_all"
        return "recompute_all" if self.num_load_blocks == 0 else "partial"

    @property
    def est_saved_s(self) -> float:
        """Estimated seconds this plan saves against recomputing the whole hit (0 unknown)."""
        if self.est_ttft_s is None or self.est_recompute_all_s is None:
            return 0.0
        return max(0.0, self.est_recompute_all_s - self.est_ttft_s)


@dataclass(frozen=True, slots=True)
class _Option:
    """One candidate plan: its estimated TTFT, the hit blocks it loads, the seconds of compute
    it needs, and whether that compute lies inside the prefill model's measured range."""

    est_s: float
    start: int
    end: int
    compute_s: float
    covered: bool


@dataclass(frozen=True, slots=True)
class _BlockCosts:
    """Per hit block: its tier, transfer seconds, and its span's round trip where a span
    starts (0 elsewhere)."""

    tiers: list[str]
    transfer_s: list[float]
    latency_s: list[float]
    span_latency_s: list[float]


def _choose(options: list[_Option], margin: float, load_compute_s: float) -> _Option:
    """The plan with the smallest estimate, each option's extra compute (over loading all)
    inflated by ``margin``; among plans close enough to it whose extra time the compute they
    free pays for, the one that loads the most."""

    def est(o: _Option) -> float:
        return o.est_s + margin * max(o.compute_s - load_compute_s, 0.0)

    best_option = min(options, key=lambda o: (est(o), -(o.end - o.start)))
    best, best_compute = est(best_option), best_option.compute_s
    close = max(best * (1 + _PREFER_LOAD), best + _PREFER_LOAD_S)
    return max(
        (
            o
            for o in options
            if est(o) <= close
            and est(o) - best <= max(best_compute - o.compute_s, 0.0) + _PREFER_LOAD_S
        ),
        key=lambda o: (o.end - o.start, -est(o)),
    )


class CostModel:
    """Plans loads from ``TierRates`` and a ``PrefillModel``.

    Two shapes of plan are weighed: load a leading run of the hit and recompute the rest with
    the suffix, or recompute a leading run and load the rest. Every block costs the same to
    load, but a later block costs more to compute (it attends to more context), so when a
    link is a little slower than compute the best plan recomputes the early blocks and loads
    the late ones. An engine that can only take a loaded prefix (vLLM's connector reports a
    number of leading tokens) asks for the first shape only.

    A plan that recomputes hit blocks (a refusal) is made only on evidence: its compute must
    lie inside the prefill model's measured range (``PrefillModel.covers``), and its estimate
    must win with the compute it adds inflated by ``PrefillModel.error.margin``. Every
    refusal is logged at INFO with both estimates; ``observe_outcome`` logs its real time and
    teaches the margin.

    Args:
        rates: the store's measured tier rates.
        prefill: the engine's measured prefill speed.
        copy: the engine's measured copy into its KV memory, added to every loaded block;
            ``None`` where restores land in place.
        enabled: ``False`` always loads every hit (the behaviour before the model).
        probe_interval_s: a tier the plans have avoided for this long gets one block read
            anyway, so that a link that became fast again is noticed.
        clock: monotonic seconds.
        log_refusals: log each refusal (a router weighing every replica's plan for every
            request plans what no engine runs, and turns it off).
    """

    def __init__(
        self,
        rates: TierRates,
        prefill: PrefillModel,
        *,
        copy: CopyRate | None = None,
        enabled: bool = True,
        probe_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        log_refusals: bool = True,
    ) -> None:
        self.rates = rates
        self.log_refusals = log_refusals
        self.prefill = prefill
        self.copy = copy
        self.enabled = enabled
        self.probe_interval_s = probe_interval_s
        self._clock = clock

    def plan(
        self,
        spans: Sequence[tuple[str, int]],
        *,
        block_bytes: int,
        block_size: int,
        cached_tokens: int,
        num_tokens: int,
        chunk_tokens: int,
        prefix_only: bool = False,
        overlap_tiers: Collection[str] = (),
        request_id: str = "",
    ) -> LoadPlan:
        """Choose which hit blocks to load.

        Args:
            spans: ``(tier name, blocks)`` runs of the hit, in order (a tier may repeat).
            block_bytes: payload bytes of one block.
            block_size: tokens per block.
            cached_tokens: tokens before the hit that need neither (the engine's own pool).
            num_tokens: tokens that must be computed or loaded before the first token.
            chunk_tokens: most tokens one prefill step computes.
            prefix_only: consider only plans that load a leading run of the hit.
            overlap_tiers: tiers the engine reads a loaded tail from while it recomputes the
                head before it (ours: network tiers beside a CPU forward, every tier beside a
                GPU one). Where such a tier reads a block slower than the engine computes one,
                the read waits on its link, not on the cores the head needs, and the plan
                counts the longer of head and tail instead of their sum.
            request_id: names the request in the refusal's log line.

        Returns:
            The plan; ``reason`` says what decided it.
        """
        total = sum(n for _, n in spans)
        if not self.enabled:
            return LoadPlan.load_all(total, "disabled")
        if total == 0:
            return LoadPlan(0, 0, 0, "model")
        costs = self._block_costs(spans, block_bytes)
        if costs is None or self.prefill.coefficients is None:
            return LoadPlan.load_all(total, "unmeasured")
        options = self._options(
            costs, cached_tokens, block_size, num_tokens, chunk_tokens, prefix_only, overlap_tiers
        )
        load_all = options[total]
        margin = self.prefill.error.margin
        # Decided three times: on the estimates alone, on those the model measured, and on
        # those held to the margin. Where a later step loads all and an earlier one did not,
        # it names why.
        chosen = _choose(options, 0.0, load_all.compute_s)
        reason = "model"
        if chosen is not load_all:
            chosen = _choose([o for o in options if o.covered], 0.0, load_all.compute_s)
            reason = "model" if chosen is not load_all else "unmeasured_length"
        if chosen is not load_all:
            chosen = _choose([o for o in options if o.covered], margin, load_all.compute_s)
            reason = "model" if chosen is not load_all else "within_error"
        start, end = chosen.start, chosen.end
        # A tier avoided for long gets one block read, to notice a link that recovered.
        if end < total and self._stale(costs.tiers[end]):
            end, reason = end + 1, "probe"
        elif start > 0 and self._stale(costs.tiers[start - 1]):
            start, reason = start - 1, "probe"
        plan = LoadPlan(
            total,
            start,
            end,
            reason,
            chosen.est_s,
            load_all.est_s,
            options[0].est_s,
            chosen.compute_s,
            margin,
        )
        if plan.refused and self.log_refusals:
            _log_refusal(plan, request_id)
        return plan

    def _block_costs(
        self, spans: Sequence[tuple[str, int]], block_bytes: int
    ) -> _BlockCosts | None:
        """What each hit block costs to load, or ``None`` if a tier is not measured yet."""
        copy_spb = self.copy.seconds_per_byte if self.copy is not None else None
        copy_s = block_bytes * copy_spb if copy_spb is not None else 0.0
        costs = _BlockCosts([], [], [], [])
        for tier, n in spans:
            rate = self.rates.get(tier)
            if rate is None or rate.seconds_per_byte is None:
                return None
            for i in range(n):
                costs.tiers.append(tier)
                costs.transfer_s.append(block_bytes * rate.seconds_per_byte + copy_s)
                costs.latency_s.append(rate.latency_s)
                costs.span_latency_s.append(rate.latency_s if i == 0 else 0.0)
        return costs

    def _options(
        self,
        costs: _BlockCosts,
        hit_start: int,
        block_size: int,
        num_tokens: int,
        chunk_tokens: int,
        prefix_only: bool,
        overlap_tiers: Collection[str],
    ) -> list[_Option]:
        """Every candidate plan: ``[k]`` loads hit blocks ``[0, k)`` (``[total]`` loads all,
        ``[0]`` none), then, unless ``prefix_only``, those that recompute ``[0, j)`` and load
        the rest."""
        prefill = self.prefill
        total = len(costs.tiers)

        def compute(start: int, end: int) -> float:
            est = prefill.recompute_s(start, end, chunk_tokens)
            return 0.0 if est is None else est

        per_block = [t + s for t, s in zip(costs.transfer_s, costs.span_latency_s)]
        # Leading loads [0, k): a span cut short still pays its round trip.
        head = [0.0, *_cumsum(per_block)]
        # Trailing loads [j, total): the first block loaded pays its span's round trip.
        tail = [*reversed(_cumsum(per_block[::-1])), 0.0]
        tail_latency = [
            tail[j] + (0.0 if j == total or costs.span_latency_s[j] else costs.latency_s[j])
            for j in range(total + 1)
        ]
        options: list[_Option] = []
        for k in range(total + 1):
            begin = hit_start + k * block_size
            rest = compute(begin, num_tokens)
            # The plan that loads all is the baseline every other is held against: whether
            # its suffix was measured does not decide a refusal.
            covered = k == total or prefill.covers(begin, num_tokens, chunk_tokens)
            options.append(_Option(head[k] + rest, 0, k, rest, covered))
        if prefix_only:
            return options
        # Loading all first computes the same suffix as every plan below: its estimate's
        # error is the same on both sides, and only the recomputed head needs measuring.
        suffix_s = options[total].compute_s
        # hidden[j]: the tail [j, total) can be read beside the head's compute. A tier faster
        # than compute (a local Redis) is the cores' work as much as the forward's, and stays
        # counted in series.
        hidden = [bool(overlap_tiers)] * (total + 1)
        if overlap_tiers:
            block_compute_s = compute(hit_start, hit_start + total * block_size) / total
            for j in range(total - 1, -1, -1):
                beside = costs.tiers[j] in overlap_tiers and per_block[j] >= block_compute_s
                hidden[j] = hidden[j + 1] and beside
        for j in range(1, total):
            early = compute(hit_start, hit_start + j * block_size)
            both = max(early, tail_latency[j]) if hidden[j] else early + tail_latency[j]
            covered = prefill.covers(hit_start, hit_start + j * block_size, chunk_tokens)
            options.append(_Option(both + suffix_s, j, total, early + suffix_s, covered))
        return options

    def observe_outcome(self, plan: LoadPlan, actual_s: float, *, request_id: str = "") -> None:
        """Learn from a refusal's real cost, once the request's prompt is computed.

        Logs the real time against the estimate at INFO and feeds the error to
        ``prefill.error`` (a refusal that cost more than estimated raises the margin later
        refusals are held to). Plans that refused nothing teach nothing here and are ignored.

        Args:
            plan: the plan the request ran under (``plan()``'s answer).
            actual_s: seconds of the forward steps that computed the request's prompt: what
                ``plan.est_compute_s`` estimates. Steps shared with other requests count
                whole; that overstates the cost, which only makes later refusals rarer.
            request_id: names the request in the log line.
        """
        estimated = plan.est_compute_s
        if not plan.refused or estimated is None:
            return
        if not (math.isfinite(actual_s) and actual_s > 0):
            return
        before = self.prefill.error.margin
        ratio = self.prefill.error.observe(estimated, actual_s)
        if ratio is None:
            return
        log.info(
            "cost model: request %s recomputed %d hit blocks: its prompt took %.4f s against "
            "%.4f s estimated (x%.2f); margin %.2f -> %.2f",
            request_id or "?",
            plan.num_recompute_blocks,
            actual_s,
            estimated,
            ratio,
            before,
            self.prefill.error.margin,
        )

    def _stale(self, tier: str) -> bool:
        rate = self.rates.get(tier)
        return rate is not None and self._clock() - rate.last_read_s >= self.probe_interval_s


def _log_refusal(plan: LoadPlan, request_id: str) -> None:
    log.info(
        "cost model: request %s recomputes %d of %d hit blocks: estimated %.4f s "
        "(%.4f s of compute) against %.4f s to load them all; margin %.2f",
        request_id or "?",
        plan.num_recompute_blocks,
        plan.num_hit_blocks,
        plan.est_ttft_s,
        plan.est_compute_s,
        plan.est_load_all_s,
        plan.margin,
    )


def _cumsum(values: list[float]) -> list[float]:
    out: list[float] = []
    acc = 0.0
    for v in values:
        acc += v
        out.append(acc)
    return out
