"""A replica's TTFT estimate: its queue plus the cost model's load-or-recompute of the prompt,
lower for every block held and for a faster medium, higher for a slower tier, and only from
what the replica measured."""

from __future__ import annotations

import pytest

from cachetier.fleet import estimate_all, prefill_from_snapshot, tier_rates_from_snapshot
from cachetier.fleet.estimate import ReplicaEstimate
from tests.cachetier.fleet.fleet_views import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    PREFILL,
    TIERS,
    make_cost,
    request,
    view,
)


def one(media: tuple[str, ...], **more: object) -> ReplicaEstimate:
    return estimate_all(request(), [view("r0", media, **more)])["r0"]


def ttft(media: tuple[str, ...], **more: object) -> float:
    est = one(media, **more).ttft_s
    assert est is not None
    return est


def test_nothing_held_is_the_prompt_recomputed_at_the_prefill_speed() -> None:
    est = one(())
    assert est.prefix_s == pytest.approx(BLOCK_SIZE * NUM_BLOCKS * PREFILL["s_per_token"])
    assert (est.pool_blocks, est.local_blocks, est.shared_blocks, est.loaded_blocks) == (0,) * 4


def test_the_pool_is_free_and_the_rest_is_recomputed() -> None:
    est = one(("pool",) * 3)
    assert est.pool_blocks == 3 and est.held_blocks == 3
    assert est.prefix_s == pytest.approx(BLOCK_SIZE * (NUM_BLOCKS - 3) * PREFILL["s_per_token"])


@pytest.mark.parametrize("medium", ["pool", "disk", "redis"])
def test_every_block_more_held_lowers_the_estimate(medium: str) -> None:
    estimates = [ttft((medium,) * k) for k in range(NUM_BLOCKS + 1)]
    assert all(a > b for a, b in zip(estimates, estimates[1:])), estimates


def test_a_faster_medium_for_the_same_blocks_lowers_the_estimate() -> None:
    blocks = 5
    pool, disk, redis, none = (ttft((m,) * blocks) for m in ("pool", "disk", "redis", "x"))
    assert pool < disk < redis < none


def test_a_slower_tier_raises_the_estimate() -> None:
    slow = {**TIERS, "disk": {"latency_ms": 1.0, "read_gbps": 0.5}}
    fast = ttft(("disk",) * 6)
    assert ttft(("disk",) * 6, cost=make_cost(tiers=slow)) > fast
    higher_latency = {**TIERS, "disk": {"latency_ms": 50.0, "read_gbps": 4.0}}
    assert ttft(("disk",) * 6, cost=make_cost(tiers=higher_latency)) > fast


def test_a_slower_prefill_raises_the_estimate_of_what_is_computed() -> None:
    slow = make_cost(prefill={**PREFILL, "s_per_token": 2e-3})
    assert ttft(("pool",) * 2, cost=slow) > ttft(("pool",) * 2)
    # A whole prompt in the pool computes nothing: the prefill speed does not matter.
    assert ttft(("pool",) * NUM_BLOCKS, cost=slow) == ttft(("pool",) * NUM_BLOCKS) == 0.0


def test_the_queue_adds_its_seconds() -> None:
    assert ttft(("disk",) * 4, pending_s=2.5) == pytest.approx(ttft(("disk",) * 4) + 2.5)


def test_blocks_are_counted_by_where_they_are_read() -> None:
    cpu = {"latency_ms": 0.1, "read_gbps": 10.0}
    sidecar = {"latency_ms": 2.0, "read_gbps": 1.0}
    est = one(
        ("pool", "pool", "cpu", "disk", "redis", "sidecar"),
        cost=make_cost(tiers={**TIERS, "cpu": cpu, "sidecar": sidecar}),
    )
    assert (est.pool_blocks, est.local_blocks, est.shared_blocks) == (2, 2, 2)
    assert est.loaded_blocks == 4  # every load beats its recompute here


def test_a_tier_the_replica_has_not_measured_counts_as_recomputed() -> None:
    only_disk = make_cost(tiers={"disk": TIERS["disk"]})
    est = one(("disk", "disk", "redis", "redis"), cost=only_disk)
    assert (est.local_blocks, est.shared_blocks) == (2, 0)
    assert est.ttft_s == pytest.approx(ttft(("disk", "disk")))


def test_a_pool_block_after_a_gap_counts_as_recomputed() -> None:
    est = one(("pool", "disk", "pool", "disk"))
    assert (est.pool_blocks, est.local_blocks) == (1, 1)


def test_an_unmeasured_prefill_gives_no_estimate() -> None:
    est = one(("disk",) * 2, cost=make_cost(prefill=None))
    assert est.prefix_s is None and est.ttft_s is None


def test_replicas_down_get_no_estimate_and_equal_ones_get_equal_estimates() -> None:
    views = [view("a", ("disk",) * 3), view("b", up=False), view("c", ("disk",) * 3)]
    estimates = estimate_all(request(), views)
    assert list(estimates) == ["a", "c"]
    assert estimates["a"].ttft_s == estimates["c"].ttft_s


def test_a_prefill_snapshot_is_rebuilt_with_its_coefficients_and_range() -> None:
    recorded = {
        "step_s": 0.044676,
        "s_per_token": 0.0014167818,
        "s_per_attention": 1.0042838e-07,
        "max_step_tokens": 2066,
        "max_step_attention": 2134178.0,
    }
    model = prefill_from_snapshot(recorded)
    assert model.coefficients == pytest.approx((0.044676, 0.0014167818, 1.0042838e-07))
    assert model.measured_range == (2066, 2134178.0)
    assert prefill_from_snapshot(None).coefficients is None
    assert prefill_from_snapshot({**recorded, "s_per_token": None}).coefficients is None


def test_tier_rates_are_rebuilt_and_a_tier_without_a_read_speed_is_left_out() -> None:
    rates = tier_rates_from_snapshot(
        {"disk": {"latency_ms": 2.0, "read_gbps": 4.0}, "redis": {"read_gbps": None}}
    )
    disk = rates.get("disk")
    assert disk is not None and disk.latency_s == pytest.approx(2e-3)
    assert disk.read_s(4_000_000_000, calls=0) == pytest.approx(1.0)
    assert rates.get("redis") is None
