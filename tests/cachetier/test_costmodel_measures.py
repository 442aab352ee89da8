"""What the cost model learns: tier rates from real reads (and nothing from failed calls), the
prefill model fitted to measured steps and the range it covers, and the error of its
estimates. The plans made from them are ``test_costmodel_plan``."""

from __future__ import annotations

import math
import socket
from pathlib import Path

import pytest

from cachetier.record import KVBlock
from cachetier.store.costmodel import EstimateError, PrefillModel, TierRates
from cachetier.store.tiered import TieredStore
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from cachetier.tiers.redis import RedisTier, RedisTierConfig
from tests.support import FakeClock


def test_tier_rates_average_latency_and_read_speed() -> None:
    rates = TierRates(FakeClock())
    assert rates.get("disk") is None
    rates.observe_latency("disk", 0.002)
    rates.observe_read("disk", 10**9, 0.502)  # 0.5 s of transfer after a 2 ms round trip
    rate = rates.get("disk")
    assert rate is not None and rate.num_reads == 1
    assert rate.latency_s == pytest.approx(0.002)
    assert rate.read_s(10**9) == pytest.approx(0.502)
    assert rates.snapshot()["disk"]["read_gbps"] == pytest.approx(2.0)
    # A slower read moves the average part of the way, not all of it.
    rates.observe_read("disk", 10**9, 2.002)
    slower = rates.get("disk")
    assert slower is not None and 0.5 < slower.read_s(10**9) - 0.002 < 2.0


def test_tier_rates_ignore_reads_that_teach_nothing() -> None:
    rates = TierRates(FakeClock())
    rates.observe_read("cpu", 0, 1.0)  # a miss: no bytes
    rates.observe_read("cpu", 100, math.nan)
    rates.observe_read("cpu", 100, -1.0)
    rates.observe_latency("cpu", math.inf)
    assert rates.get("cpu") is None


def test_prefill_model_recovers_a_quadratic_cost() -> None:
    c0, c1, c2 = 0.01, 2e-4, 3e-8
    model = PrefillModel()
    assert model.recompute_s(0, 100, 2048) is None
    for n, cached in [(64, 0), (512, 0), (2048, 0), (2048, 2048), (2048, 4096), (8, 6000)]:
        work = PrefillModel.attention_work(n, cached)
        model.observe(n, work, c0 + c1 * n + c2 * work)
    coef = model.coefficients
    assert coef is not None
    assert coef == pytest.approx((c0, c1, c2), rel=1e-3)
    # 6,000 tokens in chunks of 2,048: three steps, each attending to what came before.
    expected = sum(
        c0 + c1 * n + c2 * PrefillModel.attention_work(n, start)
        for start, n in [(0, 2048), (2048, 2048), (4096, 1904)]
    )
    assert model.recompute_s(0, 6000, 2048) == pytest.approx(expected, rel=1e-3)


def test_prefill_model_never_fits_a_negative_cost() -> None:
    model = PrefillModel()
    # Noisy small steps that a free fit would explain with a negative per-token cost.
    for n, seconds in [(10, 0.05), (20, 0.04), (40, 0.045), (80, 0.05)]:
        model.observe(n, PrefillModel.attention_work(n, 0), seconds)
    coef = model.coefficients
    assert coef is not None and min(coef) >= 0
    assert model.recompute_s(0, 1000, 256) is not None


def block(key: bytes, size: int = 4096) -> KVBlock:
    return KVBlock(key, b"f" * 32, "float32", (size // 4,), 16, bytes(size))


def test_a_store_measures_its_tiers_on_real_gets(tmp_path: Path) -> None:
    disk = DiskTier(DiskTierConfig(root=str(tmp_path), capacity_bytes=1 << 30, fsync=False))
    store = TieredStore([CPUTier(CPUTierConfig(capacity_bytes=1 << 20)), disk])
    keys = [bytes([i]) * 32 for i in range(8)]
    disk.put_many("ns", [block(k) for k in keys])
    assert store.rates.get("disk") is None
    hit = store.lookup("ns", keys)
    assert hit.num_blocks == 8
    restored = store.restore_prefix("ns", keys, hit=hit)
    assert len(restored.blocks) == 8
    rates = store.stats()["rates"]
    assert rates["disk"]["reads"] == 1 and rates["disk"]["read_gbps"] > 0
    assert rates["disk"]["latency_ms"] >= 0
    store.close()


def test_a_link_that_recovered_is_trusted_again_within_a_few_reads() -> None:
    rates = TierRates(FakeClock())
    rates.observe_read("remote", 10**8, 50.0)  # 2 MB/s: a thin link
    for _ in range(3):
        rates.observe_read("remote", 10**8, 0.25)  # 400 MB/s again
    rate = rates.get("remote")
    assert rate is not None and rate.read_s(10**8) is not None
    # A plain mean of seconds per byte would still say ~6 MB/s here (17 s for 100 MB).
    assert rate.read_s(10**8) < 0.5  # type: ignore[operator]


def test_calls_that_failed_teach_nothing_about_a_tier() -> None:
    # A Redis that accepts connections and never answers: every call times out. Those timeouts
    # are the outage, not the link's speed; learnt, they would keep a Redis that came back
    # looking slow, and its hits recomputed, long after it recovered.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        redis = RedisTier(
            RedisTierConfig(
                url=f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.05, connect_timeout_s=0.05
            )
        )
        store = TieredStore([CPUTier(CPUTierConfig(capacity_bytes=1 << 20)), redis])
        keys = [bytes([i]) * 32 for i in range(4)]
        assert store.lookup("ns", keys).num_blocks == 0
        assert store.get_many("ns", keys) == [None] * 4
        assert redis.num_errors >= 2
        assert store.rates.get("redis") is None
        assert store.rates.get("cpu") is not None  # the tier that answered is measured
        store.close()


def test_the_measured_range_is_what_still_weighs_in_the_fit() -> None:
    prefill = PrefillModel(decay=0.98)
    prefill.observe(512, PrefillModel.attention_work(512, 0), 1.2)
    prefill.observe(16, PrefillModel.attention_work(16, 0), 0.003)
    assert prefill.covers(0, 347, 2048) and prefill.covers(0, 512, 2048)
    assert not prefill.covers(0, 513, 2048)  # one token more than any step measured
    assert not prefill.covers(400, 747, 2048)  # as many tokens, more context
    assert prefill.covers(0, 512, 128)  # in steps of 128: each one inside
    assert not prefill.covers(0, 1024, 256)  # the last of these attends to too much
    # 0.98^114 < 0.1: after that many short steps the long one hardly weighs in the fit.
    for _ in range(114):
        prefill.observe(16, PrefillModel.attention_work(16, 0), 0.003)
    assert prefill.measured_range[0] == 16
    assert not prefill.covers(0, 347, 2048)
    snap = prefill.snapshot()
    assert snap["max_step_tokens"] == 16 and snap["error"]["outcomes"] == 0


def test_the_margin_follows_the_measured_error() -> None:
    error = EstimateError(default_margin=1.0, min_outcomes=4)
    assert error.margin == 1.0 and error.num_outcomes == 0
    assert error.observe(0.0, 1.0) is None and error.observe(1.0, math.nan) is None
    assert error.num_outcomes == 0
    # Exact estimates: the default holds until four outcomes are known, then the margin goes.
    for _ in range(3):
        assert error.observe(0.1, 0.1) == pytest.approx(1.0)
    assert error.margin == 1.0
    error.observe(0.1, 0.1)
    assert error.margin == pytest.approx(0.0)
    # One refusal that cost 13 times its estimate: the margin grows past its default.
    assert error.observe(0.063, 0.84) == pytest.approx(0.84 / 0.063)
    grown = error.margin
    assert grown > 1.0
    # Estimates right again: it shrinks back, a step at a time.
    error.observe(0.1, 0.1)
    assert 0 < error.margin < grown
    # An estimate too high is an error too.
    before = error.margin
    error.observe(1.0, 0.1)
    assert error.margin > before
    assert error.snapshot()["outcomes"] == 7
