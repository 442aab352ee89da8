"""Each policy's decisions, pinned and cheap tiers, generated blocks, the counts per tier, and
counts that add up when threads record and ask at once."""

from __future__ import annotations

import random
import threading

import pytest

from cachetier.admission import (
    ADMISSION_POLICIES,
    POLICY_CLASSES,
    AdmissionConfig,
    AdmissionPolicy,
    SecondHit,
    StoreAll,
    TinyLFU,
    make_admission_policy,
)
from cachetier.primitives.keys import BlockHash


def _keys(n: int, seed: int = 0) -> list[BlockHash]:
    rng = random.Random(seed)
    return [BlockHash(rng.randbytes(32)) for _ in range(n)]


def _policy(name: str, **settings: object) -> AdmissionPolicy:
    return make_admission_policy(AdmissionConfig(admission_policy=name, **settings))  # type: ignore[arg-type]


def test_every_named_policy_has_its_class() -> None:
    assert tuple(POLICY_CLASSES) == ADMISSION_POLICIES
    for name, cls in POLICY_CLASSES.items():
        assert type(_policy(name)) is cls
    assert type(make_admission_policy()) is POLICY_CLASSES[AdmissionConfig().admission_policy]


def test_all_writes_every_block_and_remembers_nothing() -> None:
    policy = _policy("all")
    assert isinstance(policy, StoreAll)
    (key,) = _keys(1)
    assert policy.admit(key, tier="disk", nbytes=10)
    assert policy.admit(key, tier="redis", nbytes=10, generated=True)
    assert policy.nbytes == 0


def test_second_hit_writes_a_block_seen_before() -> None:
    policy = _policy("second_hit", admission_tracked_keys=100)
    assert isinstance(policy, SecondHit)
    key, other = _keys(2)
    policy.record([key, other])
    assert not policy.admit(key, tier="disk", nbytes=1)
    assert policy.admit(key, tier="cpu", nbytes=1)  # the cheap tier takes everything
    policy.record([key])
    assert policy.admit(key, tier="disk", nbytes=1)
    assert not policy.admit(other, tier="disk", nbytes=1)


def test_second_hit_forgets_past_its_window() -> None:
    policy = _policy("second_hit", admission_tracked_keys=10)
    key, *fillers = _keys(11)
    policy.record([key, *fillers])  # key is the oldest of 11: forgotten
    policy.record([key])
    assert not policy.admit(key, tier="disk", nbytes=1)


@pytest.mark.parametrize("threshold", [1, 2, 3, 5])
def test_tinylfu_writes_a_block_seen_threshold_times(threshold: int) -> None:
    policy = _policy("tinylfu", admission_threshold=threshold)
    assert isinstance(policy, TinyLFU)
    (key,) = _keys(1)
    verdicts = []
    for _ in range(6):
        policy.record([key])
        verdicts.append(policy.admit(key, tier="disk", nbytes=1))
    assert verdicts == [n >= threshold for n in range(1, 7)]


def test_tinylfu_writes_a_block_only_if_it_outnumbers_the_victim() -> None:
    policy = _policy("tinylfu", admission_threshold=2)
    key, cold, hot = _keys(3)
    policy.record([key, key, key, cold, hot, hot, hot, hot])
    assert policy.admit(key, tier="disk", nbytes=1, victim=cold)
    assert not policy.admit(key, tier="disk", nbytes=1, victim=hot)
    policy.record([key])  # 4 sightings each: a tie keeps the victim
    assert not policy.admit(key, tier="disk", nbytes=1, victim=hot)


@pytest.mark.parametrize("name", ADMISSION_POLICIES)
def test_pinned_blocks_are_always_written(name: str) -> None:
    policy = _policy(name, admission_generated="refuse")
    (key,) = _keys(1)
    for tier in ("cpu", "disk", "redis", "remote"):
        assert policy.admit(key, tier=tier, nbytes=1, pinned=True)
        assert policy.admit(key, tier=tier, nbytes=1, pinned=True, generated=True)


@pytest.mark.parametrize("name", ["second_hit", "tinylfu"])
def test_generated_blocks_follow_their_setting(name: str) -> None:
    key, seen = _keys(2)
    cases = {"filter": (False, True), "admit": (True, True), "refuse": (False, False)}
    for mode, expected in cases.items():
        policy = _policy(name, admission_generated=mode)
        policy.record([key, seen, seen])
        got = (
            policy.admit(key, tier="disk", nbytes=1, generated=True),
            policy.admit(seen, tier="disk", nbytes=1, generated=True),
        )
        assert got == expected, mode
        assert policy.admit(key, tier="cpu", nbytes=1, generated=True)  # cheap: always


def test_cheap_tiers_are_a_setting() -> None:
    (key,) = _keys(1)
    none_cheap = _policy("second_hit", admission_cheap_tiers="")
    none_cheap.record([key])
    assert not none_cheap.admit(key, tier="cpu", nbytes=1)
    two_cheap = _policy("second_hit", admission_cheap_tiers="cpu, disk")
    two_cheap.record([key])
    assert two_cheap.admit(key, tier="disk", nbytes=1)
    assert not two_cheap.admit(key, tier="redis", nbytes=1)


def test_decisions_are_counted_per_tier_in_blocks_and_bytes() -> None:
    policy = _policy("second_hit")
    a, b = _keys(2)
    policy.record([a, b, b])
    policy.admit(a, tier="disk", nbytes=100)  # refused
    policy.admit(b, tier="disk", nbytes=30)  # admitted
    policy.admit(a, tier="cpu", nbytes=100)  # admitted: cheap
    policy.admit(a, tier="redis", nbytes=7)  # refused
    policy.admit(a, tier="redis", nbytes=5, pinned=True)  # admitted
    snapshot = policy.stats()
    assert {tier: s.as_dict() for tier, s in snapshot.items()} == {
        "disk": {"admitted": 1, "refused": 1, "bytes_admitted": 30, "bytes_refused": 100},
        "cpu": {"admitted": 1, "refused": 0, "bytes_admitted": 100, "bytes_refused": 0},
        "redis": {"admitted": 1, "refused": 1, "bytes_admitted": 5, "bytes_refused": 7},
    }
    policy.admit(a, tier="disk", nbytes=1)
    assert snapshot["disk"].refused == 1  # a snapshot, not the live counts
    assert policy.stats()["disk"].refused == 2


@pytest.mark.parametrize("name", ADMISSION_POLICIES)
def test_threads_recording_and_asking_at_once_lose_no_count(name: str) -> None:
    policy = _policy(name, admission_tracked_keys=50_000)
    num_threads, per_thread = 8, 500
    barrier = threading.Barrier(num_threads)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        keys = _keys(per_thread, seed=100 + seed)
        try:
            barrier.wait()
            for key in keys:
                policy.record([key, key])  # seen twice: every filter admits it
                assert policy.admit(key, tier="disk", nbytes=3)
                policy.admit(key, tier="cpu", nbytes=2)
        except BaseException as exc:  # reported below, with the thread's seed
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    total = num_threads * per_thread
    stats = policy.stats()
    assert stats["disk"].as_dict() == {
        "admitted": total,
        "refused": 0,
        "bytes_admitted": 3 * total,
        "bytes_refused": 0,
    }
    assert stats["cpu"].admitted == total
