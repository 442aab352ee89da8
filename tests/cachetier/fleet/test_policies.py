"""Each policy's decision on views built by hand: who is chosen, in which order the rest would
be tried, what is passed over by the imbalance bound, and what happens to a replica that is
down and to replicas that tie."""

from __future__ import annotations

import dataclasses

import pytest

from cachetier.fleet import POLICIES, RoutingConfig, decide, over_bound
from cachetier.fleet.view import ReplicaView, RouteRequest
from tests.cachetier.fleet.fleet_views import make_cost, request, view


def chosen(policy: str, views: list[ReplicaView], **req: object) -> str:
    decision = decide(policy, request(**req), views)  # type: ignore[arg-type]
    assert decision is not None
    return decision.replica


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_decision_orders_the_up_replicas_and_estimates_each(policy: str) -> None:
    views = [view("a", ("disk",) * 2, 1), view("b", up=False), view("c", ("pool",) * 3)]
    decision = decide(policy, request("s1", seq=5), views)
    assert decision is not None and decision.policy == policy
    assert sorted(decision.order) == ["a", "c"] and decision.replica == decision.order[0]
    assert set(decision.estimates) == {"a", "c"}
    assert all(e.ttft_s is not None for e in decision.estimates.values())
    assert decide(policy, request("s1", seq=5), views) == decision  # deterministic


@pytest.mark.parametrize("policy", list(POLICIES))
def test_no_replica_up_is_no_decision(policy: str) -> None:
    assert decide(policy, request("s"), [view("a", up=False)]) is None
    assert decide(policy, request("s"), []) is None


def test_an_unknown_policy_and_a_name_twice_are_refused() -> None:
    with pytest.raises(ValueError, match="tier_aware"):
        decide("random", request(), [view("a")])
    with pytest.raises(ValueError, match="unique"):
        decide("least_loaded", request(), [view("a"), view("a", num_requests=1)])


def test_round_robin_takes_turns_and_passes_over_a_replica_down() -> None:
    views = [view("a"), view("b"), view("c")]
    assert [chosen("round_robin", views, seq=s) for s in range(4)] == ["a", "b", "c", "a"]
    decision = decide("round_robin", request(seq=1), views)
    assert decision is not None and decision.order == ("b", "c", "a")
    views[1] = view("b", up=False)
    assert [chosen("round_robin", views, seq=s) for s in range(4)] == ["a", "c", "a", "c"]


def test_least_loaded_takes_the_fewest_requests_and_ties_rotate() -> None:
    views = [view("a", num_requests=2), view("b", num_requests=1), view("c", num_requests=1)]
    assert chosen("least_loaded", views, seq=0) == "b"
    assert chosen("least_loaded", views, seq=2) == "c"  # b and c tie: the turn decides
    assert chosen("least_loaded", [view("a", ("pool",) * 8, 1), view("b")]) == "b"


def test_session_affinity_keeps_a_session_on_one_replica() -> None:
    views = [view(f"r{i}", num_requests=i) for i in range(8)]
    homes = {s: chosen("session_affinity", views, session_id=s, seq=0) for s in "abcdefghij"}
    assert len(set(homes.values())) > 1  # sessions spread over the replicas
    for session, home in homes.items():
        for seq in (1, 7, 100):
            assert chosen("session_affinity", views, session_id=session, seq=seq) == home


def test_session_affinity_moves_only_the_sessions_of_a_replica_down() -> None:
    views = [view(f"r{i}") for i in range(8)]
    sessions = [f"s{i}" for i in range(40)]
    homes = {s: chosen("session_affinity", views, session_id=s) for s in sessions}
    down = homes["s0"]
    views = [view(v.name, up=v.name != down) for v in views]
    for session in sessions:
        now = chosen("session_affinity", views, session_id=session)
        assert now != down
        if homes[session] != down:
            assert now == homes[session]


def test_session_affinity_without_a_session_is_least_loaded() -> None:
    views = [view("a", num_requests=3), view("b", num_requests=0), view("c", num_requests=1)]
    assert chosen("session_affinity", views, session_id=None) == "b"


def test_pool_only_sees_only_the_pool() -> None:
    views = [view("a", ("disk",) * 8), view("b", ("pool",) * 2), view("c", ("pool",) * 1)]
    assert chosen("pool_only", views) == "b"
    # tier_aware sees the whole prompt on a's disk
    assert chosen("tier_aware", views) == "a"


def test_pool_only_ties_are_broken_by_load() -> None:
    views = [view("a", ("pool",) * 2, 2), view("b", ("pool",) * 2, 1), view("c", ("pool",), 0)]
    assert chosen("pool_only", views) == "b"


def test_tier_aware_weighs_the_queue_against_what_is_held() -> None:
    held, empty = ("disk",) * 8, ()
    # A whole prompt on disk saves ~0.12 s of recompute: worth 0.05 s more queue, not 0.5 s.
    assert chosen("tier_aware", [view("a", held, 1, 0.06), view("b", empty, 1, 0.01)]) == "a"
    assert chosen("tier_aware", [view("a", held, 1, 0.51), view("b", empty, 1, 0.01)]) == "b"


def test_tier_aware_prefers_the_faster_medium_and_then_the_lighter_load() -> None:
    views = [view("a", ("redis",) * 8), view("b", ("disk",) * 8), view("c", ("pool",) * 4)]
    assert chosen("tier_aware", views) == "b"
    even = [view("a", ("disk",) * 8, 2), view("b", ("disk",) * 8, 1)]
    assert chosen("tier_aware", even) == "b"  # equal estimates: the lighter load


def test_tier_aware_uses_each_replicas_own_rates() -> None:
    slow_disk = make_cost(tiers={"disk": {"latency_ms": 1.0, "read_gbps": 0.01}})
    views = [view("a", ("disk",) * 8, cost=slow_disk), view("b", ("redis",) * 8)]
    assert chosen("tier_aware", views) == "b"


def test_the_imbalance_bound_passes_over_a_loaded_replica() -> None:
    views = [view("a", ("pool",) * 8, 5), view("b", (), 1), view("c", (), 0), view("d", (), 0)]
    # mean load 1.5, bound 1.95: a is over it although it holds the whole prompt
    assert over_bound(views, 1.3) == {"a"}
    for policy in ("tier_aware", "pool_only"):
        decision = decide(policy, request(), views)
        assert decision is not None and decision.replica != "a"
        assert decision.skipped == ("a",) and decision.order[-1] == "a"
    # a looser bound lets it through
    loose = decide("tier_aware", request(), views, RoutingConfig(max_imbalance=4.0))
    assert loose is not None and loose.replica == "a" and loose.skipped == ()


def test_a_load_at_the_bound_is_within_it() -> None:
    views = [view("a", (), 13), view("b", (), 7)]  # mean 10: 13 is exactly 1.3 times it
    assert over_bound(views, 1.3) == frozenset()
    assert over_bound([view("a"), view("b")], 1.3) == frozenset()  # an idle fleet


def test_a_replica_routed_too_much_lately_is_passed_over_until_the_others_catch_up() -> None:
    views = [view("a", ("pool",) * 8), view("b"), view("c")]
    counts = {"a": 20.0, "b": 10.0, "c": 0.0}  # mean 10: a is at 2x, past 1.3 x 10 + 1
    views = [dataclasses.replace(v, num_routed=counts[v.name]) for v in views]
    assert over_bound(views, 1.3) == {"a"}
    decision = decide("tier_aware", request(), views)
    assert decision is not None and decision.replica != "a" and decision.skipped == ("a",)
    # when the two bounds together would pass over every replica, only the load bound holds
    loaded = [dataclasses.replace(v, num_requests=0 if v.name == "a" else 9) for v in views]
    assert over_bound(loaded, 1.3) == {"b", "c"}


def test_an_unmeasured_replica_comes_after_the_measured_ones() -> None:
    unmeasured = make_cost(prefill=None)
    views = [view("a", ("pool",) * 8, cost=unmeasured), view("b", (), 0, 1.0)]
    decision = decide("tier_aware", request(), views)
    assert decision is not None and decision.order == ("b", "a")


def test_tier_aware_ties_rotate_with_the_request_count() -> None:
    views = [view(n) for n in "abcd"]
    assert [chosen("tier_aware", views, seq=s) for s in range(5)] == list("abcda")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_tokens": -1, "block_size": 16, "block_bytes": 1},
        {"num_tokens": 1, "block_size": 0, "block_bytes": 1},
        {"num_tokens": 1, "block_size": 16, "block_bytes": 0},
        {"num_tokens": 1, "block_size": 16, "block_bytes": 1, "seq": -1},
    ],
)
def test_a_bad_request_is_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        RouteRequest(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs", [{"num_requests": -1}, {"pending_s": -0.1}, {"pending_s": float("nan")}]
)
def test_a_bad_view_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        view("a", **kwargs)


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_imbalance"):
        RoutingConfig(max_imbalance=0.9)
