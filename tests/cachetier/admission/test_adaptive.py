"""Adaptive admission: the key sample, the ghost tiers, switching with hysteresis, bounded
memory, and what a restart reloads from the state file (or refuses, when it is damaged)."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest

from cachetier.admission import (
    Adaptive,
    AdmissionConfig,
    AdmissionStateFile,
    GhostLRU,
    KeySample,
    make_admission_policy,
)
from cachetier.admission.simulation import SWITCH_MARGIN, WINDOW_REFS, TierSimulation

CONFIG = AdmissionConfig(admission_tracked_keys=5_000, admission_sample_keys=4_096)
CHEAP, TIER = 50, 100  # blocks: a small disk below a smaller CPU tier


def _keys(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def _scan_traffic(num_requests: int, seed: int = 0) -> list[list[bytes]]:
    """Each request: one of 80 reused keys, then three keys never seen again. Store-all lets
    the one-hit keys flush the reused ones out of a 100-block disk; a filter keeps them out."""
    reused = _keys(80, seed)
    fresh = iter(_keys(3 * num_requests, seed + 1))
    return [[reused[i % 80], next(fresh), next(fresh), next(fresh)] for i in range(num_requests)]


def _reuse_once_traffic(num_requests: int, seed: int = 2) -> list[list[bytes]]:
    """Each request's keys come back once, 30 requests later: only store-all has them then."""
    out: list[list[bytes]] = []
    for i in range(num_requests):
        out.append(out[i - 30] if i % 60 >= 30 else _keys(2, seed * 100_000 + i))
    return out


def test_a_sample_keeps_about_its_rate_and_the_same_keys_everywhere() -> None:
    keys = _keys(40_000, 3)
    sample = KeySample(0.25)
    kept = [k for k in keys if sample.keeps(k)]
    assert 0.23 < len(kept) / len(keys) < 0.27
    assert kept == [k for k in keys if KeySample(0.25).keeps(k)]
    assert all(KeySample(0.5).keeps(k) for k in kept)  # a larger sample holds a smaller one
    assert sample.scaled(1_000) == 250 and sample.scaled(1) == 1
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="sampling rate"):
            KeySample(bad)
    with pytest.raises(ValueError, match="digest"):
        sample.keeps(b"short")


def test_a_ghost_lru_holds_its_capacity_and_evicts_the_least_recent() -> None:
    lru = GhostLRU(3)
    a, b, c, d = _keys(4, 4)
    assert lru.put(a) and lru.put(b) and lru.put(c)
    assert not lru.put(a)  # a refresh, not a write: a is now the most recent
    lru.put(d)
    assert len(lru) == 3 and not lru.holds(b) and lru.holds(a)


def test_the_simulation_switches_to_a_filter_and_back_to_store_all() -> None:
    sim = TierSimulation(CONFIG, CHEAP, TIER)
    assert sim.choice == "all" and sim.sample.rate == 1.0
    for keys in _scan_traffic(4_000):
        sim.request(keys)
    ratios = sim.hit_ratios()
    assert sim.choice in ("second_hit", "tinylfu"), ratios
    assert ratios[sim.choice] > ratios["all"] + SWITCH_MARGIN
    for keys in _reuse_once_traffic(6_000):
        sim.request(keys)
    assert sim.choice == "all", sim.hit_ratios()


def test_a_lead_within_the_margin_does_not_switch() -> None:
    sim = TierSimulation(CONFIG, CHEAP, TIER)
    refs = WINDOW_REFS * 10
    # Every candidate hits as often as store-all, second_hit a hair more: no switch.
    sim.restore(
        {
            **sim.snapshot(),
            "refs": refs,
            "hits": {
                "all": 0.30 * refs,
                "second_hit": (0.30 + SWITCH_MARGIN / 2) * refs,
                "tinylfu": 0.2 * refs,
            },
        }
    )
    for keys in [[k] for k in _keys(WINDOW_REFS, 9)]:  # a window of keys seen once: no hits
        sim.request(keys)
    assert sim.num_windows == 1 and sim.choice == "all"
    sim.restore(
        {
            **sim.snapshot(),
            "hits": {
                "all": 0.30 * refs,
                "second_hit": (0.30 + 3 * SWITCH_MARGIN) * refs,
                "tinylfu": 0.2 * refs,
            },
            "refs": refs,
        }
    )
    for keys in [[k] for k in _keys(WINDOW_REFS, 10)]:
        sim.request(keys)
    assert sim.choice == "second_hit"


def test_memory_is_bounded_by_the_sample_whatever_the_traffic() -> None:
    config = AdmissionConfig(admission_tracked_keys=100_000, admission_sample_keys=500)
    sim = TierSimulation(config, 2_000, 8_000)
    assert sim.sample.rate == pytest.approx(500 / 10_000, rel=0.01)
    before = sim.nbytes
    for keys in _scan_traffic(30_000, seed=5):
        sim.request(keys)
    assert sim.nbytes == before  # fixed at construction
    assert sim.num_keys() <= 3 * 500  # the cheap ghost and three candidates' ghosts
    assert sim._cheap is not None and len(sim._cheap) <= round(2_000 * sim.sample.rate)


def _adaptive(state: Path | None = None, **tiers: int) -> Adaptive:
    policy = make_admission_policy(
        CONFIG,
        tier_bytes=tiers or {"cpu": CHEAP, "disk": TIER},
        state_file=AdmissionStateFile(state) if state else None,
    )
    assert isinstance(policy, Adaptive)
    return policy


def _drive(policy: Adaptive, traffic: list[list[bytes]]) -> int:
    """Record and ask as a store does; returns the disk's admitted blocks."""
    admitted = 0
    for keys in traffic:
        policy.record(keys)
        admitted += sum(policy.admit(k, tier="disk", nbytes=1) for k in keys)
    return admitted


def test_the_policy_admits_as_its_choice_and_restarts_from_the_state_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    policy = _adaptive(path)
    assert policy.admit(_keys(1, 11)[0], tier="disk", nbytes=1)  # first sighting: store-all
    traffic = _scan_traffic(4_000, seed=12)
    admitted = _drive(policy, traffic)
    choice = policy.choices()["disk"]
    assert choice in ("second_hit", "tinylfu")
    assert admitted < 0.6 * 4 * len(traffic)  # the filter refused most one-hit blocks
    assert path.exists()  # a switch is kept at once
    doc = json.loads(path.read_text())
    assert doc["tiers"]["disk"]["choice"] == choice
    restarted = _adaptive(path)
    fresh = _keys(1, 13)[0]
    restarted.record([fresh])
    assert not restarted.admit(fresh, tier="disk", nbytes=1)  # admits as the filter at once
    assert restarted.choices() == {"disk": choice}
    other = _adaptive(path, cpu=CHEAP, disk=TIER * 2)  # another capacity: learnt nothing
    other.record([fresh])
    assert other.admit(fresh, tier="disk", nbytes=1) and other.choices() == {"disk": "all"}


@pytest.mark.parametrize(
    "damage",
    ["garbage", "flipped", "forged_choice", "huge", "wrong_version", "nan", "directory"],
)
def test_a_damaged_state_file_starts_as_store_all(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.json"
    policy = _adaptive(path)
    _drive(policy, _scan_traffic(4_000, seed=14))
    assert policy.choices()["disk"] != "all"
    text = path.read_text()
    if damage == "garbage":
        path.write_bytes(b"\x00{not json")
    elif damage == "flipped":  # a score changed without its checksum
        doc = json.loads(text)
        doc["tiers"]["disk"]["refs"] += 1
        path.write_text(json.dumps(doc))
    elif damage == "forged_choice":
        path.write_text(text.replace(policy.choices()["disk"], "lfu"))
    elif damage == "huge":
        path.write_text(text + " " * 70_000)
    elif damage == "wrong_version":
        path.write_text(text.replace('"version": 1', '"version": 9'))
    elif damage == "nan":
        path.write_text(text.replace('"refs": ', '"refs": NaN, "x": '))
    else:
        path.unlink()
        path.mkdir()
    with caplog.at_level(logging.WARNING):
        restarted = _adaptive(path)
    fresh = _keys(1, 15)[0]
    restarted.record([fresh])
    assert restarted.admit(fresh, tier="disk", nbytes=1)  # store-all: the first sighting
    assert restarted.choices() == {"disk": "all"}
    if damage != "directory":
        assert "starting as store-all" in caplog.text


def test_a_tier_of_unknown_capacity_is_written_as_store_all() -> None:
    policy = _adaptive(cpu=CHEAP, disk=TIER)
    _drive(policy, _scan_traffic(4_000, seed=16))
    key = _keys(1, 17)[0]
    policy.record([key])
    assert not policy.admit(key, tier="disk", nbytes=1)
    assert policy.admit(key, tier="remote", nbytes=1)  # no capacity known: no simulation
    assert set(policy.choices()) == {"disk"}
    assert policy.nbytes > 0
