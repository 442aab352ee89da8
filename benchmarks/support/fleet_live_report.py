"""The figures ``benchmarks.bench_fleet`` leads its JSON with, its targets, and its table."""

from __future__ import annotations

import sys
from typing import Any

TARGETS = {
    "tier_aware_ttft_vs_round_robin": 0.7,
    "tier_aware_ttft_vs_pool_only": 0.9,
    "failed_requests_with_replica_killed": 0,
    "restarted_replica_blocks_routable_s": 5.0,
}
"""Each figure's upper bound (the issue's); ``index_stale_after_lost_events_s``'s is the
router's reconcile interval, set per run."""
RATIOS = ("mean_ttft_s", "p50_ttft_s", "p90_ttft_s")


def add_ratios(policies: dict[str, dict[str, Any]], baseline: str) -> None:
    """Each policy's TTFT figures over the baseline's, beside them (``mean_ttft_vs_<base>``)."""
    base = policies.get(baseline, {})
    for figures in policies.values():
        for name in RATIOS:
            if name in figures and base.get(name):
                figures[f"{name[:-2]}_vs_{baseline}"] = figures[name] / base[name]


def _ratio(policies: dict[str, dict[str, Any]], a: str, b: str) -> float | None:
    x, y = policies.get(a, {}).get("mean_ttft_s"), policies.get(b, {}).get("mean_ttft_s")
    return x / y if x is not None and y else None


def headline(result: dict[str, Any], baseline: str, target: str) -> dict[str, Any]:
    """The issue's figures, their targets and whether each is met."""
    policies = result["policies"]
    add_ratios(policies, baseline)
    killed = policies.get(target, {}).get("replica_killed") or {}
    restart = killed.get("restart") or {}
    lost = result["lost_events"]
    out: dict[str, Any] = {
        "tier_aware_ttft_vs_round_robin": _ratio(policies, target, baseline),
        "tier_aware_ttft_vs_pool_only": _ratio(policies, target, "pool_only"),
        "failed_requests_with_replica_killed": killed.get("failed_requests"),
        "restarted_replica_blocks_routable_s": restart.get("routable_s"),
        "restarted_replica_blocks_routable_after_healthy_s": restart.get(
            "routable_after_healthy_s"
        ),
        "index_stale_after_lost_events_s": lost.get("stale_s"),
        "reconcile_interval_s": lost["reconcile_interval_s"],
        "num_dropped_events": lost["num_dropped_events"],
    }
    bounds: dict[str, float] = {
        **TARGETS,
        "index_stale_after_lost_events_s": lost["reconcile_interval_s"],
    }
    met = {name: out[name] is not None and out[name] <= bound for name, bound in bounds.items()}
    out["targets"] = bounds
    out["targets_met"] = met
    out["all_targets_met"] = all(met.values())
    return out


def print_table(result: dict[str, Any], as_json: bool) -> None:
    """Each policy's figures, one line each (stderr with ``--json``: stdout ends with it)."""
    out = sys.stderr if as_json else sys.stdout
    head = f"{'policy':>17} {'mean s':>8} {'p50 s':>8} {'p90 s':>8} {'mean/rr':>8}"
    print(head + f" {'imbal':>6} {'hit':>6} {'failed':>6}", file=out)
    for policy, f in result["policies"].items():
        print(
            f"{policy:>17} {f.get('mean_ttft_s', float('nan')):8.3f} "
            f"{f.get('p50_ttft_s', float('nan')):8.3f} {f.get('p90_ttft_s', float('nan')):8.3f} "
            f"{f.get('mean_ttft_vs_round_robin', float('nan')):8.3f} "
            f"{f.get('load_imbalance') or float('nan'):6.2f} {f['token_hit_ratio']:6.3f} "
            f"{f['failed_requests']:6d}",
            file=out,
        )
