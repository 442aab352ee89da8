"""The runs of ``benchmarks.bench_fleet``: one live fleet per policy, driven by the same
requests on the same schedule; the tier-aware fleet then loses a replica under traffic; and a
fleet whose replicas drop KV events.

Each run starts its own fleet in a folder of its own (empty disks, an empty sidecar, a fresh
router), so no policy inherits another's cache. Before its requests, each fleet serves the same
cold rounds (``cold_rounds``: one new prompt per replica, all at once), sent to the replicas
directly: every fleet starts equally warm, and the first fleet's rounds set the arrival rate.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.support.fleet_live_client import Outcome, cold_rounds, open_loop, router_decisions
from benchmarks.support.fleet_live_procs import FleetSpec, LiveFleet
from benchmarks.support.fleet_live_requests import LiveRequest, poisson_arrivals
from benchmarks.support.fleet_live_watch import fleet_counters, kill_and_restart, watch_agreement


@dataclass(frozen=True, slots=True)
class Drive:
    """What every policy's fleet is given.

    Args:
        requests: the measured requests, in order.
        warmup: the cold prompts (a multiple of the replica count).
        max_tokens: tokens each request generates.
        utilization: the share of the fleet's cold capacity the arrivals ask for.
        seed: the arrival schedule's seed.
    """

    requests: Sequence[LiveRequest]
    warmup: Sequence[Sequence[int]]
    max_tokens: int
    utilization: float
    seed: int = 0


def ttft_figures(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Mean, p50, p90 and p99 TTFT of the requests that got a token, and the failures."""
    ttft = np.asarray([o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None])
    out: dict[str, Any] = {
        "num_requests": len(outcomes),
        "failed_requests": sum(1 for o in outcomes if not o.ok),
    }
    if ttft.size:
        out.update(
            mean_ttft_s=float(ttft.mean()),
            p50_ttft_s=float(np.percentile(ttft, 50)),
            p90_ttft_s=float(np.percentile(ttft, 90)),
            p99_ttft_s=float(np.percentile(ttft, 99)),
        )
    errors = sorted({o.error for o in outcomes if o.error})
    if errors:
        out["errors"] = errors[:5]
    return out


def hit_figures(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """The share of prompt tokens the chosen replica did not compute, by where they came from."""
    total = sum(o.prompt_tokens for o in outcomes if o.ok)
    by: dict[str, int] = {}
    for o in outcomes:
        for source, n in o.cached_by_source.items():
            by[source] = by.get(source, 0) + n
    share = {k: v / total for k, v in sorted(by.items())} if total else {}
    return {"token_hit_ratio": sum(share.values()), "token_hit_ratio_by_source": share}


def policy_figures(outcomes: Sequence[Outcome], routed: list[int]) -> dict[str, Any]:
    out = ttft_figures(outcomes)
    out.update(hit_figures(outcomes))
    mean = sum(routed) / len(routed) if routed else 0.0
    out["requests_per_replica"] = routed
    out["load_imbalance"] = max(routed) / mean if mean else None
    return out


def arrival_rate(rounds: Sequence[float], num_replicas: int, utilization: float) -> float:
    """Requests per second that keep the fleet ``utilization`` busy recomputing every prompt:
    a cold round serves one request per replica in its median wall time."""
    return utilization * num_replicas / statistics.median(rounds)


@dataclass(frozen=True, slots=True)
class KillPlan:
    """The tier-aware fleet's extra phase: other sessions' requests, a replica killed while
    they run.

    Args:
        requests: the phase's requests.
        victim: the replica killed (its index).
        kill_at: when, as a share of the phase's arrival span.
    """

    requests: Sequence[LiveRequest]
    victim: int
    kill_at: float


def run_policy(
    spec: FleetSpec,
    folder: Path,
    drive: Drive,
    rate: float | None,
    kill: KillPlan | None = None,
) -> dict[str, Any]:
    """One fleet under ``spec.policy``: cold rounds, then the requests open loop at ``rate``
    (``None``: the rate its cold rounds give), then ``kill``'s phase if given.

    Returns:
        The policy's figures, with ``cold_round_s`` (its rounds' median), ``arrival_rate``,
        ``run_s`` (first arrival to last answer) and, with ``kill``, ``replica_killed``.
    """
    with LiveFleet(spec, folder) as fleet:
        urls = [c.url for c in fleet.replicas]
        # The first round is each process's first use of its code paths: not timed.
        rounds = asyncio.run(cold_rounds(urls, drive.warmup, drive.max_tokens))[1:]
        if rate is None:
            rate = arrival_rate(rounds, spec.num_replicas, drive.utilization)
        arrivals = poisson_arrivals(len(drive.requests), rate, drive.seed)
        started = time.monotonic()
        outcomes, _ = asyncio.run(
            open_loop(fleet.router_url, drive.requests, arrivals, drive.max_tokens)
        )
        run_s = time.monotonic() - started
        routed, estimated = asyncio.run(router_decisions(fleet.router_url, spec.num_replicas))
        figures = policy_figures(outcomes, routed)
        # What the policy expected of its choices, beside what the client measured.
        figures["mean_estimated_ttft_s"] = estimated
        figures.update(cold_round_s=statistics.median(rounds), arrival_rate=rate, run_s=run_s)
        if kill is not None:
            figures["replica_killed"] = kill_phase(fleet, kill, rate, drive)
    return figures


def kill_phase(fleet: LiveFleet, plan: KillPlan, rate: float, drive: Drive) -> dict[str, Any]:
    """``plan``'s requests at ``rate``, a replica SIGKILLed and restarted among them."""
    before = asyncio.run(fleet_counters(fleet))
    arrivals = poisson_arrivals(len(plan.requests), rate, drive.seed + 1)
    kill_at_s = plan.kill_at * arrivals[-1]

    async def beside(start: float) -> dict[str, Any]:
        return await kill_and_restart(fleet, plan.victim, kill_at_s, start)

    outcomes, restart = asyncio.run(
        open_loop(fleet.router_url, plan.requests, arrivals, drive.max_tokens, beside)
    )
    after = asyncio.run(fleet_counters(fleet))
    out = ttft_figures(outcomes)
    out["restart"] = restart
    out["router_retries"] = after["retries_total"] - before["retries_total"]
    out["router_unrouted"] = after["unrouted_requests_total"] - before["unrouted_requests_total"]
    killed_at = restart["killed_at_s"]
    # The requests on the wire when the replica died: sent before, answered after.
    out["sent_before_kill"] = sum(1 for o in outcomes if o.sent_at < killed_at)
    out["failed_sent_before_kill"] = sum(1 for o in outcomes if not o.ok and o.sent_at < killed_at)
    # A request that failed after its first token cannot be retried by any router (its
    # output had begun); one that failed before it could have been.
    out["failed_after_first_token"] = sum(1 for o in outcomes if not o.ok and o.ttft_s is not None)
    return out


def run_lost_events(spec: FleetSpec, folder: Path, drive: Drive) -> dict[str, Any]:
    """A tier-aware fleet whose replicas queue one event batch at most (``spec`` with
    ``kv_events_queue`` 1): a burst of traffic, then the time until the router's index agrees
    with every replica again (``watch_agreement``)."""
    spec = replace(spec, kv_events_queue=1)
    with LiveFleet(spec, folder) as fleet:
        urls = [c.url for c in fleet.replicas]
        asyncio.run(cold_rounds(urls, drive.warmup, drive.max_tokens))
        before = asyncio.run(fleet_counters(fleet))
        # One burst: every request at once, so the publishers' one-batch queues overflow up
        # to the last answers and the index is likely wrong when the traffic stops.
        arrivals = [0.0] * len(drive.requests)
        outcomes, _ = asyncio.run(
            open_loop(fleet.router_url, drive.requests, arrivals, drive.max_tokens)
        )
        agreement = asyncio.run(watch_agreement(fleet))
        after = asyncio.run(fleet_counters(fleet))
    dropped = after["num_dropped_events"]
    return {
        "num_requests": len(outcomes),
        "failed_requests": sum(1 for o in outcomes if not o.ok),
        "kv_events_queue": 1,
        "reconcile_interval_s": spec.reconcile_interval_s,
        "num_dropped_events": sum(dropped.values()),
        "num_dropped_events_by_replica": dropped,
        "router_batches_missed": after["kv_event_batches_missed"]
        - before["kv_event_batches_missed"],
        "router_index_resyncs": after["index_resyncs"] - before["index_resyncs"],
        **agreement,
    }
