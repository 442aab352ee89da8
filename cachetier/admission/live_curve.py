"""The capacity curve live: per tier, the hit ratio it would have at other capacities.

``LiveCurve`` replays the store's lookups, as they arrive, through keys-only LRU caches of
``CAPACITY_FACTORS`` times each tier's capacity, on a hashed sample of keys (SHARDS: the
``KeySample`` the adaptive policy's ghost tiers use). A lookup is one request: its hit at a
size is the leading run of its sampled keys that size's ghost holds, then every sampled key is
stored or refreshed in order, the definition of ``cachetier report``'s capacity curve; a put's
keys are stored or refreshed too (a tier holds what it is given, looked up first or not, and a
put of a block it holds marks it used). So a
tier's point at factor 1 is what an LRU cache of its size alone would hit on the lookups (for
the largest tier of a write-through stack, the store's own block hit ratio), and the points at
2 and 4 say what more capacity would buy.

Counts are since the store opened (the ghosts start empty, as the tiers did not): the ratios
are of every lookup so far. Hits are read back as the whole stream's with SHARDS's
adjustment (``adjusted_ratio``); at rate 1 they are the exact LRU hit ratios.

The ghosts of every tier sampled at one rate are one ``SegmentedStack`` (LRU caches of several
sizes are the tops of one recency stack): a sampled key costs one lookup and one move, not one
of each per ghost, which keeps the curve within a percent of a sidecar's throughput
(``python -m benchmarks.live_curve``).

Memory, fixed at construction: per tier, the rate is chosen so that the largest ghost (4x)
holds at most ``sample_keys`` keys; tiers sampled at one rate share their keys, so the stacks
hold at most ``sample_keys`` keys a tier, of ``KEY_BYTES`` each (``nbytes``); a key is kept as
at most its first ``MAX_KEY_BYTES`` bytes. Thread-safe (one lock); a lookup costs one hash
test per key and a few dictionary operations per sampled key and sample.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from cachetier.admission.adaptive import Adaptive
from cachetier.admission.policy import AdmissionPolicy
from cachetier.admission.sample import (
    SAMPLE_MODULUS,
    KeySample,
    adjusted_ratio,
    sample_rate_for,
)
from cachetier.admission.simulation import START_CHOICE
from cachetier.admission.sketch import MIN_KEY_BYTES
from cachetier.admission.stack import SegmentedStack
from cachetier.util.checks import positive_int

CAPACITY_FACTORS = (0.5, 1.0, 2.0, 4.0)
"""The sizes each tier is simulated at, as multiples of its capacity."""
KEY_BYTES = 260
"""Bytes a ghost key takes: its stack's ``OrderedDict`` entry and segment entry (195, measured
with ``tracemalloc`` over 200,000 keys) and the key object."""
MAX_KEY_BYTES = 32
"""A key is kept as at most its first 32 bytes (a block key is a 32-byte digest), whatever a
caller sent."""
DEFAULT_SAMPLE_KEYS = 65_536
"""Keys the largest ghost of a tier holds at most (at most about 17 MiB of ghosts a tier):
sized so that the live curve stays within a point of block hit ratio of the exact one on the
shipped conversation trace at the report's disk capacities (``python -m benchmarks.live_curve``;
a quarter of it strays past a point there)."""


def _kept(sample: KeySample, keys: Sequence[bytes]) -> list[bytes]:
    """The keys ``sample`` keeps, each at most ``MAX_KEY_BYTES`` long (all of them at rate 1)."""
    if sample.threshold >= SAMPLE_MODULUS:
        return [k[:MAX_KEY_BYTES] for k in keys]
    keeps = sample.keeps
    return [k[:MAX_KEY_BYTES] for k in keys if keeps(k)]


def factor_label(factor: float) -> str:
    """A capacity factor as the metrics and reports write it: ``0.5``, ``1``, ``2``, ``4``."""
    return f"{factor:g}"


class _TierCurve:
    """One tier's points: its ghost capacities (in sampled keys) and their hit counts, read
    from the stack of its sample (under ``LiveCurve``'s lock)."""

    def __init__(self, capacity_blocks: int, block_bytes: int, sample_keys: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        largest = max(1, round(max(CAPACITY_FACTORS) * capacity_blocks))
        self.sample = KeySample(sample_rate_for(sample_keys, largest))
        self.capacities = [
            self.sample.scaled(max(1, round(f * capacity_blocks))) for f in CAPACITY_FACTORS
        ]
        self.indexes: list[int] = []  # each capacity's place in its stack's bounds
        self.hits = [0] * len(CAPACITY_FACTORS)
        self.num_lookups = 0
        self.num_blocks = 0
        self.num_sampled = 0

    def count(self, num_keys: int, num_sampled: int, runs: Sequence[int]) -> None:
        """A lookup of ``num_keys`` keys, ``num_sampled`` of them sampled, whose leading runs
        at the stack's bounds are ``runs``."""
        self.num_lookups += 1
        self.num_blocks += num_keys
        self.num_sampled += num_sampled
        hits = self.hits
        for point, index in enumerate(self.indexes):
            hits[point] += runs[index]

    def snapshot(self) -> dict[str, Any]:
        rate = self.sample.rate
        return {
            "capacity_blocks": self.capacity_blocks,
            "block_bytes": self.block_bytes,
            "sample_rate": rate,
            "num_lookups": self.num_lookups,
            "num_blocks": self.num_blocks,
            "num_sampled_blocks": self.num_sampled,
            "hit_ratio": {
                factor_label(f): adjusted_ratio(h, self.num_sampled, self.num_blocks, rate)
                for f, h in zip(CAPACITY_FACTORS, self.hits)
            },
        }


class _SampleStack:
    """The tiers of one sample and the one stack that holds all their ghosts."""

    def __init__(self, sample: KeySample, curves: list[_TierCurve]) -> None:
        self.sample = sample
        self.curves = curves
        self.stack = SegmentedStack([c for curve in curves for c in curve.capacities])
        for curve in curves:
            curve.indexes = [self.stack.index_of(c) for c in curve.capacities]


class LiveCurve:
    """Each tier's LRU hit ratio at ``CAPACITY_FACTORS`` times its capacity, on the lookups.

    Args:
        tier_bytes: capacity in bytes of each tier by name; tiers of unknown capacity are left
            out (no curve).
        sample_keys: keys the largest ghost of a tier holds at most.
        block_bytes: bytes of a block, to count capacities in blocks; ``None``: the first
            block ``stored`` is told of (lookups before it wait, up to ``sample_keys`` keys,
            and are replayed then; past that they are not counted).
    """

    def __init__(
        self,
        tier_bytes: Mapping[str, int],
        *,
        sample_keys: int = DEFAULT_SAMPLE_KEYS,
        block_bytes: int | None = None,
    ) -> None:
        positive_int("sample_keys", sample_keys)
        self.sample_keys = sample_keys
        self._tier_bytes = {t: b for t, b in tier_bytes.items() if b and b > 0}
        self._lock = threading.Lock()
        self._tiers: dict[str, _TierCurve] = {}
        self._stacks: list[_SampleStack] = []  # one per sample, the widest first
        self._widest: KeySample | None = None  # the sample every other one is a subset of
        self._pending: list[tuple[int, list[bytes]]] = []  # lookups before the block size
        self._num_pending_keys = 0
        self.num_uncounted_lookups = 0  # before the block size, past the pending bound
        if block_bytes is not None:
            self._build(block_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes the ghosts may take at most (0 before the block size is known)."""
        with self._lock:
            keys = sum(max(s.stack.bounds) for s in self._stacks)
        return keys * KEY_BYTES

    def observe(self, keys: Sequence[bytes]) -> None:
        """Replay one lookup's keys through every tier's ghosts: count its hits, then store.

        Args:
            keys: the lookup's block keys, in prompt order (keys shorter than a digest are
                left out: no block, and as an unsampled reference it would read as a hit).
        """
        valid = [k for k in keys if len(k) >= MIN_KEY_BYTES]
        widest = self._widest
        if widest is None:
            self._wait(len(valid), [k[:MAX_KEY_BYTES] for k in valid])
            return
        if not self._tiers:
            return
        kept = _kept(widest, valid)
        with self._lock:
            self._feed(len(valid), kept, count=True)

    def stored(self, keys: Sequence[bytes], block_bytes: int) -> None:
        """Store or refresh one put's keys in every tier's ghosts (a tier keeps what it is
        given, whether or not a lookup asked for it first: a generated block, say).

        Args:
            keys: the put's block keys, in order.
            block_bytes: bytes of one of its blocks (``KVBlock.nbytes``): the first one told
                sizes the ghosts.
        """
        if self._widest is None:
            self._build(block_bytes)
        widest = self._widest
        if widest is None or not self._tiers:
            return
        kept = _kept(widest, [k for k in keys if len(k) >= MIN_KEY_BYTES])
        if kept:
            with self._lock:
                self._feed(0, kept, count=False)

    def _wait(self, num_keys: int, keys: list[bytes]) -> None:
        with self._lock:
            if self._widest is not None:  # built meanwhile
                self._feed(num_keys, [k for k in keys if self._widest.keeps(k)], count=True)
            elif self._num_pending_keys + num_keys <= self.sample_keys:
                self._pending.append((num_keys, keys))
                self._num_pending_keys += num_keys
            else:
                self.num_uncounted_lookups += 1

    def _build(self, nbytes: int) -> None:
        """Size the ghosts in blocks of ``nbytes`` and replay the lookups that waited."""
        if nbytes <= 0:
            return
        with self._lock:
            if self._widest is not None:
                return
            tiers = {
                tier: _TierCurve(capacity // nbytes, nbytes, self.sample_keys)
                for tier, capacity in self._tier_bytes.items()
                if capacity >= nbytes
            }
            # Widest sample first: each narrower one keeps a subset of its keys (same hash).
            self._tiers = dict(sorted(tiers.items(), key=lambda kv: -kv[1].sample.threshold))
            by_sample: dict[int, list[_TierCurve]] = {}
            for curve in self._tiers.values():
                by_sample.setdefault(curve.sample.threshold, []).append(curve)
            self._stacks = [_SampleStack(curves[0].sample, curves) for curves in by_sample.values()]
            self._widest = self._stacks[0].sample if self._stacks else KeySample(1.0)
            pending, self._pending, self._num_pending_keys = self._pending, [], 0
            for num_keys, keys in pending:
                self._feed(num_keys, [k for k in keys if self._widest.keeps(k)], count=True)

    def _feed(self, num_keys: int, kept: list[bytes], *, count: bool) -> None:
        """``kept`` (the widest sample's keys) into each sample's stack (under the lock)."""
        widest = self._widest
        for group in self._stacks:
            sample = group.sample
            mine = kept if sample is widest else [k for k in kept if sample.keeps(k)]
            if count:
                runs = group.stack.leading_runs(mine)
                for curve in group.curves:
                    curve.count(num_keys, len(mine), runs)
            group.stack.use(mine)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per tier with a curve: its capacity and sample, the lookups counted, and
        ``hit_ratio`` by capacity factor label (``"0.5"``, ``"1"``, ``"2"``, ``"4"``)."""
        with self._lock:
            return {tier: curve.snapshot() for tier, curve in self._tiers.items()}


def admission_choices(policy: AdmissionPolicy, tiers: Sequence[str]) -> dict[str, str]:
    """The fixed policy each filtered tier (one not in ``admission_cheap_tiers``) admits as now.

    Args:
        policy: the store's admission policy.
        tiers: the store's tier names, fastest first (the first one is never filtered).

    Returns:
        tier name -> ``all``, ``second_hit`` or ``tinylfu``: a fixed policy's own name; the
        adaptive policy's current choice (``all`` for a tier it has not judged yet or whose
        capacity it does not know).
    """
    cheap = policy.config.cheap_tiers
    filtered = [t for t in tiers[1:] if t not in cheap]
    if isinstance(policy, Adaptive):
        chosen = policy.choices()
        return {t: chosen.get(t, START_CHOICE) for t in filtered}
    return dict.fromkeys(filtered, policy.name)
