"""The live capacity curve (``cachetier.admission.live_curve``): exact LRU ratios at rate 1, an
estimate near them on a sample, bounded memory, many threads, hostile keys, and the store's
lookups feeding it (real CPU and disk tiers)."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from cachetier.admission import AdmissionConfig, make_admission_policy
from cachetier.admission.live_curve import (
    CAPACITY_FACTORS,
    KEY_BYTES,
    LiveCurve,
    admission_choices,
)
from cachetier.record import KVBlock
from cachetier.store.config import StoreConfig, build_store
from tests.cachetier.admission.curve_traffic import chats, key, lru_hit_ratio

FACTORS = ("0.5", "1", "2", "4")


def test_a_known_sequence_gives_each_size_its_lru_hits() -> None:
    a, b, c, d, e = (key(i) for i in range(5))
    curve = LiveCurve({"cpu": 20}, sample_keys=1024, block_bytes=10)  # 2 blocks: 1, 2, 4, 8
    for keys in ([a, b], [a, b], [c, d, e], [a, b]):
        curve.observe(keys)
    (snap,) = curve.snapshot().values()
    assert snap["capacity_blocks"] == 2 and snap["sample_rate"] == 1.0
    assert snap["num_lookups"] == 4 and snap["num_blocks"] == 9
    # 1 block: only b stays after [a, b], so no run starts; 2: the second [a, b]; 4: the
    # second [a, b] (then [c, d, e] pushes a out); 8: both repeats.
    assert snap["hit_ratio"] == {"0.5": 0.0, "1": 2 / 9, "2": 2 / 9, "4": 4 / 9}


def test_at_rate_one_every_point_is_the_exact_lru_ratio() -> None:
    requests = chats(600, seed=1)
    capacity = 120
    curve = LiveCurve({"cpu": capacity * 100, "disk": 3 * capacity * 100}, block_bytes=100)
    for keys in requests:
        curve.observe(keys)
    snap = curve.snapshot()
    for tier, blocks in (("cpu", capacity), ("disk", 3 * capacity)):
        assert snap[tier]["sample_rate"] == 1.0
        want = [lru_hit_ratio(requests, round(f * blocks)) for f in CAPACITY_FACTORS]
        got = [snap[tier]["hit_ratio"][f] for f in FACTORS]
        assert got == pytest.approx(want, abs=1e-12), tier
        assert got == sorted(got) and got[0] < got[-1]


def test_a_sample_estimates_the_exact_curve() -> None:
    requests = chats(3000, seed=2)
    capacity = 2000
    sampled = LiveCurve({"disk": capacity}, sample_keys=2000, block_bytes=1)
    for keys in requests:
        sampled.observe(keys)
    snap = sampled.snapshot()["disk"]
    assert snap["sample_rate"] == pytest.approx(0.25, rel=1e-3)
    assert 0 < snap["num_sampled_blocks"] < snap["num_blocks"]
    for factor, label in zip(CAPACITY_FACTORS, FACTORS):
        exact = lru_hit_ratio(requests, round(factor * capacity))
        assert snap["hit_ratio"][label] == pytest.approx(exact, abs=0.05), label


def test_memory_is_bounded_whatever_the_traffic() -> None:
    curve = LiveCurve({"cpu": 10_000_000, "disk": 100}, sample_keys=256, block_bytes=1)
    bound = curve.nbytes
    assert bound <= 2 * (256 + 1) * KEY_BYTES  # two tiers of two rates: two stacks
    rng = random.Random(3)
    for _ in range(400):  # 40,000 distinct keys, far past every ghost
        curve.observe([rng.randbytes(32) for _ in range(100)])
    stacks = [group.stack for group in curve._stacks]
    assert len(stacks) == 2
    for group in curve._stacks:
        for c in group.curves:
            assert all(group.stack.held_by(cap) <= cap for cap in c.capacities)
    assert sum(len(s) for s in stacks) <= 2 * (256 + 1)
    assert curve.nbytes == bound
    # A hostile client's long keys are held as their first 32 bytes only.
    curve.observe([b"\xff" * 13 + b"\0\0\0" + b"x" * 1_000_000 for _ in range(10)])
    assert all(len(k) <= 32 for s in stacks for k in s)


def test_bad_keys_are_never_sampled_and_never_raise() -> None:
    curve = LiveCurve({"cpu": 100}, block_bytes=10)
    curve.observe([b"", b"short", key(1)[:15]])
    curve.observe([])
    (snap,) = curve.snapshot().values()
    assert snap["num_lookups"] == 2 and snap["num_blocks"] == snap["num_sampled_blocks"] == 0
    assert snap["hit_ratio"] == dict.fromkeys(FACTORS, 0.0)  # not 1: no reference is a hit


def test_lookups_wait_for_the_block_size_up_to_a_bound() -> None:
    curve = LiveCurve({"cpu": 10, "disk": 5, "redis": 0}, sample_keys=4)
    for n in range(3):  # 2 keys each: the third does not fit the 4 keys that may wait
        curve.observe([key(n), key(n + 10)])
    assert curve.snapshot() == {} and curve.nbytes == 0
    assert curve.num_uncounted_lookups == 1
    curve.stored([key(0)], 10)  # sizes the ghosts (only cpu is >= a block), replays the two
    curve.stored([key(0)], 1)  # the first size stands
    snap = curve.snapshot()
    assert list(snap) == ["cpu"] and snap["cpu"]["capacity_blocks"] == 1
    assert snap["cpu"]["num_lookups"] == 2 and snap["cpu"]["num_blocks"] == 4
    # The ghost of 4 holds both keys of the first lookup, the ghost of 1 the key put last.
    curve.observe([key(0), key(10)])
    ratios = curve.snapshot()["cpu"]["hit_ratio"]
    assert ratios == {"0.5": 1 / 6, "1": 1 / 6, "2": 1 / 6, "4": 2 / 6}
    with pytest.raises(ValueError, match="sample_keys"):
        LiveCurve({"cpu": 100}, sample_keys=0)


def test_a_put_stores_what_no_lookup_asked_for() -> None:
    a, b = key(1), key(2)
    curve = LiveCurve({"cpu": 20})
    curve.stored([a, b], 10)  # 2 blocks: ghosts of 1, 2, 4 and 8
    curve.observe([a, b])
    (snap,) = curve.snapshot().values()
    assert snap["hit_ratio"] == {"0.5": 0.0, "1": 1.0, "2": 1.0, "4": 1.0}


def test_many_threads_count_every_lookup_once() -> None:
    curve = LiveCurve({"cpu": 50 * 8, "disk": 400 * 8}, sample_keys=512, block_bytes=8)
    requests = chats(400, seed=4)
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def feed(part: list[list[bytes]]) -> None:
        try:
            barrier.wait()
            for keys in part:
                curve.observe(keys)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=feed, args=(requests[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    reader = [curve.snapshot() for _ in range(50)]  # read while they write
    for t in threads:
        t.join()
    assert errors == [] and reader
    for snap in curve.snapshot().values():
        assert snap["num_lookups"] == len(requests)
        assert snap["num_blocks"] == sum(len(k) for k in requests)
        line = [snap["hit_ratio"][f] for f in FACTORS]
        assert line == sorted(line) and all(0 <= v <= 1 for v in line)


def block(n: int, nbytes: int = 64) -> KVBlock:
    return KVBlock(key(n), b"f" * 32, "uint8", (nbytes,), 16, bytes(nbytes))


def test_the_store_feeds_lookups_not_probes_or_restores(tmp_path: Path) -> None:
    config = StoreConfig(
        live_curve=True, cpu_bytes=4 * 64, disk_path=str(tmp_path), disk_bytes=64 * 64, fsync=False
    )
    with build_store(config) as store:
        assert store.lookup("ns", [key(1)]).num_blocks == 0  # waits for the block size
        store.put_many("ns", [block(i) for i in range(3)])
        store.flush()
        for _ in range(3):
            assert store.lookup("ns", [key(i) for i in range(3)]).num_blocks == 3
        assert store.contains_prefix("ns", [key(0)]) == 1
        assert len(store.restore_prefix("ns", [key(0), key(1)]).blocks) == 2
        stats = store.stats()
    curve = stats["live_curve"]
    assert set(curve) == {"cpu", "disk"}
    assert curve["cpu"]["capacity_blocks"] == 4 and curve["disk"]["capacity_blocks"] == 64
    for snap in curve.values():  # the first lookup missed; the put stored all three
        assert snap["num_lookups"] == 4 and snap["num_blocks"] == 10
        assert snap["hit_ratio"]["1"] == pytest.approx(9 / 10)
    assert stats["admission"]["choices"] == {"disk": "all"}


def test_the_curve_is_on_by_default_and_can_be_turned_off() -> None:
    with build_store(StoreConfig(cpu_bytes=1 << 20)) as store:
        store.put_many("ns", [block(1)])
        store.lookup("ns", [key(1)])
        assert store.stats()["live_curve"]["cpu"]["num_lookups"] == 1
    with build_store(StoreConfig(cpu_bytes=1 << 20, live_curve=False)) as store:
        store.put_many("ns", [block(1)])
        store.lookup("ns", [key(1)])
        assert "live_curve" not in store.stats() and store.live_curve is None
    with pytest.raises(ValueError, match="live_curve_sample_keys"):
        StoreConfig(cpu_bytes=1 << 20, live_curve_sample_keys=0)


def test_admission_choices_name_each_filtered_tier() -> None:
    tiers = ("cpu", "disk", "redis")
    fixed = make_admission_policy(AdmissionConfig(admission_policy="tinylfu"))
    assert admission_choices(fixed, tiers) == {"disk": "tinylfu", "redis": "tinylfu"}
    adaptive = make_admission_policy(AdmissionConfig(), tier_bytes={"cpu": 640, "disk": 6400})
    assert admission_choices(adaptive, tiers) == {"disk": "all", "redis": "all"}
    adaptive.record([key(1)])
    adaptive.admit(key(1), tier="disk", nbytes=64)  # builds disk's simulation: starts as all
    assert admission_choices(adaptive, tiers) == {"disk": "all", "redis": "all"}
    every = make_admission_policy(AdmissionConfig(admission_cheap_tiers=""))
    assert admission_choices(every, tiers) == {"disk": "all", "redis": "all"}
