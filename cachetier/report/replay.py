"""Replay a Mooncake-format request trace through one cache, and the offline bounds beside it.

Each replay here is of a single cache: a real ``CPUTier`` under one eviction policy, Belady's
offline policy, or an infinite cache; ``benchmarks/policies.py`` and the report's capacity
curve call them. A replay through a hierarchy of tiers, as a report's per-tier figures need, is
``cachetier.report.hierarchy_replay``.

A trace line is one request: ``{"timestamp": ms, "input_length": tokens, "output_length":
tokens, "hash_ids": [...]}``, where ``hash_ids`` are chained prefix-block ids, one per block of
``block_size`` (512) tokens, the last one covering a partial block. Each id gets deterministic
synthetic token ids and, chained as the engine chains them, its real ``cachetier.primitives.keys``
key.

The hit of a request is the leading run of its blocks the cache holds before it is served;
then all its blocks are stored (new ones) or refreshed (held ones) in order. Every replay here
(a ``CPUTier`` under any policy, Belady's offline policy, an infinite cache) uses that
definition, and counts every hash id as a block, partial last block included, as the trace's
own figures do. Token figures take the partial block out: a 512-token block cache can only
reuse whole blocks.
"""

from __future__ import annotations

import gzip
import heapq
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cachetier.primitives.keys import BlockHash, KVLayout, Namespace, block_keys, num_leading_hits
from cachetier.record import KVBlock
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.util.checks import positive_int

BLOCK_SIZE = 512  # tokens per Mooncake hash id
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_PAYLOAD = b"\0"  # every replayed block: capacities count blocks


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Args:
        timestamp_ms: arrival time from the start of the trace.
        input_length: prompt tokens.
        output_length: generated tokens.
        hash_ids: chained prefix-block ids, one per (possibly partial, for the last) block.
    """

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_trace(
    lines: Iterable[str], *, source: str = "<trace>", block_size: int = BLOCK_SIZE
) -> list[TraceRequest]:
    """Parse and validate Mooncake-format JSON lines (blank lines are skipped).

    Args:
        lines: the lines of the trace.
        source: name used in error messages (a path).
        block_size: tokens per hash id; each request must carry ``ceil(input_length /
            block_size)`` ids.

    Returns:
        The requests, in file order.

    Raises:
        ValueError: naming ``source``, the 1-based line number and what is wrong with it.
    """
    requests: list[TraceRequest] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: a request is a JSON object, got {type(obj).__name__}")
        missing = [name for name in _FIELDS if name not in obj]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}")
        for name in _FIELDS[:3]:
            if not _is_count(obj[name]):
                raise ValueError(f"{where}: {name} must be an int >= 0, got {obj[name]!r}")
        ids = obj["hash_ids"]
        if not isinstance(ids, list) or not all(_is_count(h) for h in ids):
            raise ValueError(f"{where}: hash_ids must be a list of ints >= 0")
        expected = -(-obj["input_length"] // block_size)
        if len(ids) != expected:
            raise ValueError(
                f"{where}: input_length {obj['input_length']} needs {expected} hash_ids of "
                f"{block_size} tokens, got {len(ids)}"
            )
        requests.append(
            TraceRequest(obj["timestamp"], obj["input_length"], obj["output_length"], tuple(ids))
        )
    return requests


def read_trace(path: str | Path, *, block_size: int = BLOCK_SIZE) -> list[TraceRequest]:
    """Read a Mooncake-format ``.jsonl`` trace file (see ``parse_trace``).

    Args:
        path: the trace; a name ending in ``.gz`` is gzip-decompressed as it is read (the
            repository ships its trace that way).
        block_size: tokens per hash id.

    Returns:
        The requests, in file order.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return parse_trace(f, source=str(path), block_size=block_size)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def synthetic_tokens(
    hash_ids: Sequence[int] | np.ndarray,
    *,
    block_size: int = BLOCK_SIZE,
    seed: int = 0,
    vocab_size: int = 32_000,
) -> np.ndarray:
    """Token ids standing in for the unreleased text of each hash id's block.

    Counter-based, so cheap and the same in every process: a splitmix64 word per id (distinct
    ids, distinct words) mixed with a fixed word per position.

    Args:
        hash_ids: trace hash ids.
        block_size: tokens per block.
        seed: picks another, equally deterministic, set of tokens.
        vocab_size: tokens are in ``[0, vocab_size)``, at most ``2**32``.

    Returns:
        ``uint32`` array ``[len(hash_ids), block_size]``.
    """
    if not 0 < vocab_size <= 2**32:
        raise ValueError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    ids = np.asarray(hash_ids, dtype=np.uint64)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps on purpose
        per_id = _splitmix64(ids + np.uint64(seed) * _GOLDEN)
        per_position = _splitmix64(np.arange(block_size, dtype=np.uint64) + _GOLDEN)
        mixed = (per_id[:, None] ^ per_position) * _GOLDEN
    return ((mixed >> np.uint64(32)) % np.uint64(vocab_size)).astype(np.uint32)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@dataclass(frozen=True, slots=True)
class ReplayTrace:
    """A trace with each request's block keys and tiny blocks, built once, replayed many times.

    Args:
        requests: the requests.
        namespace: the namespace the keys are computed under.
        keys: per request, the key of each of its hash ids.
        blocks: per request, a 1-byte block under each key (capacities count blocks).
    """

    requests: tuple[TraceRequest, ...]
    namespace: Namespace
    keys: tuple[tuple[BlockHash, ...], ...]
    blocks: tuple[tuple[KVBlock, ...], ...]

    @classmethod
    def from_requests(
        cls, requests: Sequence[TraceRequest], *, block_size: int = BLOCK_SIZE, seed: int = 0
    ) -> ReplayTrace:
        """Key the hash ids as the engine keys a prompt: ``block_keys`` over the synthetic
        tokens of each request's ids, each id's key computed once (at its first request).

        Raises:
            ValueError: if an id follows different ids in different requests (not a chained
                prefix trace, so one id cannot stand for one key).
        """
        layout = KVLayout("uint8", block_size=block_size, num_layers=1, num_kv_heads=1, head_dim=1)
        namespace = Namespace("mooncake-trace-replay", layout)
        parent_of: dict[int, int] = {}  # -1: the namespace root
        key_of: dict[int, BlockHash] = {}
        for index, request in enumerate(requests):
            ids = request.hash_ids
            first_new = len(ids)
            prev = -1
            for position, hash_id in enumerate(ids):
                known = parent_of.get(hash_id)
                if known is None:
                    parent_of[hash_id] = prev
                    first_new = min(first_new, position)
                elif known != prev:
                    raise ValueError(
                        f"request {index}: hash id {hash_id} follows {_after(prev)} here but "
                        f"{_after(known)} earlier; hash_ids must be chained prefix-block ids"
                    )
                prev = hash_id
            # Chained ids: once one id is new, so is every later one (their parents are new).
            if first_new < len(ids):
                new_ids = ids[first_new:]
                tokens = synthetic_tokens(new_ids, block_size=block_size, seed=seed)
                parent = key_of[ids[first_new - 1]] if first_new else None
                keys = block_keys(namespace, tokens.reshape(-1), parent=parent)
                key_of.update(zip(new_ids, keys))
        fp = namespace.fingerprint
        block_of = {
            h: KVBlock(k, fp, "uint8", (1,), block_size, _PAYLOAD) for h, k in key_of.items()
        }
        return cls(
            tuple(requests),
            namespace,
            tuple(tuple(key_of[h] for h in r.hash_ids) for r in requests),
            tuple(tuple(block_of[h] for h in r.hash_ids) for r in requests),
        )

    @classmethod
    def load(cls, path: str | Path, *, block_size: int = BLOCK_SIZE, seed: int = 0) -> ReplayTrace:
        """``read_trace`` then ``from_requests``."""
        return cls.from_requests(
            read_trace(path, block_size=block_size), block_size=block_size, seed=seed
        )

    @property
    def block_size(self) -> int:
        return self.namespace.block_size


def _after(parent: int) -> str:
    return "nothing" if parent < 0 else f"id {parent}"


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request found in the cache.

    Args:
        timestamp_ms: arrival time.
        num_blocks: blocks asked for (hash ids).
        num_hit_blocks: leading blocks found.
        num_tokens: prompt tokens (``input_length``).
        num_hit_tokens: prompt tokens served from whole hit blocks.
        num_alignment_lost_tokens: tokens of the matched prefix in a hit partial last block,
            which a cache of whole blocks cannot reuse.
    """

    timestamp_ms: int
    num_blocks: int
    num_hit_blocks: int
    num_tokens: int
    num_hit_tokens: int
    num_alignment_lost_tokens: int


class HitRatios:
    """``block_hit_ratio`` and ``token_hit_ratio`` of a replay's totals, for any class that has
    ``num_blocks``, ``num_hit_blocks``, ``num_tokens`` and ``num_hit_tokens``."""

    __slots__ = ()
    num_blocks: int
    num_hit_blocks: float
    num_tokens: int
    num_hit_tokens: float

    @property
    def block_hit_ratio(self) -> float:
        """Hit blocks over all block references (0.0 for an empty trace)."""
        return self.num_hit_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        """Tokens served from whole hit blocks over all prompt tokens."""
        return self.num_hit_tokens / self.num_tokens if self.num_tokens else 0.0


@dataclass(frozen=True, slots=True)
class ReplayResult(HitRatios):
    """Per-request records and totals of one replay.

    Args:
        policy: eviction policy name, ``"belady"`` or ``"infinite"``.
        capacity_blocks: blocks the cache held at most, ``None`` for the infinite cache.
        records: one per request, in trace order.
        elapsed_s: wall time of the replay loop.
    """

    policy: str
    capacity_blocks: int | None
    records: tuple[RequestRecord, ...]
    elapsed_s: float

    @property
    def num_blocks(self) -> int:
        return sum(r.num_blocks for r in self.records)

    @property
    def num_hit_blocks(self) -> int:
        return sum(r.num_hit_blocks for r in self.records)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.records)

    @property
    def num_hit_tokens(self) -> int:
        return sum(r.num_hit_tokens for r in self.records)

    @property
    def num_alignment_lost_tokens(self) -> int:
        return sum(r.num_alignment_lost_tokens for r in self.records)

    def summary(self) -> dict[str, object]:
        """The totals as a flat dict (for JSON)."""
        return {
            "policy": self.policy,
            "capacity_blocks": self.capacity_blocks,
            "num_requests": len(self.records),
            "num_blocks": self.num_blocks,
            "num_hit_blocks": self.num_hit_blocks,
            "block_hit_ratio": self.block_hit_ratio,
            "num_tokens": self.num_tokens,
            "num_hit_tokens": self.num_hit_tokens,
            "token_hit_ratio": self.token_hit_ratio,
            "num_alignment_lost_tokens": self.num_alignment_lost_tokens,
            "elapsed_s": self.elapsed_s,
        }


def replay_tier(trace: ReplayTrace, policy: str, capacity_blocks: int) -> ReplayResult:
    """Replay through a real ``CPUTier``: ``contains_prefix`` is the hit, then ``put_many``
    stores or refreshes every block of the request.

    Args:
        trace: the keyed trace.
        policy: eviction policy name (``cachetier.tiers.eviction.POLICIES``).
        capacity_blocks: blocks the tier holds at most.

    Returns:
        The result.
    """
    positive_int("capacity_blocks", capacity_blocks)
    config = CPUTierConfig(capacity_bytes=capacity_blocks * len(_PAYLOAD), policy=policy)
    tier = CPUTier(config)
    ns = trace.namespace.id
    contains_prefix, put_many = tier.contains_prefix, tier.put_many
    hits: list[int] = []
    start = time.perf_counter()
    for keys, blocks in zip(trace.keys, trace.blocks):
        hits.append(contains_prefix(ns, keys))
        put_many(ns, blocks)
    return _result(trace, policy, capacity_blocks, hits, time.perf_counter() - start)


def replay_belady(trace: ReplayTrace, capacity_blocks: int) -> ReplayResult:
    """Belady's offline policy: past capacity, evict the block whose next use is farthest away
    (never used again counts as farthest). Next uses are precomputed; a max-heap with lazy
    deletion finds the victim.

    With prefix hits this is a reference point, not a proven optimum: it does not know that a
    block behind an evicted one is useless to the requests that reach it through that block.

    Args:
        trace: the keyed trace.
        capacity_blocks: blocks the cache holds at most (payload bytes, for blocks of more
            than one byte).

    Returns:
        The result.
    """
    positive_int("capacity_blocks", capacity_blocks)
    start = time.perf_counter()
    refs = [key for keys in trace.keys for key in keys]
    never = len(refs)
    next_use = [never] * len(refs)
    last: dict[BlockHash, int] = {}
    for position in range(len(refs) - 1, -1, -1):
        next_use[position] = last.get(refs[position], never)
        last[refs[position]] = position
    cached: dict[BlockHash, int] = {}  # key -> its next use
    heap: list[tuple[int, BlockHash]] = []  # (-next use, key); stale when cached disagrees
    hits: list[int] = []
    position = used = 0
    # A block takes its payload's bytes (1 in a trace; a sampled trace's weigh what they
    # stand for: ``cachetier.report.sampled``).
    size_of = {block.key: block.nbytes for blocks in trace.blocks for block in blocks}
    for keys in trace.keys:
        hits.append(num_leading_hits(keys, cached))
        for key in keys:
            use = next_use[position]
            position += 1
            if key not in cached:
                used += size_of[key]
            cached[key] = use
            heapq.heappush(heap, (-use, key))
            while used > capacity_blocks:
                neg_use, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg_use:
                    del cached[victim]
                    used -= size_of[victim]
    return _result(trace, "belady", capacity_blocks, hits, time.perf_counter() - start)


def replay_infinite(trace: ReplayTrace) -> ReplayResult:
    """The ceiling: a cache that never evicts.

    Args:
        trace: the keyed trace.

    Returns:
        The replay's hits, under policy name ``"infinite"`` and no capacity.
    """
    start = time.perf_counter()
    seen: set[BlockHash] = set()
    hits: list[int] = []
    for keys in trace.keys:
        hits.append(num_leading_hits(keys, seen))
        seen.update(keys)
    return _result(trace, "infinite", None, hits, time.perf_counter() - start)


def usable_hit(request: TraceRequest, num_hit_blocks: int, block_size: int) -> tuple[int, int]:
    """What a hit of ``num_hit_blocks`` leading hash ids gives a request.

    Args:
        request: the request.
        num_hit_blocks: leading hash ids found (the last one may cover a partial block).
        block_size: tokens per hash id.

    Returns:
        (whole blocks reusable, tokens matched but not reusable: those inside a partial last
        block, which a cache of whole blocks cannot reuse, or the whole last block where the
        prompt fills it, since an engine computes at least the prompt's last token to sample
        the first output token, as vLLM's and our engine's prefix caches do).
    """
    usable = min(num_hit_blocks, max(0, request.input_length - 1) // block_size)
    matched = min(num_hit_blocks * block_size, request.input_length)
    return usable, matched - usable * block_size


def _result(
    trace: ReplayTrace, policy: str, capacity: int | None, hits: list[int], elapsed_s: float
) -> ReplayResult:
    size = trace.block_size
    records = []
    for request, num_hit in zip(trace.requests, hits):
        usable, lost = usable_hit(request, num_hit, size)
        records.append(
            RequestRecord(
                request.timestamp_ms,
                len(request.hash_ids),
                num_hit,
                request.input_length,
                usable * size,
                lost,
            )
        )
    return ReplayResult(policy, capacity, tuple(records), elapsed_s)
