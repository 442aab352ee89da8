"""The capacity curve from a hashed sample of keys (SHARDS), and the error bound it is sized for.

A replay of the whole trace per policy and capacity costs the whole trace each time. SHARDS
(Waldspurger et al., FAST 2015) replays only the references to a spatially hashed sample of
keys (``cachetier.admission.sample.KeySample``: a key is in or out in every request) and reads
the full cache's hit ratio off them. A prefix trace has keys in nearly every request (a system
prompt's blocks, a popular document's): in or out of the sample as a whole, one such key moves
the estimate by its whole share. So the sample is stratified: a key with at least ``HOT_REFS``
references in the trace is always kept and stands for itself; every other key is kept at rate
``1 / m`` by its hash and stands for ``m`` keys. Each kept block's payload is its weight in
bytes, so the replayed caches (``ReplayCache``s, of the whole cache's capacity in bytes) give a
kept cold key the room of the ``m`` keys it stands for. A request's hit is the weight of the
leading run of its kept keys the cache holds, over the weight of all of them; tokens likewise
over the keys at reusable positions (a whole block before the prompt's last token).

The rate is chosen for an error bound ``max_error`` (absolute, in block hit ratio, at any point
of the curve): the sample keeps about ``0.6 / max_error**2`` of the cold keys (24,000 for half a
point), a size at which LRU's and Belady's curves and the fixed admission policies' replays
stay under the bound on the shipped conversation trace and the admission benchmark's RAG trace
(``python -m benchmarks.admission`` measures it against the exact replay); the adaptive
policy's ghost simulation is fed as on the whole trace (``cachetier.report.admission_sampled``),
so its replay stays as close. Policies not in ``SAMPLED_POLICIES``, a trace with
fewer keys, and every trace with ``rate=1`` (``--exact``) are replayed whole: every formula
here then reduces to the plain counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from cachetier.admission.sample import KeySample
from cachetier.record import KVBlock
from cachetier.report.replay import HitRatios, ReplayTrace, usable_hit

DEFAULT_MAX_ERROR = 0.005
"""The error bound of the default (sampled) curve: half a point of block hit ratio."""
HOT_REFS = 16
"""References that make a key hot: always in the sample, standing for itself."""
SAMPLED_POLICIES = ("lru", "belady")
"""Curve policies replayed on the sample: stack algorithms, whose sample with scaled room holds
what the whole cache holds (SHARDS). S3-FIFO and ARC size their queues in keys, which a
weighted sample miscounts, so they are replayed on the whole trace."""


def sample_rate(num_cold_keys: int, max_error: float) -> float:
    """The rate whose sample keeps about ``0.6 / max_error**2`` of the cold keys.

    Args:
        num_cold_keys: distinct keys of the trace with fewer than ``HOT_REFS`` references.
        max_error: the error bound, in (0, 1).

    Returns:
        ``1 / m`` for a whole ``m >= 1``; 1.0 (the exact replay) for a trace with fewer keys.
    """
    if not 0 < max_error < 1:
        raise ValueError(f"max_error must be in (0, 1), got {max_error!r}")
    need = 0.6 / max_error**2
    return 1.0 / max(1, int(num_cold_keys // need))


@dataclass(frozen=True, slots=True)
class SampledTrace:
    """A trace cut down to the references of its sampled keys, and the counts of the whole.

    Args:
        whole: the trace itself (the replays of policies SHARDS does not fit read it).
        trace: per request, only its kept keys, each block's payload its weight in bytes (the
            requests as they were).
        rate: the cold keys' sampling rate (1.0: every key, the exact replay).
        weight: the weight of a kept cold key (``round(1 / rate)``).
        cum_weights: per request, the running total of its kept keys' weights.
        usable: per request, how many of its kept keys are at reusable positions (a leading
            count: positions only grow along a request).
        num_refs: block references of the whole trace.
        num_kept_refs: of those, to kept keys.
        num_keys: distinct keys of the whole trace.
        num_kept_keys: of those, kept.
        num_usable_refs: references at reusable positions.
        num_tokens: prompt tokens of the whole trace.
    """

    whole: ReplayTrace
    trace: ReplayTrace
    rate: float
    weight: int
    cum_weights: tuple[tuple[int, ...], ...]
    usable: tuple[int, ...]
    num_refs: int
    num_kept_refs: int
    num_keys: int
    num_kept_keys: int
    num_usable_refs: int
    num_tokens: int


def count_refs(trace: ReplayTrace) -> Counter[bytes]:
    """References of each key of ``trace``."""
    return Counter(key for keys in trace.keys for key in keys)


def sample_trace(
    trace: ReplayTrace, rate: float, refs: Counter[bytes] | None = None
) -> SampledTrace:
    """Keep the hot keys and a hashed ``rate`` of the others.

    Args:
        trace: the keyed trace.
        rate: in (0, 1], rounded to ``1 / m``; 1.0 keeps every reference.
        refs: ``count_refs(trace)``, where the caller has it already.

    Returns:
        The sampled trace.
    """
    weight = max(1, round(1 / rate))
    if weight == 1:
        return _whole(trace)
    sample = KeySample(1 / weight)
    refs = refs if refs is not None else count_refs(trace)
    size = trace.block_size
    block_of: dict[bytes, KVBlock] = {}
    keys_out, blocks_out, cum_out, usable_out = [], [], [], []
    num_usable = 0
    for request, keys, blocks in zip(trace.requests, trace.keys, trace.blocks):
        limit = max(0, request.input_length - 1) // size  # reusable positions: [0, limit)
        num_usable += min(limit, len(keys))
        kept, weights = [], []
        for position, (key, block) in enumerate(zip(keys, blocks)):
            hot = refs[key] >= HOT_REFS
            if hot or sample.keeps(key):
                kept.append((position, key, _weighted(block_of, block, 1 if hot else weight)))
                weights.append(1 if hot else weight)
        keys_out.append(tuple(key for _, key, _ in kept))
        blocks_out.append(tuple(block for _, _, block in kept))
        cum_out.append(tuple(accumulate(weights)))
        usable_out.append(sum(1 for position, _, _ in kept if position < limit))
    return SampledTrace(
        whole=trace,
        trace=ReplayTrace(trace.requests, trace.namespace, tuple(keys_out), tuple(blocks_out)),
        rate=1 / weight,
        weight=weight,
        cum_weights=tuple(cum_out),
        usable=tuple(usable_out),
        num_refs=sum(refs.values()),
        num_kept_refs=sum(len(keys) for keys in keys_out),
        num_keys=len(refs),
        num_kept_keys=len({key for keys in keys_out for key in keys}),
        num_usable_refs=num_usable,
        num_tokens=sum(r.input_length for r in trace.requests),
    )


def _whole(trace: ReplayTrace) -> SampledTrace:
    size = trace.block_size
    usable = tuple(
        min(max(0, r.input_length - 1) // size, len(keys))
        for r, keys in zip(trace.requests, trace.keys)
    )
    return SampledTrace(
        whole=trace,
        trace=trace,
        rate=1.0,
        weight=1,
        cum_weights=tuple(tuple(range(1, len(keys) + 1)) for keys in trace.keys),
        usable=usable,
        num_refs=sum(len(keys) for keys in trace.keys),
        num_kept_refs=sum(len(keys) for keys in trace.keys),
        num_keys=len({key for keys in trace.keys for key in keys}),
        num_kept_keys=len({key for keys in trace.keys for key in keys}),
        num_usable_refs=sum(usable),
        num_tokens=sum(r.input_length for r in trace.requests),
    )


def _weighted(cache: dict[bytes, KVBlock], block: KVBlock, weight: int) -> KVBlock:
    """``block`` with a payload of ``weight`` bytes (one object per key)."""
    if weight == 1:
        return block
    held = cache.get(block.key)
    if held is None:
        held = cache[block.key] = KVBlock(
            block.key, block.fingerprint, "uint8", (weight,), block.num_tokens, bytes(weight)
        )
    return held


@dataclass(frozen=True, slots=True)
class CurvePoint(HitRatios):
    """One point of the capacity curve: a policy at a capacity, estimated from a sample.

    Args:
        policy: eviction policy name or ``"belady"``.
        capacity_blocks: the capacity of the whole trace's cache.
        num_blocks: block references of the trace.
        num_hit_blocks: hit blocks (estimated unless ``sample_rate`` is 1).
        num_tokens: prompt tokens of the trace.
        num_hit_tokens: tokens served from whole hit blocks (estimated likewise).
        sample_rate: the cold keys' sampling rate (1.0: exact).
        elapsed_s: wall time of the replay.
    """

    policy: str
    capacity_blocks: int
    num_blocks: int
    num_hit_blocks: float
    num_tokens: int
    num_hit_tokens: float
    sample_rate: float
    elapsed_s: float


def weight_of(sampled: SampledTrace, request: int, first: int, end: int) -> int:
    """The weight of kept keys ``[first, end)`` of one request."""
    cum = sampled.cum_weights[request]
    if end <= first:
        return 0
    return cum[end - 1] - (cum[first - 1] if first else 0)


def estimate_hits(sampled: SampledTrace, hits: Sequence[int]) -> tuple[float, float]:
    """The whole trace's hit blocks and hit tokens from the sample's per-request leading hits.

    Args:
        sampled: the sampled trace.
        hits: per request, the leading run of its kept keys that hit.

    Returns:
        ``(hit blocks, hit tokens)``; exact counts when the rate is 1.
    """
    hit = hit_usable = total = total_usable = 0
    for i, (h, u) in enumerate(zip(hits, sampled.usable)):
        hit += weight_of(sampled, i, 0, h)
        hit_usable += weight_of(sampled, i, 0, min(h, u))
        total += weight_of(sampled, i, 0, len(sampled.cum_weights[i]))
        total_usable += weight_of(sampled, i, 0, u)
    block_size = sampled.trace.block_size
    if sampled.weight == 1:
        return float(hit), float(hit_usable * block_size)
    blocks = hit / total * sampled.num_refs if total else 0.0
    usable = hit_usable / total_usable * sampled.num_usable_refs if total_usable else 0.0
    return blocks, usable * block_size


def curve_point(
    sampled: SampledTrace, policy: str, capacity: int, hits: Sequence[int], elapsed_s: float
) -> CurvePoint:
    """A replay of the sample as a point of the whole trace's curve.

    Args:
        sampled: the sampled trace.
        policy: the replayed policy.
        capacity: the cache's capacity in blocks (the sample's tiers have it in bytes).
        hits: per request, its kept keys' leading hit run.
        elapsed_s: wall time of the replay.
    """
    blocks, tokens = estimate_hits(sampled, hits)
    return CurvePoint(
        policy,
        capacity,
        sampled.num_refs,
        blocks,
        sampled.num_tokens,
        tokens,
        sampled.rate,
        elapsed_s,
    )


def exact_point(
    trace: ReplayTrace, policy: str, capacity: int, hits: Sequence[int], elapsed_s: float
) -> CurvePoint:
    """A replay of the whole trace as a point of its curve (exact counts).

    Args:
        trace: the keyed trace.
        policy: the replayed policy.
        capacity: the cache's capacity in blocks.
        hits: per request, its leading hit run.
        elapsed_s: wall time of the replay.
    """
    size = trace.block_size
    return CurvePoint(
        policy,
        capacity,
        sum(len(keys) for keys in trace.keys),
        float(sum(hits)),
        sum(r.input_length for r in trace.requests),
        float(sum(usable_hit(r, hit, size)[0] * size for r, hit in zip(trace.requests, hits))),
        1.0,
        elapsed_s,
    )
