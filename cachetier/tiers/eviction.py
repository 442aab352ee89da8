"""Eviction policies a tier uses to choose which block leaves when it is over capacity.

A policy only orders keys; the tier owns the blocks and the byte accounting. Policies are not
thread-safe: the tier calls them under its own lock.

Policies are never told the capacity. A tier calls ``pop_victim`` only when it is over capacity,
so the number of keys held at that moment is the capacity in blocks (give or take one); policies
that size internal queues (S3-FIFO, ARC) take their targets as fractions of that count. With
blocks of unequal size the targets are in keys, not bytes.

On the Mooncake conversation trace no policy here beats LRU at every capacity (that trace is
recency-driven: a conversation's next turn reuses its last prompt), so LRU stays the default;
``benchmarks/policies.py`` measures them and the README has the figures.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol


class EvictionPolicy(Protocol):
    """Orders the keys a tier holds."""

    def insert(self, key: Hashable) -> None:
        """A new key was stored."""

    def touch(self, key: Hashable) -> None:
        """A stored key was read (or overwritten)."""

    def remove(self, key: Hashable) -> None:
        """A key left the tier for a reason other than eviction (delete, corruption)."""

    def pop_victim(self) -> Hashable | None:
        """Remove and return the key to evict next, ``None`` if the policy holds none."""

    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def pop_victim(self) -> Hashable | None:
        if not self._order:
            return None
        key, _ = self._order.popitem(last=False)
        return key

    def __len__(self) -> int:
        return len(self._order)


class S3FIFOPolicy:
    """S3-FIFO (Yang et al., SOSP 2023): a small FIFO that filters one-hit keys out quickly,
    a main FIFO with lazy reinsertion, and a ghost FIFO of recently filtered keys.

    New keys enter the small queue. A touch only bumps a 2-bit counter (no reordering, which
    is what makes FIFOs cheap). When the small queue holds at least ``small_ratio`` of the keys
    its oldest key leaves it: touched at least ``promote_after`` times it moves to the main
    queue, else it is evicted and remembered in the ghost queue. A key inserted again while in
    the ghost queue goes straight to the main queue. The main queue evicts its oldest key with
    a zero counter, reinserting (and decrementing) the ones it passes.

    Args:
        small_ratio: share of the held keys the small queue may keep before it must give one up.
        promote_after: touches in the small queue that earn a key its place in the main queue
            (1, as the authors' blog illustrates; a prefix block is touched once per request).
    """

    MAX_FREQ = 3  # a 2-bit counter

    def __init__(self, small_ratio: float = 0.1, promote_after: int = 1) -> None:
        if not 0.0 < small_ratio < 1.0:
            raise ValueError(f"small_ratio must be in (0, 1), got {small_ratio}")
        if not 1 <= promote_after <= self.MAX_FREQ:
            raise ValueError(f"promote_after must be in [1, {self.MAX_FREQ}], got {promote_after}")
        self._small_ratio = small_ratio
        self._promote_after = promote_after
        self._small: OrderedDict[Hashable, None] = OrderedDict()
        self._main: OrderedDict[Hashable, None] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._freq: dict[Hashable, int] = {}  # held keys only

    def insert(self, key: Hashable) -> None:
        if key in self._freq:
            self.touch(key)
            return
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key: Hashable) -> None:
        freq = self._freq.get(key)
        if freq is not None and freq < self.MAX_FREQ:
            self._freq[key] = freq + 1

    def remove(self, key: Hashable) -> None:
        if self._freq.pop(key, None) is not None:
            self._small.pop(key, None)
            self._main.pop(key, None)

    def pop_victim(self) -> Hashable | None:
        held = len(self._freq)
        if not held:
            return None
        if self._small and (len(self._small) >= self._small_ratio * held or not self._main):
            victim = self._evict_small(held)
            if victim is not None:
                return victim
        return self._evict_main()

    def _evict_small(self, held: int) -> Hashable | None:
        freq = self._freq
        while self._small:
            key, _ = self._small.popitem(last=False)
            if freq[key] >= self._promote_after:
                freq[key] = 0
                self._main[key] = None
                continue
            del freq[key]
            self._ghost[key] = None
            # The ghost remembers about as many keys as the main queue's share of the cache.
            while len(self._ghost) > (1.0 - self._small_ratio) * held:
                self._ghost.popitem(last=False)
            return key
        return None  # every key was promoted: the main queue gives one up instead

    def _evict_main(self) -> Hashable | None:
        freq = self._freq
        while self._main:
            key = next(iter(self._main))
            if freq[key]:
                freq[key] -= 1
                self._main.move_to_end(key)
                continue
            del self._main[key], freq[key]
            return key
        return None

    def __len__(self) -> int:
        return len(self._freq)


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo and Modha, FAST 2003).

    ``t1`` holds keys seen once recently and ``t2`` keys seen at least twice, both in LRU order;
    ``b1`` and ``b2`` remember keys recently evicted from each. A re-insert of a key remembered in
    ``b1`` means recency deserved more room, one from ``b2`` that frequency did: the target size
    ``p`` of ``t1`` moves accordingly, and the victim comes from ``t1`` when it is over target.
    """

    def __init__(self) -> None:
        self._t1: OrderedDict[Hashable, None] = OrderedDict()
        self._t2: OrderedDict[Hashable, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._p = 0.0  # target size of t1, in keys
        self._last_from_b2 = False

    def insert(self, key: Hashable) -> None:
        if key in self._t1 or key in self._t2:
            self.touch(key)
            return
        held = len(self)
        self._last_from_b2 = False
        if key in self._b1:
            self._p = min(float(held), self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
            self._last_from_b2 = True
        else:
            self._t1[key] = None

    def touch(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def pop_victim(self) -> Hashable | None:
        t1, t2 = self._t1, self._t2
        if not (t1 or t2):
            return None
        over = len(t1) > self._p or (self._last_from_b2 and len(t1) == self._p)
        if t1 and (over or not t2):
            key, _ = t1.popitem(last=False)
            self._b1[key] = None
        else:
            key, _ = t2.popitem(last=False)
            self._b2[key] = None
        # The paper's bounds with c = keys held after this eviction: |t1|+|b1| <= c and
        # all four lists <= 2c.
        capacity = len(t1) + len(t2)
        while self._b1 and len(t1) + len(self._b1) > capacity:
            self._b1.popitem(last=False)
        while self._b2 and capacity + len(self._b1) + len(self._b2) > 2 * capacity:
            self._b2.popitem(last=False)
        return key

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by name.

    Args:
        name: one of ``POLICIES``.

    Returns:
        A new, empty policy.
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction policy {name!r} is not one of {sorted(POLICIES)}") from None
