"""benchmarks.bench_fleet's pure parts: the sessions and prompts it builds from the trace, the
arrival schedule, the figures it draws from outcomes and digests, and its targets. The live
fleet itself is not started here (minutes of three SmolLM2 replicas)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.support.admission_traces import CONVERSATION_TRACE
from benchmarks.support.fleet_live_client import Outcome, metric_values
from benchmarks.support.fleet_live_procs import Child, FleetSpec, replica_cores
from benchmarks.support.fleet_live_report import TARGETS, headline
from benchmarks.support.fleet_live_requests import (
    TOKEN_LOW,
    LiveRequest,
    id_tokens,
    live_requests,
    pick_sessions,
    poisson_arrivals,
    reuse_ceiling,
    warmup_prompts,
)
from benchmarks.support.fleet_live_runs import arrival_rate, hit_figures, ttft_figures
from benchmarks.support.fleet_live_watch import index_media, replica_media
from cachetier.report.replay import TraceRequest, read_trace

VOCAB = 49_152


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return read_trace(CONVERSATION_TRACE)


def test_sessions_have_turns_that_fit_and_skip_gives_other_sessions(
    trace: list[TraceRequest],
) -> None:
    first = pick_sessions(trace, 10, max_ids=48, max_turns=4)
    later = pick_sessions(trace, 5, skip=10, max_ids=48, max_turns=4)
    assert len(first) == 10 and len(later) == 5
    for turns in first + later:
        assert 2 <= len(turns) <= 4 and turns == sorted(turns)
        assert len({trace[i].hash_ids[1] for i in turns}) == 1  # one session
        assert all(len(trace[i].hash_ids) <= 48 for i in turns)
    sessions = {trace[s[0]].hash_ids[1] for s in first}
    assert sessions.isdisjoint(trace[s[0]].hash_ids[1] for s in later)
    with pytest.raises(ValueError, match="sessions"):
        pick_sessions(trace[:50], 1000, max_ids=48, max_turns=4)


def test_prompts_repeat_the_tokens_of_repeated_ids_in_trace_order(
    trace: list[TraceRequest],
) -> None:
    requests = live_requests(trace, pick_sessions(trace, 6, max_ids=48, max_turns=6), VOCAB, 16)
    assert [r.trace_index for r in requests] == sorted(r.trace_index for r in requests)
    tokens_of: dict[int, tuple[int, ...]] = {}
    for r in requests:
        assert len(r.prompt) == 16 * len(r.hash_ids)
        assert all(TOKEN_LOW <= t < VOCAB - TOKEN_LOW for t in r.prompt)
        for i, h in enumerate(r.hash_ids):
            block = r.prompt[16 * i : 16 * (i + 1)]
            assert tokens_of.setdefault(h, block) == block
    turns = [r for r in requests if r.session == requests[0].session]
    assert [r.turn for r in turns] == list(range(len(turns))) and len(turns) >= 2
    shared = 0
    while turns[0].hash_ids[shared] == turns[1].hash_ids[shared]:
        shared += 1
    assert turns[0].prompt[: 16 * shared] == turns[1].prompt[: 16 * shared]


def test_warmup_prompts_share_no_block_with_each_other() -> None:
    prompts = warmup_prompts(3, 4, VOCAB, 16)
    blocks = [tuple(p[i : i + 16]) for p in prompts for i in range(0, len(p), 16)]
    assert len(prompts) == 3 and len(set(blocks)) == len(blocks) == 12
    with pytest.raises(ValueError, match="vocab_size"):
        id_tokens([1], 2 * TOKEN_LOW, 16)


def test_arrivals_start_at_zero_ascend_and_repeat_for_a_seed() -> None:
    arrivals = poisson_arrivals(50, 4.0, seed=3)
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and len(arrivals) == 50
    assert poisson_arrivals(50, 4.0, seed=3) == arrivals != poisson_arrivals(50, 4.0, seed=4)
    assert poisson_arrivals(0, 1.0) == []
    assert arrival_rate([2.0, 1.0, 3.0], 3, 0.5) == pytest.approx(0.75)


def test_figures_count_failures_and_hits_of_the_answered_requests() -> None:
    outcomes = [
        Outcome(0.0, ttft_s=1.0, prompt_tokens=100, cached_by_source={"disk": 50}),
        Outcome(0.1, ttft_s=3.0, prompt_tokens=100, cached_by_source={"remote": 25}),
        Outcome(0.2, error="the stream ended before [DONE]", prompt_tokens=100),
    ]
    ttft = ttft_figures(outcomes)
    assert ttft["num_requests"] == 3 and ttft["failed_requests"] == 1
    assert ttft["mean_ttft_s"] == pytest.approx(2.0) and ttft["p50_ttft_s"] == pytest.approx(2.0)
    assert ttft["errors"] == ["the stream ended before [DONE]"]
    hits = hit_figures(outcomes)
    assert hits["token_hit_ratio_by_source"] == {"disk": 0.25, "remote": 0.125}
    assert hits["token_hit_ratio"] == pytest.approx(0.375)


def test_digests_compare_node_local_media_of_the_same_epoch() -> None:
    state = {
        "kv_events": {"epoch": 7},
        "kv_digest": {
            "Disk": {"count": 3, "xor": "00000000000000ab"},
            "pool": {"count": 0, "xor": "0000000000000000"},
            "remote": {"count": 9, "xor": "00000000000000ff"},
        },
    }
    index = {
        "replicas": {
            "r0": {"epoch": 7, "media": {"disk": {"count": 3, "xor": "00000000000000ab"}}},
            "*": {"epoch": 0, "media": {"remote": {"count": 9, "xor": "00000000000000ff"}}},
        }
    }
    assert replica_media(state) == {"disk": (3, "00000000000000ab")}
    assert index_media(index, "r0", 7) == replica_media(state)
    assert index_media(index, "r0", 8) == {} and index_media(index, "r1", 7) == {}


def test_metric_values_reads_every_series_of_one_name() -> None:
    text = (
        "# TYPE cachetier_router_requests_total counter\n"
        'cachetier_router_requests_total{policy="tier_aware",replica="r0"} 4.0\n'
        'cachetier_router_requests_total{policy="tier_aware",replica="r1"} 2.0\n'
        "cachetier_router_retries_total 1.0\n"
    )
    assert metric_values(text, "cachetier_router_requests_total") == {
        'policy="tier_aware",replica="r0"': 4.0,
        'policy="tier_aware",replica="r1"': 2.0,
    }
    assert metric_values(text, "cachetier_router_retries_total") == {"": 1.0}


def _result(stale_s: float | None) -> dict[str, Any]:
    killed = {"failed_requests": 0, "restart": {"routable_s": 4.0, "routable_after_healthy_s": 1}}
    return {
        "policies": {
            "round_robin": {"mean_ttft_s": 2.0, "p50_ttft_s": 1.0},
            "pool_only": {"mean_ttft_s": 1.0, "p50_ttft_s": 1.0},
            "tier_aware": {"mean_ttft_s": 0.8, "p50_ttft_s": 0.5, "replica_killed": killed},
        },
        "lost_events": {"stale_s": stale_s, "reconcile_interval_s": 5.0, "num_dropped_events": 9},
    }


def test_headline_ratios_and_targets() -> None:
    result = _result(stale_s=2.0)
    out = headline(result, "round_robin", "tier_aware")
    assert out["tier_aware_ttft_vs_round_robin"] == pytest.approx(0.4)
    assert out["tier_aware_ttft_vs_pool_only"] == pytest.approx(0.8)
    assert result["policies"]["pool_only"]["mean_ttft_vs_round_robin"] == pytest.approx(0.5)
    assert out["targets"] == {**TARGETS, "index_stale_after_lost_events_s": 5.0}
    assert out["all_targets_met"] and all(out["targets_met"].values())
    missing = headline(_result(stale_s=None), "round_robin", "tier_aware")
    assert missing["targets_met"]["index_stale_after_lost_events_s"] is False
    assert not missing["all_targets_met"]


def _spec(num_replicas: int, pin: bool) -> FleetSpec:
    return FleetSpec("round_robin", Path("."), num_replicas, 1, 1, 1, 1, 1.0, pin_cores=pin)


def test_pinned_replicas_get_a_core_each_and_a_child_runs_on_its_own(tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    assert replica_cores(_spec(2, pin=False)) == [None, None]
    if len(cores) >= 2:
        assert replica_cores(_spec(2, pin=True)) == [frozenset({cores[0]}), frozenset({cores[1]})]
    with pytest.raises(ValueError, match="a core of their own"):
        replica_cores(_spec(len(cores) + 1, pin=True))
    # A real child: the mask is set before the interpreter starts.
    script = "import os; print(sorted(os.sched_getaffinity(0)), flush=True)"
    child = Child(
        "pinned", [sys.executable, "-c", script], dict(os.environ), tmp_path, frozenset({cores[-1]})
    )
    child.spawn()
    assert child.proc is not None
    assert child.proc.wait(timeout=60) == 0
    child.reap()
    assert child.log_tail().strip() == str([cores[-1]])


def test_reuse_ceiling_counts_prefixes_seen_before_less_the_last_token() -> None:
    def req(ids: tuple[int, ...], tokens: int) -> LiveRequest:
        return LiveRequest(0, "s", 0, ids, tuple(range(tokens)))

    # 2 ids of 4 tokens each: the second request has both ids seen, but must compute its last
    # token; the third shares only the first id (its second follows another prefix).
    requests = [req((1, 2), 8), req((1, 2), 8), req((1, 3), 8), req((3,), 4)]
    assert reuse_ceiling(requests, tokens_per_id=4) == (0 + 7 + 4 + 0) / 28
    assert reuse_ceiling([], tokens_per_id=4) == 0.0
