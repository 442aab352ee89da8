"""The frequency sketch: exact counts where keys do not collide, never an undercount, halving
on aging, saturation, its size at a million keys, and keys that are not digests refused."""

from __future__ import annotations

import random

import pytest

from cachetier.admission.sketch import MAX_COUNT, MAX_TRACKED_KEYS, FrequencySketch, next_pow2


def _keys(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def test_a_key_is_counted_once_per_sighting() -> None:
    sketch = FrequencySketch(10_000)
    key, other = _keys(2)
    assert sketch.estimate(key) == 0
    for count in range(1, 8):
        sketch.record(key)
        assert sketch.estimate(key) == count
    assert sketch.estimate(other) == 0


def test_estimates_never_undercount_and_rarely_overcount() -> None:
    # Zipf-like counts over 5,000 keys, 20,000 sightings in a window of 50,000: no aging yet.
    rng = random.Random(1)
    keys = _keys(5_000, seed=2)
    true = {k: 0 for k in keys}
    sketch = FrequencySketch(50_000)
    for _ in range(20_000):
        key = keys[min(int(rng.paretovariate(1.0)) - 1, len(keys) - 1)]
        true[key] += 1
        sketch.record(key)
    estimates = {k: sketch.estimate(k) for k in keys}
    assert all(estimates[k] >= min(true[k], MAX_COUNT + 1) for k in keys)
    exact = sum(estimates[k] == min(true[k], MAX_COUNT + 1) for k in keys)
    assert exact >= 0.99 * len(keys)
    unseen = _keys(5_000, seed=3)
    assert sum(sketch.estimate(k) > 0 for k in unseen) <= 0.05 * len(unseen)


def test_aging_halves_the_counts_and_forgets_single_sightings() -> None:
    sketch = FrequencySketch(1_000)
    hot, once = _keys(2, seed=4)
    for _ in range(9):
        sketch.record(hot)  # 1 in the doorkeeper + 8 in the counters
    sketch.record(once)
    assert (sketch.estimate(hot), sketch.estimate(once)) == (9, 1)
    fillers = _keys(1_000 - 10 - 1, seed=5)
    for key in fillers:
        sketch.record(key)
    assert sketch.num_resets == 0
    sketch.record(fillers[0])  # the 1,000th sighting ages the sketch
    assert sketch.num_resets == 1
    assert sketch.estimate(hot) == 4  # 8 // 2, and the doorkeeper is cleared
    assert sketch.estimate(once) == 0


def test_counters_saturate_at_four_bits() -> None:
    sketch = FrequencySketch(10_000)
    (key,) = _keys(1, seed=6)
    for _ in range(100):
        sketch.record(key)
    assert sketch.estimate(key) == MAX_COUNT + 1


def test_memory_at_a_million_keys_is_nine_bytes_a_key() -> None:
    sketch = FrequencySketch(1_000_000)
    slots = next_pow2(1_000_000)  # 2**20
    counters = 4 * 4 * slots // 2  # 4 rows of 4 counters a slot, two 4-bit counters a byte
    doorkeeper = 8 * slots // 8  # 8 bits a slot
    assert sketch.nbytes == counters + doorkeeper == 9 * 2**20
    assert sketch.nbytes <= 10 * 1_000_000


@pytest.mark.parametrize("tracked", [0, -1, True, 2.5, MAX_TRACKED_KEYS + 1])
def test_bad_sizes_are_refused(tracked: object) -> None:
    with pytest.raises(ValueError, match="tracked_keys"):
        FrequencySketch(tracked)  # type: ignore[arg-type]


def test_a_key_that_is_not_a_digest_is_refused() -> None:
    with pytest.raises(ValueError, match="digest"):
        FrequencySketch(10).record(b"short")


@pytest.mark.parametrize("n,expected", [(0, 1), (1, 1), (2, 2), (3, 4), (1_000_000, 2**20)])
def test_next_pow2(n: int, expected: int) -> None:
    assert next_pow2(n) == expected
