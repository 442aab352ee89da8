"""In-process tier: blocks in host memory under a byte capacity."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachetier.pins.pinset import PinSet
from cachetier.primitives.keys import BlockHash
from cachetier.record import KVBlock
from cachetier.tiers.base import EvictCallback, Tier, check_namespace
from cachetier.tiers.eviction import make_policy
from cachetier.util.checks import fraction, positive_int


@dataclass(frozen=True, slots=True)
class CPUTierConfig:
    """Settings of a ``CPUTier``: its capacity and eviction policy.

    Args:
        capacity_bytes: most payload bytes held at once.
        policy: eviction policy name (``cachetier.tiers.eviction.POLICIES``).
        max_pinned_fraction: share of ``capacity_bytes`` pinned blocks may hold, in [0, 1)
            (0: nothing can be pinned); the rest is what eviction works in.
    """

    capacity_bytes: int
    policy: str = "lru"
    max_pinned_fraction: float = 0.5

    def __post_init__(self) -> None:
        positive_int("capacity_bytes", self.capacity_bytes)
        fraction("max_pinned_fraction", self.max_pinned_fraction)


class CPUTier(Tier):
    """Blocks kept as immutable ``bytes`` in this process.

    A get hands back the stored block itself (no copy): its ``data`` is immutable ``bytes``, so
    the caller may keep it as long as it likes and copies it where it needs it (e.g. into a
    paged KV pool). A put copies a mutable payload once so the tier owns what it holds; bytes
    and read-only memoryviews are kept as they are.
    Records are not re-checked on a get: the bytes never left this process's memory.
    Pinned blocks (``pin``) stay out of the eviction policy, so it never offers them.
    """

    name = "cpu"
    supports_pins = True

    def __init__(self, config: CPUTierConfig, on_evict: EvictCallback | None = None) -> None:
        super().__init__()
        self._config = config
        self._blocks: dict[tuple[str, bytes], KVBlock] = {}
        # When each block was stored: an eviction tells its age (``Tier.eviction_listener``).
        self._stored_at: dict[tuple[str, bytes], float] = {}
        self._policy = make_policy(config.policy)
        self._used = 0
        self._lock = threading.Lock()
        self._on_evict = on_evict
        self._pins = PinSet(int(config.capacity_bytes * config.max_pinned_fraction), self.name)

    @property
    def capacity_bytes(self) -> int:
        return self._config.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._used

    def put_many(self, namespace: str, blocks: Sequence[KVBlock]) -> int:
        check_namespace(namespace)
        start = time.perf_counter()
        owned = [_owned(block) for block in blocks]
        evicted: list[tuple[str, KVBlock, float | None]] = []
        now = time.time()
        stored = rejected = nbytes = skipped = 0
        with self._lock:
            for block in owned:
                size = block.nbytes
                slot = (namespace, block.key)
                if slot in self._blocks:
                    # The same key holds the same KV: a put of it again is a use, not a write.
                    self._policy.touch(slot)
                    skipped += 1
                    continue
                if size > self._config.capacity_bytes:
                    rejected += 1
                    continue
                self._pins.place(self._policy, slot, size, replaces=False)
                self._blocks[slot] = block
                self._stored_at[slot] = now
                self._used += size
                stored += 1
                nbytes += size
                while self._used > self._config.capacity_bytes:
                    victim = self._policy.pop_victim()
                    # Protected bytes stay below the capacity (max_pinned_fraction < 1), and
                    # every other block, this one included, is in the policy.
                    assert victim is not None, "capacity exceeded with nothing left to evict"
                    gone = self._blocks.pop(victim)  # type: ignore[call-overload]
                    self._used -= gone.nbytes
                    stamp = self._stored_at.pop(victim, None)  # type: ignore[call-overload]
                    evicted.append((victim[0], gone, stamp))  # type: ignore[index]
        self._stats.add(
            puts=stored,
            bytes_in=nbytes,
            rejected=rejected,
            evictions=len(evicted),
            skipped_present=skipped,
        )
        self._stats.observe(time.perf_counter() - start)
        listener = self.eviction_listener
        if listener is not None:
            for ns, block, stamp in evicted:
                listener(ns, block.key, stamp)
        if self._on_evict is not None:
            # Outside the lock: the callback may block on a bounded queue.
            for ns, block, _ in evicted:
                self._on_evict(ns, block)
        return stored + skipped

    def get_many(self, namespace: str, keys: Sequence[BlockHash]) -> list[KVBlock | None]:
        check_namespace(namespace)
        start = time.perf_counter()
        out: list[KVBlock | None] = []
        hits = nbytes = 0
        with self._lock:
            for key in keys:
                slot = (namespace, key)
                block = self._blocks.get(slot)
                if block is not None:
                    self._policy.touch(slot)
                    hits += 1
                    nbytes += block.nbytes
                out.append(block)
        self._stats.record_get(time.perf_counter() - start, hits, len(keys) - hits, nbytes)
        return out

    def held_keys(self) -> list[tuple[str, BlockHash]]:
        with self._lock:
            return [(ns, BlockHash(key)) for ns, key in self._blocks]

    def contains_prefix(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        check_namespace(namespace)
        count = 0
        with self._lock:
            for key in keys:
                if (namespace, key) not in self._blocks:
                    break
                count += 1
        return count

    def delete(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        check_namespace(namespace)
        removed = 0
        with self._lock:
            for key in keys:
                block = self._blocks.pop((namespace, key), None)
                if block is not None:
                    self._stored_at.pop((namespace, key), None)
                    self._pins.leave((namespace, key))
                    self._policy.remove((namespace, key))
                    self._used -= block.nbytes
                    removed += 1
        return removed

    def clear(self, namespace: str) -> int:
        check_namespace(namespace)
        with self._lock:
            slots = [slot for slot in self._blocks if slot[0] == namespace]
        return self.delete(namespace, [BlockHash(slot[1]) for slot in slots])

    def pin(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        check_namespace(namespace)
        slots = [(namespace, bytes(key)) for key in keys]
        with self._lock:
            stored = {s: self._blocks[s].nbytes for s in slots if s in self._blocks}
            return self._pins.pin_stored(self._policy, slots, stored)

    def unpin(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        check_namespace(namespace)
        with self._lock:
            return self._pins.unpin_stored(self._policy, [(namespace, bytes(k)) for k in keys])

    def pin_stats(self) -> dict[str, Any]:
        with self._lock:
            return self._pins.snapshot()


def _immutable(buf: object) -> bool:
    # A read-only memoryview is taken as a hand-over: the caller gives up the memory under it
    # (the engine passes views of a staging buffer it never touches again), saving a copy.
    return isinstance(buf, bytes) or (isinstance(buf, memoryview) and buf.readonly)


def _owned(block: KVBlock) -> KVBlock:
    """The block with an immutable payload the tier can hold on to."""
    if _immutable(block.data) and _immutable(block.aux):
        return block
    return KVBlock(
        block.key,
        block.fingerprint,
        block.dtype,
        block.shape,
        block.num_tokens,
        bytes(block.data),
        bytes(block.aux),
    )
