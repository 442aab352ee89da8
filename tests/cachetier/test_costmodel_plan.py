"""The cost model's load / recompute plan, made from measured tier rates and a fitted prefill
model: which blocks load, which recompute, and when a refusal is worth its risk. What the
model learns from measurements is ``test_costmodel_measures``."""

from __future__ import annotations

import logging

import pytest

from cachetier.store.costmodel import (
    CopyRate,
    CostModel,
    EstimateError,
    LoadPlan,
    PrefillModel,
    TierRates,
)
from tests.support import FakeClock

BLOCK_BYTES = 1 << 20
BLOCK_SIZE = 16

STILL = FakeClock()  # a clock that never moves: no tier ever looks stale


def rates_with(clock: FakeClock = STILL, **gbps: float) -> TierRates:
    """Rates as if each tier had been read at ``gbps`` GB/s with 1 ms round trips."""
    rates = TierRates(clock)
    for tier, speed in gbps.items():
        rates.observe_latency(tier, 1e-3)
        rates.observe_read(tier, 100 * BLOCK_BYTES, 1e-3 + 100 * BLOCK_BYTES / (speed * 1e9))
    return rates


def trusted() -> EstimateError:
    """An error with no default margin: the tests of a plan's shape weigh bare estimates."""
    return EstimateError(default_margin=0.0)


def linear_prefill(seconds_per_token: float, error: EstimateError | None = None) -> PrefillModel:
    model = PrefillModel(error=error or trusted())
    for n in (64, 256, 1024, 4096):
        model.observe(n, PrefillModel.attention_work(n, 0), n * seconds_per_token)
    return model


def plan(model: CostModel, spans: list[tuple[str, int]], num_tokens: int = 4096) -> LoadPlan:
    return model.plan(
        spans,
        block_bytes=BLOCK_BYTES,
        block_size=BLOCK_SIZE,
        cached_tokens=0,
        num_tokens=num_tokens,
        chunk_tokens=2048,
    )


def test_a_fast_tier_is_loaded_a_slow_one_recomputed() -> None:
    prefill = linear_prefill(1e-4)  # 4,096 tokens in 0.41 s
    fast = CostModel(rates_with(disk=5.0), prefill, clock=STILL)
    # 256 blocks of 1 MiB: 0.05 s at 5 GB/s, 27 s at 0.01 GB/s.
    assert plan(fast, [("disk", 256)]).num_load_blocks == 256
    slow = CostModel(rates_with(remote=0.01), prefill, clock=STILL)
    chosen = plan(slow, [("remote", 256)])
    assert chosen.num_load_blocks == 0 and chosen.num_recompute_blocks == 256
    assert chosen.reason == "model"
    assert chosen.est_ttft_s == pytest.approx(chosen.est_recompute_all_s)
    assert chosen.est_load_all_s is not None and chosen.est_load_all_s > 20


def test_the_copy_into_the_engine_counts_with_the_read() -> None:
    # A fast disk read whose copy into the engine's memory is slow (a GPU pool over PCIe): the
    # read alone beats the recompute, read and copy together do not.
    prefill = linear_prefill(1e-4)  # 4,096 tokens in 0.41 s
    copy = CopyRate()
    assert copy.seconds_per_byte is None and copy.snapshot() == {"copy_gbps": None, "copies": 0}
    unmeasured = CostModel(rates_with(disk=5.0), prefill, copy=copy, clock=STILL)
    assert plan(unmeasured, [("disk", 256)]).num_load_blocks == 256  # no copy measured: none
    copy.observe(256 * BLOCK_BYTES, 1.0)  # 0.27 GB/s
    chosen = plan(unmeasured, [("disk", 256)])
    assert chosen.num_load_blocks == 0
    assert chosen.est_load_all_s is not None and chosen.est_load_all_s > 1.0
    assert copy.snapshot() == {"copy_gbps": pytest.approx(0.2684, abs=1e-4), "copies": 1}
    # Averaged like a tier's reads: a faster copy counts at once, nothing is learnt from none.
    copy.observe(256 * BLOCK_BYTES, 0.01)
    copy.observe(0, 1.0)
    copy.observe(BLOCK_BYTES, float("nan"))
    assert copy.snapshot()["copies"] == 2
    assert plan(unmeasured, [("disk", 256)]).num_load_blocks == 256


def quadratic_prefill() -> PrefillModel:
    prefill = PrefillModel(error=trusted())
    for n, cached in [(256, 0), (1024, 0), (2048, 0), (2048, 2048), (1024, 3072)]:
        work = PrefillModel.attention_work(n, cached)
        prefill.observe(n, work, 1e-3 + 1e-5 * n + 4e-8 * work)
    return prefill


def test_a_link_a_little_slower_than_compute_loads_the_late_blocks() -> None:
    # Every block costs the same to load, but a late block costs more to compute (it attends
    # to more context): the best plan recomputes the early blocks and loads the late ones. The
    # plan must be the exact minimum over every such split.
    prefill = quadratic_prefill()
    rates = rates_with(remote=0.7)
    chosen = plan(CostModel(rates, prefill, clock=STILL), [("remote", 256)])
    rate = rates.get("remote")
    assert rate is not None

    def ttft(j: int) -> float:  # recompute [0, j), load [j, 256), then the suffix
        early = prefill.recompute_s(0, j * BLOCK_SIZE, 2048)
        load = rate.read_s((256 - j) * BLOCK_BYTES) if j < 256 else 0.0
        assert early is not None and load is not None
        return early + load

    best = min(ttft(j) for j in range(257))
    assert 0 < chosen.load_start < 256 and chosen.load_end == 256
    assert ttft(chosen.load_start) <= max(best * 1.02, best + 1e-3) + 1e-12
    assert chosen.est_ttft_s is not None and chosen.est_recompute_all_s is not None
    assert chosen.est_ttft_s < min(chosen.est_recompute_all_s, chosen.est_load_all_s or 0)
    assert chosen.est_saved_s == pytest.approx(chosen.est_recompute_all_s - chosen.est_ttft_s)
    # An engine that takes only a loaded prefix gets all or nothing here.
    prefix = CostModel(rates, prefill, clock=STILL).plan(
        [("remote", 256)],
        block_bytes=BLOCK_BYTES,
        block_size=BLOCK_SIZE,
        cached_tokens=0,
        num_tokens=4096,
        chunk_tokens=2048,
        prefix_only=True,
    )
    assert prefix.load_start == 0 and prefix.num_load_blocks in (0, 256)


def overlapped_plan(model: CostModel, blocks: int, num_tokens: int) -> LoadPlan:
    return model.plan(
        [("remote", blocks)],
        block_bytes=BLOCK_BYTES,
        block_size=BLOCK_SIZE,
        cached_tokens=0,
        num_tokens=num_tokens,
        chunk_tokens=2048,
        overlap_tiers={"remote"},
    )


def test_a_tail_read_beside_the_head_costs_the_longer_of_the_two() -> None:
    # A link slower than compute: in series, loading gains nothing on recomputing all. An
    # engine that reads the tail while it computes the head loads as much as the head hides,
    # and the estimate is max(head, tail read) + suffix, exactly.
    prefill = linear_prefill(1e-3)  # 16 ms a block
    rates = rates_with(remote=0.05)  # 1 MiB blocks: 21 ms a block
    serial = plan(CostModel(rates, prefill, clock=STILL), [("remote", 200)], num_tokens=3216)
    assert serial.est_ttft_s is not None and serial.est_recompute_all_s is not None
    assert serial.est_ttft_s >= 0.98 * serial.est_recompute_all_s
    chosen = overlapped_plan(CostModel(rates, prefill, clock=STILL), 200, 3216)
    rate = rates.get("remote")
    assert rate is not None
    j = chosen.load_start
    assert 0 < j < 200 and chosen.load_end == 200
    head = prefill.recompute_s(0, j * BLOCK_SIZE, 2048)
    suffix = prefill.recompute_s(200 * BLOCK_SIZE, 3216, 2048)
    tail = rate.read_s((200 - j) * BLOCK_BYTES)
    assert head is not None and suffix is not None and tail is not None
    assert chosen.est_ttft_s == pytest.approx(max(head, tail) + suffix)
    assert abs(j - 200 * 21 / 37) <= 20  # where 16 ms x j meets 21 ms x (200 - j)
    assert chosen.est_recompute_all_s is not None
    assert chosen.est_ttft_s < 0.7 * chosen.est_recompute_all_s


def test_a_tier_faster_than_compute_is_not_counted_as_hidden() -> None:
    # At 1 GB/s a block reads in 1 ms against 16 ms of compute: such a read is the cores' own
    # work (a local Redis), so it is counted in series, and loading all of it wins.
    prefill = linear_prefill(1e-3)
    chosen = overlapped_plan(CostModel(rates_with(remote=1.0), prefill, clock=STILL), 200, 3216)
    assert chosen.num_load_blocks == 200


def test_a_gain_within_the_estimates_noise_loads() -> None:
    # 8 blocks read at 10 GB/s after a 1 ms round trip (1.8 ms), against 128 tokens at 10 us
    # each (1.3 ms): the recompute wins on paper by less than the estimates are worth.
    model = CostModel(rates_with(redis=10.0), linear_prefill(1e-5), clock=STILL)
    chosen = plan(model, [("redis", 8)], num_tokens=129)
    assert chosen.num_load_blocks == 8
    assert chosen.est_load_all_s is not None and chosen.est_recompute_all_s is not None
    assert 0 < chosen.est_load_all_s - chosen.est_recompute_all_s < 1e-3
    # At 50 MB/s the same blocks take 0.17 s: a real gain, and the plan recomputes.
    slow = CostModel(rates_with(redis=0.05), linear_prefill(1e-5), clock=STILL)
    assert plan(slow, [("redis", 8)], num_tokens=129).num_load_blocks == 0


def test_a_block_slower_to_fetch_than_to_recompute_is_not_loaded_for_being_close() -> None:
    # 256 blocks of 16 tokens at 1 ms a token: 4.1 s to recompute. Over 20 MB/s a 1 MiB block
    # takes ~53 ms to fetch against 16 ms to recompute, yet loading the first one or two keeps
    # the estimate within 2% of the best. The time they add is more than the compute they
    # free: the plan recomputes all.
    model = CostModel(rates_with(remote=0.02), linear_prefill(1e-3), clock=STILL)
    chosen = plan(model, [("remote", 256)])
    assert chosen.est_recompute_all_s is not None
    one_block = model.rates.get("remote")
    assert one_block is not None
    near = one_block.read_s(BLOCK_BYTES) - 16e-3  # what loading the first block adds
    assert 0 < near < 0.02 * chosen.est_recompute_all_s  # within the 2% the tie-break allows
    assert chosen.num_load_blocks == 0
    assert chosen.est_ttft_s == pytest.approx(chosen.est_recompute_all_s)


def test_spans_of_two_tiers_load_the_fast_one_only() -> None:
    model = CostModel(rates_with(cpu=10.0, remote=0.01), linear_prefill(1e-4), clock=STILL)
    chosen = plan(model, [("cpu", 100), ("remote", 156)])
    assert chosen.num_load_blocks == 100


def test_unmeasured_or_disabled_loads_everything() -> None:
    prefill = linear_prefill(1e-4)
    assert plan(CostModel(TierRates(FakeClock()), prefill), [("disk", 8)]).reason == "unmeasured"
    assert plan(CostModel(rates_with(disk=1.0), PrefillModel()), [("disk", 8)]).reason == (
        "unmeasured"
    )
    off = plan(CostModel(rates_with(remote=1e-4), prefill, enabled=False), [("remote", 8)])
    assert (off.num_load_blocks, off.reason) == (8, "disabled")


def test_an_avoided_tier_is_probed_again_after_a_while() -> None:
    clock = FakeClock()
    model = CostModel(
        rates_with(clock, remote=0.01), linear_prefill(1e-4), probe_interval_s=30, clock=clock
    )
    assert plan(model, [("remote", 256)]).num_load_blocks == 0
    clock.now += 31
    probe = plan(model, [("remote", 256)])
    assert (probe.num_load_blocks, probe.reason) == (1, "probe")


def test_a_plan_names_its_choice_for_the_dashboard() -> None:
    assert LoadPlan.load_all(4, "model").choice == "load_all"
    assert LoadPlan(4, 0, 0, "model").choice == "recompute_all"
    assert LoadPlan(4, 1, 4, "model").choice == "partial"
    assert LoadPlan(4, 0, 2, "model").choice == "partial"


def restarted_over_a_full_folder(error: EstimateError | None = None) -> PrefillModel:
    """What an engine restarted over a folder it filled had seen: its warm-up requests were
    hits, so only 16-token suffixes were computed (after 320 tokens loaded), at 2.9 ms each."""
    model = PrefillModel(error=error)
    for cached in (320, 320, 336):
        model.observe(16, PrefillModel.attention_work(16, cached), 0.0029)
    return model


def plan_347(model: CostModel) -> LoadPlan:
    """A 347-token prompt whose first 10 blocks of 32 tokens the disk holds."""
    return model.plan(
        [("disk", 10)],
        block_bytes=BLOCK_BYTES,
        block_size=32,
        cached_tokens=0,
        num_tokens=347,
        chunk_tokens=2048,
    )


def test_a_model_started_from_hits_only_loads_a_longer_prompt() -> None:
    # 10 blocks of 1 MiB at 0.135 GB/s: 78 ms to load. The line through 16-token steps puts
    # the whole prompt's recompute below that: on those estimates alone the plan would
    # recompute every stored block (measured: 0.84 s, against 63 ms estimated).
    prefill = restarted_over_a_full_folder(trusted())
    model = CostModel(rates_with(disk=0.135), prefill, clock=STILL)
    estimate = prefill.recompute_s(0, 347, 2048)
    chosen = plan_347(model)
    assert chosen.est_load_all_s is not None and estimate is not None
    assert estimate < chosen.est_load_all_s
    assert not prefill.covers(0, 347, 2048) and prefill.measured_range[0] == 16
    assert (chosen.num_load_blocks, chosen.reason) == (10, "unmeasured_length")
    assert not chosen.refused


def test_a_calibrated_model_still_refuses_a_thin_link() -> None:
    # One forward at a realistic length (what an engine runs at start) puts the prompt inside
    # the measured range: a link 1,000 times too slow is still refused.
    prefill = restarted_over_a_full_folder(trusted())
    prefill.observe(512, PrefillModel.attention_work(512, 0), 1.2)
    assert prefill.covers(0, 347, 2048)
    chosen = plan_347(CostModel(rates_with(disk=0.0001), prefill, clock=STILL))
    assert (chosen.num_load_blocks, chosen.reason) == (0, "model")
    assert chosen.refused and chosen.choice == "recompute_all"


def tight_plan(error: EstimateError) -> LoadPlan:
    # 8 blocks of 1 MiB over 0.01 GB/s: 0.105 s each to load, against 256 tokens at 0.28 ms
    # each (0.072 s) to recompute: every block loads 1.46 times slower than it computes.
    model = CostModel(rates_with(remote=0.01), linear_prefill(2.8e-4, error), clock=STILL)
    return model.plan(
        [("remote", 8)],
        block_bytes=BLOCK_BYTES,
        block_size=256,
        cached_tokens=0,
        num_tokens=2049,
        chunk_tokens=2048,
        prefix_only=True,
        request_id="r1",
    )


def test_a_refusal_needs_a_gain_beyond_the_measured_error() -> None:
    bare = tight_plan(trusted())
    assert bare.refused and bare.margin == 0.0
    assert bare.est_load_all_s is not None and bare.est_ttft_s is not None
    assert bare.est_ttft_s < bare.est_load_all_s < 1.5 * bare.est_ttft_s
    # Nothing known of the model's error: the default margin (the recompute, doubled, must
    # still win) is not met, and the hit loads.
    error = EstimateError()
    held = tight_plan(error)
    assert (held.num_load_blocks, held.reason, held.margin) == (8, "within_error", 1.0)
    # Refusals whose estimates came true lower the margin below the gain: the plan refuses.
    model = CostModel(rates_with(remote=0.01), linear_prefill(2.8e-4, error), clock=STILL)
    for _ in range(4):
        model.observe_outcome(bare, bare.est_compute_s or 0.0)
    assert error.margin == pytest.approx(0.0)
    assert tight_plan(error).refused
    # Then one that cost three times its estimate: the margin outgrows the gain again.
    model.observe_outcome(bare, 3 * (bare.est_compute_s or 0.0))
    assert error.margin > 0.5
    assert tight_plan(error).reason == "within_error"


def test_a_refusal_and_its_outcome_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    error = trusted()
    with caplog.at_level(logging.INFO, logger="cachetier.store.costmodel"):
        chosen = tight_plan(error)
    assert chosen.refused and chosen.est_compute_s is not None
    assert chosen.est_ttft_s is not None and chosen.est_load_all_s is not None
    (line,) = [r.getMessage() for r in caplog.records]
    assert "r1" in line and "recomputes 8 of 8" in line
    assert f"{chosen.est_ttft_s:.4f} s" in line and f"{chosen.est_load_all_s:.4f} s" in line
    caplog.clear()
    model = CostModel(rates_with(remote=0.01), linear_prefill(2.8e-4, error), clock=STILL)
    with caplog.at_level(logging.INFO, logger="cachetier.store.costmodel"):
        model.observe_outcome(chosen, 1.25, request_id="r1")
        model.observe_outcome(LoadPlan.load_all(8, "model"), 9.0)  # no refusal: nothing
    (line,) = [r.getMessage() for r in caplog.records]
    assert "r1" in line and "1.2500 s" in line and f"{chosen.est_compute_s:.4f} s" in line
    assert error.num_outcomes == 1
