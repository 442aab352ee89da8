"""One segmented recency stack (``cachetier.admission.stack``) against one plain LRU cache per
capacity, on random traffic: the same keys held and the same leading runs, use after use."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from cachetier.admission.stack import SegmentedStack


class _PlainLRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: OrderedDict[bytes, None] = OrderedDict()

    def leading_run(self, keys: list[bytes]) -> int:
        run = 0
        while run < len(keys) and keys[run] in self.held:
            run += 1
        return run

    def use(self, keys: list[bytes]) -> None:
        for key in keys:
            if key in self.held:
                self.held.move_to_end(key)
            else:
                self.held[key] = None
                if len(self.held) > self.capacity:
                    self.held.popitem(last=False)


@pytest.mark.parametrize("seed", range(6))
def test_the_stack_is_every_lru_cache_at_once(seed: int) -> None:
    rng = random.Random(seed)
    capacities = rng.sample(range(1, 60), rng.randint(1, 5))
    capacities.append(capacities[0])  # a repeat shares its bound
    stack = SegmentedStack(capacities)
    plain = {c: _PlainLRU(c) for c in set(capacities)}
    universe = [bytes([i]) * 32 for i in range(90)]
    recent: list[bytes] = []
    for _ in range(400):
        # Requests that resend a recent prefix, add fresh keys, and now and then repeat a key.
        keys = recent[: rng.randint(0, len(recent))] + rng.sample(universe, rng.randint(0, 8))
        if keys and rng.random() < 0.1:
            keys.append(rng.choice(keys))
        runs = stack.leading_runs(keys)
        for capacity, lru in plain.items():
            assert runs[stack.index_of(capacity)] == lru.leading_run(keys)
        stack.use(keys)
        for lru in plain.values():
            lru.use(keys)
        for capacity, lru in plain.items():
            assert stack.held_by(capacity) == len(lru.held)
            index = stack.index_of(capacity)
            held = {k for k, segment in stack._segment_of.items() if segment <= index}
            assert held == set(lru.held)
        assert set(stack) == set(plain[max(plain)].held)
        recent = keys or recent


def test_a_stack_needs_positive_capacities() -> None:
    with pytest.raises(ValueError, match="capacity"):
        SegmentedStack([4, 0])
    with pytest.raises(ValueError, match="at least one"):
        SegmentedStack([])
