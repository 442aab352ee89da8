"""KV-aware routing (issue 55) in a simulated fleet: the five policies of ``cachetier.fleet``,
the router's own decision code, driven with the shipped conversation trace at 16 and 64
replicas.

    python -m benchmarks.fleet_sim --json [--quick] [--sizes 16,64] [--limit N]

The fleet (``benchmarks.support.fleet_replica``, ``fleet_run``):

- every replica has an engine pool and a node-local disk tier of bounded blocks (LRU), and all
  read and write one shared tier (Redis, LRU); a served request's blocks are stored in all
  three (store-all). Capacities in trace blocks of 512 tokens: the pool holds what the
  engine's default ``kv_cache_bytes`` (``EngineConfig``) holds of SmolLM2 KV, each disk
  ``--disk-blocks`` (2,000) and the shared tier ``--shared-blocks`` (10,000): assumed sizes,
  not measured ones;
- speeds are measured figures the repository records (``benchmarks.support.fleet_rates``):
  the prefill model our engine fitted on SmolLM2 (``docs/results/cost_model.json``), the KV
  bytes per token and the disk and Redis restores of ``docs/results/restart.json`` (its disk
  restore read a page cache the run had just filled: a disk larger than memory is slower); every
  replica's ``CostModel`` is rebuilt from them (``cachetier.fleet.measured``), and the chunk
  of a prefill step is the engine's default ``max_num_batched_tokens``;
- each replica serves one request at a time, first come first served: a request's service is
  the chosen replica's estimated load-or-recompute of its prompt (``CostModel.plan`` over
  where that replica holds it) plus a fixed ``--decode-s`` (an assumption: no decode speed is
  recorded); its TTFT is its wait plus that prefill. A replica's view gives the router its
  requests running and queued and the seconds of work ahead of a new one, which a router can
  keep from its own estimates of what it sent;
- arrivals are the trace's timestamps times one factor per fleet size: the one at which
  recomputing every prompt with no cache would keep the fleet ``--utilization`` busy on
  average (0.7 by default: loaded, not saturated, and less so with the hits a cache gives);
- sessions: a request's session id is its second block's hash id (the first block past the
  system prompt that every request of the trace shares; a conversation's later turns resend
  it), none for a one-block prompt.

Per fleet size and policy: ``mean_ttft_s`` (every request counted once, hits and misses
alike), ``p50_ttft_s``, ``p99_ttft_s``, ``load_imbalance`` (most requests served by one
replica over the mean), the share of prompt tokens the chosen replica held in each medium, the
utilization reached, and each TTFT figure over round robin's in the same run. The issue's
targets: ``tier_aware`` has the lowest mean TTFT at every size, with ``load_imbalance`` <= 1.3.

``--quick``: 300 requests, 4 replicas, small capacities (for tests; seconds).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.support.admission_traces import CONVERSATION_TRACE
from benchmarks.support.fleet_rates import RESULTS, FleetRates, measured_rates
from benchmarks.support.fleet_run import FleetShape, PolicyRun, SimRequest, run_policy
from benchmarks.support.output import emit
from cachetier.engine.config import EngineConfig
from cachetier.fleet import POLICIES, RoutingConfig, cost_model_from_snapshot
from cachetier.report.replay import BLOCK_SIZE, TraceRequest, read_trace
from cachetier.store.costmodel import CostModel

BASELINE = "round_robin"
TARGET_POLICY = "tier_aware"
MAX_IMBALANCE_TARGET = 1.3
SIZES = (16, 64)
DISK_BLOCKS = 2000
SHARED_BLOCKS = 10_000
DECODE_S = 1.0
UTILIZATION = 0.7
QUICK_REQUESTS = 300
QUICK_SIZES = (4,)
QUICK_POOL_BLOCKS, QUICK_DISK_BLOCKS, QUICK_SHARED_BLOCKS = 8, 64, 256
ENGINE = EngineConfig(model="-")  # the engine's defaults; no model is loaded


def sim_requests(trace: list[TraceRequest]) -> list[SimRequest]:
    """The trace's requests, arrivals in trace seconds, sessions as the module says."""
    return [
        SimRequest(
            t.timestamp_ms / 1e3,
            t.input_length,
            t.hash_ids,
            str(t.hash_ids[1]) if len(t.hash_ids) > 1 else None,
        )
        for t in trace
    ]


def time_scale(
    requests: list[SimRequest], num_replicas: int, cost: CostModel, decode_s: float, rho: float
) -> float:
    """The factor on trace time at which the fleet, recomputing every prompt, is ``rho``
    busy on average."""
    chunk = ENGINE.max_num_batched_tokens
    cold = 0.0
    for req in requests:
        prefill = cost.prefill.recompute_s(0, req.num_tokens, chunk)
        assert prefill is not None, "the recorded prefill model has coefficients"
        cold += prefill + decode_s
    span = max(requests[-1].arrival_s - requests[0].arrival_s, 1.0)
    return cold / (num_replicas * span * rho)


def summary(run: PolicyRun, first_arrival_s: float, num_replicas: int) -> dict[str, Any]:
    ttft = np.asarray(run.ttft_s)
    routed = np.asarray(run.routed, dtype=float)
    held = {k: v / run.num_tokens for k, v in run.held_tokens.items()}
    return {
        "mean_ttft_s": float(ttft.mean()),
        "p50_ttft_s": float(np.percentile(ttft, 50)),
        "p99_ttft_s": float(np.percentile(ttft, 99)),
        "load_imbalance": float(routed.max() / routed.mean()),
        "requests_per_replica": run.routed,
        "token_hit_ratio": sum(held.values()),
        "token_hit_ratio_by_medium": held,
        "utilization": run.busy_s / (num_replicas * (run.end_s - first_arrival_s)),
        "max_estimate_error_s": run.max_estimate_error_s,
    }


def fleet(
    requests: list[SimRequest], shape: FleetShape, cost: CostModel, rho: float
) -> dict[str, Any]:
    """Every policy on one fleet size, with ratios against round robin."""
    scale = time_scale(requests, shape.num_replicas, cost, shape.decode_s, rho)
    scaled = [
        SimRequest(r.arrival_s * scale, r.num_tokens, r.blocks, r.session_id) for r in requests
    ]
    policies: dict[str, dict[str, Any]] = {}
    for policy in POLICIES:
        started = time.perf_counter()
        run = run_policy(policy, scaled, shape, cost)
        policies[policy] = summary(run, scaled[0].arrival_s, shape.num_replicas)
        policies[policy]["sim_wall_s"] = time.perf_counter() - started
    base = policies[BASELINE]
    for figures in policies.values():
        for name in ("mean_ttft_s", "p50_ttft_s", "p99_ttft_s"):
            figures[f"{name[:-2]}_vs_{BASELINE}"] = figures[name] / base[name]
    best = min(policies, key=lambda p: policies[p]["mean_ttft_s"])
    return {
        "num_replicas": shape.num_replicas,
        "time_scale": scale,
        "policies": policies,
        "best_mean_ttft_policy": best,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every fleet size of ``args``; the JSON the benchmark prints."""
    rates: FleetRates = measured_rates(Path(args.results))
    cost = cost_model_from_snapshot(rates.prefill, rates.tiers)
    block_bytes = rates.bytes_per_token * BLOCK_SIZE
    limit = QUICK_REQUESTS if args.quick and args.limit is None else args.limit
    trace = read_trace(args.trace)
    requests = sim_requests(trace if limit is None else trace[:limit])
    sizes = QUICK_SIZES if args.quick else tuple(int(s) for s in args.sizes.split(","))
    pool_blocks = QUICK_POOL_BLOCKS if args.quick else ENGINE.kv_cache_bytes // block_bytes
    disk_blocks = QUICK_DISK_BLOCKS if args.quick else args.disk_blocks
    shared_blocks = QUICK_SHARED_BLOCKS if args.quick else args.shared_blocks
    fleets = {}
    for n in sizes:
        shape = FleetShape(
            n,
            pool_blocks,
            disk_blocks,
            shared_blocks,
            args.decode_s,
            BLOCK_SIZE,
            block_bytes,
            ENGINE.max_num_batched_tokens,
            args.max_imbalance,
        )
        fleets[str(n)] = fleet(requests, shape, cost, args.utilization)
    result: dict[str, Any] = {
        "command": "python -m benchmarks.fleet_sim --json" + (" --quick" if args.quick else ""),
        "trace": Path(args.trace).name,
        "num_requests": len(requests),
        "sizes": list(sizes),
        "policies": list(POLICIES),
        "baseline": BASELINE,
        "settings": {
            "pool_blocks": pool_blocks,
            "disk_blocks": disk_blocks,
            "shared_blocks": shared_blocks,
            "block_size": BLOCK_SIZE,
            "block_bytes": block_bytes,
            "chunk_tokens": ENGINE.max_num_batched_tokens,
            "decode_s": args.decode_s,
            "utilization_target": args.utilization,
            "max_imbalance": args.max_imbalance,
        },
        "rates": rates.as_dict(),
        "fleets": fleets,
    }
    result.update(headline(fleets))
    return result


def headline(fleets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The figures the issue's targets are about, per size, and whether both are met."""
    out: dict[str, Any] = {}
    met = True
    for n, figures in fleets.items():
        target = figures["policies"][TARGET_POLICY]
        out[f"tier_aware_mean_ttft_vs_round_robin_{n}"] = target["mean_ttft_vs_round_robin"]
        out[f"tier_aware_load_imbalance_{n}"] = target["load_imbalance"]
        out[f"best_mean_ttft_policy_{n}"] = figures["best_mean_ttft_policy"]
        met = met and figures["best_mean_ttft_policy"] == TARGET_POLICY
        met = met and target["load_imbalance"] <= MAX_IMBALANCE_TARGET
    out["targets_met"] = met
    return out


def print_table(result: dict[str, Any], as_json: bool) -> None:
    out = sys.stderr if as_json else sys.stdout
    head = f"{'replicas':>8} {'policy':>17} {'mean s':>9} {'p50 s':>9} {'p99 s':>9}"
    print(head + f" {'mean/rr':>8} {'imbal':>6} {'hit':>6} {'util':>5}", file=out)
    for n, figures in result["fleets"].items():
        for policy, f in figures["policies"].items():
            print(
                f"{n:>8} {policy:>17} {f['mean_ttft_s']:9.3f} {f['p50_ttft_s']:9.3f} "
                f"{f['p99_ttft_s']:9.2f} {f['mean_ttft_vs_round_robin']:8.3f} "
                f"{f['load_imbalance']:6.2f} {f['token_hit_ratio']:6.3f} {f['utilization']:5.2f}",
                file=out,
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="300 requests, 4 replicas")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="replica counts")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--disk-blocks", type=int, default=DISK_BLOCKS)
    parser.add_argument("--shared-blocks", type=int, default=SHARED_BLOCKS)
    parser.add_argument("--decode-s", type=float, default=DECODE_S)
    parser.add_argument("--utilization", type=float, default=UTILIZATION)
    parser.add_argument("--max-imbalance", type=float, default=RoutingConfig().max_imbalance)
    parser.add_argument("--results", default=str(RESULTS), help="folder of the recorded JSON")
    parser.add_argument("--trace", default=str(CONVERSATION_TRACE))
    args = parser.parse_args()
    if not 0 < args.utilization < 1:
        parser.error("--utilization must be in (0, 1)")
    result = measure(args)
    print_table(result, args.json)
    emit(result, args.json)


if __name__ == "__main__":
    main()
