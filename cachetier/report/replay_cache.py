"""A tier's placement and eviction as a replay needs them: what a ``CPUTier`` holds after the
same puts, without what it adds for serving.

A ``CPUTier`` put takes a lock, times itself, copies mutable payloads, accounts pins, stamps
each block with its arrival time and counts its statistics; a report pays that per block of
the trace for every policy at every capacity. ``ReplayCache`` keeps only what decides a hit:
the held keys with their bytes and the tier's own eviction policy
(``cachetier.tiers.eviction``), told of each store, use and eviction in the order a
``CPUTier`` tells it. It has no pins: the replay that pins (an engine's pool) keeps its
``CPUTier``. ``tests/cachetier/report/test_replay_cache.py`` replays traces through both and
compares every hit and every write.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from cachetier.primitives.keys import BlockHash
from cachetier.record import KVBlock
from cachetier.tiers.eviction import make_policy
from cachetier.util.checks import positive_int


class ReplayCache:
    """The blocks a ``CPUTier`` of ``capacity_bytes`` under ``policy`` would hold (one
    namespace, no pins, one thread).

    Args:
        capacity_bytes: most payload bytes held at once (blocks, for a trace's 1-byte ones).
        policy: eviction policy name (``cachetier.tiers.eviction.POLICIES``).
    """

    def __init__(self, capacity_bytes: int, policy: str = "lru") -> None:
        positive_int("capacity_bytes", capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self._policy = make_policy(policy)
        self._held: dict[bytes, int] = {}  # key -> its bytes
        self._used = 0
        self.bytes_in = 0
        """Payload bytes stored (a block held already is a use, not a write)."""

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def contains_prefix(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        """How many leading ``keys`` are held (``namespace`` as a tier takes it; one here).

        Args:
            namespace: ignored: a replay has one.
            keys: block keys in sequence order.

        Returns:
            The length of the held leading run.
        """
        held = self._held
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count

    def put_many(self, namespace: str, blocks: Sequence[KVBlock]) -> int:
        """Store each block, or use it where held, evicting past the capacity after each store.

        Args:
            namespace: ignored: a replay has one.
            blocks: the blocks, in order.

        Returns:
            Blocks stored or used (a block larger than the whole capacity is neither).
        """
        held, policy, capacity = self._held, self._policy, self.capacity_bytes
        done = 0
        for block in blocks:
            key = block.key
            if key in held:
                policy.touch(key)
                done += 1
                continue
            size = block.nbytes
            if size > capacity:
                continue
            policy.insert(key)
            held[key] = size
            self._used += size
            self.bytes_in += size
            done += 1
            while self._used > capacity:
                victim = policy.pop_victim()
                assert victim is not None, "over capacity with nothing to evict"
                self._used -= held.pop(victim)  # type: ignore[call-overload]
        return done


def replay_hits(
    keys: Sequence[Sequence[BlockHash]],
    blocks: Sequence[Sequence[KVBlock]],
    policy: str,
    capacity_bytes: int,
) -> tuple[list[int], float]:
    """``cachetier.report.replay.replay_tier``'s loop through a ``ReplayCache``: each request's
    held leading run, then all its blocks put.

    Args:
        keys: per request, its block keys.
        blocks: per request, its blocks (their bytes count against the capacity).
        policy: eviction policy name.
        capacity_bytes: the cache's capacity.

    Returns:
        Per request its leading hit, and the loop's wall time in seconds.
    """
    cache = ReplayCache(capacity_bytes, policy)
    contains_prefix, put_many = cache.contains_prefix, cache.put_many
    hits: list[int] = []
    start = time.perf_counter()
    for request_keys, request_blocks in zip(keys, blocks):
        hits.append(contains_prefix("", request_keys))
        put_many("", request_blocks)
    return hits, time.perf_counter() - start
