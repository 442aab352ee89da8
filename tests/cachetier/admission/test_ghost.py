"""The ghost queue: sightings counted, the oldest key forgotten first and only past capacity,
agreement with a dict-based twin under colliding keys, and its size at a million keys."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from cachetier.admission.ghost import GhostQueue
from cachetier.admission.sketch import MAX_TRACKED_KEYS


def _keys(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def test_sightings_are_zero_one_then_two() -> None:
    ghost = GhostQueue(10)
    (key,) = _keys(1)
    assert ghost.sightings(key) == 0
    ghost.record(key)
    assert ghost.sightings(key) == 1
    ghost.record(key)
    ghost.record(key)
    assert ghost.sightings(key) == 2
    assert len(ghost) == 1


def test_it_holds_at_most_capacity_keys_and_forgets_the_oldest() -> None:
    ghost = GhostQueue(100)
    keys = _keys(1_000)
    for key in keys:
        ghost.record(key)
    assert len(ghost) == 100
    assert [ghost.sightings(k) for k in keys[:900]] == [0] * 900
    assert [ghost.sightings(k) for k in keys[900:]] == [1] * 100


def test_a_second_sighting_does_not_move_a_key_to_the_back() -> None:
    # A FIFO, as S3-FIFO's ghost: the window is arrival order, not recency.
    ghost = GhostQueue(3)
    a, b, c, d = _keys(4)
    for key in (a, b, c, a, d):
        ghost.record(key)
    assert ghost.sightings(a) == 0
    assert (ghost.sightings(b), ghost.sightings(c), ghost.sightings(d)) == (1, 1, 1)


def _colliding_keys(n: int, rng: random.Random) -> list[bytes]:
    # Keys whose fingerprints share their low bits: every home slot of a small table is one
    # of the last four, so probes run long and wrap, and deletions shift entries back across
    # the wrap.
    keys = []
    for i in range(n):
        word = (rng.getrandbits(40) << 24) | ((28 + i % 4) << 2)  # homes 28..31 of 32
        keys.append(word.to_bytes(8, "little") + rng.randbytes(24))
    return keys


@pytest.mark.parametrize("seed", range(5))
def test_it_agrees_with_a_dict_twin_under_collisions(seed: int) -> None:
    rng = random.Random(seed)
    universe = _colliding_keys(60, rng)
    ghost = GhostQueue(13)
    twin: OrderedDict[bytes, int] = OrderedDict()
    for _ in range(3_000):
        key = rng.choice(universe)
        ghost.record(key)
        if key in twin:
            twin[key] = 2
        else:
            twin[key] = 1
            if len(twin) > 13:
                twin.popitem(last=False)
        probe = rng.choice(universe)
        assert ghost.sightings(probe) == twin.get(probe, 0)
    assert len(ghost) == len(twin)
    assert [ghost.sightings(k) for k in universe] == [twin.get(k, 0) for k in universe]


def test_memory_at_a_million_keys_is_about_24_bytes_a_key() -> None:
    ghost = GhostQueue(1_000_000)
    ring = 8 * 1_000_000  # one 8-byte fingerprint a key, in arrival order
    table = 8 * 2**21  # next_pow2(2 * 1,000,000) slots of 8 bytes: at most half full
    assert ghost.nbytes == ring + table == 24_777_216
    assert ghost.nbytes <= 25 * 1_000_000


@pytest.mark.parametrize("capacity", [0, -3, False, MAX_TRACKED_KEYS + 1])
def test_bad_capacities_are_refused(capacity: object) -> None:
    with pytest.raises(ValueError, match="capacity"):
        GhostQueue(capacity)  # type: ignore[arg-type]
