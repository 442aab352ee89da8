"""Load or recompute: a per-request choice from measured tier speeds and prefill speed.

A hit in a slow but healthy tier (a sidecar over a thin link, a far Redis, a cold disk) can take
longer to read than the engine takes to compute the same tokens; on a GPU with fast prefill that
is the common case. So a prefix hit is not loaded blindly: for each split point ``k`` of the hit
(load blocks ``[0, k)``, recompute the rest with the prompt's suffix) the estimated TTFT is

    sum of reads of blocks [0, k), each tier span one call: latency + bytes x seconds-per-byte
    + prefill of tokens [cached + k x block_size, prompt end), chunk by chunk

and the smallest wins. The other shape recomputes a leading run ``[0, j)`` and loads the rest;
an engine that reads that tail while it computes the head (ours, from a tier whose reads wait
on a link slower than its compute) pays the longer of the two instead of their sum.

Both sides are measured, never configured: ``TierRates`` keeps a moving average of each tier's
round-trip latency (from lookups) and read time per byte (from real gets), ``CopyRate`` the time
per byte of the engine's own copy of what a tier read into its KV memory (a GPU's, across PCIe:
on an H200, 72 ms for the 189 MB a 47 ms disk read had brought in), and
``PrefillModel`` fits a step's seconds as ``c0 + c1 x tokens + c2 x attention`` (attention = the
sum over sequences of new tokens x mean context, the quadratic part) from the engine's own
forward passes. Until a side has been measured the plan loads everything, as before.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

# Weight of a new sample in a tier's moving averages: a link whose speed changed is trusted
# again after two or three reads, one odd read does not flip decisions.
_ALPHA = 0.5
# Within this fraction of the best estimate, or this many seconds of it, the plan loads more
# rather than less: a recompute costs compute other requests could use, and a gain smaller
# than the estimates' own noise (a millisecond: one scheduler tick on a busy host) is no
# reason to spend it. Only while the time a load adds is less than the compute it frees: on a
# thin link one block can take longer to fetch than to recompute, and 2% of a long prompt's
# TTFT is worth many such blocks (measured: one 16-token block over 10 MB/s, ~80 ms against
# ~20 ms of recompute, put on every thin-link request).
_PREFER_LOAD = 0.02
_PREFER_LOAD_S = 0.001


def _log_average(old: float | None, sample: float) -> float:
    """One step of a moving average in log space (``sample`` alone where there is no ``old``)."""
    if not old:
        return sample
    return math.exp(math.log(old) + _ALPHA * (math.log(sample) - math.log(old)))


@dataclass(frozen=True, slots=True)
class TierRate:
    """What one tier's reads cost, as measured.

    Args:
        latency_s: moving average of one round trip (a lookup).
        seconds_per_byte: moving (geometric) average of read time per payload byte, latency
            taken out.
        num_reads: reads that fed ``seconds_per_byte``.
        last_read_s: when the last read was seen (``time.monotonic``); 0 for never.
    """

    latency_s: float
    seconds_per_byte: float | None
    num_reads: int
    last_read_s: float

    def read_s(self, nbytes: int, calls: int = 1) -> float | None:
        """Estimated seconds to read ``nbytes`` in ``calls`` round trips (``None``: no reads
        measured yet)."""
        if self.seconds_per_byte is None:
            return None
        return calls * self.latency_s + nbytes * self.seconds_per_byte

    def snapshot(self) -> dict[str, Any]:
        spb = self.seconds_per_byte
        return {
            "latency_ms": round(1e3 * self.latency_s, 4),
            "read_gbps": round(1e-9 / spb, 4) if spb else None,
            "reads": self.num_reads,
        }


class TierRates:
    """Moving averages of every tier's latency and read speed. Thread-safe.

    Args:
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._rates: dict[str, TierRate] = {}

    def observe_latency(self, tier: str, seconds: float) -> None:
        """One metadata round trip to ``tier`` took ``seconds``."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        with self._lock:
            old = self._rates.get(tier)
            if old is None:
                self._rates[tier] = TierRate(seconds, None, 0, 0.0)
            else:
                latency = old.latency_s + _ALPHA * (seconds - old.latency_s)
                self._rates[tier] = TierRate(
                    latency, old.seconds_per_byte, old.num_reads, old.last_read_s
                )

    def observe_read(self, tier: str, nbytes: int, seconds: float, calls: int = 1) -> None:
        """A read of ``nbytes`` payload from ``tier`` in ``calls`` round trips took
        ``seconds``. Reads that returned nothing teach nothing about bandwidth and are ignored."""
        if nbytes <= 0 or not (math.isfinite(seconds) and seconds >= 0):
            return
        with self._lock:
            old = self._rates.get(tier) or TierRate(0.0, None, 0, 0.0)
            # What the round trips do not explain is transfer; never below a tenth of the read,
            # so a latency estimate a little too high cannot make a tier look infinitely fast.
            transfer = max(seconds - calls * old.latency_s, 0.1 * seconds, 1e-12)
            sample = transfer / nbytes
            # Averaged in log space: speeds span orders of magnitude (a thin link is 100x a
            # fast one), and a plain mean of seconds per byte would let one slow read outweigh
            # many fast ones long after the link recovered.
            spb = _log_average(old.seconds_per_byte, sample)
            self._rates[tier] = TierRate(old.latency_s, spb, old.num_reads + 1, self._clock())

    def get(self, tier: str) -> TierRate | None:
        with self._lock:
            return self._rates.get(tier)

    def measured(self) -> dict[str, TierRate]:
        """Every tier with at least one measured read, by name (to hand to another process)."""
        with self._lock:
            return {k: v for k, v in self._rates.items() if v.seconds_per_byte is not None}

    def adopt(self, tier: str, rate: TierRate) -> None:
        """Take another process's measurement of ``tier`` (the process that reads it), as read
        now by this process's clock."""
        if rate.seconds_per_byte is None or not (
            math.isfinite(rate.latency_s) and math.isfinite(rate.seconds_per_byte)
        ):
            return
        with self._lock:
            self._rates[tier] = TierRate(
                max(rate.latency_s, 0.0),
                max(rate.seconds_per_byte, 0.0),
                rate.num_reads,
                self._clock(),
            )

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per tier: ``latency_ms``, ``read_gbps`` (``None`` until a read) and ``reads``."""
        with self._lock:
            rates = dict(self._rates)
        return {name: rate.snapshot() for name, rate in sorted(rates.items())}


class CopyRate:
    """Seconds per byte of an engine's copies of restored blocks into its KV memory, as a
    moving (geometric) average of the copies it times. A tier that reads straight into that
    memory (the disk tier into a CPU pool) copies nothing, and the estimate stays ``None``:
    no cost. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spb: float | None = None
        self._count = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        """A copy of ``nbytes`` took ``seconds``."""
        if nbytes <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        sample = seconds / nbytes
        with self._lock:
            self._spb = _log_average(self._spb, sample)
            self._count += 1

    @property
    def seconds_per_byte(self) -> float | None:
        with self._lock:
            return self._spb

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            spb, count = self._spb, self._count
        return {"copy_gbps": round(1e-9 / spb, 4) if spb else None, "copies": count}


class PrefillModel:
    """Seconds of one forward step as ``c0 + c1 x tokens + c2 x attention``, fitted online by
    least squares with exponential forgetting. Thread-safe.

    ``attention`` is the sum over the step's sequences of new tokens x (cached context + half
    the new tokens): the work of causal attention over the context, quadratic in prompt length.

    Args:
        decay: weight kept by past samples at each new one (0.98: the last ~50 steps count).
        min_samples: steps to see before estimating anything.
    """

    _FEATURES = 3

    def __init__(self, *, decay: float = 0.98, min_samples: int = 2) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self._decay = decay
        self._min_samples = min_samples
        self._lock = threading.Lock()
        n = self._FEATURES
        self._xtx = [[0.0] * n for _ in range(n)]
        self._xty = [0.0] * n
        self._yty = 0.0
        self._count = 0
        self._coef: tuple[float, float, float] | None = None

    @staticmethod
    def attention_work(num_new: int, num_cached: int) -> float:
        """The ``attention`` feature of one sequence computing ``num_new`` tokens after
        ``num_cached``."""
        return num_new * (num_cached + num_new / 2)

    def observe(self, num_tokens: int, attention: float, seconds: float) -> None:
        """One step computed ``num_tokens`` with ``attention`` work in ``seconds``."""
        if num_tokens <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        x = (1.0, float(num_tokens), float(attention))
        with self._lock:
            d = self._decay
            for i in range(self._FEATURES):
                for j in range(self._FEATURES):
                    self._xtx[i][j] = d * self._xtx[i][j] + x[i] * x[j]
                self._xty[i] = d * self._xty[i] + x[i] * seconds
            self._yty = d * self._yty + seconds * seconds
            self._count += 1
            self._coef = self._fit() if self._count >= self._min_samples else None

    def _fit(self) -> tuple[float, float, float] | None:
        # Least squares with every coefficient >= 0 (time never shrinks with more work): solve
        # on each subset of features and keep the best non-negative fit. Three features make
        # seven subsets of at most 3x3 systems, microseconds per step.
        best: tuple[float, tuple[float, float, float]] | None = None
        for mask in range(1, 1 << self._FEATURES):
            idx = [i for i in range(self._FEATURES) if mask >> i & 1]
            sol = _solve([[self._xtx[i][j] for j in idx] for i in idx], [self._xty[i] for i in idx])
            if sol is None or any(c < 0 for c in sol):
                continue
            coef = [0.0] * self._FEATURES
            for i, c in zip(idx, sol):
                coef[i] = c
            resid = self._yty - 2 * sum(c * self._xty[i] for i, c in enumerate(coef))
            resid += sum(
                coef[i] * coef[j] * self._xtx[i][j]
                for i in range(self._FEATURES)
                for j in range(self._FEATURES)
            )
            if best is None or resid < best[0] - 1e-15:
                best = (resid, (coef[0], coef[1], coef[2]))
        return None if best is None else best[1]

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """``(c0, c1, c2)``, or ``None`` before enough steps were seen."""
        with self._lock:
            return self._coef

    def recompute_s(self, start: int, end: int, chunk_tokens: int) -> float | None:
        """Estimated seconds to compute tokens ``[start, end)`` with ``[0, start)`` cached, in
        steps of at most ``chunk_tokens`` (``None`` before enough steps were seen)."""
        coef = self.coefficients
        if coef is None:
            return None
        c0, c1, c2 = coef
        total = 0.0
        pos = start
        while pos < end:
            n = min(chunk_tokens, end - pos)
            total += c0 + c1 * n + c2 * self.attention_work(n, pos)
            pos += n
        return total

    def snapshot(self) -> dict[str, Any]:
        coef = self.coefficients
        return {
            "samples": self._count,
            "step_s": None if coef is None else round(coef[0], 6),
            "s_per_token": None if coef is None else coef[1],
            "s_per_attention": None if coef is None else coef[2],
        }


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; ``None`` for a singular system."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max((abs(v) for row in a for v in row), default=0.0)
    if scale == 0:
        return None
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][c] * out[c] for c in range(r + 1, n))) / m[r][r]
    return out


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
            load all), ``disabled`` (always load), ``probe`` (a stale tier read to refresh it).
        est_ttft_s: estimated seconds to first token for the chosen plan (``None`` unmeasured).
        est_load_all_s: the same estimate had everything been loaded.
        est_recompute_all_s: the same had nothing been loaded (what a miss would cost).
    """

    num_hit_blocks: int
    load_start: int
    load_end: int
    reason: str
    est_ttft_s: float | None = None
    est_load_all_s: float | None = None
    est_recompute_all_s: float | None = None

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


class CostModel:
    """Plans loads from ``TierRates`` and a ``PrefillModel``.

    Two shapes of plan are weighed: load a leading run of the hit and recompute the rest with
    the suffix, or recompute a leading run and load the rest. Every block costs the same to
    load, but a later block costs more to compute (it attends to more context), so when a
    link is a little slower than compute the best plan recomputes the early blocks and loads
    the late ones. An engine that can only take a loaded prefix (vLLM's connector reports a
    number of leading tokens) asks for the first shape only.

    Args:
        rates: the store's measured tier rates.
        prefill: the engine's measured prefill speed.
        copy: the engine's measured copy into its KV memory, added to every loaded block;
            ``None`` where restores land in place.
        enabled: ``False`` always loads every hit (the behaviour before the model).
        probe_interval_s: a tier the plans have avoided for this long gets one block read
            anyway, so that a link that became fast again is noticed.
        clock: monotonic seconds.
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
    ) -> None:
        self.rates = rates
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
        """
        total = sum(n for _, n in spans)
        if not self.enabled:
            return LoadPlan.load_all(total, "disabled")
        if total == 0:
            return LoadPlan(0, 0, 0, "model")
        tiers: list[str] = []  # the tier of each hit block
        per_block: list[float] = []  # transfer seconds of each hit block
        latency: list[float] = []  # round-trip seconds of each block's span
        span_start: list[bool] = []
        copy_spb = self.copy.seconds_per_byte if self.copy is not None else None
        copy_s = block_bytes * copy_spb if copy_spb is not None else 0.0
        for tier, n in spans:
            rate = self.rates.get(tier)
            if rate is None or rate.seconds_per_byte is None:
                return LoadPlan.load_all(total, "unmeasured")
            for i in range(n):
                tiers.append(tier)
                per_block.append(block_bytes * rate.seconds_per_byte + copy_s)
                latency.append(rate.latency_s)
                span_start.append(i == 0)

        def compute(start: int, end: int) -> float:
            est = self.prefill.recompute_s(start, end, chunk_tokens)
            return 0.0 if est is None else est

        if self.prefill.coefficients is None:
            return LoadPlan.load_all(total, "unmeasured")
        hit_start = cached_tokens
        # Leading loads [0, k): a span cut short still pays its round trip.
        head = [0.0]
        for i in range(total):
            head.append(head[-1] + per_block[i] + (latency[i] if span_start[i] else 0.0))
        # Trailing loads [j, total): the first block loaded pays its span's round trip.
        tail = [0.0] * (total + 1)
        for j in range(total - 1, -1, -1):
            tail[j] = tail[j + 1] + per_block[j] + (latency[j] if span_start[j] else 0.0)
        tail_latency = [
            tail[j] + (0.0 if j == total or span_start[j] else latency[j]) for j in range(total + 1)
        ]
        # (estimate, load_start, load_end, compute seconds of the plan)
        options: list[tuple[float, int, int, float]] = []
        for k in range(total + 1):
            rest = compute(hit_start + k * block_size, num_tokens)
            options.append((head[k] + rest, 0, k, rest))
        if not prefix_only:
            suffix_s = compute(hit_start + total * block_size, num_tokens)
            # hidden[j]: the tail [j, total) can be read beside the head's compute. A tier
            # faster than compute (a local Redis) is the cores' work as much as the forward's,
            # and stays counted in series.
            hidden = [bool(overlap_tiers)] * (total + 1)
            if overlap_tiers:
                block_compute_s = compute(hit_start, hit_start + total * block_size) / total
                for j in range(total - 1, -1, -1):
                    beside = tiers[j] in overlap_tiers and per_block[j] >= block_compute_s
                    hidden[j] = hidden[j + 1] and beside
            for j in range(1, total):
                early = compute(hit_start, hit_start + j * block_size)
                both = max(early, tail_latency[j]) if hidden[j] else early + tail_latency[j]
                options.append((both + suffix_s, j, total, early + suffix_s))
        best, _, _, best_compute = min(options)
        # Among plans close enough to the best whose extra time the compute they free pays
        # for, the one that loads the most.
        close = max(best * (1 + _PREFER_LOAD), best + _PREFER_LOAD_S)
        est, start, end, _ = max(
            (
                o
                for o in options
                if o[0] <= close and o[0] - best <= max(best_compute - o[3], 0.0) + _PREFER_LOAD_S
            ),
            key=lambda o: (o[2] - o[1], -o[0]),
        )
        reason = "model"
        # A tier avoided for long gets one block read, to notice a link that recovered.
        stale = end < total and self._stale(tiers[end])
        if stale:
            end, reason = end + 1, "probe"
        elif start > 0 and self._stale(tiers[start - 1]):
            start, reason = start - 1, "probe"
        return LoadPlan(total, start, end, reason, est, options[total][0], options[0][0])

    def _stale(self, tier: str) -> bool:
        rate = self.rates.get(tier)
        return rate is not None and self._clock() - rate.last_read_s >= self.probe_interval_s
